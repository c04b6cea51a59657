"""The run store's write side: trace rows to Parquet part files.

It runs inside traced processes, so it imports only the standard library, numpy, pyarrow and
tracekit core (never duckdb or polars). `RunWriter.append` only validates and queues; a daemon thread
writes one zstd part file per table per flush to `<run>/<table>/rank=<R>/part-NNNNN.parquet`
(tracekit/parts.py), under a hidden temporary name renamed into place when complete, so a reader
globbing `*.parquet` never sees half a file and a crash loses at most the rows not yet flushed.

Collectors on a hot path do not append: they register a *source* (`add_source`), keep raw
records with a list append, and the writer thread pulls and converts them on every flush, so
the traced program pays for neither the conversion nor the Parquet encoding on its own thread.

    writer = RunWriter("runs/base", rank=0)
    writer.append("steps", {"step": [0], "t_start_ns": [t0], "t_end_ns": [t1], "samples": [512], "loss": [0.69]})
    writer.close()
    writer.dropped                      # rows shed per table, for the manifest (tracekit/manifest.py)
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any, Callable, Iterable

import pyarrow as pa
import pyarrow.compute as pc

from tracekit.parts import PARQUET_OPTIONS, prime, write_part
from tracekit.schema import TABLES, file_metadata
from tracekit.thread_priority import may_leave_idle, renice, set_idle


def to_batch(table: str, columns: dict[str, Any] | pa.RecordBatch) -> pa.RecordBatch:
    """Columns (lists, numpy arrays or Arrow arrays) or a RecordBatch, checked against and cast to
    the schema of trace table `table`. A nullable column left out is all null (so a writer need not
    change when a column is added). Raises ValueError naming the table and the column at fault."""
    schema = _schema(table)
    names = columns.schema.names if isinstance(columns, pa.RecordBatch) else list(columns)
    missing = [f.name for f in schema if f.name not in names and not f.nullable]
    extra = [name for name in names if name not in schema.names]
    if missing or extra:
        raise ValueError(
            f"trace table {table!r}: missing column(s) {missing}, unknown column(s) {extra}; "
            f"expected {schema.names}"
        )
    if isinstance(columns, pa.RecordBatch):
        columns = {name: columns.column(name) for name in names}
    rows = len(columns[names[0]])  # some column is given: every table has a required one
    arrays = [columns[f.name] if f.name in columns else pa.nulls(rows, f.type) for f in schema]
    return pa.RecordBatch.from_arrays([_to_array(table, f, a) for f, a in zip(schema, arrays)], schema=schema)


Source = Callable[[bool], Iterable[tuple[str, "dict[str, Any] | pa.RecordBatch"]]]
"""`drain(final)` -> (trace table, columns) pairs of the rows collected since the last drain; called
on the writer thread at every flush, with final=True once, at close."""

InFlight = Callable[[], dict[str, int]]
"""A source's `in_flight()`: the rows per trace table its running drain has taken out of its buffers
and not yet handed over (for `accesses`, lookups), which a failed drain loses."""


def _schema(table: str) -> pa.Schema:
    if table not in TABLES:
        raise ValueError(f"unknown trace table {table!r}; the trace tables are {list(TABLES)}")
    return TABLES[table]


def _to_array(table: str, field: pa.Field, values: Any) -> pa.Array:
    try:
        if isinstance(values, pa.Array):
            array = values if values.type == field.type else values.cast(field.type)
        else:
            array = pa.array(values, type=field.type)
    except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError, TypeError) as e:
        raise ValueError(f"trace table {table!r}, column {field.name!r} ({field.type}): {e}") from e
    if not field.nullable and array.null_count:
        nulls = f"{array.null_count} null(s) in a required column"
        raise ValueError(f"trace table {table!r}, column {field.name!r}: {nulls}")
    return array


class RunWriter:
    """Writes one rank's trace rows under a run directory, from a background thread.

    Parameters
    ----------
    run_dir
        The run directory; `<run_dir>/<table>/rank=<rank>/` is created on first write.
    rank
        The global rank this process writes for; ranks never share a file.
    flush_interval_s
        Write a part file at most this long after the first unflushed row was appended.
    flush_rows
        Write as soon as this many rows (all tables together) are buffered.
    nice
        Run the thread this much nicer than the process (capped at 19; 0: as the process), so that
        it takes the rank's core mostly while the training thread waits (WRITER_NICE).
    idle
        Also run it under SCHED_IDLE, where the process may lift it back (tracekit/thread_priority.py):
        it then takes a core only when nothing else wants it. A watchdog thread lifts it back to its
        nice value whenever a flush is a quarter of `flush_interval_s` late (LIFT_LATE: on a core
        that never idles), and it returns to idle after the flush; `rescues` counts the lifts.
    max_queued_rows
        Bound on rows appended but not yet written. `append` drops a batch that would exceed it
        and counts its rows in `dropped`, so a slow disk never blocks or bloats the training loop.

    `written` counts rows on disk per table; `dropped` counts rows lost per table (queue full, writer
    closed, or a failed write); `cpu_s` is the CPU time the writer thread has used (draining its
    sources, counting, encoding and writing), what recording costs the rank beyond its hooks;
    `scheduling` says how the thread runs (`idle`, `nice +N`, `as the process`). `errors` counts
    failed writes and `first_error` keeps the first one's message, `first_lost_step` the earliest
    step whose rows one lost: the thread never raises into the caller. With `max_bytes`, it writes no
    part once it has written that many bytes of Parquet (the rows after are lost, as in a failed write).
    """

    def __init__(
        self,
        run_dir: str | os.PathLike,
        rank: int,
        *,
        flush_interval_s: float = 1.0,
        flush_rows: int = 1_000_000,
        max_queued_rows: int = 4_000_000,
        nice: int = 0,
        idle: bool = False,
        max_bytes: int | None = None,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.rank = rank
        self.flush_interval_s = flush_interval_s
        self.flush_rows = flush_rows
        self.max_queued_rows = max_queued_rows
        self.nice = nice
        self.rescues = 0
        self._idle_mode = idle  # requested; from the thread's start, in effect
        self._idle = False  # the thread is under SCHED_IDLE now (not while lifted)
        self._tid: int | None = None
        self._stopped = threading.Event()
        self.dropped: Counter[str] = Counter()
        self.lost_lookups = 0  # of the `accesses` rows in `dropped`: the lookups they counted
        self.written: Counter[str] = Counter()
        self.errors = 0
        self.cpu_s = 0.0
        self.first_error: str | None = None
        self.first_lost_step: int | None = None  # the earliest step whose rows a failed write lost
        self.max_bytes = max_bytes  # None: no cap on the Parquet this writer writes
        self.bytes_written = 0
        self._cond = threading.Condition()
        self._pending: dict[str, list[pa.RecordBatch]] = {}
        self._pending_rows = 0  # buffered, not yet taken by the thread
        self._queued_rows = 0  # appended, not yet written (buffered plus being written)
        self._first_pending_at: float | None = None
        self._flush_requested = 0  # flush() calls so far
        self._flush_done = 0  # flush() calls whose rows are written
        self._closing = False
        self._next_part: dict[str, int] = {}
        self._sources: list[tuple[Source, InFlight | None]] = []
        self._last_flush_at = time.monotonic()
        self._wake = False
        self._thread = threading.Thread(target=self._run, name=f"tracekit-writer-rank{rank}", daemon=True)
        self._thread.start()

    def append(self, table: str, columns: dict[str, Any] | pa.RecordBatch) -> None:
        """Queue rows for `table`; never blocks on I/O. Raises ValueError if the columns do not
        match the table's schema; drops (and counts) the rows if the queue is full or the writer
        is closed."""
        batch = to_batch(table, columns)
        n = batch.num_rows
        if n == 0:
            return
        with self._cond:
            if self._closing or self._queued_rows + n > self.max_queued_rows:
                self.dropped[table] += n
                return
            self._pending.setdefault(table, []).append(batch)
            self._pending_rows += n
            self._queued_rows += n
            if self._first_pending_at is None:  # the thread now has a deadline to wait for
                self._first_pending_at = time.monotonic()
                self._cond.notify_all()
            elif self._pending_rows >= self.flush_rows:
                self._cond.notify_all()

    def add_source(self, drain: Source, in_flight: InFlight | None = None) -> None:
        """Pull rows from `drain` on every flush (at least every `flush_interval_s`) and at close. If a
        drain fails, the rows `in_flight()` names are counted as lost; a source that cannot say loses
        an unknown number, counted as one row of the table it was draining (`unknown` if none yet)."""
        with self._cond:
            self._sources.append((drain, in_flight))
            self._cond.notify_all()

    def wake(self) -> None:
        """Flush now rather than at the next interval: a source holds many rows."""
        with self._cond:
            self._wake = True
            self._cond.notify_all()

    def count_dropped(self, table: str, rows: int, lookups: int | None = None) -> None:
        """Count rows a source had to drop (its buffer was full); for `accesses`, `lookups` is the
        lookups they held (rows: the ids, at most one row each, where they were never counted)."""
        with self._cond:
            self.dropped[table] += rows
            if table == "accesses":
                self.lost_lookups += rows if lookups is None else lookups

    def flush(self) -> None:
        """Write every row appended or held by a source so far and wait until it is on disk."""
        with self._cond:
            self._flush_requested += 1
            target = self._flush_requested
            self._cond.notify_all()
            while self._flush_done < target and self._thread.is_alive():
                self._cond.wait(0.1)

    def close(self) -> None:
        """Write everything still queued and stop the thread. Later appends are dropped."""
        with self._cond:
            self._closing = True
            self._lift(rescue=False)  # the last flush is on the program's exit path
            self._cond.notify_all()
        self._stopped.set()
        self._thread.join()

    @property
    def scheduling(self) -> str:
        """How the thread runs: `idle`, `nice +N` or `as the process` (final once the thread has started)."""
        if self._idle_mode:
            return "idle"
        return f"nice +{self.nice}" if self.nice > 0 else "as the process"

    def __enter__(self) -> RunWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _run(self) -> None:
        self._tid = threading.get_native_id()
        renice(self._tid, self.nice)
        with self._cond:
            self._idle_mode = self._idle = (self._idle_mode and not self._closing and may_leave_idle(self._tid)
                                            and set_idle(self._tid, True))
        if self._idle_mode:
            threading.Thread(target=self._watch, name=f"tracekit-watchdog-rank{self.rank}", daemon=True).start()
        prime()
        while True:
            with self._cond:
                while not self._due():
                    self._cond.wait(self._wait_s())
                closing = self._closing
                flush_seen = self._flush_requested
                pending, self._pending = self._pending, {}
                self._pending_rows = 0
                self._first_pending_at = None
                self._last_flush_at = time.monotonic()
                self._wake = False
                sources = list(self._sources)
            appended = sum(b.num_rows for batches in pending.values() for b in batches)
            self._drain(sources, pending, final=closing)
            for table, batches in pending.items():
                self._write(table, batches)
            with self._cond:
                self._queued_rows -= appended
                self._flush_done = flush_seen
                self.cpu_s = time.thread_time()
                if self._idle_mode and not self._idle and not self._closing:
                    self._idle = set_idle(self._tid, True)
                self._cond.notify_all()
            if closing:
                return

    def _watch(self) -> None:
        """Lift the idle writer back to its nice value whenever a flush is LIFT_LATE late."""
        late = LIFT_LATE * self.flush_interval_s
        while not self._stopped.wait(late):
            with self._cond:
                started = self._deadline_from()
                if started is not None and time.monotonic() - started > self.flush_interval_s + late:
                    self._lift(rescue=True)

    def _lift(self, *, rescue: bool) -> None:
        """Called with the lock held: move the writer thread out of SCHED_IDLE, if it is there."""
        if self._idle and set_idle(self._tid, False):
            self._idle = False
            if rescue:
                self.rescues += 1

    def _drain(self, sources: list[tuple[Source, InFlight | None]], pending: dict[str, list[pa.RecordBatch]], *,
               final: bool) -> None:
        """Add each source's rows to `pending`; a failing source's rows in flight are counted as lost,
        like a failed write's."""
        for drain, in_flight in sources:
            table = None
            try:
                for table, columns in drain(final):
                    batch = to_batch(table, columns)
                    if batch.num_rows:
                        pending.setdefault(table, []).append(batch)
            except Exception as e:  # a trace failure must never take the training process down
                self._count_failure(_in_flight(in_flight) or {table or "unknown": 1}, e,
                                    source=getattr(drain, "__qualname__", "source"))

    def _due(self) -> bool:
        """Called with the lock held: is it time to write what is buffered?"""
        if self._closing or self._wake or self._flush_requested > self._flush_done:
            return True
        if self._pending_rows >= self.flush_rows:
            return True
        return (started := self._deadline_from()) is not None and time.monotonic() - started >= self.flush_interval_s

    def _deadline_from(self) -> float | None:
        """When the interval now running began: the first row waiting, or the last flush if a source
        may hold rows."""
        return self._last_flush_at if self._sources else self._first_pending_at

    def _wait_s(self) -> float | None:
        started = self._deadline_from()
        if started is None:
            return None
        return max(0.0, started + self.flush_interval_s - time.monotonic())

    def _write(self, table: str, batches: list[pa.RecordBatch]) -> None:
        rows = sum(b.num_rows for b in batches)
        try:
            if self.max_bytes is not None and self.bytes_written >= self.max_bytes:
                raise SizeCapReached(f"the run's --max-size share of this rank ({self.max_bytes:,} bytes) is written")
            directory = self.run_dir / table / f"rank={self.rank}"
            index = self._part_index(table, directory)
            data = pa.Table.from_batches(batches).replace_schema_metadata(file_metadata(table))
            part = write_part(data, directory, index, **PARQUET_OPTIONS.get(table, {}))
            self.bytes_written += part.stat().st_size
        except Exception as e:  # a trace write must never take the training process down
            lookups = sum(pc.sum(b.column("count")).as_py() or 0 for b in batches) if table == "accesses" else rows
            self._count_failure({table: rows}, e, _first_step(batches), lookups=lookups)
        else:
            with self._cond:
                self.written[table] += rows

    def _count_failure(self, lost: dict[str, int], error: Exception, step: int | None = None, *,
                       lookups: int | None = None, source: str | None = None) -> None:
        """Count one failure that lost `lost` rows per trace table (`lookups`: the lookups of the
        accesses rows among them; their row count where not given)."""
        with self._cond:
            self.errors += 1
            self.dropped.update(lost)
            self.lost_lookups += lost.get("accesses", 0) if lookups is None else lookups
            table = ", ".join(lost)
            if step is not None and (self.first_lost_step is None or step < self.first_lost_step):
                self.first_lost_step = step
            first = self.first_error is None
            if first:
                self.first_error = f"{source or table}: {type(error).__name__}: {error}"
        if first:
            message = f"tracekit: rank {self.rank} could not write {table} rows ({self.first_error})"
            print(f"{message}; counting the lost rows in `dropped` and carrying on", file=sys.stderr)

    def _part_index(self, table: str, directory: Path) -> int:
        """The next part number in `directory`; continues after any part files already there."""
        if table not in self._next_part:
            existing = [int(p.stem.removeprefix("part-")) for p in directory.glob("part-*.parquet")
                        if p.stem.removeprefix("part-").isdigit()]
            self._next_part[table] = max(existing, default=-1) + 1
        index = self._next_part[table]
        self._next_part[table] = index + 1
        return index


LIFT_LATE = 0.25
"""How late a flush of an idle writer may be, in flush intervals, before its watchdog lifts it (the
watchdog looks this often): even with no core ever idle, a crash then loses at most about 1.5
intervals of rows, plus the flush itself."""

WRITER_NICE = 10
"""What a recorded rank's writer thread runs at, above the rank's niceness. A rank's core is shared by
its training thread and its writer (~2.5% of the core on the CPU trainer, bench/RESULTS.md §14);
at nice 10 the writer weighs 110 against the training thread's 1024, so the scheduler runs it mostly
while training waits on a collective or the GPU, and it still gets ~10% of a core that training
keeps busy: four times what it needs, so it keeps up where nice 19 (1.5%) could fall behind. Where the
process may lift it back, the writer runs under SCHED_IDLE too (`RunWriter(idle=True)`), at this
nice value whenever a watchdog lifts it (bench/RESULTS.md §17)."""


class SizeCapReached(Exception):
    """A writer stops writing once it has written its share of `record --max-size`."""


def _in_flight(in_flight: InFlight | None) -> dict[str, int]:
    """What a failed source had in flight, rows > 0 only; {} where it cannot say."""
    try:
        return {table: rows for table, rows in (in_flight() if in_flight else {}).items() if rows > 0}
    except Exception:
        return {}


def _first_step(batches: list[pa.RecordBatch]) -> int | None:
    """The least `step` among the rows of `batches`, or None where they have no steps."""
    steps = [pc.min(b.column("step")).as_py() for b in batches if "step" in b.schema.names and b.num_rows]
    return min((s for s in steps if s is not None), default=None)

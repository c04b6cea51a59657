"""`tracekit watch`: a live terminal view of a run, read from its part files as they land.

`RunReader` reads each part file once, only the columns it needs, and keeps running aggregates;
a poll lists the rank folders of `steps`, `comms` and `accesses` and reads only the part files it
has not seen, so a tick costs what landed since the last one, never the whole run. Part files are
renamed into place when complete (tracekit/store.py), so a file that is listed is whole.

The figures (`RunReader.figures`), over training rows (`phase` = train):

- steps per rank, and the recent step time: the median of the rank's last WINDOW step durations
  (t_end_ns - t_start_ns of `steps`);
- comm share per rank: over the rank's last WINDOW recorded steps, sum of comm_ns / sum of step
  durations, where comm_ns of a step is the length of the union of the rank's collective intervals
  [t_start_ns, t_end_ns] of that step, clipped to the step (overlapping async calls count once);
- bytes per step by op: sum of `bytes_out` over all ranks of the last WINDOW recorded steps that
  every rank has finished, divided by the number of those steps (DESIGN.md §5's per-step bytes).
  A recorded step is one of `record --steps/--every` (tracekit/window.py): every step by default;
  step times are of every step, comms only of recorded ones;
- the hottest tables by lookups (sum of `count` in `accesses`), with rows touched and the top-1%
  share: the share of the table's lookups taken by its ceil(1% * N) most-read rows, N = num_rows from
  the manifest, else the largest row seen + 1 (analyses/skew.py's definition);
- dropped rows per table, from the manifest or, before it is finalised, the rank reports
  (ranks/rank=R.json, written when a rank exits); omitted where neither exists yet;
- the manifest's status and the time since the run started (or its length, once ended);
- while ranks run, what each is doing now from its heartbeat (collectors/heartbeat.py): its step, how
  old the heartbeat is, the collective it is in (op, tag, call number in its group) and for how
  long; and the hang `record` diagnosed (hang.json, tracekit/app/hang.py) until it clears.

    reader = RunReader("runs/base")
    reader.poll()                      # reads the part files that landed since the last poll
    reader.figures()["ranks"]          # {0: {"steps": 40, "step_s": 0.031, "comm_share": 0.42, ...}, ...}
    watch("runs/base", interval=1.0)   # the live view, until the run ends

Imports pyarrow, numpy and rich only (never torch, duckdb or polars): it runs beside a traced run.
"""

from __future__ import annotations

import datetime
import json
import contextlib
import math
import os
import shutil
import statistics
import threading
import time
from collections import Counter, defaultdict
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from tracekit.errors import SchemaVersionError
from tracekit.app.background import in_background
from tracekit.app.hang import describe as describe_hang
from tracekit.app.hang import read_heartbeats
from tracekit.phases import TRAIN
from tracekit.run_dir import MANIFEST, RunDir
from tracekit.schema import SCHEMA_VERSION, STATUS_RUNNING, VERSION_KEY, major
from tracekit import manifest
from tracekit.manifest import Manifest
from tracekit.units import format_bytes
from tracekit.window import Window

WINDOW = 20
"""Steps in the recent window of step time, comm share and bytes per step."""

HOT_TABLES = 5
"""Tables shown, the most looked up first."""

COLUMNS = {
    "steps": ["step", "t_start_ns", "t_end_ns"],
    "comms": ["step", "op", "bytes_out", "t_start_ns", "t_end_ns", "phase"],
    "accesses": ["table_name", "row", "count", "phase"],
}
"""The tables the view reads, and the columns it reads of each (`phase` is absent before schema 1.1)."""


class RunReader:
    """The figures of a run, kept up to date by reading each new part file once.

    Parameters
    ----------
    run_dir
        The run directory; RunNotFound (from `read_manifest`) if it or its manifest is missing.
    window
        Steps in the recent window (WINDOW by default).

    `files` counts part files read per table and `rows` their rows (every phase); `manifest` is the
    latest one read.
    """

    def __init__(self, run_dir: str | os.PathLike, *, window: int = WINDOW) -> None:
        self.run_dir = Path(run_dir)
        self.window = window
        self.manifest = manifest.read(self.run_dir)
        self.files: Counter[str] = Counter()
        self.rows: Counter[str] = Counter()
        self._seen: set[str] = set()  # "table/rank=R/part-NNNNN.parquet" of every file read
        self._steps: dict[int, dict[int, tuple[int, int]]] = defaultdict(dict)  # rank -> step -> (t0, t1), recent
        self._step_count: Counter[int] = Counter()  # rank -> steps read
        self._last_step: dict[int, int] = {}  # rank -> largest step read
        self._comm: dict[int, dict[int, list[tuple[int, int]]]] = defaultdict(lambda: defaultdict(list))
        self._bytes: dict[int, Counter[str]] = defaultdict(Counter)  # step -> op -> bytes_out, all ranks
        self._lookups: dict[str, np.ndarray] = {}  # table -> lookups per row (dense, grown as rows appear)
        self._skew: dict[str, tuple[int, float]] = {}  # table -> (rows touched, top-1% share), until it changes
        self._reports: dict[str, dict] = {}  # ranks/rank=R.json already read

    @property
    def running(self) -> bool:
        return self.manifest.status == STATUS_RUNNING

    def refresh_manifest(self) -> Manifest:
        """Re-read manifest.json (it is replaced atomically, so it is always whole)."""
        self.manifest = manifest.read(self.run_dir)
        return self.manifest

    def poll(self) -> int:
        """Read the part files that landed since the last poll; returns how many were read."""
        read = 0
        for table in COLUMNS:
            for rank, path in self._new_parts(table):
                data = self._read(table, path)
                self.files[table] += 1
                self.rows[table] += data.num_rows
                if "phase" in data.column_names:  # schema 1.0 has no phase: every row is training
                    data = data.filter(pc.equal(data.column("phase").cast(pa.string()), TRAIN))
                getattr(self, f"_add_{table}")(rank, data)
                self._seen.add(f"{table}/{path.parent.name}/{path.name}")
                read += 1
        self._prune()
        return read

    def _new_parts(self, table: str) -> list[tuple[int, Path]]:
        """(rank, path) of the part files of `table` not read yet, in rank and part order."""
        found = []
        try:
            rank_dirs = [d for d in os.scandir(self.run_dir / table) if d.is_dir() and d.name.startswith("rank=")]
        except FileNotFoundError:
            return []
        for rank_dir in rank_dirs:
            rank = rank_dir.name.removeprefix("rank=")
            if not rank.isdigit():
                continue
            for entry in os.scandir(rank_dir.path):  # a listing, not a read: temporary files are hidden (.part-...)
                if (entry.name.startswith("part-") and entry.name.endswith(".parquet")
                        and f"{table}/{rank_dir.name}/{entry.name}" not in self._seen):
                    found.append((int(rank), Path(entry.path)))
        return sorted(found, key=lambda item: (item[0], item[1].name))

    def _read(self, table: str, path: Path) -> pa.Table:
        part = pq.ParquetFile(path)
        version = (part.schema_arrow.metadata or {}).get(VERSION_KEY, b"").decode()
        if version and major(version) != major(SCHEMA_VERSION):
            raise SchemaVersionError(f"{path} has trace schema {version}; this tracekit reads {SCHEMA_VERSION} "
                                     f"(major {major(SCHEMA_VERSION)}): upgrade tracekit to watch this run")
        names = part.schema_arrow.names
        return part.read(columns=[c for c in COLUMNS[table] if c in names])

    def _add_steps(self, rank: int, data: pa.Table) -> None:
        steps = data.column("step").to_pylist()
        for step, t0, t1 in zip(steps, data.column("t_start_ns").to_pylist(), data.column("t_end_ns").to_pylist()):
            self._steps[rank][step] = (t0, t1)
        if steps:
            self._step_count[rank] += len(steps)
            self._last_step[rank] = max(self._last_step.get(rank, -1), max(steps))

    def _add_comms(self, rank: int, data: pa.Table) -> None:
        columns = [data.column(c).to_pylist() for c in ("step", "op", "bytes_out", "t_start_ns", "t_end_ns")]
        for step, op, nbytes, t0, t1 in zip(*columns):
            self._comm[rank][step].append((t0, t1))
            self._bytes[step][op] += nbytes

    def _add_accesses(self, rank: int, data: pa.Table) -> None:
        if data.num_rows == 0:
            return
        names = data.column("table_name").combine_chunks()
        if isinstance(names, pa.DictionaryArray):
            codes, dictionary = names.indices.to_numpy(zero_copy_only=False), names.dictionary.to_pylist()
        else:
            dictionary, codes = np.unique(names.to_numpy(zero_copy_only=False), return_inverse=True)
        rows = data.column("row").to_numpy()
        counts = data.column("count").to_numpy().astype(np.int64)
        for code, name in enumerate(dictionary):
            chosen = (codes == code) & (rows >= 0)
            if not chosen.any():
                continue
            added = np.bincount(rows[chosen], weights=counts[chosen]).astype(np.int64)
            kept = self._lookups.get(name, np.zeros(0, np.int64))
            if len(added) > len(kept):
                kept, added = added, kept
            kept[:len(added)] += added
            self._lookups[name] = kept
            self._skew.pop(name, None)

    @property
    def recorded(self) -> Window:
        """The steps whose comms and accesses are recorded (record --steps/--every)."""
        return Window.of_settings(self.manifest.collector_settings)

    def _prune(self) -> None:
        """Forget steps older than the recent window needs (step counts stay exact): the last 2 ×
        `window` steps are kept, and the last 2 × `window` recorded ones."""
        recorded = self.recorded
        for rank, last in self._last_step.items():
            keep = set(sorted(s for s in self._steps[rank] if recorded.on(s))[-2 * self.window:])
            for by_step in (self._steps[rank], self._comm[rank]):
                for step in [s for s in by_step if s < last - 2 * self.window and s not in keep]:
                    del by_step[step]
        for step in sorted(self._bytes)[:-2 * self.window]:
            del self._bytes[step]

    def figures(self) -> dict:
        """What the view shows, as plain data (see the module docstring for each definition)."""
        ranks = {}
        for rank in sorted(self._step_count):
            steps = self._steps[rank]
            recent = sorted(steps)[-self.window:]
            traced = sorted(s for s in steps if self.recorded.on(s))[-self.window:]
            step_ns = sum(steps[s][1] - steps[s][0] for s in traced)
            comm_ns = sum(_union_ns(self._comm[rank].get(s, []), *steps[s]) for s in traced)
            ranks[rank] = {"steps": self._step_count[rank], "last_step": self._last_step[rank],
                           "step_s": statistics.median(steps[s][1] - steps[s][0] for s in recent) / 1e9,
                           "comm_share": comm_ns / step_ns if step_ns > 0 and self.files["comms"] else None}
        return {"run_dir": str(self.run_dir), "status": self.manifest.status,
                "elapsed_s": _elapsed(self.manifest), "window": self.window, "ranks": ranks, "bytes_per_step": self._bytes_per_step(),
                "tables": self._hot_tables(), "dropped_rows": self._dropped(), "now": self._now(),
                "hang": self._hang(), "files": dict(self.files), "rows": dict(self.rows),
                "recorded": None if self.recorded.everything else self.recorded.describe()}

    def _now(self) -> dict[int, dict]:
        """What each rank is doing now, from its heartbeat (collectors/heartbeat.py), while it runs."""
        now = time.time()
        out = {}
        for rank, beat in sorted(read_heartbeats(self.run_dir).items()):
            call = beat.get("open")
            out[rank] = {"step": beat["step"], "beat_age_s": now - beat["wall_time"],
                         "in": None if call is None else {**call, "for_s": now - call["since"]}}
        return out

    def _hang(self) -> dict | None:
        """hang.json while the hang it describes has not cleared."""
        try:
            hang = json.loads((self.run_dir / "hang.json").read_text())
        except (OSError, ValueError):
            return None
        return None if "cleared_after_s" in hang else hang

    def _bytes_per_step(self) -> dict[str, float]:
        """op -> bytes_out per step, over the last `window` steps with comms that every rank has finished."""
        if not self._last_step:
            return {}
        done = min(self._last_step.values())
        steps = sorted(s for s in self._bytes if s <= done)[-self.window:]
        total: Counter[str] = Counter()
        for step in steps:
            total.update(self._bytes[step])
        return {op: n / len(steps) for op, n in sorted(total.items(), key=lambda kv: -kv[1])}

    def _hot_tables(self) -> list[dict]:
        """The HOT_TABLES most looked-up tables: lookups, their share of all, rows touched, top-1% share."""
        lookups = {name: int(counts.sum()) for name, counts in self._lookups.items()}
        everything = sum(lookups.values())
        num_rows = {t.name: t.num_rows for t in self.manifest.tables or ()}
        hot = []
        for name in sorted(lookups, key=lambda n: (-lookups[n], n))[:HOT_TABLES]:
            if name not in self._skew:
                counts = self._lookups[name]
                top = math.ceil(0.01 * max(num_rows.get(name, 0), len(counts)))
                share = np.partition(counts, len(counts) - top)[len(counts) - top:].sum() if top < len(counts) \
                    else counts.sum()
                self._skew[name] = (int(np.count_nonzero(counts)), float(share) / max(lookups[name], 1))
            touched, top1 = self._skew[name]
            hot.append({"table": name, "lookups": lookups[name], "share": lookups[name] / everything,
                        "rows_touched": touched, "top_1pct_share": top1})
        return hot

    def _dropped(self) -> dict[str, int] | None:
        """Dropped rows per table over all ranks, from the manifest or the rank reports; None if neither says."""
        per_rank = self.manifest.dropped_rows
        if per_rank is None:
            for path in RunDir.at(self.run_dir).ranks.glob("rank=*.json"):
                if path.name not in self._reports:
                    try:
                        self._reports[path.name] = json.loads(path.read_text())
                    except (OSError, ValueError):
                        continue
            if not self._reports:
                return None
            per_rank = {name: report.get("dropped_rows") or {} for name, report in self._reports.items()}
        total: Counter[str] = Counter()
        for rows in per_rank.values():
            total.update(rows)
        return dict(total)


def _union_ns(intervals: list[tuple[int, int]], lo: int, hi: int) -> int:
    """Length of the union of `intervals`, each clipped to [lo, hi]."""
    covered, reach = 0, lo
    for t0, t1 in sorted(intervals):
        t0, t1 = max(t0, reach), min(t1, hi)
        if t1 > t0:
            covered += t1 - t0
            reach = t1
    return covered


def _elapsed(manifest: Manifest) -> float | None:
    try:
        start = datetime.datetime.fromisoformat(manifest.started_at)
        end = (datetime.datetime.fromisoformat(manifest.ended_at) if manifest.ended_at
               else datetime.datetime.now(datetime.timezone.utc))
        return (end - start).total_seconds()
    except (TypeError, ValueError):
        return None


def render(figures: dict) -> Group:
    """The view of `figures` (RunReader.figures): a status line and one table per figure."""
    elapsed = "" if figures["elapsed_s"] is None else f" after {figures['elapsed_s']:.1f} s"
    files = sum(figures["files"].values())
    parts = [Text(f"{figures['run_dir']}: {figures['status']}{elapsed}; {len(figures['ranks'])} rank(s), "
                  f"{files} part file(s) read", style="bold")]
    n = figures["window"]
    if figures["ranks"]:
        ranks = Table("rank", "steps", "last step", "step time", "comm share",
                      title="steps", title_justify="left")
        for rank, r in figures["ranks"].items():
            share = "-" if r["comm_share"] is None else f"{r['comm_share']:.0%}"
            ranks.add_row(str(rank), f"{r['steps']:,}", str(r["last_step"]), f"{r['step_s'] * 1e3:.1f} ms", share)
        parts.append(ranks)
    else:
        parts.append(Text("no steps yet"))
    if figures.get("now"):
        now = Table("rank", "step", "heartbeat", "in a collective", title="ranks now", title_justify="left")
        for rank, r in figures["now"].items():
            call = r["in"]
            where = "-" if call is None else (f"{call['op']} ({call['tag']}), call #{call['call']} of group "
                                              f"{call['group']}, for {call['for_s']:.1f} s")
            now.add_row(str(rank), str(r["step"]), f"{r['beat_age_s']:.1f} s ago", where)
        parts.append(now)
    if figures.get("hang"):
        parts.append(Text(describe_hang(figures["hang"]), style="bold red"))
    if figures["bytes_per_step"]:
        ops = Table("op", "bytes per step", title="bytes per step by op",
                    title_justify="left")
        for op, n_bytes in figures["bytes_per_step"].items():
            ops.add_row(op, format_bytes(n_bytes))
        parts.append(ops)
    if figures["tables"]:
        hot = Table("table", "lookups", "share", "rows touched", "top-1% rows' share", title="hottest tables",
                    title_justify="left")
        for t in figures["tables"]:
            hot.add_row(t["table"], f"{t['lookups']:,}", f"{t['share']:.0%}", f"{t['rows_touched']:,}",
                        f"{t['top_1pct_share']:.0%}")
        parts.append(hot)
    if figures["dropped_rows"] is not None:
        dropped = ", ".join(f"{table} {rows:,}" for table, rows in sorted(figures["dropped_rows"].items()) if rows)
        parts.append(Text(f"dropped rows: {dropped or 'none'}"))
    recorded = "" if figures["recorded"] is None else f" recorded ({figures['recorded']})"
    parts.append(Text(f"step time: median of the rank's last {n} steps; comm share: the union of its collective "
                      f"intervals within each of its last {n}{recorded} steps / their time; bytes per step: all "
                      f"ranks' bytes_out over the last {n}{recorded} steps every rank finished", style="dim"))
    return Group(*parts)


def wide_console(*, stderr: bool = False) -> Console:
    """A console as wide as the terminal, or 120 columns in a pipe or a file, so the tables stay whole."""
    return Console(stderr=stderr, width=shutil.get_terminal_size((120, 24)).columns)


def watch(run_dir: str | os.PathLike, *, interval: float = 1.0, once: bool = False, window: int = WINDOW,
          console: Console | None = None, stop: threading.Event | None = None) -> dict:
    """Show the run at `run_dir` live until its manifest leaves `running` (or `stop` is set), then
    print the final figures once; a finished run, or `once`, prints one snapshot at once. Returns
    the last figures. RunNotFound if `run_dir` is not a run directory."""
    reader = RunReader(run_dir, window=window)
    console = console or wide_console()
    reader.poll()
    if once or not reader.running:
        figures = reader.figures()
        console.print(render(figures))
        return figures
    stop = stop or threading.Event()
    with Live(render(reader.figures()), console=console, auto_refresh=False, transient=False) as live:
        while True:
            stop.wait(interval)
            ended = reader.refresh_manifest().status != STATUS_RUNNING or stop.is_set()
            reader.poll()  # after the manifest: every part file of an ended run is on disk by now
            figures = reader.figures()
            live.update(render(figures), refresh=True)
            if ended:
                break
    if not console.is_terminal:  # Live ends its last render with a newline only on a terminal
        console.line()
    return figures


def watching(run_dir: str | os.PathLike, *, enabled: bool = True, interval: float = 1.0,
             console: Console | None = None) -> contextlib.AbstractContextManager[None]:
    """`watch` on a thread, beside the run recorded inside the block (it waits for the manifest,
    and ends with the block once the run is finalised). The thread only reads files; an error ends
    the view with one line on the console, never the recording. `enabled` False: nothing."""
    if not enabled:
        return contextlib.nullcontext()
    run_dir = Path(run_dir)
    console = console or wide_console(stderr=True)

    def run(stop: threading.Event) -> None:
        try:
            while not (run_dir / MANIFEST).is_file():
                if stop.wait(0.05) and not (run_dir / MANIFEST).is_file():
                    return
            # a run finalised before the view started (a command that fails at once) still gets its figures
            watch(run_dir, interval=interval, console=console, stop=stop)
        except Exception as err:  # the view must never take the recording down
            console.print(f"tracekit watch: stopped ({type(err).__name__}: {err})")

    return in_background(run, "tracekit-watch")

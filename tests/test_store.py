"""Tests for the run store: RunWriter's part files, the manifest, and reading a run with Polars and DuckDB."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import tracekit.store
from tests.manifests import read_manifest, write_manifest
from tests.prerequisites import needs
from tracekit import thread_priority
from tracekit.errors import RunNotFound, SchemaVersionError, TracekitError
from tracekit.parts import write_part
from tracekit.run import open_run
from tracekit.run_dir import MANIFEST
from tracekit.schema import SCHEMA_VERSION, STATUS_COMPLETED, TABLE_KEY, TABLES, VERSION_KEY, file_metadata
from tracekit.store import RunWriter

REPO = Path(__file__).resolve().parents[1]


def accesses(step: int, n: int) -> dict:
    return {
        "step": [step] * n,
        "table_name": [f"t{i % 3}" for i in range(n)],
        "row": np.arange(n, dtype=np.int64),
        "count": np.ones(n, dtype=np.int32),
        "phase": ["train"] * n,
    }


def steps(first: int, n: int) -> dict:
    return {
        "step": list(range(first, first + n)),
        "t_start_ns": [10 * s for s in range(first, first + n)],
        "t_end_ns": [10 * s + 5 for s in range(first, first + n)],
        "samples": [512] * n,
        "loss": [None if s == 0 else 1.0 / (s + 1) for s in range(first, first + n)],
    }


def comm(step: int, seq: int) -> dict:
    return {
        "step": [step], "seq": [seq], "op": ["all_to_all_single"], "group": ["0,1"], "group_size": [2],
        "dtype": ["float32"], "bytes_out": [300], "bytes_in": [500], "splits_out": [[100, 200]],
        "splits_in": [[100, 400]], "t_start_ns": [0], "t_end_ns": [7], "tag": ["emb_fwd"], "async": [True],
        "phase": ["train"],
    }


def make_run(tmp_path: Path, *, ranks: int = 2, n_steps: int = 3) -> Path:
    """A run written through the real writer: per rank, n_steps × 10 accesses, n_steps steps, n_steps comms."""
    run_dir = tmp_path / "run"
    write_manifest(run_dir, {"status": STATUS_COMPLETED, "world_size": ranks})
    for rank in range(ranks):
        with RunWriter(run_dir, rank) as writer:
            for step in range(n_steps):
                writer.append("accesses", accesses(step, 10))
                writer.append("comms", comm(step, seq=step))
            writer.append("steps", steps(0, n_steps))
    return run_dir


def part_files(run_dir: Path) -> list[Path]:
    return sorted(run_dir.rglob("*.parquet"))


def hidden_files(run_dir: Path) -> list[Path]:
    return [p for p in run_dir.rglob(".*") if p.is_file()]


def wait_for(predicate, timeout_s: float = 60.0) -> None:
    """Wait until `predicate()` holds; the bound only stops a test that would otherwise hang."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def test_round_trip_polars_and_duckdb(tmp_path):
    import polars as pl

    run = open_run(make_run(tmp_path))
    assert run.manifest.to_json() == {"status": STATUS_COMPLETED, "world_size": 2}
    assert run.tables() == ["accesses", "comms", "steps"]

    acc = run.scan("accesses").collect()
    assert acc.schema["table_name"] == pl.String
    assert acc.schema["rank"].is_integer()
    per_rank = acc.group_by("rank").agg(pl.len(), pl.col("row").sum(), pl.col("count").sum()).sort("rank")
    assert per_rank.rows() == [(0, 30, 3 * 45, 30), (1, 30, 3 * 45, 30)]
    assert acc.filter(pl.col("table_name") == "t0").height == 2 * 3 * 4

    comms = run.scan("comms").collect()
    assert comms["splits_in"].to_list() == [[100, 400]] * 6
    assert comms["bytes_out"].sum() == 6 * 300

    loss = run.scan("steps").select(pl.col("loss").null_count().alias("nulls"), pl.col("loss").sum()).collect().row(0)
    assert loss == (2, 2 * (1 / 2 + 1 / 3))

    rel = run.relation("accesses")
    assert rel.aggregate("rank, count(*), sum(row), sum(count)").order("rank").fetchall() == [
        (0, 30, 3 * 45, 30), (1, 30, 3 * 45, 30)
    ]
    assert rel.filter("table_name = 't0'").aggregate("count(*)").fetchall() == [(24,)]
    assert dict(zip(rel.columns, rel.types))["table_name"] == "VARCHAR"


def test_phases_of_batches_with_different_dictionaries_share_a_part_file_intact(tmp_path):
    """`phase` is written as a dictionary (parts.PARQUET_OPTIONS): batches whose dictionaries differ
    (["train"], then ["eval", "train"]) still read back row for row."""
    phases = [["train"] * 3, ["eval", "train", "eval"], ["train"] * 2]
    write_manifest(tmp_path, {"status": STATUS_COMPLETED, "world_size": 1})
    with RunWriter(tmp_path, 0, flush_interval_s=3600) as writer:
        for step, batch in enumerate(phases):
            writer.append("accesses", {**accesses(step, len(batch)), "phase": batch})
    assert len(list((tmp_path / "accesses" / "rank=0").glob("part-*.parquet"))) == 1
    rows = open_run(tmp_path).relation("accesses").order("step, row").project("phase").fetchall()
    assert [phase for (phase,) in rows] == [p for batch in phases for p in batch]


def test_relation_uses_the_given_connection(tmp_path):
    import duckdb

    con = duckdb.connect()
    run = open_run(make_run(tmp_path))
    run.relation("steps", con).to_view("steps")
    assert con.sql("SELECT count(*), sum(samples) FROM steps").fetchall() == [(6, 6 * 512)]


def test_flush_by_time_and_by_rows(tmp_path):
    with RunWriter(tmp_path, 0, flush_interval_s=0.05) as writer:
        for step in range(3):
            writer.append("steps", steps(step, 1))
            wait_for(lambda: writer.written["steps"] == step + 1)
    assert len(list((tmp_path / "steps" / "rank=0").glob("*.parquet"))) == 3

    with RunWriter(tmp_path, 1, flush_interval_s=3600, flush_rows=10) as writer:
        for step in range(3):
            writer.append("accesses", accesses(step, 10))
            wait_for(lambda: writer.written["accesses"] == 10 * (step + 1))
        writer.append("accesses", accesses(3, 4))  # below flush_rows: written by close()
    parts = sorted((tmp_path / "accesses" / "rank=1").glob("*.parquet"))
    assert [p.name for p in parts] == [f"part-0000{i}.parquet" for i in range(4)]
    assert [pq.read_metadata(p).num_rows for p in parts] == [10, 10, 10, 4]
    assert hidden_files(tmp_path) == []


def test_part_files_carry_version_and_table(tmp_path):
    run_dir = make_run(tmp_path, ranks=1)
    for part in part_files(run_dir):
        schema = pq.read_schema(part)
        assert schema.metadata[VERSION_KEY] == SCHEMA_VERSION.encode()
        table = schema.metadata[TABLE_KEY].decode()
        assert part.parts[-3] == table
        assert schema.remove_metadata().equals(TABLES[table])


def test_flush_waits_for_the_rows_and_new_writer_continues_numbering(tmp_path):
    writer = RunWriter(tmp_path, 0, flush_interval_s=3600)
    writer.append("steps", steps(0, 5))
    writer.flush()
    assert pq.read_table(tmp_path / "steps" / "rank=0" / "part-00000.parquet").num_rows == 5
    writer.close()
    with RunWriter(tmp_path, 0) as again:
        again.append("steps", steps(5, 1))
    assert (tmp_path / "steps" / "rank=0" / "part-00001.parquet").is_file()


CRASHING_CHILD = textwrap.dedent(
    """
    import os, signal, sys
    import numpy as np
    from tracekit.store import RunWriter

    run_dir, side = sys.argv[1], sys.argv[2]
    writer = RunWriter(run_dir, 0, flush_interval_s=0.05)
    n = 20_000
    for i in range(1, 1000):
        writer.append("accesses", {"step": np.full(n, i), "table_name": ["t0"] * n,
                                   "row": np.arange(n), "count": np.ones(n, dtype=np.int32),
                                   "phase": ["train"] * n})
        if i % 4 == 0:
            writer.flush()
            with open(side + ".tmp", "w") as f:
                f.write(str(i * n))
            os.replace(side + ".tmp", side)
        if i == 14:
            os.kill(os.getpid(), signal.SIGKILL)
    """
)


def test_crash_leaves_only_complete_part_files(tmp_path):
    run_dir, side = tmp_path / "run", tmp_path / "flushed_rows"
    write_manifest(run_dir, {"status": "running"})
    child = subprocess.run(
        [sys.executable, "-c", CRASHING_CHILD, str(run_dir), str(side)],
        cwd=REPO, capture_output=True, text=True, timeout=60,
    )
    assert child.returncode == -9, child.stderr
    flushed = int(side.read_text())
    assert flushed == 12 * 20_000

    rows = sum(pq.read_table(part).num_rows for part in part_files(run_dir))
    assert flushed <= rows <= 14 * 20_000
    assert all(part.name.startswith("part-") for part in part_files(run_dir))
    run = open_run(run_dir)
    assert run.scan("accesses").select("step").collect().height == rows
    assert run.relation("accesses").aggregate("count(*)").fetchall() == [(rows,)]


def test_full_queue_drops_and_counts_without_blocking(tmp_path, monkeypatch):
    release = threading.Event()

    def stuck_write_part(*args):
        release.wait()
        return write_part(*args)

    monkeypatch.setattr(tracekit.store, "write_part", stuck_write_part)
    writer = RunWriter(tmp_path, 0, flush_interval_s=0.001, max_queued_rows=10)
    writer.append("steps", steps(0, 4))
    wait_for(lambda: writer._pending_rows == 0)  # the thread holds these 4 rows, stuck writing them
    appending = threading.Thread(target=lambda: [writer.append("steps", steps(0, n)) for n in (4, 4, 2, 1)])
    try:
        appending.start()  # queued 8, (12 > 10: dropped), 10, (11 > 10: dropped)
        appending.join(60)  # a bound for appends that wait on the write, not a speed to meet
        assert not appending.is_alive()  # they returned while the write is still stuck
    finally:
        release.set()
    assert writer.dropped == {"steps": 5}
    writer.close()
    assert writer.written == {"steps": 10}
    assert writer.errors == 0
    writer.append("steps", steps(0, 3))
    assert writer.dropped == {"steps": 8}


def test_write_failure_is_counted_not_raised(tmp_path, monkeypatch, capsys):
    def failing_write_part(*args):
        raise OSError("disk full")

    monkeypatch.setattr(tracekit.store, "write_part", failing_write_part)
    with RunWriter(tmp_path, 3) as writer:
        writer.append("steps", steps(0, 2))
        writer.flush()
        writer.append("steps", steps(2, 1))
    assert writer.errors == 2
    assert writer.first_error == "steps: OSError: disk full"
    assert writer.dropped == {"steps": 3}
    assert capsys.readouterr().err.count("disk full") == 1


def test_sources_are_drained_on_every_flush_and_at_close(tmp_path):
    held: list[int] = []
    finals: list[bool] = []

    def drain(final):
        finals.append(final)
        rows, held[:] = list(held), []
        return [("steps", steps(rows[0], len(rows)))] if rows else []

    with RunWriter(tmp_path, 0, flush_interval_s=0.05) as writer:
        writer.add_source(drain)
        held.extend([0, 1])
        wait_for(lambda: writer.written["steps"] == 2)  # pulled by time, with nothing appended
        held.append(2)
        writer.flush()
        assert writer.written["steps"] == 3
        held.append(3)
    assert writer.written["steps"] == 4 and finals[-1] is True and not any(finals[:-1])
    assert pq.read_table(tmp_path / "steps")["step"].to_pylist() == [0, 1, 2, 3]


def test_a_failing_source_is_counted_and_the_others_still_written(tmp_path, capsys):
    def broken(final):
        raise RuntimeError("bad drain")

    with RunWriter(tmp_path, 0) as writer:
        writer.add_source(broken)
        writer.add_source(lambda final: [("steps", steps(0, 1))])
        writer.flush()
    assert writer.errors == 2 and writer.written["steps"] == 2  # the flush's drain and close's
    assert "RuntimeError: bad drain" in writer.first_error
    assert capsys.readouterr().err.count("bad drain") == 1


@pytest.mark.parametrize(
    "columns, message",
    [
        ({**steps(0, 1), "lost": [1.0]}, "'steps': missing column(s) [], unknown column(s) ['lost']"),
        ({k: v for k, v in steps(0, 1).items() if k != "samples"}, "'steps': missing column(s) ['samples']"),
        ({**steps(0, 1), "samples": ["many"]}, "'steps', column 'samples'"),
        ({**steps(0, 1), "t_end_ns": [None]}, "'steps', column 't_end_ns': 1 null(s)"),
    ],
)
def test_bad_columns_name_table_and_column(tmp_path, columns, message):
    with RunWriter(tmp_path, 0) as writer, pytest.raises(ValueError) as e:
        writer.append("steps", columns)
    assert message in str(e.value)


def test_append_accepts_record_batch_in_any_column_order(tmp_path):
    batch = pa.RecordBatch.from_pydict(dict(reversed(list(steps(0, 2).items()))))
    with RunWriter(tmp_path, 0) as writer:
        writer.append("steps", batch)
    assert pq.read_table(tmp_path / "steps").column_names == TABLES["steps"].names + ["rank"]


def test_unknown_major_version_is_refused(tmp_path):
    run_dir = make_run(tmp_path, ranks=1)
    future = pa.Table.from_pylist([{"step": 9, "t_start_ns": 0, "t_end_ns": 1, "samples": 1, "loss": 0.5}])
    metadata = {**file_metadata("steps"), VERSION_KEY: b"2.0"}
    write_part(future.replace_schema_metadata(metadata), run_dir / "steps" / "rank=1", 0)
    run = open_run(run_dir)
    for read in (run.scan, run.relation):
        with pytest.raises(SchemaVersionError, match=r"rank=1/part-00000.parquet has trace schema version 2.0; "
                           rf"this tracekit reads version {SCHEMA_VERSION}"):
            read("steps")
    assert run.scan("accesses").collect().height == 30


def test_newer_minor_version_is_read(tmp_path):
    run_dir = make_run(tmp_path, ranks=1)
    part = run_dir / "steps" / "rank=0" / "part-00000.parquet"
    table = pq.read_table(part)
    pq.write_table(table.replace_schema_metadata({**table.schema.metadata, VERSION_KEY: b"1.7"}), part)
    assert open_run(run_dir).scan("steps").collect().height == 3


def test_missing_table_and_missing_run(tmp_path):
    run = open_run(make_run(tmp_path))
    message = r"run has no gpu table \(no gpu rows were recorded\); it has: accesses, comms, steps"
    with pytest.raises(TracekitError, match=message):
        run.scan("gpu")
    with pytest.raises(TracekitError, match="unknown trace table 'comm'"):
        run.relation("comm")
    with pytest.raises(RunNotFound, match="does not exist"):
        open_run(tmp_path / "nowhere")
    with pytest.raises(RunNotFound, match=f"has no {MANIFEST}"):
        open_run(tmp_path)


def test_manifest_round_trip_is_atomic(tmp_path, monkeypatch):
    data = {"status": "running", "command": ["python", "train.py"], "world_size": 2}
    path = write_manifest(tmp_path, data)
    assert read_manifest(tmp_path) == data
    assert path.read_text() == json.dumps(data, sort_keys=True, indent=2) + "\n"

    with pytest.raises(TypeError):
        write_manifest(tmp_path, {**data, "status": object()})
    assert read_manifest(tmp_path) == data

    def failing_replace(src, dst):
        raise OSError("no space left")

    monkeypatch.setattr(os, "replace", failing_replace)
    with pytest.raises(OSError):
        write_manifest(tmp_path, {**data, "status": "completed"})
    assert read_manifest(tmp_path) == data
    assert sorted(p.name for p in tmp_path.iterdir()) == [MANIFEST]


def test_store_imports_neither_duckdb_nor_polars():
    code = "import sys, tracekit.store; print(sorted({m.split('.')[0] for m in sys.modules} & {'duckdb', 'polars'}))"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "[]", out.stderr


@pytest.mark.skipif(not hasattr(os, "setpriority"), reason="thread priorities are a POSIX/Linux feature")
def test_the_writer_thread_runs_nicer_and_counts_its_cpu(tmp_path):
    def own_nice():
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    base, seen = own_nice(), []

    def source(final):
        seen.append(own_nice())
        return []

    with RunWriter(tmp_path, 0, nice=5) as writer:
        writer.add_source(source)
        writer.flush()
    assert seen and set(seen) == {min(19, base + 5)}  # the writer's own thread, read from inside it
    assert own_nice() == base  # the training thread's stays as it was
    assert writer.cpu_s > 0


def _thread_state() -> tuple[bool, int]:
    tid = threading.get_native_id()
    return thread_priority.is_idle(tid), os.getpriority(os.PRIO_PROCESS, tid)


@needs(None if thread_priority.may_leave_idle(threading.get_native_id()) else
       "this process may not lift a thread out of SCHED_IDLE (no CAP_SYS_NICE or RLIMIT_NICE)")
def test_an_idle_writer_runs_under_sched_idle_at_its_nice_value(tmp_path):
    seen = []
    base = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    with RunWriter(tmp_path, 0, nice=5, idle=True) as writer:
        writer.add_source(lambda final: seen.append(_thread_state()) or [])
        writer.flush()
        flushing = list(seen)
    assert writer.scheduling == "idle" and writer.rescues == 0
    assert flushing and set(flushing) == {(True, min(19, base + 5))}
    assert seen[-1] == (False, min(19, base + 5))  # lifted for the last flush, on the program's exit path
    assert _thread_state() == (False, base)  # the caller's thread is untouched


@needs(None if thread_priority.may_leave_idle(threading.get_native_id()) else
       "this process may not lift a thread out of SCHED_IDLE (no CAP_SYS_NICE or RLIMIT_NICE)")
def test_a_starved_idle_writer_is_lifted_and_returns_to_idle(tmp_path):
    """A process spinning on the writer's core leaves an idle writer no time at all: the watchdog lifts
    it to its nice value, its rows are written, and once the core is free it goes back to idle."""
    core = min(os.sched_getaffinity(0))
    calls = []

    def source(final):
        start = _thread_state()
        spent = time.thread_time()
        while time.thread_time() - spent < 0.03:  # a flush's worth of CPU work
            pass
        calls.append((start, _thread_state()))
        return [("steps", {"step": [len(calls)], "t_start_ns": [0], "t_end_ns": [1], "samples": [1]})]

    old = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {core})  # this thread only: the writer and its watchdog inherit it
    spinner = subprocess.Popen([sys.executable, "-c", f"import os; os.sched_setaffinity(0, {{{core}}})\nwhile True: pass"])
    try:
        time.sleep(0.3)  # the spinner holds the core
        writer = RunWriter(tmp_path, 0, nice=5, idle=True, flush_interval_s=0.2)
        writer.add_source(source)
        writer.flush()  # waits: only a lifted writer gets through
        lifted = writer.rescues
    finally:
        spinner.kill()
        spinner.wait()
        os.sched_setaffinity(0, old)
    assert lifted >= 1 and any(not end[0] for _, end in calls)
    writer.flush()  # any flush lifted while the spinner ran is done
    n = len(calls)
    writer.flush()  # the core is free now: the writer is back under SCHED_IDLE
    writer.close()
    assert any(start[0] for start, _ in calls[n:])
    assert writer.written["steps"] == len(calls) and not writer.dropped

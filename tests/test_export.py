"""`tracekit export --chrome-trace` on a recorded 2-rank run of the reference trainer: valid JSON in
the Trace Event Format, one X event per steps and comms row with its times, every rank named, lanes
that nest; a call of unknown completion; clocks of two hosts; bad runs and a missing option."""

from __future__ import annotations

import json
import shutil
import sys
from collections import Counter
from pathlib import Path

import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from analyses.export import chrome_trace
from tests.recorded import REPO, TINY, record
from tracekit.app.cli import cli


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """TINY for 4 steps on 2 gloo ranks."""
    code, run_dir = record(tmp_path_factory.mktemp("export"), sys.executable, "-m", "torch.distributed.run",
                           "--standalone", "--nproc-per-node", "2", str(REPO / "train.py"), *TINY)
    assert code == 0
    return run_dir


def rows(run_dir: Path, table: str) -> list[dict]:
    return pq.read_table(run_dir / table, partitioning="hive").to_pylist()


def x_events(trace: dict, cat: str) -> list[dict]:
    return [e for e in trace["traceEvents"] if e["ph"] == "X" and e["cat"] == cat]


def export(run_dir: Path, out: Path) -> dict:
    r = CliRunner().invoke(cli, ["export", str(run_dir), "--chrome-trace", str(out)])
    assert r.exit_code == 0, r.output
    return json.loads(out.read_text())


@pytest.mark.slow
def test_the_trace_is_trace_event_format_with_one_event_per_step_and_collective(run, tmp_path) -> None:
    out = tmp_path / "t.json"
    r = CliRunner().invoke(cli, ["export", str(run), "--chrome-trace", str(out)])
    assert r.exit_code == 0, r.output
    steps, comms = rows(run, "steps"), rows(run, "comms")
    assert r.output == f"wrote {out}: {len(steps)} step and {len(comms)} collective events of 2 rank(s)\n"
    assert [p.name for p in tmp_path.iterdir()] == ["t.json"]  # no temporary file left behind
    trace = json.loads(out.read_text())
    assert trace["displayTimeUnit"] == "ms" and isinstance(trace["traceEvents"], list)
    for e in trace["traceEvents"]:
        assert e["ph"] in ("M", "X") and isinstance(e["pid"], int) and isinstance(e["tid"], int), e
        if e["ph"] == "X":
            assert {"name", "cat", "ts", "dur", "args"} <= e.keys() and e["dur"] >= 0, e

    # one X event per row, per rank and table, at the row's times (one host: no clock offset)
    origin = trace["otherData"]["origin_ns"]
    assert origin == min(r["t_start_ns"] for r in steps + comms)
    for cat, table, key in (("step", steps, ("step",)), ("comm", comms, ("step", "seq"))):
        events = x_events(trace, cat)
        assert Counter(e["pid"] for e in events) == Counter(r["rank"] for r in table)
        expected = {(r["rank"], *(r[k] for k in key)): r for r in table}
        got = {(e["pid"], *(e["args"][k] for k in key)): e for e in events}
        assert got.keys() == expected.keys() and len(got) == len(events)
        for k, e in got.items():
            row = expected[k]
            assert e["ts"] == pytest.approx((row["t_start_ns"] - origin) / 1000, abs=1e-3)
            assert e["dur"] == pytest.approx((row["t_end_ns"] - row["t_start_ns"]) / 1000, abs=1e-3)
    step_args = {(e["pid"], e["args"]["step"]): e["args"] for e in x_events(trace, "step")}
    for row in steps:
        assert step_args[(row["rank"], row["step"])] == {k: row[k] for k in ("step", "samples", "loss", "schedule")}
    comm_args = {(e["pid"], e["args"]["seq"]): e["args"] for e in x_events(trace, "comm")}
    for row in comms:
        args = comm_args[(row["rank"], row["seq"])]
        assert args == {k: row[k] for k in args}
        assert {"op", "tag", "phase", "bytes_out", "bytes_in", "splits_out", "splits_in", "group", "dtype",
                "async", "step"} <= args.keys()

    # every rank named, with its steps and collectives tracks
    meta = [e for e in trace["traceEvents"] if e["ph"] == "M"]
    names = {(e["pid"], e["args"]["name"]) for e in meta if e["name"] == "process_name"}
    assert names == {(0, "rank 0"), (1, "rank 1")}
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in meta if e["name"] == "thread_name"}
    for rank in (0, 1):
        assert threads[(rank, 0)] == "steps" and threads[(rank, 1)] == "collectives"
    assert {(e["pid"], e["tid"]) for e in trace["traceEvents"] if e["ph"] == "X"} <= threads.keys()

    # events of one track never overlap, so a viewer draws each where it belongs
    by_track: dict[tuple[int, int], list[dict]] = {}
    for e in trace["traceEvents"]:
        if e["ph"] == "X":
            by_track.setdefault((e["pid"], e["tid"]), []).append(e)
    for track in by_track.values():
        track.sort(key=lambda e: e["ts"])
        for a, b in zip(track, track[1:]):
            assert a["ts"] + a["dur"] <= b["ts"] + 1e-3, (a, b)


@pytest.mark.slow
def test_a_collective_of_unknown_completion_is_a_zero_length_event_saying_so(run, tmp_path) -> None:
    copy = shutil.copytree(run, tmp_path / "run")
    part = sorted((copy / "comms" / "rank=1").glob("*.parquet"))[-1]
    table = pq.read_table(part)
    ends = table["t_end_ns"].to_pylist()
    ends[-1] = -1
    pq.write_table(table.set_column(table.schema.get_field_index("t_end_ns"), "t_end_ns",
                                    pc.cast(ends, table.schema.field("t_end_ns").type)), part)
    seq = table["seq"].to_pylist()[-1]
    trace = export(copy, tmp_path / "t.json")
    event, = [e for e in x_events(trace, "comm") if e["pid"] == 1 and e["args"]["seq"] == seq]
    assert event["dur"] == 0 and event["args"]["completion"] == "unknown"
    assert sum("completion" in e["args"] for e in x_events(trace, "comm")) == 1


@pytest.mark.slow
def test_ranks_on_two_hosts_are_aligned_with_the_clock_anchors(run, tmp_path) -> None:
    copy = shutil.copytree(run, tmp_path / "run")
    manifest = json.loads((copy / "manifest.json").read_text())
    anchors = {"0": {"monotonic_ns": 1_000, "wall_ns": 5_000}, "1": {"monotonic_ns": 1_000, "wall_ns": 8_000_000}}
    (copy / "manifest.json").write_text(json.dumps(manifest | {"hosts": ["a", "b"], "clock_anchors": anchors}))
    aligned, raw = chrome_trace(copy), chrome_trace(run)
    shift = {0: 0.0, 1: (8_000_000 - 5_000) / 1000}  # rank 1's clock runs 7.995 ms behind rank 0's
    origin_shift = (aligned["otherData"]["origin_ns"] - raw["otherData"]["origin_ns"]) / 1000
    both = zip(x_events(aligned, "step") + x_events(aligned, "comm"), x_events(raw, "step") + x_events(raw, "comm"))
    for a, r in both:
        assert a["ts"] == pytest.approx(r["ts"] + shift[a["pid"]] - origin_shift, abs=1e-3)
    assert aligned["otherData"]["clock"].startswith("several hosts: aligned")


@pytest.mark.parametrize("make", [lambda p: p / "missing", lambda p: p])
def test_a_run_dir_that_does_not_exist_or_is_not_a_run_exits_2_naming_it(tmp_path, make) -> None:
    run_dir = make(tmp_path)
    r = CliRunner().invoke(cli, ["export", str(run_dir), "--chrome-trace", str(tmp_path / "t.json")])
    assert r.exit_code == 2, r.output
    assert f"Error: {run_dir} " in r.output and "Traceback" not in r.output
    assert not (tmp_path / "t.json").exists()


def test_without_chrome_trace_is_a_usage_error_saying_what_to_add(tmp_path) -> None:
    r = CliRunner().invoke(cli, ["export", str(tmp_path)])
    assert r.exit_code == 2, r.output
    assert r.output.startswith("Usage: ") and " export [OPTIONS] RUN_DIR" in r.output
    assert "export needs --chrome-trace FILE" in r.output
    assert f"tracekit export {tmp_path} --chrome-trace t.json" in r.output

"""`tracekit watch` and `record --watch`: the incremental reader counts exactly what landed, part by
part, and reads each part file once; the figures follow their definitions; the view of a finished
run prints the final figures and exits 0; `record --watch` keeps the command's exit code."""

from __future__ import annotations

import io
import json
import shutil
import sys
import threading
from collections import Counter
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner
from rich.console import Console

from tests.manifests import read_manifest, write_manifest
from tests.recorded import REPO, TINY, record
from tracekit.app.cli import cli
from tracekit.store import RunWriter
from tracekit.app.watch import RunReader, watch

MS = 1_000_000


@pytest.fixture(scope="module")
def recorded(tmp_path_factory) -> tuple[int, Path, str]:
    """A real 2-rank TINY run recorded with --watch: (exit code, run dir, record's output)."""
    tmp = tmp_path_factory.mktemp("watched")
    run_dir = tmp / "run"
    r = CliRunner().invoke(cli, ["record", "-o", str(run_dir), "--flush-interval", "0.2", "--watch", "--",
                                 sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                                 "2", str(REPO / "train.py"), *TINY])
    return r.exit_code, run_dir, r.output


def parts_of(run_dir: Path) -> list[Path]:
    """The run's part files of the tables the view reads, ordered as a writer lands them: by part number."""
    parts = [p for table in ("steps", "comms", "accesses") for p in (run_dir / table).glob("rank=*/part-*.parquet")]
    return sorted(parts, key=lambda p: (p.name, p.parent.parent.name, p.parent.name))


def test_record_watch_keeps_the_exit_code_and_ends_with_the_final_view(recorded) -> None:
    code, run_dir, output = recorded
    assert code == 0, output
    assert read_manifest(run_dir)["status"] == "completed"
    view = output[output.index(f"{run_dir}: completed"):]  # the view's last render comes after the run ends
    for figure in ("steps", "bytes per step by op", "all_to_all_single", "hottest tables", "dropped rows: none"):
        assert figure in view, output
    assert [line.split()[:4] for line in view.splitlines() if line.startswith(("│ 0 ", "│ 1 "))] == \
        [["│", "0", "│", "4"], ["│", "1", "│", "4"]], output


def test_record_watch_of_a_failing_command_exits_with_its_code(tmp_path: Path) -> None:
    r = CliRunner().invoke(cli, ["record", "-o", str(tmp_path / "run"), "--watch", "--",
                                 sys.executable, "-c", "import sys; sys.exit(3)"])
    assert r.exit_code == 3, r.output
    assert f"{tmp_path / 'run'}: failed" in r.output and "no steps yet" in r.output, r.output


def test_watch_on_a_finished_run_prints_the_final_figures_and_exits_0(recorded) -> None:
    _, run_dir, _ = recorded
    r = CliRunner().invoke(cli, ["watch", str(run_dir), "--interval", "60"])  # no wait: the run has ended
    assert r.exit_code == 0, r.output
    assert r.output.startswith(f"{run_dir}: completed after "), r.output
    reader = RunReader(run_dir)
    reader.poll()
    figures = reader.figures()
    assert {rank: f["steps"] for rank, f in figures["ranks"].items()} == {0: 4, 1: 4}
    manifest = read_manifest(run_dir)
    written = manifest["written_rows"]
    assert figures["rows"] == {table: written[table] for table in ("steps", "comms", "accesses")}
    assert sum(t["lookups"] for t in figures["tables"]) == sum(
        pq.read_table(p, columns=["count"]).column("count").to_numpy().sum()
        for p in (run_dir / "accesses").glob("rank=*/*.parquet"))
    assert figures["dropped_rows"] == {} and set(figures["bytes_per_step"]) >= {"all_to_all_single", "all_reduce"}
    for table in figures["tables"]:
        assert f"│ {table['table']} " in r.output and f"{table['lookups']:,}" in r.output, r.output


def test_the_reader_sees_steps_advance_part_by_part_and_reads_each_file_once(recorded, tmp_path: Path) -> None:
    _, run_dir, _ = recorded
    live = tmp_path / "live"
    write_manifest(live, {**read_manifest(run_dir), "status": "running", "ended_at": None, "dropped_rows": None})
    reader = RunReader(live)
    copied: Counter = Counter()
    steps: Counter = Counter()
    lookups = 0
    seen_steps = []
    for part in parts_of(run_dir):
        table, rank = part.parent.parent.name, int(part.parent.name.removeprefix("rank="))
        target = live / table / part.parent.name
        target.mkdir(parents=True, exist_ok=True)
        (target / f".{part.name}.tmp").write_bytes(b"half a file")  # a writer's temporary file: never read
        shutil.copy(part, target / part.name)
        data = pq.read_table(part)
        copied[table] += data.num_rows
        if table == "steps":
            steps[rank] += data.num_rows
        if table == "accesses":
            lookups += int(data.column("count").to_numpy().sum())
        assert reader.poll() == 1
        assert reader.poll() == 0  # nothing new, nothing read
        figures = reader.figures()
        assert figures["rows"] == {t: n for t, n in copied.items()}
        assert {r: f["steps"] for r, f in figures["ranks"].items()} == {r: n for r, n in steps.items() if n}
        assert sum(t["lookups"] for t in figures["tables"]) == lookups
        seen_steps.append(sum(steps.values()))
    assert seen_steps[-1] == 8 and len(set(seen_steps)) > 2, seen_steps  # steps arrived over several parts
    assert reader.files == Counter(p.parent.parent.name for p in parts_of(run_dir))
    assert figures["dropped_rows"] is None  # no manifest figure and no rank report yet: omitted


def test_figures_follow_their_definitions(tmp_path: Path) -> None:
    write_manifest(tmp_path, {"status": "running", "started_at": "2026-01-01T00:00:00+00:00"})
    with RunWriter(tmp_path, rank=0) as writer:
        writer.append("steps", {"step": [0, 1, 2], "t_start_ns": [0, 10 * MS, 30 * MS],
                                "t_end_ns": [10 * MS, 30 * MS, 60 * MS], "samples": [8, 8, 8]})
        comm = {"seq": [0, 1, 2, 3], "group": ["g"] * 4, "group_size": [2] * 4, "dtype": ["f32"] * 4,
                "bytes_in": [0] * 4, "splits_out": [[]] * 4, "splits_in": [[]] * 4, "tag": [""] * 4,
                "async": [True] * 4}
        writer.append("comms", {**comm, "step": [1, 1, 2, 2], "op": ["all_reduce", "all_to_all_single", "all_reduce",
                                                                      "all_reduce"],
                                "bytes_out": [100, 40, 100, 0], "phase": ["train", "train", "train", "eval"],
                                # step 1: [12, 20] and [16, 24] overlap: 12 ms; step 2: [50, 70] clipped to 10 ms
                                "t_start_ns": [12 * MS, 16 * MS, 50 * MS, 31 * MS],
                                "t_end_ns": [20 * MS, 24 * MS, 70 * MS, 59 * MS]})
        writer.append("accesses", {"step": [0, 0, 1], "table_name": ["a", "a", "b"], "row": [0, 199, 5],
                                   "count": [3, 1, 2], "phase": ["train", "train", "train"]})
    reader = RunReader(tmp_path, window=2)
    reader.poll()
    figures = reader.figures()
    assert figures["ranks"] == {0: {"steps": 3, "last_step": 2, "step_s": 0.025, "comm_share": (12 + 10) / 50}}
    assert figures["bytes_per_step"] == {"all_reduce": 100.0, "all_to_all_single": 20.0}
    # table a: N = 200 rows seen, top 1% = 2 rows = every lookup; b: 6 rows seen, top 1% = 1 row
    assert figures["tables"] == [
        {"table": "a", "lookups": 4, "share": 4 / 6, "rows_touched": 2, "top_1pct_share": 1.0},
        {"table": "b", "lookups": 2, "share": 2 / 6, "rows_touched": 1, "top_1pct_share": 1.0}]


def test_a_windowed_runs_comm_share_and_bytes_are_over_its_recorded_steps(tmp_path: Path) -> None:
    """record --every 3:1 records comms on steps 0, 3, 6, 9 only: the figures are over those, not
    diluted by the steps between, whose comms were never written."""
    from tracekit.window import Window

    write_manifest(tmp_path, {"status": "running", "started_at": "2026-01-01T00:00:00+00:00",
                              "collector_settings": {"window": Window.parse(every="3:1").to_json()}})
    recorded = [0, 3, 6, 9]
    with RunWriter(tmp_path, rank=0) as writer:
        writer.append("steps", {"step": list(range(10)), "t_start_ns": [10 * MS * s for s in range(10)],
                                "t_end_ns": [10 * MS * (s + 1) for s in range(10)], "samples": [8] * 10})
        n = len(recorded)
        writer.append("comms", {"seq": list(range(n)), "group": ["g"] * n, "group_size": [2] * n, "dtype": ["f32"] * n,
                                "bytes_in": [0] * n, "splits_out": [[]] * n, "splits_in": [[]] * n, "tag": [""] * n,
                                "async": [False] * n, "step": recorded, "op": ["all_reduce"] * n,
                                "bytes_out": [100] * n, "phase": ["train"] * n,
                                "t_start_ns": [10 * MS * s for s in recorded],
                                "t_end_ns": [10 * MS * s + 5 * MS for s in recorded]})
    reader = RunReader(tmp_path, window=2)
    reader.poll()
    figures = reader.figures()
    assert figures["ranks"][0]["comm_share"] == 0.5  # steps 6 and 9: 5 ms of 10 each
    assert figures["ranks"][0]["step_s"] == 0.01
    assert figures["bytes_per_step"] == {"all_reduce": 100.0}
    assert figures["recorded"] == "the first 1 of every 3 steps"


def test_watch_follows_a_running_run_and_ends_with_it(recorded, tmp_path: Path) -> None:
    _, run_dir, _ = recorded
    live = tmp_path / "live"
    final = read_manifest(run_dir)
    write_manifest(live, {**final, "status": "running", "ended_at": None, "dropped_rows": None})

    def land() -> None:
        for part in parts_of(run_dir):
            target = live / part.parent.parent.name / part.parent.name
            target.mkdir(parents=True, exist_ok=True)
            shutil.copy(part, target / part.name)
            threading.Event().wait(0.01)
        write_manifest(live, final)

    lander = threading.Thread(target=land)
    console = Console(file=io.StringIO(), width=120, record=True)
    lander.start()
    figures = watch(live, interval=0.05, console=console)
    lander.join()
    assert figures["status"] == "completed"
    assert {rank: f["steps"] for rank, f in figures["ranks"].items()} == {0: 4, 1: 4}
    assert f"{live}: completed" in console.export_text()


def test_watch_of_a_missing_run_dir_exits_2_with_a_message(tmp_path: Path) -> None:
    r = CliRunner().invoke(cli, ["watch", str(tmp_path / "nothing")])
    assert r.exit_code == 2, r.output
    assert f"{tmp_path / 'nothing'} does not exist" in r.output, r.output


def test_watch_once_of_a_run_without_parts_says_no_steps_yet(tmp_path: Path) -> None:
    write_manifest(tmp_path, {"status": "running", "started_at": "2026-01-01T00:00:00+00:00"})
    r = CliRunner().invoke(cli, ["watch", str(tmp_path), "--once"])
    assert r.exit_code == 0, r.output
    assert f"{tmp_path}: running" in r.output and "no steps yet" in r.output, r.output
    assert json.loads((tmp_path / "manifest.json").read_text())["status"] == "running"

"""`tracekit compare` on recorded runs of the reference trainer: a run against itself, against a
longer run and a run of another model, and against policies set by hand whose figures are checked
by hand; the bytes against direct sums of the comms table; --json, exit codes."""

from __future__ import annotations

import hashlib
import json
import shutil
import statistics
import sys
from collections import defaultdict
from pathlib import Path

import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from analyses.compare import compare
from analyses.network import warmup_steps
from tests.recorded import REPO, TINY, record
from tracekit.app.cli import cli
from tracekit.policy import new_policy, write_policy

STEPS = 8
SKIP = 2


def _record(tmp: Path, *changes: str) -> Path:
    options = dict(zip(TINY[::2], TINY[1::2])) | {"--steps": str(STEPS)} | dict(zip(changes[::2], changes[1::2]))
    argv = [x for pair in options.items() for x in pair]
    code, run_dir = record(tmp, sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(REPO / "train.py"), *argv, options=("--lookup-every", "1"))
    assert code == 0
    return run_dir


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """base: TINY for 8 steps; longer: 10 steps; other_model: 400 rows per table."""
    return {"base": _record(tmp_path_factory.mktemp("base")),
            "longer": _record(tmp_path_factory.mktemp("longer"), "--steps", "10"),
            "other_model": _record(tmp_path_factory.mktemp("other"), "--rows", "400")}


def invoke(*args: str):
    return CliRunner().invoke(cli, ["compare", *map(str, args)])


def copy_run(run: Path, target: Path, **manifest_fields) -> Path:
    shutil.copytree(run, target)
    manifest = json.loads((target / "manifest.json").read_text())
    (target / "manifest.json").write_text(json.dumps(manifest | manifest_fields))
    return target


def direct_bytes(run: Path) -> tuple[dict[tuple[str, str], float], float, float]:
    """From the Parquet files alone: bytes_out per training step by (op, tag), and the all-to-alls'
    bytes_out and remote bytes (less each rank's own split) per step."""
    comms = pq.read_table(run / "comms", partitioning="hive").to_pylist()
    steps = len({r["step"] for r in pq.read_table(run / "steps", partitioning="hive").to_pylist()})
    by_op = defaultdict(float)
    a2a = remote = 0.0
    for r in comms:
        if r["phase"] != "train":
            continue
        by_op[(r["op"], r["tag"])] += r["bytes_out"] / steps
        if r["op"] == "all_to_all_single":
            a2a += r["bytes_out"] / steps
            remote += (r["bytes_out"] - r["splits_out"][r["rank"]]) / steps
    return dict(by_op), a2a, remote


@pytest.mark.slow
def test_a_run_against_itself_is_equal_everywhere_and_its_bytes_are_the_comms_sums(runs) -> None:
    result = compare(runs["base"], [runs["base"]], skip_steps=SKIP)
    summary = result.summary
    assert summary["warnings"] == [] and summary["rows"] == []
    base, same = summary["runs"]
    assert all(r == 1.0 for r in same["ratios"].values() if r is not None), same["ratios"]
    assert same["ratios"]["step_time_s"] == 1.0 and same["ratios"]["total_bytes_per_step"] == 1.0
    assert same["loss_max_abs_diff"] == 0.0
    by_op, a2a, remote = direct_bytes(runs["base"])
    assert {(r["op"], r["tag"]): r["bytes_out_per_step"] for r in base["by_op_tag"]} == pytest.approx(by_op, rel=1e-12)
    assert base["a2a_bytes_per_step"] == pytest.approx(a2a, rel=1e-12)
    assert base["a2a_remote_bytes_per_step"] == pytest.approx(remote, rel=1e-12)
    assert base["sync_bytes_per_step"] == 0 and base["total_bytes_per_step"] == base["a2a_bytes_per_step"]
    # all-reduce wire bytes at 2 ranks: 2(W−1)/W = 1 times bytes_out
    ddp = [r for r in base["by_op_tag"] if r["op"] == "all_reduce"]
    assert ddp and all(r["wire_bytes_per_step"] == pytest.approx(r["bytes_out_per_step"]) for r in ddp)
    # times: the slowest rank per step, after the first SKIP steps; samples from the input dist (2 × 32)
    steps = pl.read_parquet(runs["base"] / "steps" / "**" / "*.parquet", hive_partitioning=True)
    per_step = (steps.group_by("step").agg(((pl.col("t_end_ns") - pl.col("t_start_ns")).max() / 1e9).alias("d"))
                .sort("step")["d"].to_list()[SKIP:])
    assert base["steps"] == STEPS and base["timed_steps"] == STEPS - SKIP
    assert base["step_time_s"] == pytest.approx(statistics.median(per_step), rel=1e-12)
    assert base["samples_per_step"] == 64
    assert base["samples_per_s"] == pytest.approx(64 * len(per_step) / sum(per_step), rel=1e-9)
    assert set(result.tables) == {"compare_runs", "compare_bytes", "compare_schedule", "compare_policy"}
    assert result.tables["compare_runs"].height == 2


@pytest.mark.slow
def test_cli_prints_the_runs_side_by_side_and_json_parses(runs) -> None:
    r = CliRunner().invoke(cli, ["analyze", str(runs["base"]), "--no-report", "--no-calibrate", "--json"])
    assert r.exit_code == 0, r.output  # the report of a comparison draws BASE's analysis
    r = invoke(runs["base"], runs["base"], "--skip-steps", SKIP)
    assert r.exit_code == 0, r.output
    for text in ("runs (RUN figures with their ratio to BASE)", "step time, median", "×1.00", "embedding all-to-all",
                 "bytes_out per training step by op and tag", "output_fwd", "nothing predicted to compare"):
        assert text in r.output, text
    assert f"report: {runs['base'] / 'compare.html'}" in r.output and (runs["base"] / "compare.html").is_file()
    r = invoke(runs["base"], runs["base"], "--json", "--no-report")
    assert r.exit_code == 0, r.output
    document = json.loads(r.stdout)
    assert {"runs", "rows", "warnings"} <= set(document) and len(document["runs"]) == 2
    # the default warm-up: analyses.network's rule, the one analyze's baseline uses
    assert document["skip_steps"] == warmup_steps(document["runs"][0]["steps"]) and "report" not in document


@pytest.mark.slow
def test_a_base_never_analysed_is_compared_and_its_report_said_not_written(runs) -> None:
    r = invoke(runs["longer"], runs["base"], "--skip-steps", SKIP)
    assert r.exit_code == 0, r.output
    assert "runs (RUN figures with their ratio to BASE)" in r.output
    assert "report: not written" in r.output and f"tracekit analyze {runs['longer']}" in r.output, r.output
    assert not (runs["longer"] / "compare.html").exists()


@pytest.mark.slow
def test_a_run_of_another_model_is_refused_naming_the_table(runs) -> None:
    r = invoke(runs["base"], runs["other_model"])
    assert r.exit_code == 2, r.output
    assert "table t0: num_rows 500 in" in r.output and "400 in" in r.output, r.output
    assert str(runs["base"]) in r.output and str(runs["other_model"]) in r.output, r.output


@pytest.mark.slow
def test_another_step_count_is_flagged_and_still_compared(runs) -> None:
    summary = compare(runs["base"], [runs["longer"]], skip_steps=SKIP).summary
    warnings = "\n".join(summary["warnings"])
    assert f"ran 10 training steps, {runs['base']} {STEPS}" in warnings, warnings
    assert f"`--steps {STEPS}` → `--steps 10`" in warnings, warnings
    longer = summary["runs"][1]
    assert longer["steps"] == 10 and longer["ratios"]["a2a_bytes_per_step"] is not None
    # the same seed and data: the loss curves agree on the steps both ran
    assert longer["loss_max_abs_diff"] < 1e-6


@pytest.mark.slow
def test_a_policy_whose_file_is_missing_is_flagged(runs, tmp_path) -> None:
    missing = tmp_path / "gone" / "policy.json"
    run = copy_run(runs["base"], tmp_path / "applied", policy={"path": str(missing), "sha256": "0" * 64})
    r = invoke(runs["base"], run, "--json")
    assert r.exit_code == 0, r.output
    document = json.loads(r.stdout)
    assert any(f"applied the policy {missing}, which is missing" in w for w in document["warnings"]), document
    assert document["rows"] == [] and document["runs"][1]["policy"]["status"] == "missing"


def _policy(run: Path, target: Path, measured: dict) -> tuple[Path, dict]:
    """A policy for the TINY model with replication and schedule sections whose predictions are set
    from `measured` (BASE's figures) by simple factors."""
    manifest = json.loads((run / "manifest.json").read_text())
    model = {"tables": [{"name": t["name"], "num_rows": t["num_rows"], "dim": t["dim"]} for t in manifest["tables"]],
             "world_size": 2}
    policy = new_policy(source_run=str(run), model=model,
                        baseline={"a2a_bytes_per_step": measured["a2a_bytes_per_step"], "step_time_s": 0.01})
    a2a, remote = measured["a2a_bytes_per_step"], measured["a2a_remote_bytes_per_step"]
    policy["replication"] = {"kind": "hybrid", "rows": "policy/hot_rows.parquet", "budget_bytes_per_rank": 1024,
                             "sync": "sparse_allreduce", "why": "set by the test",
                             "predicted": {"a2a_bytes_per_step": a2a / 2, "a2a_remote_bytes_per_step": remote / 2,
                                           "sync_bytes_per_step": a2a / 4, "step_time_s": 0.004}}
    policy["schedule"] = {"kind": "fae", "hot_rows": "policy/hot_rows.parquet", "hot_sample_fraction": 0.5,
                          "why": "set by the test", "predicted": {"a2a_bytes_per_step": a2a}}
    path = write_policy(target, policy, rows={"hot_rows": pl.DataFrame({"table_name": ["t0"], "row": [1]})})
    return path, policy


@pytest.mark.slow
def test_policy_predictions_against_measurements_by_hand(runs, tmp_path) -> None:
    measured = compare(runs["base"], [], skip_steps=SKIP).summary["runs"][0]
    path, _ = _policy(runs["base"], tmp_path / "policy" / "policy.json", measured)
    sha = hashlib.sha256(path.read_bytes()).hexdigest()
    run = copy_run(runs["base"], tmp_path / "applied", policy={"path": str(path), "sha256": sha})
    summary = compare(runs["base"], [run], skip_steps=SKIP).summary
    assert summary["warnings"] == [] and summary["runs"][1]["policy"]["status"] == "verified"
    rows = {(r["section"], r["figure"]): r for r in summary["rows"]}
    a2a = measured["a2a_bytes_per_step"]
    # replication predicted half the all-to-all bytes and a sync of a quarter; the run (BASE itself) has no sync
    assert rows["replication", "a2a_bytes_per_step"]["diff_pct"] == pytest.approx(1.0)  # (a2a − a2a/2) / (a2a/2)
    assert rows["replication", "a2a_remote_bytes_per_step"]["diff_pct"] == pytest.approx(1.0)
    assert rows["replication", "sync_bytes_per_step"]["diff_pct"] == pytest.approx(-1.0)
    total = rows["replication", "total_bytes_per_step"]
    assert total["predicted"] == pytest.approx(0.75 * a2a) and total["measured"] == pytest.approx(a2a)
    assert total["diff_pct"] == pytest.approx(1 / 0.75 - 1)
    saving = rows["replication", "saving"]
    assert saving["predicted"] == pytest.approx(0.25) and saving["measured"] == pytest.approx(0.0)
    assert saving["unit"] == "fraction" and saving["diff"] == pytest.approx(-0.25)
    step = rows["replication", "step_time_s"]
    assert step["diff_pct"] == pytest.approx(measured["step_time_s"] / 0.004 - 1)
    # schedule predicted the recorded all-to-all exactly, and no sync: diff 0, saving 0
    assert rows["schedule", "a2a_bytes_per_step"]["diff_pct"] == 0
    assert rows["schedule", "saving"]["predicted"] == pytest.approx(0) and ("schedule", "step_time_s") not in rows
    # the policy's baseline against BASE's measured figures
    assert rows["baseline", "a2a_bytes_per_step"]["diff_pct"] == pytest.approx(0)
    assert any("replication, schedule together" in note for note in summary["notes"]), summary["notes"]
    r = invoke(runs["base"], run, "--skip-steps", SKIP)
    assert r.exit_code == 0, r.output
    assert "policies: predicted against measured" in r.output and "+100.0%" in r.output and "-25.0 pts" in r.output

    # the file rewritten after the run: flagged, still compared
    run2 = copy_run(runs["base"], tmp_path / "changed", policy={"path": str(path), "sha256": "f" * 64})
    summary = compare(runs["base"], [run2], skip_steps=SKIP).summary
    assert any("was rewritten after the run" in w for w in summary["warnings"]), summary["warnings"]
    assert summary["rows"] and summary["runs"][1]["policy"]["status"] == "changed"


@pytest.mark.slow
def test_hot_and_cold_steps_are_split(runs, tmp_path) -> None:
    """A run whose steps carry the schedule column of schema 1.2 (set in a copy: even steps hot)."""
    run = copy_run(runs["base"], tmp_path / "scheduled")
    for part in (run / "steps").glob("*/*.parquet"):
        table = pq.read_table(part)
        kinds = pa.array(["hot" if s % 2 == 0 else "cold" for s in table["step"].to_pylist()], pa.string())
        names = table.column_names
        table = (table.set_column(names.index("schedule"), "schedule", kinds) if "schedule" in names
                 else table.append_column("schedule", kinds))
        pq.write_table(table.replace_schema_metadata(pq.read_schema(part).metadata), part)
    base = compare(run, [], skip_steps=SKIP).summary["runs"][0]
    comms = pl.read_parquet(run / "comms" / "**" / "*.parquet", hive_partitioning=True)
    comms = comms.filter(pl.col("phase") == "train")
    split = {s["schedule"]: s for s in base["schedule"]}
    for kind, parity in (("hot", 0), ("cold", 1)):
        assert split[kind]["steps"] == STEPS // 2
        moved = comms.filter(pl.col("step") % 2 == parity)["bytes_out"].sum()
        assert split[kind]["bytes_per_step"] == pytest.approx(moved / (STEPS // 2), rel=1e-12)


@pytest.mark.slow
def test_exit_codes(runs, tmp_path) -> None:
    assert invoke(runs["base"], tmp_path / "nothing").exit_code == 2
    (tmp_path / "empty").mkdir()
    r = invoke(runs["base"], tmp_path / "empty")
    assert r.exit_code == 2 and "has no manifest.json" in r.output, r.output
    assert invoke(runs["base"]).exit_code == 2  # no RUN: a usage error
    r = invoke(runs["base"], runs["base"], "--skip-steps", 20)
    assert r.exit_code == 0, r.output
    assert "not more than --skip-steps 20" in r.output

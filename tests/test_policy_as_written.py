"""The policy file applies as written (DESIGN.md §5): `train.py --policy FILE` applies every
recommended section of its run's kind and skips each other section with one line, on real 2-rank
gloo runs of the reference trainer:

- a file holding every section, some not recommended, `lag` included: a training run applies the
  recommended training sections (the trace shows their collectives), prints one line per section
  skipped, and the manifest names both; `compare` checks the `combined` prediction and says which
  predicted figures are estimates, with their interval;
- the same file under `--inference` applies `lag` and skips the rest;
- a recommended section whose row list is corrupt is refused before any process group starts, and
  the same section not recommended is skipped without being read.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import polars as pl
import pytest

from analyses.compare import compare
from tests.recorded import REPO, TINY
from tests.test_trainer_cli import master, rank_of_two  # noqa: F401 — master is a fixture
from tracekit.dlrm import policies
from tracekit.dlrm.tables import TableSpec
from tracekit.policy import PolicyError, new_policy, write_policy

TABLES = [TableSpec(f"t{i}", 500, 8) for i in range(4)]  # TINY's model
HOT = pl.DataFrame({"table_name": ["t0", "t1", "t2", "t3"], "row": [0, 1, 2, 3]})
TIERS, SCHEDULE, MP = (f"not recommended ({why})" for why in (
    "set by the test: not recommended", "the gain is within the model's error on this run",
    "the AUC cost is not measured yet"))
TRAINING_ONLY = "training-only (an --inference run applies only lag)"
SKIPPED_IN_TRAINING = {"tiers": TIERS, "schedule": SCHEDULE, "compression.mp": MP,
                       "lag": "inference-only (train.py --inference --policy FILE applies it)"}
SKIPPED_IN_INFERENCE = {"replication": TRAINING_ONLY, "tiers": TIERS, "schedule": SCHEDULE,
                        "compression.dp": TRAINING_ONLY, "compression.mp": MP}


def every_section(folder: Path) -> Path:
    """A policy for TINY at world 2 with every section: replication, compression.dp and lag
    recommended; tiers (2 nodes × 1 rank, which this one-node run could not apply), schedule and
    compression.mp not; and the combined prediction of the recommended training sections."""
    policy = new_policy(source_run="tests/test_policy_as_written.py", model={
        "tables": [{"name": t.name, "num_rows": t.rows, "dim": t.dim} for t in TABLES], "world_size": 2})
    policy["replication"] = {"kind": "hybrid", "rows": "policy/hot_rows.parquet", "budget_bytes_per_rank": 128,
                             "sync": "sparse_allreduce", "why": "set by the test",
                             "predicted": {"a2a_bytes_per_step": 1000.0, "sync_bytes_per_step": 100.0,
                                           "step_time_s": 0.01},
                             "intervals": {"a2a_bytes_per_step": [900.0, 1200.0]}}
    policy["tiers"] = {"topology": {"nodes": 2, "ranks_per_node": 1}, "rows": "policy/tiers.parquet",
                       "predicted": {"tier2_rows": 2}, "why": "set by the test", "recommended": False,
                       "reason": "set by the test: not recommended"}
    policy["schedule"] = {"kind": "fae", "hot_rows": "policy/hot_rows.parquet", "hot_sample_fraction": 0.3,
                          "predicted": {}, "why": "set by the test", "recommended": False,
                          "reason": "the gain is within the model's error on this run"}
    policy["compression"] = {
        "dp": {"keep_ratio": 0.5, "refresh_every": 2, "error_feedback": True, "predicted": {"dp_bytes_per_step": 500.0},
               "why": "set by the test"},
        "mp": {"keep_ratio": 0.5, "predicted": {}, "why": "set by the test", "recommended": False,
               "reason": "the AUC cost is not measured yet"}}
    policy["lag"] = {"bound": 2, "predicted": {"makespan_s": 0.1}, "why": "set by the test"}
    policy["combined"] = {"sections": ["replication", "compression.dp"], "why": "set by the test",
                          "predicted": {"a2a_bytes_per_step": 1000.0, "step_time_s": 0.012},
                          "intervals": {"step_time_s": [0.01, 0.015]}}
    tiers = pl.DataFrame({"table_name": ["t0", "t1"], "row": [5, 6], "tier": [1, 2]})
    return write_policy(folder / "policy.json", policy, rows={"hot_rows": HOT, "tiers": tiers})


def _env() -> dict:
    return {k: v for k, v in os.environ.items() if not k.startswith("TRACEKIT_")} | {"OMP_NUM_THREADS": "1"}


def _policy_lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith("policy")]


def _skip_lines(skipped: dict[str, str]) -> list[str]:
    return [f"policy: skipped {label}: {why}" for label, why in skipped.items()]


@pytest.mark.slow
def test_every_section_applies_as_written_in_training(tmp_path: Path) -> None:
    policy = every_section(tmp_path / "policy")
    run = tmp_path / "run"
    r = subprocess.run([sys.executable, "-m", "tracekit", "record", "-o", str(run), "--lookup-every", "1", "--",
                        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                        str(REPO / "train.py"), *TINY, "--policy", str(policy)],
                       cwd=REPO, env=_env(), capture_output=True, text=True, timeout=300)
    output = f"exit {r.returncode}\nstdout:\n{r.stdout}\nstderr:\n{r.stderr}"
    assert r.returncode == 0, output
    assert _policy_lines(r.stdout) == [f"policy {policy}: applying replication, compression.dp",
                                       *_skip_lines(SKIPPED_IN_TRAINING)], output
    assert _policy_lines(r.stderr) == [], output
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["policy"]["applied"] == ["replication", "compression.dp"]
    assert manifest["policy"]["skipped"] == SKIPPED_IN_TRAINING
    # applied for real: the replicas' sync and DCT-DP's all-gathers ran; DCT-MP did not
    tags = set(pl.read_parquet(run / "comms" / "**" / "*.parquet", hive_partitioning=True)["tag"].to_list())
    assert any(t.startswith("replica_sync") for t in tags) and any(t.startswith("dct_dp") for t in tags), tags
    assert "output all-to-all:" not in r.stdout, output

    summary = compare(run, []).summary
    rows = {(row["section"], row["figure"]): row for row in summary["rows"]}
    assert {section for section, _ in rows} == {"replication", "compression.dp", "combined"}
    a2a, sync, total = (rows["replication", f] for f in ("a2a_bytes_per_step", "sync_bytes_per_step",
                                                         "total_bytes_per_step"))
    assert (a2a["kind"], a2a["predicted_low"], a2a["predicted_high"]) == ("estimated", 900.0, 1200.0)
    assert (sync["kind"], sync["predicted_low"], sync["predicted_high"]) == ("exact", None, None)
    assert (total["kind"], total["predicted"], total["predicted_low"], total["predicted_high"]) == (
        "estimated", 1100.0, 1000.0, 1300.0)
    saving, base_total = rows["replication", "saving"], summary["runs"][0]["total_bytes_per_step"]
    assert saving["predicted_low"] == pytest.approx(1 - 1300 / base_total)
    assert saving["predicted_high"] == pytest.approx(1 - 1000 / base_total)
    assert rows["replication", "step_time_s"]["kind"] == "exact"
    step = rows["combined", "step_time_s"]
    assert (step["kind"], step["predicted"], step["predicted_low"], step["predicted_high"]) == (
        "estimated", 0.012, 0.01, 0.015)
    assert rows["combined", "a2a_bytes_per_step"]["measured"] == summary["runs"][0]["a2a_bytes_per_step"]
    notes = "\n".join(summary["notes"])
    assert f"{run} skipped lag: inference-only" in notes and "section combined is the policy's prediction" in notes


@pytest.mark.slow
def test_inference_applies_lag_and_skips_the_rest(tmp_path: Path) -> None:
    policy = every_section(tmp_path)
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                        "train.py", *TINY, "--inference", "--policy", str(policy)],
                       cwd=REPO, env=_env(), capture_output=True, text=True, timeout=180)
    output = f"exit {r.returncode}\nstdout:\n{r.stdout}\nstderr:\n{r.stderr}"
    assert r.returncode == 0, output
    assert _policy_lines(r.stdout) == [f"policy {policy}: applying lag", *_skip_lines(SKIPPED_IN_INFERENCE)], output
    assert "(lag bound 2)" in r.stdout, output


def test_nothing_recommended_runs_with_nothing_applied(tmp_path: Path) -> None:
    policy = json.loads(every_section(tmp_path).read_text())
    for body in (policy["replication"], policy["compression"]["dp"], policy["lag"]):
        body.update(recommended=False, reason="not worth it here")
    del policy["combined"]
    path = write_policy(tmp_path / "policy.json", policy)
    for inference in (False, True):
        applied = policies.load(path, TABLES, world_size=2, local_world_size=2, inference=inference)
        assert (applied.sections, applied.replicated_rows, applied.dct_dp, applied.lag_bound) == ((), None, None, None)
        assert applied.lines()[0] == f"policy {path}: no section applies; the run goes on as it would without --policy"
        assert len(applied.skipped) == 6


def corrupt_rows(folder: Path, *, recommended: bool) -> Path:
    """every_section with its hot-row list (replication's, and the schedule's, never recommended)
    overwritten by CSV, replication `recommended` or not."""
    path = every_section(folder)
    (folder / "policy" / "hot_rows.parquet").write_text("table_name,row\nt0,1\n")
    policy = json.loads(path.read_text())
    policy["replication"].update(recommended=recommended, reason="set by the test")
    path.write_text(json.dumps(policy))
    return path


def test_a_corrupt_row_list_of_a_section_not_recommended_is_never_read(tmp_path: Path) -> None:
    applied = policies.load(corrupt_rows(tmp_path, recommended=False), TABLES, world_size=2, local_world_size=2)
    assert applied.sections == ("compression.dp",) and applied.replicated_rows is None
    assert applied.skipped["replication"] == "not recommended (set by the test)"
    with pytest.raises(PolicyError, match="hot_rows.parquet: not a row list"):
        policies.load(corrupt_rows(tmp_path, recommended=True), TABLES, world_size=2, local_world_size=2)


@pytest.mark.slow
def test_a_recommended_section_with_a_corrupt_row_list_is_refused_before_any_process_group(tmp_path, master) -> None:
    listener, marks = master
    policy = corrupt_rows(tmp_path / "policy", recommended=True)
    ranks = [rank_of_two(r, listener.getsockname()[1], marks, *TINY, "--policy", str(policy)) for r in (0, 1)]
    outputs = [rank.communicate(timeout=120) for rank in ranks]
    assert [rank.returncode for rank in ranks] == [2, 2], outputs
    errors = [line for line in outputs[0][1].splitlines() if line.startswith("train.py: error: ")]
    assert len(errors) == 1, outputs  # rank 0 says it, once
    assert f"{policy.parent / 'policy' / 'hot_rows.parquet'}: not a row list" in errors[0], outputs
    assert _policy_lines(outputs[0][0]) == [], outputs
    assert list(marks.iterdir()) == []  # no rank called init_process_group


def test_compare_prints_an_estimate_with_its_interval_and_an_exact_figure_alone() -> None:
    from analyses.prediction_check import row
    from tracekit.app import console, console_compare

    rows = [row("r", "combined", "step_time_s", 0.012, 0.02, (0.01, 0.015)),
            row("r", "combined", "a2a_bytes_per_step", 1000.0, 1000.0)]
    assert [(r["kind"], r["predicted_low"], r["predicted_high"]) for r in rows] == [
        ("estimated", 0.01, 0.015), ("exact", None, None)]
    with console.terminal.capture() as captured:
        console_compare._compare_policies(rows, "base")
    printed = captured.get()
    assert "~12.00 ms [10.00 ms, 15.00 ms]" in printed and "│ 1.00 kB " in printed, printed
    assert "~1.00 kB" not in printed, printed
    assert "an estimate is ~value [low, high]" in " ".join(printed.split()), printed


@pytest.mark.slow
def test_a_hand_written_section_of_trainer_fields_alone_applies(tmp_path: Path) -> None:
    """The issue's file, as a user writes it: no schema, no model, no prediction. The trainer applies
    DCT-DP (its all-gathers are in the trace), and compare measures the run without predicted rows."""
    policy = tmp_path / "dct_dp.json"
    policy.write_text(json.dumps({"compression": {"dp": {"keep_ratio": 0.001, "refresh_every": 20}}}))
    run = tmp_path / "run"
    r = subprocess.run([sys.executable, "-m", "tracekit", "record", "-o", str(run), "--",
                        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                        str(REPO / "train.py"), *TINY, "--policy", str(policy)],
                       cwd=REPO, env=_env(), capture_output=True, text=True, timeout=300)
    output = f"exit {r.returncode}\nstdout:\n{r.stdout}\nstderr:\n{r.stderr}"
    assert r.returncode == 0, output
    assert _policy_lines(r.stdout) == [f"policy {policy}: applying compression.dp"], output
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["policy"]["applied"] == ["compression.dp"]
    tags = set(pl.read_parquet(run / "comms" / "**" / "*.parquet", hive_partitioning=True)["tag"].to_list())
    assert any(t.startswith("dct_dp") for t in tags), tags
    summary = compare(run, []).summary
    assert [row for row in summary["rows"] if row["section"] == "compression.dp"] == []
    assert summary["runs"][0]["run"] == str(run)

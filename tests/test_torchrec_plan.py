"""`tracekit record --plan FILE` on a real TorchRec job (torchrec 1.8.0, 2 gloo ranks): the unchanged
script runs with the plan of FILE, read back from the manifest; with its own plan it computes what
it computes untraced, loss for loss; a plan that does not fit the model is refused with one line.
And, without TorchRec, the plan file's checks (tracekit/torchrec_plan.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from tests.recorded import REPO, record
from tests.torchrec_env import torchrec_python  # noqa: F401
from tracekit.cli import cli
from tracekit.torchrec_plan import SCHEMA, PlanError, check_model, from_manifest, read_plan, validate, write_plan

JOB = REPO / "tests" / "torchrec_job.py"
ROWS, DIM = 200, 16  # as in the job


def run_job(python: Path, out: Path, *options: str) -> list[list[float]]:
    """The job on 2 ranks, untraced or (`options` starting with record's) recorded; each rank's losses."""
    command = [str(python), "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(JOB),
               "--sharding", "table_wise", "--out", str(out)]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads((out / f"losses-rank={r}.json").read_text()) for r in range(2)]


def record_job(python: Path, tmp: Path, plan: Path | None) -> tuple[int, Path, str]:
    """(exit code, run dir, stderr of record and the job) of the job recorded, with `plan` if given."""
    options = ("--plan", str(plan)) if plan else ()
    r = subprocess.run([sys.executable, "-m", "tracekit", "record", "-o", str(tmp / "run"), "--flush-interval", "0.2",
                        *options, "--", str(python), "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                        "2", str(JOB), "--sharding", "table_wise", "--out", str(tmp / "out")], cwd=REPO,
                       capture_output=True, text=True, timeout=300)
    return r.returncode, tmp / "run", r.stderr


def manifest(run_dir: Path) -> dict:
    return json.loads((run_dir / "manifest.json").read_text())


@pytest.mark.slow
def test_its_own_plan_changes_nothing_and_another_is_the_one_it_runs(torchrec_python: Path, tmp_path: Path) -> None:
    untraced = run_job(torchrec_python, tmp_path / "untraced")
    code, base, out = record_job(torchrec_python, tmp_path / "base", None)
    assert code == 0, out
    own = tmp_path / "own.json"
    write_plan(own, from_manifest(manifest(base), str(base)))
    code, again, out = record_job(torchrec_python, tmp_path / "again", own)
    assert code == 0, out
    assert json.loads((tmp_path / "again" / "out" / "losses-rank=0.json").read_text()) == untraced[0]
    assert json.loads((tmp_path / "again" / "out" / "losses-rank=1.json").read_text()) == untraced[1]
    assert manifest(again)["torchrec_plan"]["applied"] == {"0": 1, "1": 1}

    mixed = from_manifest(manifest(base))
    mixed["tables"]["t0"] |= {"sharding_type": "column_wise", "ranks": [1, 0]}
    mixed["tables"]["t1"] |= {"sharding_type": "data_parallel", "ranks": [0, 1], "compute_kernel": "dense"}
    mixed["tables"]["t2"] |= {"ranks": [1 - mixed["tables"]["t2"]["ranks"][0]]}
    write_plan(tmp_path / "mixed.json", mixed)
    code, moved, out = record_job(torchrec_python, tmp_path / "moved", tmp_path / "mixed.json")
    assert code == 0, out
    ran = manifest(moved)
    assert from_manifest(ran)["tables"] == mixed["tables"]  # read back from what the ranks' tables were
    assert ran["torchrec_plan"]["plan"] == mixed and ran["finalise_errors"] == []


@pytest.mark.slow
@pytest.mark.parametrize("change, said", [
    (lambda p: p["tables"]["t0"].update(num_embeddings=300), "table t0 is 200 x 16 in the model, 300 x 16 in the plan"),
    (lambda p: p.update(world_size=3), "the plan is for 3 ranks, the job runs 2"),
    (lambda p: p["tables"].pop("t2"), "the plan's tables are not the model's: not in the plan: t2"),
])
def test_a_plan_that_does_not_fit_is_refused_in_one_line(torchrec_python: Path, tmp_path: Path, change, said) -> None:
    plan = {"schema": SCHEMA, "world_size": 2, "tables": {
        t: {"sharding_type": "table_wise", "ranks": [i % 2], "num_embeddings": ROWS, "embedding_dim": DIM}
        for i, t in enumerate(("t0", "t1", "t2"))}}
    change(plan)
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    code, run_dir, out = record_job(torchrec_python, tmp_path, tmp_path / "plan.json")
    assert code != 0 and f"tracekit: --plan: {tmp_path / 'plan.json'}: {said}" in out, out
    assert manifest(run_dir)["status"] == "failed"


def test_a_bad_plan_file_is_refused_before_the_command_runs(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    for text, said in [("{", "not JSON"), ('{"schema": "x"}', "schema: expected"),
                       (json.dumps({"schema": SCHEMA, "world_size": 2, "tables": {"t0": {
                           "sharding_type": "table_wise", "ranks": [2], "num_embeddings": 5, "embedding_dim": 4}}}),
                        "tables.t0.ranks: expected a non-empty list of ranks below world_size 2")]:
        (tmp_path / "plan.json").write_text(text)
        r = CliRunner().invoke(cli, ["record", "-o", str(tmp_path / "run"), "--force", "--plan",
                                     str(tmp_path / "plan.json"), "--", sys.executable, "-c",
                                     f"open({str(marker)!r}, 'w')"])
        assert r.exit_code == 2 and said in r.output and "--plan" in r.output, r.output
        assert not marker.exists()


def test_a_plan_no_rank_applied_is_named(tmp_path: Path) -> None:
    plan = {"schema": SCHEMA, "world_size": 1, "tables": {
        "t0": {"sharding_type": "table_wise", "ranks": [0], "num_embeddings": 500, "embedding_dim": 8}}}
    write_plan(tmp_path / "plan.json", plan)
    code, run_dir = record(tmp_path, sys.executable, "-c", "import torch", options=("--plan", str(tmp_path / "plan.json")))
    assert code == 0
    ran = manifest(run_dir)
    assert ran["torchrec_plan"]["applied"] == {"0": 0}
    assert any("no rank built a TorchRec DistributedModelParallel" in e for e in ran["finalise_errors"])


def test_the_plan_files_checks() -> None:
    plan = {"schema": SCHEMA, "world_size": 4, "tables": {
        "big": {"sharding_type": "column_wise", "ranks": [0, 1, 2], "num_embeddings": 10, "embedding_dim": 8}}}
    with pytest.raises(PlanError, match="a number of column shards that divides embedding_dim 8"):
        validate(plan)
    plan["tables"]["big"] |= {"sharding_type": "row_wise", "ranks": [0, 1]}
    with pytest.raises(PlanError, match="every rank 0..3 for a row_wise table"):
        validate(plan)
    plan["tables"]["big"]["ranks"] = [0, 1, 2, 3]
    validate(plan)
    check_model(plan, {"big": (10, 8)}, 4, "p.json")
    with pytest.raises(PlanError, match="not in the model: big"):
        check_model(plan, {}, 4, "p.json")
    with pytest.raises(PlanError, match="cannot read the plan file"):
        read_plan("/nonexistent/plan.json")

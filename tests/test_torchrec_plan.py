"""`tracekit record --plan FILE` on a real TorchRec job (torchrec 1.8.0, 2 gloo ranks): the unchanged
script runs with the plan of FILE, read back from the manifest; with its own plan it computes what
it computes untraced, loss for loss; a plan that does not fit the model is refused with one line.
And, without TorchRec, the plan file's checks (tracekit/torchrec_plan.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from analyses import exchange, torchrec_plan_bytes, torchrec_plans
from analyses.context import open_context
from tests.recorded import REPO, record
from tests.torchrec_env import torchrec_python  # noqa: F401
from tracekit.app.cli import cli
from tracekit.manifest import Manifest, read
from tracekit.torchrec_plan import SCHEMA, PlanError, check_model, from_manifest, read_plan, validate, write_plan

JOB = REPO / "tests" / "torchrec_job.py"
ROWS, DIM, STEPS = 200, 16, 4  # as in the job


def run_job(python: Path, out: Path, *options: str) -> list[list[float]]:
    """The job on 2 ranks, untraced or (`options` starting with record's) recorded; each rank's losses."""
    command = [str(python), "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(JOB),
               "--sharding", "table_wise", "--out", str(out)]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads((out / f"losses-rank={r}.json").read_text()) for r in range(2)]


def record_job(python: Path, tmp: Path, plan: Path | None) -> tuple[int, Path, str]:
    """(exit code, run dir, stderr of record and the job) of the job recorded (lookups every step),
    with `plan` if given."""
    options = ("--plan", str(plan)) if plan else ()
    r = subprocess.run([sys.executable, "-m", "tracekit", "record", "-o", str(tmp / "run"), "--flush-interval", "0.2",
                        "--lookup-every", "1", *options, "--", str(python), "-m", "torch.distributed.run",
                        "--standalone", "--nproc-per-node", "2", str(JOB), "--sharding", "table_wise", "--out",
                        str(tmp / "out")], cwd=REPO,
                       capture_output=True, text=True, timeout=300)
    return r.returncode, tmp / "run", r.stderr


def manifest(run_dir: Path) -> Manifest:
    return read(run_dir)


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
    assert manifest(again).torchrec_plan["applied"] == {"0": 1, "1": 1}

    mixed = from_manifest(manifest(base))
    mixed["tables"]["t0"] |= {"sharding_type": "column_wise", "ranks": [1, 0]}
    mixed["tables"]["t1"] |= {"sharding_type": "data_parallel", "ranks": [0, 1], "compute_kernel": "dense"}
    mixed["tables"]["t2"] |= {"ranks": [1 - mixed["tables"]["t2"]["ranks"][0]]}
    write_plan(tmp_path / "mixed.json", mixed)
    code, moved, out = record_job(torchrec_python, tmp_path / "moved", tmp_path / "mixed.json")
    assert code == 0, out
    ran = manifest(moved)
    assert from_manifest(ran)["tables"] == mixed["tables"]  # read back from what the ranks' tables were
    assert ran.torchrec_plan["plan"] == mixed and ran.finalise_errors == []

    quantized = {**from_manifest(manifest(base)), "qcomms": {"forward": "fp16", "backward": "bf16"}}
    write_plan(tmp_path / "quantized.json", quantized)
    code, halved, out = record_job(torchrec_python, tmp_path / "halved", tmp_path / "quantized.json")
    assert code == 0, out

    # the bytes of each plan, from the base run's lookups alone, are what each run moved
    with open_context(base) as ctx:
        s = exchange.baseline(ctx)
        L = torchrec_plan_bytes.loads(ctx, s.len_bytes, s.id_bytes)
        dense = measured(ctx)["all_reduce"]
    for run_dir, plan, dp in ((base, from_manifest(manifest(base)), 0.0), (moved, mixed, 2 * ROWS * DIM * 4),
                              (halved, quantized, 0.0)):
        predicted = torchrec_plan_bytes.figures(L, plan["tables"], plan.get("qcomms"))
        with open_context(run_dir) as ctx:
            got = measured(ctx)
        assert got["a2a"] == predicted["a2a_bytes_per_step"]
        assert got["a2a_remote"] == predicted["a2a_remote_bytes_per_step"]
        assert got["all_reduce"] - dense == predicted["dp_allreduce_bytes_per_step"] == dp
    with open_context(halved) as ctx, open_context(base) as ctx_base:
        assert measured(ctx)["output"] == measured(ctx_base)["output"] / 2  # fp16 forward, bf16 backward: exactly half


def measured(ctx) -> dict[str, float]:
    """Bytes per training step in `comms`: the embedding all-to-alls (the splits' left out), what
    crossed ranks, the output dist's (its pooled rows, floats), and the all-reduces."""
    rows = ctx.sql(f"""SELECT op, sum(bytes_out)::DOUBLE / {STEPS},
                              sum(bytes_out - coalesce(splits_out[rank + 1], 0))::DOUBLE / {STEPS},
                              sum(bytes_out) FILTER (WHERE dtype LIKE '%float%')::DOUBLE / {STEPS}
                       FROM train_comms WHERE op IN ('all_to_all_single', 'all_reduce')
                       AND tag NOT LIKE 'SplitsAllToAll%' GROUP BY op""").fetchall()
    found = {op: (total, remote, rows) for op, total, remote, rows in rows}
    return {"a2a": found["all_to_all_single"][0], "a2a_remote": found["all_to_all_single"][1],
            "output": found["all_to_all_single"][2], "all_reduce": found["all_reduce"][0]}


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
    assert manifest(run_dir).status == "failed"


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
    code, run_dir = record(tmp_path, sys.executable, "-c", "import torch",
                           options=("--plan", str(tmp_path / "plan.json")))
    assert code == 0
    ran = manifest(run_dir)
    assert ran.torchrec_plan["applied"] == {"0": 0}
    assert any("no rank built a TorchRec DistributedModelParallel" in e for e in ran.finalise_errors)


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


def synthetic_loads() -> torchrec_plan_bytes.Loads:
    """2 ranks, batch 64 each, one id a bag: `big` (1M × 48) weighs as much as three small tables
    (1k × 16) together; and a hot tiny one (`hot`: 10 × 16, 8 ids a bag) whose exchange outweighs
    copying it."""
    names = ["big", "a", "b", "c", "hot"]
    ids = np.array([[64.0, 64.0], [64, 64], [64, 64], [64, 64], [512, 512]])
    return torchrec_plan_bytes.Loads(world=2, names=names, rows=np.array([1_000_000, 1000, 1000, 1000, 10]),
                                dims=np.array([48, 16, 16, 16, 16]), eb=np.full(5, 4.0), features=np.ones(5),
                                pooled=np.ones(5, dtype=bool), ids=ids, batch=np.array([64.0, 64.0]), len_bytes=8,
                                id_bytes=8, sampled_steps=10)


def test_derive_balances_the_busiest_rank_and_copies_what_is_cheaper_to_copy() -> None:
    L = synthetic_loads()
    base = {name: {"sharding_type": "table_wise", "ranks": [0], "compute_kernel": "fused",
                   "num_embeddings": int(L.rows[t]), "embedding_dim": int(L.dims[t])} for t, name in enumerate(L.names)}
    prices = torchrec_plans.Prices(alpha=1e-4, per_byte=dict.fromkeys(torchrec_plan_bytes.COLLECTIVES, 1e-8),
                                   ring_per_byte=1e-8)
    derived = torchrec_plans.derive(L, base, prices)
    validate({"schema": SCHEMA, "world_size": 2, "tables": derived})
    assert derived["hot"]["sharding_type"] == "data_parallel"
    assert derived["big"]["sharding_type"] == "table_wise"
    on_big = derived["big"]["ranks"][0]
    assert all(derived[t]["ranks"] == [1 - on_big] for t in ("a", "b", "c"))  # the rest on the other rank
    assert torchrec_plans.link_seconds(L, derived, prices) < torchrec_plans.link_seconds(L, base, prices)
    # the bytes: every id and length once, every pooled row out and back, the copy's all-reduce
    f = torchrec_plan_bytes.figures(L, derived)
    exchanged = [t for t, name in enumerate(L.names) if name != "hot"]
    assert f["a2a_bytes_per_step"] == sum(8 * 128 + 8 * L.ids[t].sum() + 2 * 128 * L.dims[t] * 4 for t in exchanged)
    assert f["dp_allreduce_bytes_per_step"] == 2 * 10 * 16 * 4


def test_a_table_heavier_than_a_ranks_share_is_split_by_columns() -> None:
    L = synthetic_loads()
    L.dims[0], L.ids[0] = 256, [256.0, 256.0]  # big now outweighs everything else together
    base = {name: {"sharding_type": "table_wise", "ranks": [0], "compute_kernel": "fused",
                   "num_embeddings": int(L.rows[t]), "embedding_dim": int(L.dims[t])} for t, name in enumerate(L.names)}
    prices = torchrec_plans.Prices(alpha=1e-6, per_byte=dict.fromkeys(torchrec_plan_bytes.COLLECTIVES, 1e-8),
                                   ring_per_byte=1e-8)
    derived = torchrec_plans.derive(L, base, prices)
    assert derived["big"]["sharding_type"] == "column_wise" and sorted(derived["big"]["ranks"]) == [0, 1]
    assert torchrec_plans.link_seconds(L, derived, prices) < torchrec_plans.link_seconds(L, base, prices)


def test_a_plan_is_a_change_of_the_replayed_graph_pair_by_pair() -> None:
    """The replay prices a plan as its bytes per (sender, receiver) over the recorded plan's, per collective,
    and DDP's all-reduce by the data-parallel tables it adds; a plan it cannot express is None."""
    L = synthetic_loads()
    def plan(**kinds):
        return {name: {"sharding_type": kinds.get(name, ("table_wise", [t % 2]))[0],
                       "ranks": kinds.get(name, ("table_wise", [t % 2]))[1], "compute_kernel": "fused",
                       "num_embeddings": int(L.rows[t]), "embedding_dim": int(L.dims[t])} for t, name in enumerate(L.names)}
    recorded = plan()  # big, b, hot on rank 0; a, c on rank 1
    moved = plan(big=("table_wise", [1]), hot=("data_parallel", [0, 1]))
    change = torchrec_plans.plan_change(L, recorded, moved, None, allreduce=1000.0)
    before, after = torchrec_plan_bytes.pairs_of(L, recorded), torchrec_plan_bytes.pairs_of(L, moved)
    for c in torchrec_plan_bytes.COLLECTIVES:
        assert np.allclose(before[c] * change.scale[c], after[c]), c
    # rank 1 now owns big: its output to rank 0 grows by big's pooled rows, rank 0's to rank 1 shrinks
    assert change.scale["output_fwd"][1, 0] > 1 > change.scale["output_fwd"][0, 1]
    assert change.dense == pytest.approx((1000.0 + 2 * 10 * 16 * 4) / 1000.0)
    assert torchrec_plans.plan_change(L, recorded, plan(big=("column_wise", [0, 1])), None, 1000.0) is None
    alone = plan(**{name: ("table_wise", [0]) for name in L.names})
    assert torchrec_plans.plan_change(L, alone, recorded, None, 1000.0) is None  # rank 1 sent no output before


@pytest.mark.slow
def test_optimize_reruns_a_torchrec_job_with_its_derived_plan(torchrec_python: Path, tmp_path: Path) -> None:
    """The job as it is (t0, two features, and t2 on rank 0; t1 on rank 1) and, re-run unchanged, the
    plan analyze derived from its trace: t0 alone on one rank (--check-all: recommended or not, a
    gain this small is within the error of four steps), and with quantized comms (never recommended:
    lossy). Their bytes are predicted exactly, and the quantized run's loss is compared."""
    job = [str(torchrec_python), "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(JOB),
           "--sharding", "table_wise", "--out", str(tmp_path / "out")]
    r = subprocess.run([sys.executable, "-m", "tracekit", "optimize", "--check-all", "--json", "-o",
                        str(tmp_path / "opt"), "--", *job], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads(r.stdout)
    plan = read_plan(tmp_path / "opt" / "base" / "torchrec_plan.json")
    assert plan["tables"]["t1"]["ranks"] == plan["tables"]["t2"]["ranks"] != plan["tables"]["t0"]["ranks"]
    ran = manifest(tmp_path / "opt" / "torchrec_plan")
    assert from_manifest(ran)["tables"] == plan["tables"]
    assert ran.command == manifest(tmp_path / "opt" / "base").command  # the job unchanged
    for section in ("torchrec_plan", "torchrec_plan.qcomms"):  # --check-all: the quantized variant too
        rows = {row["figure"]: row for row in summary["rows"] if row["section"] == section}
        for figure in ("a2a_bytes_per_step", "a2a_remote_bytes_per_step", "allreduce_bytes_per_step"):
            assert rows[figure]["diff"] == 0, (section, rows[figure])
    quantized = manifest(tmp_path / "opt" / "torchrec_plan_qcomms").torchrec_plan["plan"]
    assert quantized["qcomms"] == {"forward": "fp16", "backward": "bf16"} and quantized["recommended"] is False
    assert any(note.startswith("a TorchRec job: tracekit's policy sections apply") for note in summary["notes"])
    measured = {run["run"]: run for run in summary["runs"]}
    assert measured[str(tmp_path / "opt" / "torchrec_plan_qcomms")]["loss_max_abs_diff"] is not None
    printed = " ".join(subprocess.run([sys.executable, "-m", "tracekit", "analyze", str(tmp_path / "opt" / "base")],
                                      cwd=REPO, capture_output=True, text=True, timeout=300).stdout.split())
    assert "torchrec plan (" in printed and " → table_wise on " in printed, printed  # the tables it moves
    estimate = plan["torchrec_estimate"]  # TorchRec's own planner, run in the job's Python, on both plans
    for label in ("recorded", "derived"):
        ranks = estimate[label]["ranks"]
        assert len(ranks) == 2 and estimate[label]["max_rank_ms"] == max(sum(r.values()) for r in ranks) > 0
    report = (tmp_path / "opt" / "report.html").read_text()  # the plans side by side, then compare's rows
    assert "the one derived from its trace" in report and "derived, quantized comms" in report
    assert "its EmbeddingPerfEstimator" in report
    assert report.count("torchrec_plan.qcomms") >= 3  # a row per figure compared

"""The optional API's run-level calls, recorded for real: `tracekit.policy_applied` and
`tracekit.metrics` (the manifest's `policy` and `metrics`) and `tracekit.step_schedule` (the
`schedule` column of `steps`); and each of them a no-op in a process that is not traced."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import polars as pl
import pyarrow.parquet as pq
import pytest

import tracekit
from tests.manifests import write_manifest
from tests.recorded import record, record_script
from tracekit.app.rank_reports import merge_policy
from tracekit.parts import write_part
from tracekit.run import open_run
from tracekit.schema import VERSION_KEY
from tracekit.store import RunWriter

ONE_PROCESS = """
import sys, torch, tracekit
tracekit.policy_applied(sys.argv[1])
emb = torch.nn.EmbeddingBag(10, 4)
opt = torch.optim.SGD(emb.parameters(), lr=0.1)
for names in [["hot"], ["cold"], [], ["hot", "cold"]]:  # step 2 unnamed; in step 3 the last name holds
    for name in names:
        tracekit.step_schedule(name)
    emb(torch.tensor([[1, 2]])).sum().backward()
    opt.step()
tracekit.metrics(eval_auc=0.5, samples_per_s=1000, train_loss=0.7)
tracekit.metrics(eval_auc=0.75, eval_logloss=None, train_loss=float("nan"))
"""


def manifest_of(run_dir: Path) -> dict:
    return json.loads((run_dir / "manifest.json").read_text())


def test_policy_schedule_and_metrics_of_one_process_are_recorded(tmp_path: Path) -> None:
    policy = tmp_path / "policy.json"
    policy.write_text('{"schema": "tracekit.policy/1"}\n')
    script = tmp_path / "script.py"
    script.write_text(ONE_PROCESS)
    code, run_dir = record(tmp_path, sys.executable, str(script), os.path.relpath(policy))  # relative: made absolute
    manifest = manifest_of(run_dir)
    assert code == 0 and manifest["finalise_errors"] == [], manifest
    assert manifest["policy"] == {"path": str(policy.resolve()), "sha256": hashlib.sha256(policy.read_bytes()).hexdigest()}
    assert manifest["metrics"] == {"eval_auc": 0.75, "eval_logloss": None, "samples_per_s": 1000, "train_loss": None}
    run = open_run(run_dir)
    steps = run.scan("steps").sort("step").collect()
    assert steps["schedule"].dtype == pl.String
    assert steps.select("step", "schedule").rows() == [(0, "hot"), (1, "cold"), (2, None), (3, "cold")]
    relation = run.relation("steps")
    assert dict(zip(relation.columns, map(str, relation.types)))["schedule"] == "VARCHAR"
    assert relation.order("step").project("step, schedule").fetchall() == [(0, "hot"), (1, "cold"), (2, None), (3, "cold")]


def test_a_run_that_declares_nothing_has_null_policy_and_no_metrics(tmp_path: Path) -> None:
    code, run_dir = record(tmp_path, sys.executable, "-c", "import torch, tracekit; tracekit.step(samples=1)")
    manifest = manifest_of(run_dir)
    assert code == 0 and (manifest["policy"], manifest["metrics"]) == (None, {}), manifest
    assert open_run(run_dir).scan("steps").collect()["schedule"].to_list() == [None]


TWO_RANKS = """
import torch, torch.distributed as dist, tracekit
dist.init_process_group("gloo")
rank = dist.get_rank()
tracekit.policy_applied({policies!r}[rank])  # rank 1 names another file: the manifest keeps rank 0's
emb = torch.nn.EmbeddingBag(10, 4)
opt = torch.optim.SGD(emb.parameters(), lr=0.1)
for step in range(4):
    if (step + rank) % 3:  # rank 0 leaves step 0 unnamed, rank 1 step 2
        tracekit.step_schedule("hot" if step % 2 else "cold")
    emb(torch.tensor([[1, 2]])).sum().backward()
    opt.step()
tracekit.metrics(eval_auc=0.6 + rank, **({{"only_rank_1": 7}} if rank else {{"samples_per_s": 10.0}}))
dist.barrier()
dist.destroy_process_group()
"""


@pytest.mark.slow
def test_two_ranks_keep_rank_0s_policy_and_metrics_and_their_own_schedules(tmp_path: Path) -> None:
    policies = [tmp_path / "policy.json", tmp_path / "other.json"]
    for path, text in zip(policies, ["{}", "{ }"]):
        path.write_text(text)
    code, run_dir = record_script(tmp_path, "ranks.py", TWO_RANKS.format(policies=[str(p) for p in policies]))
    manifest = manifest_of(run_dir)
    assert code == 0 and manifest["ranks"] == [0, 1], manifest
    digests = [hashlib.sha256(p.read_bytes()).hexdigest() for p in policies]
    assert manifest["policy"] == {"path": str(policies[0].resolve()), "sha256": digests[0]}
    assert manifest["finalise_errors"] == [
        f"policy: rank 1 applied {policies[1].resolve()} (sha256 {digests[1]}), rank 0 {policies[0].resolve()} "
        f"(sha256 {digests[0]}); the manifest keeps rank 0's"]
    assert manifest["metrics"] == {"eval_auc": 0.6, "samples_per_s": 10.0, "only_rank_1": 7}
    expected = [(r, s, ("hot" if s % 2 else "cold") if (s + r) % 3 else None) for r in (0, 1) for s in range(4)]
    run = open_run(run_dir)
    assert run.scan("steps").sort("rank", "step").select("rank", "step", "schedule").collect().rows() == expected
    assert run.relation("steps").order("rank, step").project("rank, step, schedule").fetchall() == expected


def test_ranks_that_applied_one_file_agree() -> None:
    policy = {"path": "/runs/base/policy.json", "sha256": "ab"}
    errors: list[str] = []
    ranks = [{"rank": 0, "policy": None}, {"rank": 1, "policy": policy}, {"rank": 2, "policy": dict(policy)}]
    assert merge_policy(ranks, errors) == policy and errors == []  # rank 0 named none: the lowest that did
    assert merge_policy([{"rank": 0, "policy": None}], errors) is None and errors == []


def _recorded_before(run_dir: Path, table: str, rows: dict, column: str, version: bytes, also: tuple[str, ...] = ()):
    """A run whose one part file of `table` holds `rows` as the schema `version` wrote it: without
    `column` (and the columns `also`), which a later minor version added."""
    write_manifest(run_dir, {"status": "completed"})
    with RunWriter(run_dir, 0) as writer:  # written as now, then rewritten as that version wrote it
        writer.append(table, rows)
    part = run_dir / table / "rank=0" / "part-00000.parquet"
    old = pq.read_table(part).drop_columns([column, *also])
    part.unlink()
    write_part(old.replace_schema_metadata({**old.schema.metadata, VERSION_KEY: version}), part.parent, 0)
    return open_run(run_dir)


def test_a_run_recorded_before_the_schedule_column_reads_it_as_null(tmp_path: Path) -> None:
    run = _recorded_before(tmp_path / "old", "steps", {"step": [0, 1], "t_start_ns": [0, 5], "t_end_ns": [5, 9],
                                                       "samples": [4, 4], "loss": [0.5, None]}, "schedule", b"1.1")
    frame = run.scan("steps").collect()
    assert frame["schedule"].dtype == pl.String and frame["schedule"].to_list() == [None, None]
    assert frame["loss"].to_list() == [0.5, None]
    relation = run.relation("steps")
    assert dict(zip(relation.columns, map(str, relation.types)))["schedule"] == "VARCHAR"
    assert relation.project("step, schedule").order("step").fetchall() == [(0, None), (1, None)]


def test_a_run_recorded_before_the_feature_column_reads_it_as_0(tmp_path: Path) -> None:
    run = _recorded_before(tmp_path / "old", "lookups", {"step": [0, 0], "table_name": ["t", "t"], "sample": [0, 1],
                                                         "pos": [0, 0], "row": [7, 9], "phase": ["train", "train"],
                                                         "feature": [0, 1]}, "feature", b"1.3")
    frame = run.scan("lookups").collect()
    assert frame["feature"].dtype == pl.Int16 and frame["feature"].to_list() == [0, 0]
    relation = run.relation("lookups")
    assert dict(zip(relation.columns, map(str, relation.types)))["feature"] == "SMALLINT"
    assert relation.project("row, feature").order("row").fetchall() == [(7, 0), (9, 0)]


def test_a_run_recorded_before_the_source_columns_reads_them_as_null(tmp_path: Path) -> None:
    run = _recorded_before(tmp_path / "old", "lookups", {"step": [0, 0], "table_name": ["t", "t"], "sample": [0, 1],
                                                         "pos": [0, 0], "row": [7, 9], "phase": ["train", "train"],
                                                         "feature": [0, 0], "src": [1, 0], "src_sample": [3, 4]},
                           "src", b"1.6", also=("src_sample",))
    frame = run.scan("lookups").collect()
    assert frame["src"].dtype == frame["src_sample"].dtype == pl.Int32
    assert frame["src"].to_list() == frame["src_sample"].to_list() == [None, None]
    relation = run.relation("lookups")
    assert {c: str(t) for c, t in zip(relation.columns, relation.types)}.items() >= {
        "src": "INTEGER", "src_sample": "INTEGER"}.items()
    assert relation.project("row, src, src_sample").order("row").fetchall() == [(7, None, None), (9, None, None)]


UNTRACED = """
import os, torch, tracekit
emb = torch.nn.EmbeddingBag(10, 4)
opt = torch.optim.SGD(emb.parameters(), lr=0.1)
tracekit.policy_applied("no-such-policy.json")
with tracekit.sources([1]):
    emb(torch.tensor([[3, 4]]))
for name in ["hot", "cold"]:
    tracekit.step_schedule(name)
    emb(torch.tensor([[1, 2]])).sum().backward()
    opt.step()
tracekit.metrics(eval_auc=0.7, train_loss=None)
print(sorted(os.listdir(".")))
"""


def test_each_call_is_a_no_op_in_a_process_not_traced(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRACEKIT_")}
    out = subprocess.run([sys.executable, "-c", UNTRACED], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr  # wrote nothing


@pytest.mark.parametrize(("call", "error", "message"), [
    (lambda: tracekit.metrics(eval_auc=0.7, train_loss="low"), TypeError, "`train_loss` must be a number or None"),
    (lambda: tracekit.metrics(converged=True), TypeError, "`converged` must be a number or None"),
    (lambda: tracekit.step_schedule(1), TypeError, "expected a str"),
    (lambda: tracekit.step_schedule(""), ValueError, "expected a non-empty name"),
])
def test_bad_values_are_refused_traced_or_not(call, error, message) -> None:
    with pytest.raises(error, match=message):
        call()

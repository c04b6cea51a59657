"""The `phase` column: evaluation told apart from training, by the collectors alone where they can
(collectors/phase.py) and by `tracekit.phase` where they cannot, exactly, lookup by lookup."""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import polars as pl
import pyarrow as pa
import pytest
import torch
from torch import nn

import tracekit
from tests.manifests import write_manifest
from collectors import embedding, phase, steps
from collectors.steps import StepClock
from tests.recorded import REPO, TINY, expected_accesses, record, record_gloo, sample_accesses
from tracekit.parts import write_part
from tracekit.run import open_run
from tracekit.schema import file_metadata
from tracekit.store import RunWriter


class Doubler(torch.autograd.Function):
    """Looks its table up inside forward, where autograd always turns gradients off (as the
    reference trainer's fused lookup does)."""

    @staticmethod
    def forward(ctx, anchor, table, ids):
        return table(ids)

    @staticmethod
    def backward(ctx, grad):
        return None, None, None


@pytest.fixture
def traced(tmp_path):
    writer = RunWriter(tmp_path, rank=0)
    clock = StepClock()
    handles = [phase.install(), steps.install(writer, clock), embedding.install(writer, clock, lookup_every=0)]
    yield writer
    for handle in reversed(handles):
        handle.uninstall()
    writer.close()


def phases_by_step(run_dir: Path) -> dict[int, Counter]:
    write_manifest(run_dir, {"status": "completed"})
    rows = open_run(run_dir).scan("accesses").select("step", "phase", "count").collect().rows()
    out: dict[int, Counter] = {}
    for step, name, count in rows:
        out.setdefault(step, Counter())[name] += count
    return out


def test_each_way_of_evaluating_is_seen_without_help(traced, tmp_path):
    table = nn.EmbeddingBag(50, 4, mode="sum")
    frozen = nn.EmbeddingBag.from_pretrained(torch.rand(50, 4), freeze=True)
    anchor = torch.zeros((), requires_grad=True)
    optimizer = torch.optim.SGD(table.parameters(), lr=0.1)
    ids = torch.tensor([[1, 2, 3]])

    def train_step(extra_eval) -> None:
        (table(ids).sum() + Doubler.apply(anchor, frozen, ids).sum()).backward()  # 3 + 3 train lookups
        extra_eval()
        optimizer.step()

    def under_no_grad():
        with torch.no_grad():
            table(ids), Doubler.apply(anchor, frozen, ids)  # 6 eval lookups, one inside a Function

    def in_eval_mode():
        table.eval()
        table(ids)  # gradients on, but the module is in eval mode
        table.train()

    def under_inference_mode():
        with torch.inference_mode():
            table(ids)

    def said_so():
        with tracekit.phase("eval"):
            table(ids).sum().backward()  # gradients on, a backward even: the program's word wins

    for extra in (under_no_grad, in_eval_mode, under_inference_mode, said_so):
        train_step(extra)
    traced.close()
    assert phases_by_step(tmp_path) == {0: Counter(train=6, eval=6), 1: Counter(train=6, eval=3),
                                        2: Counter(train=6, eval=3), 3: Counter(train=6, eval=3)}


def test_lookups_after_the_last_step_are_eval_and_before_any_step_train(traced, tmp_path):
    table = nn.Embedding(10, 2)
    optimizer = torch.optim.SGD(table.parameters(), lr=0.1)
    for _ in range(2):
        table(torch.tensor([1, 2])).sum().backward()
        optimizer.step()
    table(torch.tensor([5]))  # gradients on, module in training mode: only the missing step end tells
    traced.close()
    assert phases_by_step(tmp_path) == {0: Counter(train=2), 1: Counter(train=2), 2: Counter(eval=1)}


def test_phase_takes_train_eval_or_none():
    with pytest.raises(ValueError, match="tracekit.phase: expected one of train, eval or None, got 'test'"):
        tracekit.phase("test")
    from tracekit.phases import forced

    tracekit.phase("eval")
    try:
        assert forced() == "eval"
        with tracekit.phase("train"):
            assert forced() == "train"
        assert forced() == "eval"
    finally:
        tracekit.phase(None)
    assert forced() is None


def test_uninstall_restores_function_apply():
    before = torch.autograd.Function.__dict__["apply"]
    handle = phase.install()
    assert phase.install() is handle and torch.autograd.Function.__dict__["apply"] is not before
    handle.uninstall()
    assert torch.autograd.Function.__dict__["apply"] is before


def test_a_run_recorded_before_the_phase_column_reads_as_train_with_wide_counts(tmp_path):
    run_dir = tmp_path / "old"
    write_manifest(run_dir, {"status": "completed"})
    old = pa.table({"step": pa.array([0, 0], pa.int64()),
                    "table_name": pa.array(["t0", "t0"]).dictionary_encode(),
                    "row": pa.array([1, 2], pa.int64()), "count": pa.array([2**31 - 1] * 2, pa.int32())})
    write_part(old.replace_schema_metadata({**file_metadata("accesses"), b"tracekit.schema_version": b"1.0"}),
               run_dir / "accesses" / "rank=0", 0)
    run = open_run(run_dir)
    frame = run.scan("accesses").collect()
    assert frame["phase"].to_list() == ["train", "train"]
    assert frame["count"].dtype == pl.Int64 and frame["count"].sum() == 2 * (2**31 - 1)
    relation = run.relation("accesses")
    assert dict(zip(relation.columns, map(str, relation.types)))["count"] == "BIGINT"
    assert relation.aggregate('sum("count"), min(phase), max(phase)').fetchall() == [
        (2 * (2**31 - 1), "train", "train")]


EVAL_TINY = [*TINY[:TINY.index("--eval-fraction")], "--eval-fraction", "0.0625", "--eval-every", "2",
             "--steps", "4"]  # 256 held-out samples, evaluated after step 2 and at the end


@pytest.mark.slow
def test_the_trainers_evaluation_is_eval_and_its_training_exactly_the_samples_fed(tmp_path: Path) -> None:
    code, run_dir = record(tmp_path, sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc-per-node", "2", str(REPO / "train.py"), *EVAL_TINY)
    assert code == 0
    run = open_run(run_dir)
    counts = Counter()
    for step, table, row, count, name in run.scan("accesses").select(
            "step", "table_name", "row", "count", "phase").collect().rows():
        counts[(name, step, table, row)] += count
    train = Counter({key[1:]: n for key, n in counts.items() if key[0] == "train"})
    assert train == expected_accesses(2, 4)
    one_pass = sample_accesses(4096 - 256, 4096)
    for step in (2, 4):  # the evaluation after step 2 (booked to step 2, beside its training) and at the end
        evaluated = Counter({key[2:]: n for key, n in counts.items() if key[0] == "eval" and key[1] == step})
        assert evaluated == one_pass, step
    assert {key[1] for key in counts if key[0] == "eval"} == {2, 4}

    comms = run.scan("comms").collect()
    evaluation = comms.filter(pl.col("phase") == "eval")
    assert set(evaluation["step"]) == {2, 4}
    assert evaluation.filter(pl.col("op") == "all_gather").height == 4  # one gather per pass and rank
    training = comms.filter(pl.col("phase") == "train")
    assert set(training.filter(pl.col("tag") == "_sum_allreduce_hook")["step"]) == {0, 1, 2, 3}
    # per rank and training step: lengths, ids, pooled forward, pooled backward
    a2a = training.filter(pl.col("op") == "all_to_all_single").group_by("rank", "step").len()
    assert set(a2a["len"]) == {4} and a2a.height == 8
    # each evaluation batch (256 samples: 4 global batches of 64) sends lengths, ids and pooled rows
    eval_a2a = evaluation.filter(pl.col("op") == "all_to_all_single").group_by("rank", "step").len()
    assert set(eval_a2a["len"]) == {3 * 4} and eval_a2a.height == 4


USER_EVAL_SCRIPT = """\
torch.manual_seed(0)
emb = torch.nn.EmbeddingBag(1000, 8, mode="sum")
head = DistributedDataParallel(torch.nn.Linear(8, 1))
opt = torch.optim.SGD(list(emb.parameters()) + list(head.parameters()), lr=0.1)
def batch(i):  # 4 bags of 2 ids
    return torch.arange(i * 8, i * 8 + 8) + rank * 100, torch.tensor([0, 2, 4, 6])
for step in range(4):
    head(emb(*batch(step))).sum().backward()
    opt.step()
    opt.zero_grad()
    if step == 1:
        with torch.no_grad():
            for i in range(50, 53):
                head(emb(*batch(i)))
                dist.all_reduce(torch.ones(3))
emb.eval(); head.eval()
with torch.no_grad():
    for i in range(60, 62):
        head(emb(*batch(i)))
"""


@pytest.mark.slow
def test_a_user_scripts_evaluation_is_eval_exactly(tmp_path: Path) -> None:
    run_dir = record_gloo(tmp_path, "user_eval.py", USER_EVAL_SCRIPT)
    accesses = open_run(run_dir).scan("accesses").collect()
    for r in (0, 1):
        mine = accesses.filter(pl.col("rank") == r)
        rows = {name: sorted(zip(*(mine.filter(pl.col("phase") == name)[c] for c in ("step", "row", "count"))))
                for name in ("train", "eval")}
        assert rows["train"] == sorted((s, s * 8 + i + r * 100, 1) for s in range(4) for i in range(8))
        assert rows["eval"] == sorted([(2, b * 8 + i + r * 100, 1) for b in range(50, 53) for i in range(8)]
                                      + [(4, b * 8 + i + r * 100, 1) for b in range(60, 62) for i in range(8)])
    comms = open_run(run_dir).scan("comms").collect()
    assert comms.filter(pl.col("op") == "all_reduce", pl.col("phase") == "eval").height == 2 * 3
    assert set(comms.filter(pl.col("tag") == "ddp_bucket_0")["phase"]) == {"train"}

"""`tracekit record` of a real TorchRec DLRM (torchrec 1.8.0, FBGEMM CPU TBE, 2 gloo ranks): the rows
its sharded tables look up, per logical table and global row, under every plan the CPU runs.

tests/torchrec_job.py is the recorded script (it imports nothing of tracekit) and writes the ids
each rank fed; each plan is recorded once per module and shared by the tests. The TorchRec-free
parts (splitting a TBE call into its features, the lazy import hook) are tested in the toolkit's
own venv at the end.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

from collectors import embedding, torchrec_tables
from collectors.steps import StepClock
from tests.recorded import REPO, record
from tests.torchrec_env import torchrec_python  # noqa: F401
from tracekit.run import open_run
from tracekit.store import RunWriter

JOB = REPO / "tests" / "torchrec_job.py"
TABLES = {"t0": ["f0", "f1"], "t1": ["f2"], "t2": ["f3"]}  # as in the job
BATCH, STEPS, EVAL_AFTER, ROWS, DIM = 8, 4, 1, 200, 16
LOOKUP_EVERY = 2
PLANS = ["table_wise", "column_wise", "table_column_wise", "row_wise", "table_row_wise", "data_parallel"]
ROW_SHARDED = {"row_wise", "table_row_wise"}  # rows [0, 100) on rank 0, [100, 200) on rank 1


@pytest.fixture(scope="module")
def recorded(torchrec_python: Path, tmp_path_factory: pytest.TempPathFactory):
    """recorded(sharding, kind) -> (run_dir, what each rank fed), each recorded once; "none" is the
    unsharded collection on one rank."""
    runs: dict[tuple[str, str], tuple[Path, list[dict]]] = {}

    def get(sharding: str, kind: str = "pooled") -> tuple[Path, list[dict]]:
        if (sharding, kind) not in runs:
            tmp = tmp_path_factory.mktemp(f"{sharding}-{kind}")
            ranks = 1 if sharding == "none" else 2
            code, run_dir = record(tmp, str(torchrec_python), "-m", "torch.distributed.run", "--standalone",
                                   "--nproc-per-node", str(ranks), str(JOB), "--sharding", sharding, "--kind", kind,
                                   "--out", str(tmp / "fed"), options=("--lookup-every", str(LOOKUP_EVERY)))
            manifest = json.loads((run_dir / "manifest.json").read_text())
            assert code == 0 and manifest["status"] == "completed" and manifest["traced"], manifest
            fed = [json.loads((tmp / "fed" / f"rank={r}.json").read_text()) for r in range(ranks)]
            runs[(sharding, kind)] = run_dir, fed
        return runs[(sharding, kind)]

    return get


def booked(batch: str) -> tuple[int, str]:
    """(step, phase) a batch of the job is recorded under: the eval forward runs in step EVAL_AFTER + 1."""
    return (EVAL_AFTER + 1, "eval") if batch == "eval" else (int(batch), "train")


def fed_accesses(fed: list[dict]) -> Counter:
    """(step, phase, table, row) -> count of the ids every rank fed."""
    counts: Counter = Counter()
    for per_rank in fed:
        for batch, features in per_rank.items():
            step, phase = booked(batch)
            for table, names in TABLES.items():
                for name in names:
                    counts.update((step, phase, table, row) for row in features[name]["values"])
    return counts


def fed_lookups(fed: list[dict], *, own_batch: bool, block: int = ROWS, with_feature: bool = False) -> Counter:
    """(step, phase, table, sample, pos, row) of the sampled steps' lookups, as the rank holding a
    table sees them: its own batch (`own_batch`, data-parallel), else every rank's, ordered by source
    rank (sample = source rank * BATCH + bag). A shard of `block` rows sees the ids of a bag that fall
    in its rows (row-wise: TorchRec's input dist sends it no others), so `pos` counts those only. With
    `with_feature`, each ends with the feature's order among its table's (t0's f0 and f1: 0 and 1)."""
    counts: Counter = Counter()
    for source, per_rank in enumerate(fed):
        for batch, features in per_rank.items():
            step, phase = booked(batch)
            if step % LOOKUP_EVERY:
                continue
            for table, names in TABLES.items():
                for name in names:
                    values = iter(features[name]["values"])
                    for bag, length in enumerate(features[name]["lengths"]):
                        sample = bag if own_batch else source * BATCH + bag
                        seen: Counter = Counter()  # ids of this bag so far, per shard
                        for row in (next(values) for _ in range(length)):
                            key = (step, phase, table, sample, seen[row // block], row)
                            counts[(*key, names.index(name)) if with_feature else key] += 1
                            seen[row // block] += 1
    return counts


def accesses(run_dir: Path) -> Counter:
    counts: Counter = Counter()
    for r in open_run(run_dir).scan("accesses").collect().to_dicts():
        counts[(r["step"], r["phase"], r["table_name"], r["row"])] += r["count"]
    return counts


@pytest.mark.slow
@pytest.mark.parametrize("sharding", PLANS)
def test_accesses_are_the_ids_fed_per_logical_table_and_global_row(recorded, sharding: str) -> None:
    run_dir, fed = recorded(sharding)
    assert accesses(run_dir) == fed_accesses(fed)


@pytest.mark.slow
def test_every_plan_gives_the_same_accesses(recorded) -> None:
    first = accesses(recorded(PLANS[0])[0])
    for sharding in PLANS[1:]:
        assert accesses(recorded(sharding)[0]) == first, sharding


@pytest.mark.slow
@pytest.mark.parametrize("sharding", PLANS)
def test_lookups_at_sampled_steps_are_the_keyed_jagged_tensors(recorded, sharding: str) -> None:
    run_dir, fed = recorded(sharding)
    rows = open_run(run_dir).scan("lookups").select("step", "phase", "table_name", "sample", "pos", "row", "feature")
    block = ROWS // 2 if sharding in ROW_SHARDED else ROWS
    assert Counter(rows.collect().rows()) == fed_lookups(fed, own_batch=sharding == "data_parallel", block=block,
                                                         with_feature=True)


@pytest.mark.slow
@pytest.mark.parametrize("sharding", sorted(ROW_SHARDED))
def test_each_rank_reads_only_the_rows_it_holds(recorded, sharding: str) -> None:
    run_dir, _ = recorded(sharding)
    manifest = json.loads((run_dir / "manifest.json").read_text())
    held = {(t["name"], s["rank"]): range(s["first_row"], s["first_row"] + s["num_rows"])
            for t in manifest["tables"] for s in t["shards"]}
    for table, rank, row in open_run(run_dir).scan("accesses").select("table_name", "rank", "row").collect().rows():
        assert row in held[(table, rank)], (table, rank, row)


@pytest.mark.slow
def test_one_step_per_iteration_with_the_embedding_optimizer_fused_into_backward(recorded) -> None:
    run_dir, _ = recorded("table_wise")
    steps = open_run(run_dir).scan("steps").select("rank", "step", "samples").collect()
    assert sorted(steps.rows()) == [(rank, step, BATCH) for rank in (0, 1) for step in range(STEPS)]
    phases = Counter((r[0], r[1]) for r in open_run(run_dir).scan("accesses").select("step", "phase").collect().rows())
    assert {phase for (step, phase) in phases if step == EVAL_AFTER + 1} == {"train", "eval"}  # the eval forward
    assert {step for (step, phase) in phases if phase == "eval"} == {EVAL_AFTER + 1}


@pytest.mark.slow
@pytest.mark.parametrize(("sharding", "shards"), [
    ("table_wise", {"t0": [(0, 0, 200, 0, 16)], "t1": [(1, 0, 200, 0, 16)], "t2": [(0, 0, 200, 0, 16)]}),
    ("column_wise", {t: [(1, 0, 200, 0, 8), (0, 0, 200, 8, 8)] for t in TABLES}),  # column 0 on rank 1
    ("row_wise", {t: [(0, 0, 100, 0, 16), (1, 100, 100, 0, 16)] for t in TABLES}),
    ("table_row_wise", {t: [(0, 0, 100, 0, 16), (1, 100, 100, 0, 16)] for t in TABLES}),
    ("data_parallel", {t: [(0, 0, 200, 0, 16), (1, 0, 200, 0, 16)] for t in TABLES}),
])
def test_the_manifest_lists_the_plan(recorded, sharding: str, shards: dict) -> None:
    """Shards are (rank, first_row, num_rows, first_col, num_cols)."""
    run_dir, _ = recorded(sharding)
    tables = json.loads((run_dir / "manifest.json").read_text())["tables"]
    kernel = "dense" if sharding == "data_parallel" else "fused"
    placement = "replicated" if sharding == "data_parallel" else "sharded"
    assert [(t["name"], t["num_rows"], t["dim"], t["kind"], t["sharding_type"], t["compute_kernel"], t["placement"])
            for t in tables] == [(name, ROWS, DIM, "pooled", sharding, kernel, placement) for name in TABLES]
    assert {t["name"]: [tuple(s[k] for k in ("rank", "first_row", "num_rows", "first_col", "num_cols"))
                        for s in t["shards"]] for t in tables} == shards


@pytest.mark.slow
def test_an_unsharded_collection_names_its_tables_by_their_config(recorded) -> None:
    """Without DistributedModelParallel the EmbeddingBagCollection looks up nn.EmbeddingBag modules,
    which the embedding collector records itself: named t0, not sparse_arch...embedding_bags.t0."""
    run_dir, fed = recorded("none")
    assert accesses(run_dir) == fed_accesses(fed)
    rows = open_run(run_dir).scan("lookups").select("step", "phase", "table_name", "sample", "pos", "row")
    assert Counter(rows.collect().rows()) == fed_lookups(fed, own_batch=True)
    tables = json.loads((run_dir / "manifest.json").read_text())["tables"]
    assert [(t["name"], t["placement"]) for t in tables] == [(name, "local") for name in TABLES]


@pytest.mark.slow
@pytest.mark.parametrize("sharding", ["table_wise", "none"])
def test_sequence_tables_are_recorded_per_sample_and_position(recorded, sharding: str) -> None:
    """An EmbeddingCollection: sharded, FBGEMM's TBE without pooling; unsharded, one nn.Embedding call
    of all of a feature's ids, whose bags come from the KeyedJaggedTensor."""
    run_dir, fed = recorded(sharding, "sequence")
    assert accesses(run_dir) == fed_accesses(fed)
    rows = open_run(run_dir).scan("lookups").select("step", "phase", "table_name", "sample", "pos", "row")
    assert Counter(rows.collect().rows()) == fed_lookups(fed, own_batch=sharding == "none")
    tables = json.loads((run_dir / "manifest.json").read_text())["tables"]
    assert [(t["name"], t["kind"]) for t in tables] == [(name, "sequence") for name in TABLES]


def test_the_recorded_script_knows_nothing_of_tracekit() -> None:
    assert "tracekit" not in JOB.read_text().split('"""', 2)[2]  # past the docstring


# --- without TorchRec: the toolkit's own venv ---

@pytest.mark.parametrize(("offsets", "features", "batch_sizes", "bounds"), [
    ([0, 1, 3, 3, 4, 6, 7], 2, None, [0, 3, 6]),  # 2 features x 3 bags
    ([0, 1, 3, 3, 4, 6, 7], 2, [[1, 1], [2, 2]], [0, 2, 6]),  # variable batch: 2 bags, then 4
    ([0, 1, 3, 3, 4, 6, 7], 4, None, None),  # 6 bags do not split into 4 features
    ([0, 1, 3, 3, 4, 6, 7], 2, [[1], [1]], None),  # nor into 1 + 1
])
def test_a_call_splits_into_its_features(offsets, features, batch_sizes, bounds) -> None:
    assert torchrec_tables.feature_bounds(torch.tensor(offsets), features, batch_sizes) == bounds


FAKE_TBE = '''
import torch
from torch import nn


class SplitTableBatchedEmbeddingBagsCodegen(nn.Module):
    """Enough of FBGEMM's TBE for the collector: specs, feature map, names, one buffer, forward."""

    def __init__(self, embedding_specs, feature_table_map=None, table_names=None):
        super().__init__()
        self.embedding_specs = embedding_specs
        self.feature_table_map = feature_table_map
        self.table_names = table_names
        self.register_buffer("D_offsets", torch.zeros(1))

    def forward(self, indices, offsets, per_sample_weights=None):
        return torch.zeros(offsets.numel() - 1, 1)
'''


def test_a_bare_tbe_is_hooked_once_its_module_is_imported(tmp_path: Path, monkeypatch) -> None:
    """A stand-in for FBGEMM's TBE module, imported after install: its instances are hooked, each
    feature's ids are kept as calls of the table it maps to, and nothing of torchrec is imported."""
    package = tmp_path / "fbgemm_gpu"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "split_table_batched_embeddings_ops_training.py").write_text(FAKE_TBE)
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in [n for n in sys.modules if n.startswith(("fbgemm_gpu", "torchrec"))]:
        monkeypatch.delitem(sys.modules, name)
    writer = RunWriter(tmp_path / "run", 0, flush_interval_s=60)
    tables = embedding.install(writer, StepClock(), lookup_every=1)
    handle = torchrec_tables.install(tables)
    try:
        from fbgemm_gpu.split_table_batched_embeddings_ops_training import SplitTableBatchedEmbeddingBagsCodegen

        tbe = SplitTableBatchedEmbeddingBagsCodegen([(10, 4), (20, 4)], feature_table_map=[0, 1, 1],
                                                    table_names=["a", "b"])
        tbe(torch.tensor([1, 2, 3, 4, 5, 6]), torch.tensor([0, 1, 3, 3, 4, 6, 6]))  # 3 features x 2 bags
        tbe(torch.tensor([1, 2]), torch.tensor([0, 1, 2]))  # 2 bags do not split into 3 features: dropped
        assert "torchrec" not in sys.modules
    finally:
        handle.uninstall()
        tables.uninstall()
    tbe(torch.tensor([7]), torch.tensor([0, 1, 1, 1]))  # uninstalled: not recorded
    again = torchrec_tables.install(tables)  # a fresh install once uninstalled
    again.uninstall()
    assert again is not handle and handle._watcher not in sys.meta_path and again._watcher not in sys.meta_path
    calls = [call for kept in tables.staging._tables_calls for call in kept.split()]  # the writer's split of each TBE call
    assert [(c.table.name, c.ids.tolist(), c.offsets.tolist()) for c in calls] == [
        ("a", [1, 2, 3], [0, 1, 3]), ("b", [4], [0, 0, 1]), ("b", [5, 6], [0, 2, 2])]
    assert writer.dropped["accesses"] == 2
    assert [(t["table"], t["num_rows"], t["sharding_type"]) for t in tables.tables] == [
        ("a", 10, "table_wise"), ("b", 20, "table_wise")]
    writer.close()


def test_without_torchrec_nothing_is_hooked() -> None:
    """Installed in a process that never imports TorchRec or FBGEMM: no global hook, no import."""
    code = ("import sys, torch; from torch.nn.modules import module as m; "
            "from collectors import embedding, torchrec_tables; from collectors.steps import StepClock; "
            "from tracekit.store import RunWriter; import tempfile, pathlib; "
            "w = RunWriter(pathlib.Path(tempfile.mkdtemp()), 0); t = embedding.install(w, StepClock()); "
            "before = len(m._global_buffer_registration_hooks); h = torchrec_tables.install(t); "
            "torch.nn.Linear(2, 2); "
            "assert len(m._global_buffer_registration_hooks) == before and not h._hooks; "
            "assert not any(n.startswith(('torchrec', 'fbgemm_gpu')) for n in sys.modules); "
            "h.uninstall(); t.uninstall(); w.close(); print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert out.stdout.strip() == "ok", out.stderr

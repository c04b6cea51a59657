"""FlexShard's tier 2 across nodes as the reference trainer applies it (tracekit/dlrm/node_tier.py):
one copy of the tier-2 rows per node, served inside the node, the copies' gradients summed across
the nodes. It changes where rows are looked up, never what is computed.

Exactness: with tier 1 the 5% most frequent rows of every table and tier 2 the next 20%, the
per-step losses and every table row equal the run without a policy, at 2 nodes × 2 ranks and
2 nodes × 1 rank, pooled and sequence tables, table-wise and row-wise, SGD and row-wise Adagrad, each
tier-2 sync. The tier split is not vacuous: pooled bags mix tiers 1, 2 and 3, and the tier-2 rows
moved off their initial values. A run whose copies skip the sync (tier2_sync removed) differs.

Bytes: on an emulated cluster (`tracekit optimize --cluster`, skipped without root), the exchange's
bytes within and between nodes and the syncs' bytes are what analyze predicted, exactly.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import polars as pl
import pytest
import torch

from tests.multiprocess import run_ranks
from tests.recorded import REPO
from tests.test_cluster import TINY_TRAINER, needs_cluster
from tests.test_replication import SCENARIOS as REPLICATION_SCENARIOS
from tests.test_replication import _config, _dataset, assert_same_training, rows_moved
from tracekit.dlrm import policies
from tracekit.dlrm.node_tier import NodeTier
from tracekit.dlrm.train import build_tables, run
from tracekit.policy import REPLICATION_SYNCS
from tracekit.policy import new_policy, write_policy

SCENARIOS = [name for name in REPLICATION_SCENARIOS if name != "ragged-tail"]
TIER1, TIER2 = 0.05, 0.20  # shares of each table's rows, most frequent first


def tier_rows(cfg) -> pl.DataFrame:
    """table_name, row, tier: each table's most frequent rows over the dataset's first 2048 samples."""
    dataset = _dataset(cfg)
    batch = dataset.batch(0, min(dataset.num_samples, 2048))
    frames, offset = [], 0
    for t, n in enumerate(batch.lengths.sum(dim=1).tolist()):
        ids, counts = torch.unique(batch.values[offset:offset + n], return_counts=True)
        offset += n
        top = ids[torch.argsort(counts, descending=True, stable=True)].tolist()
        k1 = max(1, int(TIER1 * dataset.table_rows[t]))
        k2 = max(1, int(TIER2 * dataset.table_rows[t]))
        frames.append(pl.DataFrame({"table_name": dataset.table_names[t], "row": top[:k1 + k2],
                                    "tier": [1] * k1 + [2] * (len(top[:k1 + k2]) - k1)}))
    return pl.concat(frames).with_columns(pl.col("tier").cast(pl.Int8))


def write_tiers(path: Path, cfg, nodes: int, per_node: int, sync: str, rows: pl.DataFrame) -> Path:
    tables = build_tables(cfg, _dataset(cfg))
    policy = new_policy(source_run="tests/test_node_tier.py", model={
        "tables": [{"name": t.name, "num_rows": t.rows, "dim": t.dim} for t in tables],
        "world_size": nodes * per_node})
    policy["tiers"] = {"topology": {"nodes": nodes, "ranks_per_node": per_node}, "rows": "policy/tiers.parquet",
                       "tier1_sync": "sparse_allreduce", "tier2_sync": sync, "predicted": {}, "why": "test"}
    return write_policy(path, policy, rows={"tiers": rows})


def _train(rank: int, world_size: int, per_node: int, cfg, policy_path: Path | None, skip_sync: bool):
    torch.set_num_threads(1)
    if skip_sync:
        NodeTier.synchronise = lambda self: self.store.pending.clear()
    dataset = _dataset(cfg)
    policy = None if policy_path is None else policies.load(policy_path, build_tables(cfg, dataset),
                                                            world_size=world_size, local_world_size=per_node)
    result = run(cfg, dataset, rank=rank, world_size=world_size, device=torch.device("cpu"), policy=policy)
    return result.losses, result.weights


def _train_all(rank: int, world_size: int, per_node: int, jobs: list):
    return [_train(rank, world_size, per_node, *job) for job in jobs]


def _train_shape(tmp: Path, nodes: int, per_node: int, batch_size: int) -> dict:
    """Every scenario without a policy and with tiers per tier-2 sync, then one with the sync
    skipped, in one set of spawned gloo ranks: {(scenario, sync or None): per-rank (losses, weights)}."""
    keys, jobs = [], []
    for name in SCENARIOS:
        cfg = _config(name, batch_size)
        rows = tier_rows(cfg)
        keys.append((name, None))
        jobs.append((cfg, None, False))
        for sync in REPLICATION_SYNCS:
            keys.append((name, sync))
            jobs.append((cfg, write_tiers(tmp / name / sync / "policy.json", cfg, nodes, per_node, sync, rows), False))
    name = SCENARIOS[0]  # last: the sync skipped (it patches NodeTier in the spawned ranks)
    keys.append((name, "skipped"))
    jobs.append((_config(name, batch_size), tmp / name / REPLICATION_SYNCS[0] / "policy.json", True))
    per_rank = run_ranks(nodes * per_node, _train_all, per_node, jobs)
    return {key: [per_rank[r][i] for r in range(nodes * per_node)] for i, key in enumerate(keys)}


@pytest.fixture(scope="module")
def two_by_two(tmp_path_factory) -> dict:
    return _train_shape(tmp_path_factory.mktemp("2x2"), 2, 2, 16)


@pytest.fixture(scope="module")
def two_by_one(tmp_path_factory) -> dict:
    return _train_shape(tmp_path_factory.mktemp("2x1"), 2, 1, 32)


@pytest.mark.slow
@pytest.mark.parametrize("sync", REPLICATION_SYNCS)
@pytest.mark.parametrize("name", SCENARIOS)
def test_2x2_tiers_change_nothing_computed(name: str, sync: str, two_by_two: dict) -> None:
    assert_same_training(two_by_two[(name, None)], two_by_two[(name, sync)], _config(name, 16))


@pytest.mark.slow
@pytest.mark.parametrize("sync", REPLICATION_SYNCS)
@pytest.mark.parametrize("name", SCENARIOS)
def test_2x1_tiers_change_nothing_computed(name: str, sync: str, two_by_one: dict) -> None:
    assert_same_training(two_by_one[(name, None)], two_by_one[(name, sync)], _config(name, 32))


@pytest.mark.slow
@pytest.mark.parametrize("shape", ["two_by_two", "two_by_one"])
def test_without_the_tier2_sync_the_copies_drift(shape: str, request) -> None:
    runs = request.getfixturevalue(shape)
    name = SCENARIOS[0]
    with pytest.raises(AssertionError):
        assert_same_training(runs[(name, None)], runs[(name, "skipped")], _config(name, 16))


@pytest.mark.parametrize("name", SCENARIOS)
def test_the_tiers_are_not_vacuous(name: str) -> None:
    """Pooled bags of the first steps mix tiers (1 and 2, 2 and 3, all three), sequence lookups hit
    each tier, and tier 2 holds rows of several owners."""
    cfg = _config(name, 16)
    dataset, rows = _dataset(cfg), tier_rows(cfg)
    tables = build_tables(cfg, dataset)
    batch = dataset.batch(0, cfg.steps * 64)
    seen = {"1+2": 0, "2+3": 0, "1+2+3": 0, "sequence tier 2": 0}
    offset = 0
    for t, spec in enumerate(tables):
        tiers = dict(rows.filter(pl.col("table_name") == spec.name).select("row", "tier").iter_rows())
        lengths = batch.lengths[t].tolist()
        for n in lengths:
            kinds = {tiers.get(int(v), 3) for v in batch.values[offset:offset + n].tolist()}
            offset += n
            if not spec.pooled:
                seen["sequence tier 2"] += 2 in kinds
            elif kinds >= {1, 2, 3}:
                seen["1+2+3"] += 1
            elif kinds == {1, 2}:
                seen["1+2"] += 1
            elif kinds == {2, 3}:
                seen["2+3"] += 1
    if not cfg.sequence_tables:
        del seen["sequence tier 2"]
    assert min(seen.values()) > 0, seen


@pytest.mark.slow
def test_tier2_rows_moved(two_by_two: dict) -> None:
    name = SCENARIOS[0]
    cfg = _config(name, 16)
    rows = tier_rows(cfg).filter(pl.col("tier") == 2)
    tables = build_tables(cfg, _dataset(cfg))
    assert rows_moved(tables, rows, two_by_two[(name, REPLICATION_SYNCS[0])], cfg.seed) > 0, \
        "training must have updated tier-2 rows"


# bytes on an emulated cluster --------------------------------------------------------------------

@needs_cluster
@pytest.mark.slow
@pytest.mark.parametrize("shape", ["2x2", "2x1"])
def test_the_tiers_move_the_bytes_analyze_predicted(shape: str, tmp_path: Path) -> None:
    """`optimize --cluster` records a baseline on the cluster, analyze derives tiers (least bytes
    between nodes within a budget), the trainer re-runs them there: the exchange's bytes (all, within
    nodes, between nodes) and the syncs' bytes are what the section predicted, exactly."""
    out = tmp_path / "opt"
    train = [sys.executable, "train.py", *TINY_TRAINER, "--sequence-tables", "1", "--pooling", "3", "--steps", "6",
             "--eval-fraction", "0.02"]
    r = subprocess.run([sys.executable, "-m", "tracekit", "optimize", "-o", str(out), "--cluster", shape,
                        "--link", "200mbit", "--policies", "tiers", "--budget", "3%", "--objective", "bytes",
                        "--check-all", "--json",
                        "--", *train], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    predicted = json.loads((out / "base" / "policy.json").read_text())["tiers"]["predicted"]
    assert predicted["tier2_rows"] > 0, predicted
    rows = {row["figure"]: row for row in json.loads(r.stdout.strip().splitlines()[-1])["rows"]
            if row["section"] == "tiers"}
    for figure in ("a2a_bytes_per_step", "a2a_remote_bytes_per_step", "intra_bytes_per_step",
                   "inter_bytes_per_step", "sync_bytes_per_step"):
        assert rows[figure]["measured"] == pytest.approx(rows[figure]["predicted"], rel=1e-9), (figure, rows[figure])
    assert rows["inter_bytes_per_step"]["measured"] < predicted["baseline_inter_bytes_per_step"]

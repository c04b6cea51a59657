"""The gold test of the sharded trainer: world 2 computes exactly what world 1 computes.

For a fixed seed, step s consumes the same global batch at any world size, so per-step
losses, the updated tables and the dense weights must agree within float tolerance, for
table-wise and row-wise sharding, pooled and sequence features, SGD and row-wise Adagrad,
with fixed-length bags (synthetic) and variable-length ones (Criteo, missing = empty bag).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.multiprocess import run_ranks
from tests.prerequisites import missing
from tracekit.dlrm.config import TrainConfig
from tracekit.dlrm.data import open_dataset
from tracekit.dlrm.sharding import ShardingPlan
from tracekit.dlrm.tables import TableSpec, init_shard
from tracekit.dlrm.train import run

CRITEO = Path(__file__).resolve().parents[2] / "shared" / "data" / "criteo-sample" / "criteo_dac_train_first10k.txt.gz"

# Adagrad divides by sqrt of small accumulators, so weights get a looser atol than losses.
SMALL = dict(dim=8, dense=13, bottom_mlp=[16, 8], top_mlp=[16, 1], steps=6, log_every=1000, lr=0.05,
             eval_fraction=0.05, samples=4096, rows=[997], tables=5, pooling=3, zipf=[1.1])
SCENARIOS = {
    "table-sgd-pooled": dict(sharding="table", optimizer="sgd"),
    "table-adagrad-sequence": dict(sharding="table", optimizer="adagrad", sequence_tables=2),
    "row-sgd-sequence": dict(sharding="row", optimizer="sgd", sequence_tables=2),
    "row-adagrad-pooled": dict(sharding="row", optimizer="adagrad"),
    # 129 training samples: steps of 64, 64 and 1, so at world 2 rank 1's last batch is empty
    "ragged-tail": dict(sharding="row", optimizer="adagrad", sequence_tables=2, samples=135, epochs=1),
    "criteo-table-sequence": dict(sharding="table", optimizer="adagrad", sequence_tables=3,
                                  data=f"criteo:{CRITEO}", rows=[50_000], tables=26, eval_fraction=0.02),
    "criteo-row-pooled": dict(sharding="row", optimizer="sgd", data=f"criteo:{CRITEO}", rows=[50_000],
                              tables=26, eval_fraction=0.02),
}


def _train(rank: int, world_size: int, cfg: TrainConfig):
    torch.set_num_threads(1)
    dataset = open_dataset(cfg.data, tables=cfg.tables, rows=cfg.rows_for_data(), num_dense=cfg.dense, pooling=cfg.pooling,
                           samples=cfg.samples, seed=cfg.seed, zipf=cfg.zipf[0], drift=0.0, preset=None, scale=1.0)
    result = run(cfg, dataset, rank=rank, world_size=world_size, device=torch.device("cpu"))
    return result.losses, result.weights, result.eval_auc


def _train_all(rank: int, world_size: int, configs: list[TrainConfig]):
    return [_train(rank, world_size, cfg) for cfg in configs]


def _config(name: str, batch_size: int) -> TrainConfig:
    return TrainConfig(batch_size=batch_size, **{**SMALL, **SCENARIOS[name]})


@pytest.fixture(scope="module")
def world2() -> dict:
    """Every scenario at world 2, batch 32 per rank, in one pair of spawned gloo ranks."""
    names = [n for n in SCENARIOS if "criteo" not in n or CRITEO.exists()]
    per_rank = run_ranks(2, _train_all, [_config(n, 32) for n in names])
    return {name: [per_rank[r][i] for r in range(2)] for i, name in enumerate(names)}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SCENARIOS))
def test_world2_matches_world1(name: str, world2: dict) -> None:
    if "criteo" in name and not CRITEO.exists():
        missing(f"{CRITEO} is absent")
    losses1, weights1, auc1 = _train(0, 1, _config(name, 64))
    ranks = world2[name]
    losses2 = ranks[0][0]
    assert losses2 == ranks[1][0], "every rank reports the same global losses"
    torch.testing.assert_close(torch.tensor(losses2), torch.tensor(losses1), rtol=1e-5, atol=1e-6)
    assert ranks[0][2] == pytest.approx(auc1, abs=1e-4)

    cfg = _config(name, 64)
    changed = 0
    for table, (start1, full) in weights1["tables"].items():
        assert start1 == 0
        rebuilt = torch.full_like(full, float("nan"))
        for _, weights2, _ in ranks:
            if table in weights2["tables"]:
                start, shard = weights2["tables"][table]
                rebuilt[start:start + shard.shape[0]] = shard
        torch.testing.assert_close(rebuilt, full, rtol=1e-4, atol=1e-5, msg=lambda m: f"table {table}: {m}")
        initial = init_shard(TableSpec(table, full.shape[0], cfg.dim), list(weights1["tables"]).index(table),
                              0, full.shape[0], cfg.seed)
        changed += int((full != initial).any(dim=1).sum())
    assert changed > 0, "training must have updated some rows"
    for rank_weights in (ranks[0][1], ranks[1][1]):
        for key, value in weights1["dense"].items():
            torch.testing.assert_close(rank_weights["dense"][key], value, rtol=1e-4, atol=1e-5, msg=lambda m: f"{key}: {m}")


def test_plan_balances_tables_and_covers_rows() -> None:
    tables = [TableSpec(f"t{i}", rows, 4) for i, rows in enumerate([10, 1000, 500, 600, 7])]
    plan = ShardingPlan.build(tables, 2, "table")
    assert plan.owners == (0, 0, 1, 1, 0)  # largest first: 1000 | 600, 500 | 10, 7 to the lighter rank
    row = ShardingPlan.build(tables, 3, "row")
    for t, spec in enumerate(tables):
        ranges = [row.row_range(t, r) for r in range(3)]
        assert ranges[0][0] == 0 and ranges[-1][1] == spec.rows
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))

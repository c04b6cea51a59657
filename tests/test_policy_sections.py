"""The tiers and FAE schedule sections as the reference trainer applies them.

- tiers on one node (LOCAL_WORLD_SIZE = WORLD_SIZE): tier 1 replicated, tier 2 the recorded sharding;
  the run equals the replication run of the tier-1 rows bit for bit, and the baseline within float
  tolerance;
- FAE: every training sample once per epoch, hot batches holding only all-hot samples, hot and cold
  batches interleaved evenly.
"""

from __future__ import annotations

from pathlib import Path

import polars as pl
import torch

from tests.multiprocess import run_ranks
from tests.test_replication import _config, _dataset, _train_all, hot_rows, write_replication
from tracekit.dlrm.schedule import FaeSchedule, hot_samples, make_schedule
from tracekit.dlrm.train import build_tables
from tracekit.policy import new_policy, write_policy


def write_tiers(path: Path, cfg, world_size: int, tier1: pl.DataFrame, tier2: pl.DataFrame) -> Path:
    tables = build_tables(cfg, _dataset(cfg))
    policy = new_policy(source_run="tests/test_policy_sections.py", model={
        "tables": [{"name": t.name, "num_rows": t.rows, "dim": t.dim} for t in tables], "world_size": world_size})
    rows = pl.concat([tier1.with_columns(pl.lit(1, pl.Int8).alias("tier")),
                      tier2.with_columns(pl.lit(2, pl.Int8).alias("tier"))])
    policy["tiers"] = {"topology": {"nodes": 1, "ranks_per_node": world_size}, "rows": "policy/tiers.parquet",
                       "tier1_sync": "sparse_allreduce", "predicted": {}, "why": "one node"}
    return write_policy(path, policy, rows={"tiers": rows})


def test_tiers_on_one_node_are_replication_of_tier_one(tmp_path: Path) -> None:
    cfg = _config("table-sgd-pooled", 32)
    rows = hot_rows(cfg)
    tier1, tier2 = rows[: rows.height // 2], rows[rows.height // 2:]
    jobs = [(cfg, None),
            (cfg, write_replication(tmp_path / "rep" / "policy.json", cfg, 2, "sparse_allreduce", tier1)),
            (cfg, write_tiers(tmp_path / "tiers" / "policy.json", cfg, 2, tier1, tier2))]
    per_rank = run_ranks(2, _train_all, jobs)
    for rank in range(2):
        (base_losses, base_weights), (rep_losses, rep_weights), (tier_losses, tier_weights) = per_rank[rank]
        assert tier_losses == rep_losses
        torch.testing.assert_close(torch.tensor(tier_losses), torch.tensor(base_losses), rtol=1e-5, atol=1e-6)
        for name, (start, weight) in tier_weights["tables"].items():
            assert torch.equal(weight, rep_weights["tables"][name][1])
            torch.testing.assert_close(weight, base_weights["tables"][name][1], rtol=1e-5, atol=1e-6)


def test_fae_batches_every_sample_once_with_hot_batches_all_hot() -> None:
    cfg = _config("table-sgd-pooled", 32)
    dataset = _dataset(cfg)
    rows = hot_rows(cfg)
    hot = [torch.tensor(sorted(rows.filter(pl.col("table_name") == name)["row"].to_list()), dtype=torch.int64)
           for name in dataset.table_names]
    cfg.steps = None
    schedule = make_schedule(cfg, dataset, 2, hot)
    assert isinstance(schedule, FaeSchedule)
    is_hot = hot_samples(dataset, schedule.num_train, hot)
    assert 0 < int(is_hot.sum()) < schedule.num_train
    seen = torch.cat([schedule.samples(step) for step in range(schedule.per_epoch)])
    assert torch.equal(torch.sort(seen)[0], torch.arange(schedule.num_train))
    kinds = [schedule.kind(step) for step in range(schedule.per_epoch)]
    assert kinds.count("hot") == schedule.hot_batches
    for step, kind in enumerate(kinds):
        samples = is_hot[schedule.samples(step)]
        assert bool(samples.all()) if kind == "hot" else not bool(samples.any())
        if kind == "hot":  # so the batch's every id is a hot row
            batch = dataset.take(schedule.samples(step))
            offset = 0
            for t, n in enumerate(batch.lengths.sum(dim=1).tolist()):
                assert bool(torch.isin(batch.values[offset:offset + n], hot[t]).all())
                offset += n
    # interleaved evenly: the k-th hot batch falls where k/n_hot of the epoch has passed
    positions = [step for step, kind in enumerate(kinds) if kind == "hot"]
    for k, step in enumerate(positions):
        assert abs(step / schedule.per_epoch - k / len(positions)) <= 1 / len(positions) + 1 / schedule.per_epoch

"""Which embedding modules of different ranks are one table in the trace (collectors/embedding.py):
a shard tagged with `tracekit.shard` joins its table, a data-parallel replica joins its copies, and
a rank's own untagged module stays its own even when another rank's has the same path."""

from __future__ import annotations

import json
from pathlib import Path

import polars as pl
import pytest

from tests.recorded import record_gloo
from tracekit.run import open_run

# The shape of a widely used open-source DLRM script: model-parallel tables in a rank-local
# ModuleList whose sizes are numpy integers, beside a replicated table under DDP and a tagged shard.
IMPORTS = "numpy as np, torch, torch.distributed as dist, tracekit"
SCRIPT = """\
sizes = [np.int64(10_000)] if rank == 0 else [np.int64(5_000)]


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb_l = torch.nn.ModuleList([torch.nn.EmbeddingBag(n, 4, mode="sum") for n in sizes])


net = Net()
emb_l = net.emb_l


class Replicated(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.EmbeddingBag(300, 4, mode="sum")
        self.head = torch.nn.Linear(4, 1)

    def forward(self, ids):
        return self.head(self.emb(ids.view(1, -1)))


dp = DistributedDataParallel(Replicated())
shard = tracekit.shard(torch.nn.EmbeddingBag(100, 4, mode="sum"), table="big", first_row=rank * 100, num_rows=200)
opt = torch.optim.SGD([*emb_l.parameters(), *dp.parameters(), *shard.parameters()], lr=0.1)
for step in range(2):
    loss = emb_l[0](torch.tensor([[rank, 4_999]])).sum() + dp(torch.tensor([7, rank])).sum()
    loss = loss + shard(torch.tensor([[3]])).sum()
    loss.backward()
    opt.step()
    opt.zero_grad()
"""


@pytest.mark.slow
def test_rank_local_tables_stay_apart_and_replicas_and_shards_merge(tmp_path: Path) -> None:
    run_dir = record_gloo(tmp_path, "dlrm_like.py", SCRIPT, imports=IMPORTS)
    manifest = json.loads((run_dir / "manifest.json").read_text())
    tables = {t["name"]: (t["num_rows"], t["placement"], t["shards"]) for t in manifest["tables"]}
    assert tables == {
        "emb_l.0@rank0": (10_000, "local", [{"rank": 0, "first_row": 0, "num_rows": 10_000}]),
        "emb_l.0@rank1": (5_000, "local", [{"rank": 1, "first_row": 0, "num_rows": 5_000}]),
        "emb": (300, "replicated", [{"rank": r, "first_row": 0, "num_rows": 300} for r in (0, 1)]),
        "big": (200, "sharded", [{"rank": r, "first_row": r * 100, "num_rows": 100} for r in (0, 1)]),
    }
    assert manifest["ranks"] == [0, 1] and manifest["steps"] == {"0": 2, "1": 2}
    accesses = open_run(run_dir).scan("accesses").group_by("table_name", "rank", "row").agg(
        pl.col("count").sum()).collect()
    got = sorted(accesses.rows())
    assert got == sorted([("emb_l.0@rank0", 0, 0, 2), ("emb_l.0@rank0", 0, 4_999, 2),
                          ("emb_l.0@rank1", 1, 1, 2), ("emb_l.0@rank1", 1, 4_999, 2),
                          ("emb", 0, 7, 2), ("emb", 0, 0, 2), ("emb", 1, 7, 2), ("emb", 1, 1, 2),
                          ("big", 0, 3, 2), ("big", 1, 103, 2)])

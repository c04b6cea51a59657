"""A TorchRec DLRM that knows nothing of tracekit: what tests/test_torchrec_record.py records.

    torchrun --standalone --nproc-per-node 2 tests/torchrec_job.py --sharding column_wise --out DIR

Three tables of ROWS rows and dim DIM; `t0` is looked up by two features
(f0, f1), t1 and t2 by one each. Every table is sharded as `--sharding` says, by a plan built with
TorchRec's own helpers (`construct_module_sharding_plan`; the planner for table_column_wise), then
DistributedModelParallel, SGD fused into the backward of the tables, and CombinedOptimizer over it
and the dense SGD. `--sharding none` keeps the plain collection (on the CPU, one SGD). The model is
TorchRec's DLRM over an EmbeddingBagCollection, or with `--kind sequence` an EmbeddingCollection
(unpooled lookups) under a linear head.

It trains STEPS iterations, each on a batch that rank r draws from a generator seeded with
(step, r), and after iteration EVAL_AFTER runs one forward in eval mode under no_grad on batch
"eval". Each rank writes what it fed to `--out`/rank=R.json: {batch: {feature: {"lengths", "values"}}},
and its training losses to `--out`/losses-rank=R.json.
"""

import argparse
import gc
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.optim import _apply_optimizer_in_backward
from torch import nn
from torchrec import (EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingCollection, EmbeddingConfig,
                      KeyedJaggedTensor)
from torchrec.distributed import DistributedModelParallel
from torchrec.distributed.embedding import EmbeddingCollectionSharder
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
from torchrec.distributed.sharding_plan import (column_wise, construct_module_sharding_plan, data_parallel,
                                                row_wise, table_row_wise, table_wise)
from torchrec.distributed.types import ShardingPlan, ShardingType
from torchrec.models.dlrm import DLRM, DLRMTrain
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter
from torchrec.datasets.utils import Batch

ROWS, DIM, DENSE, BATCH, STEPS, EVAL_AFTER, MAX_POOLING = 200, 16, 4, 8, 4, 1, 3
TABLES = {"t0": ["f0", "f1"], "t1": ["f2"], "t2": ["f3"]}
FEATURES = [f for features in TABLES.values() for f in features]


def plan_for(sharding: str, world_size: int):
    """One sharding type for every table: {table: ParameterShardingGenerator}."""
    if sharding == "table_wise":
        return {t: table_wise(rank=i % world_size) for i, t in enumerate(TABLES)}
    if sharding == "column_wise":  # two column shards per table, on ranks 1 then 0: column 0 on rank 1
        return {t: column_wise(ranks=[1 % world_size, 0]) for t in TABLES}
    if sharding == "row_wise":
        return {t: row_wise() for t in TABLES}
    if sharding == "table_row_wise":  # rows across the ranks of host 0
        return {t: table_row_wise(host_index=0) for t in TABLES}
    if sharding == "data_parallel":
        return {t: data_parallel() for t in TABLES}
    raise SystemExit(f"unknown --sharding {sharding}")


def planned(model: torch.nn.Module, sharder, sharding_type: str, world_size: int) -> ShardingPlan:
    """The planner's plan with every table constrained to `sharding_type`, the fused kernel, and
    column shards of DIM / 2 columns."""
    constraints = {t: ParameterConstraints(sharding_types=[sharding_type], min_partition=DIM // 2,
                                           compute_kernels=[EmbeddingComputeKernel.FUSED.value]) for t in TABLES}
    planner = EmbeddingShardingPlanner(topology=Topology(world_size=world_size, compute_device="cpu"),
                                       batch_size=BATCH, constraints=constraints)
    return planner.collective_plan(model, [sharder], dist.GroupMember.WORLD)


class SequenceModel(nn.Module):
    """The sequence variant: an EmbeddingCollection (unpooled lookups) and a linear head on every
    looked-up vector; returns (loss, None) as DLRMTrain returns (loss, outputs)."""

    def __init__(self, ec: EmbeddingCollection) -> None:
        super().__init__()
        self.ec = ec
        self.head = nn.Linear(DIM, 1)

    def forward(self, batch: Batch) -> tuple[torch.Tensor, None]:
        vectors = torch.cat([jt.values() for jt in self.ec(batch.sparse_features).values()])
        return self.head(vectors).pow(2).mean(), None


def build_model(kind: str, device: torch.device) -> tuple[nn.Module, nn.Module, str]:
    """(model, its embedding collection, the collection's path in the model) of `kind`."""
    if kind == "sequence":
        ec = EmbeddingCollection(tables=[EmbeddingConfig(name=t, embedding_dim=DIM, num_embeddings=ROWS,
                                                         feature_names=fs) for t, fs in TABLES.items()], device=device)
        return SequenceModel(ec), ec, "ec"
    ebc = EmbeddingBagCollection(tables=[EmbeddingBagConfig(name=t, embedding_dim=DIM, num_embeddings=ROWS,
                                                            feature_names=fs) for t, fs in TABLES.items()],
                                 device=device)
    model = DLRMTrain(DLRM(embedding_bag_collection=ebc, dense_in_features=DENSE, dense_arch_layer_sizes=[8, DIM],
                           over_arch_layer_sizes=[8, 1], dense_device=torch.device("cpu")))
    return model, ebc, "model.sparse_arch.embedding_bag_collection"


def shard(model: nn.Module, tables: nn.Module, path: str, sharding: str, world_size: int):
    """(the model to train, its optimizer): DistributedModelParallel with CombinedOptimizer over the
    fused table SGD and the dense SGD, or for "none" the model itself with one SGD."""
    if sharding == "none":
        return model, torch.optim.SGD(model.parameters(), lr=0.01)
    sharder = EmbeddingCollectionSharder() if isinstance(tables, EmbeddingCollection) else EmbeddingBagCollectionSharder()
    if sharding == "table_column_wise":  # no helper builds it: the planner, constrained
        plan = planned(model, sharder, ShardingType.TABLE_COLUMN_WISE.value, world_size)
    else:
        module_plan = construct_module_sharding_plan(tables, plan_for(sharding, world_size), sharder=sharder,
                                                     local_size=world_size, world_size=world_size, device_type="cpu")
        plan = ShardingPlan({path: module_plan})
    dmp = DistributedModelParallel(model, device=torch.device("cpu"), plan=plan, sharders=[sharder])
    dense = dict(in_backward_optimizer_filter(dmp.named_parameters()))
    return dmp, CombinedOptimizer([dmp.fused_optimizer,
                                   KeyedOptimizerWrapper(dense, lambda ps: torch.optim.SGD(ps, lr=0.01))])


def batch(seed: tuple[int, int]) -> tuple[Batch, dict]:
    """A batch of BATCH samples from a generator seeded by `seed`, and what it holds per feature."""
    g = torch.Generator().manual_seed(seed[0] * 1000 + seed[1])
    lengths = torch.randint(0, MAX_POOLING + 1, (len(FEATURES), BATCH), generator=g)
    values = torch.randint(0, ROWS, (int(lengths.sum()),), generator=g)
    kjt = KeyedJaggedTensor.from_lengths_sync(keys=FEATURES, values=values, lengths=lengths.reshape(-1))
    fed, start = {}, 0
    for f, name in enumerate(FEATURES):
        n = int(lengths[f].sum())
        fed[name] = {"lengths": lengths[f].tolist(), "values": values[start:start + n].tolist()}
        start += n
    dense = torch.rand((BATCH, DENSE), generator=g)
    labels = torch.randint(0, 2, (BATCH,), generator=g).float()
    return Batch(dense_features=dense, sparse_features=kjt, labels=labels), fed


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--sharding", default="table_wise")
    p.add_argument("--kind", choices=["pooled", "sequence"], default="pooled")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()

    # init distributed
    dist.init_process_group(backend="gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = optimizer = None
    try:
        # build model (meta-device tables unless left unsharded), fuse the tables' SGD into backward
        torch.manual_seed(0)
        model, tables, path = build_model(args.kind, torch.device("cpu" if args.sharding == "none" else "meta"))
        if args.sharding != "none":
            _apply_optimizer_in_backward(torch.optim.SGD, tables.parameters(), {"lr": 0.01})

        # shard the tables (DMP puts the dense part into DDP)
        model, optimizer = shard(model, tables, path, args.sharding, world_size)

        # train, with one eval forward after EVAL_AFTER
        fed, losses = {}, []
        for step in range(STEPS):
            b, fed[str(step)] = batch((step, rank))
            optimizer.zero_grad()
            loss, _ = model(b)
            losses.append(loss.item())
            loss.backward()
            optimizer.step()
            if step == EVAL_AFTER:
                b, fed["eval"] = batch((1000, rank))
                model.eval()
                with torch.no_grad():
                    model(b)
                model.train()

        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"rank={rank}.json").write_text(json.dumps(fed))
        (args.out / f"losses-rank={rank}.json").write_text(json.dumps(losses))
    finally:
        # DDP (inside DMP) gone and a barrier, before destroying the group: each avoids the intermittent
        # SIGABRT at exit after DDP (research/env.md); the barrier alone still aborted once in a test suite
        del model, optimizer
        gc.collect()
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()

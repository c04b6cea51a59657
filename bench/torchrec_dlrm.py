"""TorchRec DLRM training throughput: the peer baseline for tracekit's reference trainer.

Runs TorchRec's own DLRM (``DLRMTrain(DLRM(...))``) with table-wise sharded, FBGEMM-fused
embedding tables on CPU/gloo, times a fixed number of training steps, and reports global
samples/s. The model and data shape match ``train.py`` so that ``bench/vs_torchrec.py`` can
compare the two; shared/research/env.md section 4 has the recipe and earlier numbers.

Needs the separate venv (``bash bench/setup_torchrec_venv.sh``). Run from the repo root:

    bench/.venv-torchrec/bin/torchrun --standalone --nproc-per-node 2 \\
        bench/torchrec_dlrm.py --pooling 1 --json

Setup, in order:
  - EmbeddingBagCollection built on the meta device (DMP materialises only the local shards);
  - embedding optimizer: SGD fused into backward (FBGEMM TBE updates rows in place);
  - EmbeddingShardingPlanner on a CPU Topology, constrained to table_wise + fused kernel,
    planned on rank 0 and broadcast (collective_plan);
  - DistributedModelParallel (the dense MLPs go into DDP), and
    CombinedOptimizer([fused embedding optimizer, SGD on the dense parameters]).

Data: torchrec's RandomRecDataset with exactly ``--pooling`` uniform ids per bag
(min = max = pooling). It pre-generates a pool of 10 batches per rank (seed + rank) and cycles
them, so data generation is outside the timed loop.

Timing: ``--warmup`` untimed steps, a barrier, ``--steps`` timed steps, a barrier.
samples_per_s is global: world_size * batch_size * steps / elapsed; train_thread_cpu_ms is the CPU
time of rank 0's training thread a timed step.
With ``--json``, rank 0 prints one JSON line on stdout; logs go to stderr.
"""

import argparse
import gc
import os
import json
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.optim import _apply_optimizer_in_backward
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
from torchrec.datasets.random import RandomRecDataset
from torchrec.distributed import DistributedModelParallel
from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
from torchrec.distributed.types import ShardingPlan, ShardingType
from torchrec.models.dlrm import DLRM, DLRMTrain
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter

IMPL = "torchrec-1.8.0"
LR = 0.01  # SGD for tables and MLPs alike; the value does not change the step time
POOL_BATCHES = 10  # pre-generated batches per rank, cycled


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    def int_list(text: str) -> list[int]:
        return [int(x) for x in text.split(",")]

    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--tables", type=int, default=8, help="embedding tables, one feature each")
    p.add_argument("--rows", type=int, default=100_000, help="rows per table")
    p.add_argument("--dim", type=int, default=64, help="embedding dimension")
    p.add_argument("--dense", type=int, default=13, help="dense input features")
    p.add_argument("--bottom-mlp", type=int_list, default=[512, 256, 64],
                   help="bottom MLP layer sizes; the last must equal --dim")
    p.add_argument("--top-mlp", type=int_list, default=[512, 256, 1],
                   help="top MLP layer sizes; the last must be 1")
    p.add_argument("--batch-size", type=int, default=512, help="samples per rank per step")
    p.add_argument("--pooling", type=int, default=1, help="ids per bag (exact, not a maximum)")
    p.add_argument("--steps", type=int, default=50, help="timed steps")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps before timing")
    p.add_argument("--seed", type=int, default=0, help="model seed; rank r's data uses seed + r")
    p.add_argument("--json", action="store_true", help="rank 0 prints one JSON line on stdout")
    p.add_argument("--pin", action="store_true",
                   help="pin each rank to its own share of the cores (as tracekit's trainer does)")
    args = p.parse_args(argv)
    if args.bottom_mlp[-1] != args.dim:
        p.error(f"--bottom-mlp must end in --dim ({args.dim}), got {args.bottom_mlp}; "
                f"e.g. --bottom-mlp 512,256,{args.dim}")
    if args.top_mlp[-1] != 1:
        p.error(f"--top-mlp must end in 1 (one logit), got {args.top_mlp}; "
                "e.g. --top-mlp 512,256,1")
    if args.pooling < 1 or args.steps < 1 or args.warmup < 0:
        p.error(f"need --pooling >= 1, --steps >= 1, --warmup >= 0; got "
                f"{args.pooling}, {args.steps}, {args.warmup}")
    return args


def build_model(args: argparse.Namespace) -> DLRMTrain:
    """DLRM with its EmbeddingBagCollection on the meta device, tables' SGD fused into backward."""
    tables = [
        EmbeddingBagConfig(name=f"t{i}", embedding_dim=args.dim, num_embeddings=args.rows,
                           feature_names=[f"f{i}"])
        for i in range(args.tables)
    ]
    ebc = EmbeddingBagCollection(tables=tables, device=torch.device("meta"))
    model = DLRMTrain(DLRM(
        embedding_bag_collection=ebc,
        dense_in_features=args.dense,
        dense_arch_layer_sizes=args.bottom_mlp,
        over_arch_layer_sizes=args.top_mlp,
        dense_device=torch.device("cpu"),
    ))
    # PT-D's API; torchrec.optim.apply_optimizer_in_backward is a deprecated alias of it.
    _apply_optimizer_in_backward(torch.optim.SGD, ebc.parameters(), {"lr": LR})
    return model


def plan_table_wise(model: DLRMTrain, args: argparse.Namespace, world_size: int,
                    sharders: list) -> ShardingPlan:
    """Table-wise sharding with the fused kernel for every table, planned on rank 0."""
    constraints = {
        f"t{i}": ParameterConstraints(
            sharding_types=[ShardingType.TABLE_WISE.value],
            compute_kernels=[EmbeddingComputeKernel.FUSED.value],
            pooling_factors=[float(args.pooling)],
        )
        for i in range(args.tables)
    }
    planner = EmbeddingShardingPlanner(
        topology=Topology(world_size=world_size, compute_device="cpu"),
        batch_size=args.batch_size,
        constraints=constraints,
        debug=False,
    )
    return planner.collective_plan(model, sharders, dist.GroupMember.WORLD)


def tables_per_rank(plan: ShardingPlan) -> dict[int, list[str]]:
    """{rank: [table, ...]} from a table-wise plan, for the log line."""
    owners: dict[int, list[str]] = {}
    for module_plan in plan.plan.values():
        for table, param_sharding in module_plan.items():
            for rank in param_sharding.ranks or []:
                owners.setdefault(rank, []).append(table)
    return dict(sorted(owners.items()))


def run_steps(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batches, n: int) -> None:
    for _ in range(n):
        batch = next(batches)
        optimizer.zero_grad()
        loss, _ = model(batch)
        loss.backward()  # also applies the fused SGD to the embedding rows
        optimizer.step()


def pin_to_cores(local_rank: int, local_world_size: int) -> None:
    """The same rule as tracekit.dlrm.runtime.pin_to_cores (not imported: other venv)."""
    cores = sorted(os.sched_getaffinity(0))
    if 1 < local_world_size <= len(cores):
        share = len(cores) // local_world_size
        os.sched_setaffinity(0, set(cores[local_rank * share:(local_rank + 1) * share]))


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)

    if args.pin:
        pin_to_cores(int(os.environ.get("LOCAL_RANK", 0)), int(os.environ.get("LOCAL_WORLD_SIZE", 1)))

    # init distributed (gloo on CPU; torchrun provides rank and world size)
    dist.init_process_group(backend="gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    try:
        # build model (meta-device tables) and shard it
        torch.manual_seed(args.seed)
        model = build_model(args)
        sharders = [EmbeddingBagCollectionSharder()]
        plan = plan_table_wise(model, args, world_size, sharders)
        dmp = DistributedModelParallel(model, device=torch.device("cpu"), plan=plan,
                                       sharders=sharders)
        dense_params = dict(in_backward_optimizer_filter(dmp.named_parameters()))
        optimizer = CombinedOptimizer([
            dmp.fused_optimizer,
            KeyedOptimizerWrapper(dense_params, lambda ps: torch.optim.SGD(ps, lr=LR)),
        ])
        if rank == 0:
            print(f"[torchrec_dlrm] world {world_size}, tables per rank: {tables_per_rank(plan)}",
                  file=sys.stderr)

        # build data: a pool of pre-generated batches, exactly --pooling ids per bag
        dataset = RandomRecDataset(
            keys=[f"f{i}" for i in range(args.tables)],
            batch_size=args.batch_size,
            hash_size=args.rows,
            ids_per_feature=args.pooling,
            min_ids_per_feature=args.pooling,
            num_dense=args.dense,
            manual_seed=args.seed + rank,
            num_generated_batches=POOL_BATCHES,
        )
        batches = iter(dataset)

        # warm up, then time --steps steps between barriers
        dmp.train()
        run_steps(dmp, optimizer, batches, args.warmup)
        dist.barrier()
        t0, cpu0 = time.perf_counter(), time.thread_time()
        run_steps(dmp, optimizer, batches, args.steps)
        dist.barrier()
        elapsed, train_cpu = time.perf_counter() - t0, time.thread_time() - cpu0

        if rank == 0:
            report(args, world_size, elapsed, train_cpu)
        del dmp, optimizer
    finally:
        # DDP's reducer gone, and a barrier, before destroying the group: else it aborts at exit now
        # and then (env.md section 2, pitfall 1; the barrier alone still let 2 of 52 runs abort here)
        gc.collect()
        dist.barrier()
        dist.destroy_process_group()


def report(args: argparse.Namespace, world_size: int, elapsed: float, train_cpu: float) -> None:
    summary = {
        "impl": IMPL,
        "world_size": world_size,
        "batch_size_per_rank": args.batch_size,
        "pooling": args.pooling,
        "steps": args.steps,
        "samples_per_s": world_size * args.batch_size * args.steps / elapsed,
        "step_ms": 1000.0 * elapsed / args.steps,
        "train_thread_cpu_ms": 1000.0 * train_cpu / args.steps,  # rank 0's training thread, a step
        "threads": torch.get_num_threads(),
        "backend": dist.get_backend(),
    }
    if args.json:
        print(json.dumps(summary), flush=True)
    else:
        print(f"{IMPL}: {summary['samples_per_s']:,.0f} samples/s global, "
              f"{summary['step_ms']:.1f} ms/step (world {world_size}, gloo, batch "
              f"{args.batch_size}/rank, pooling {args.pooling}, {args.steps} steps, "
              f"{summary['threads']} threads/rank)")


if __name__ == "__main__":
    main()

"""A TorchRec DLRM job of one of three shapes, sharded by TorchRec's own planner with no constraints
(the plan a user gets by default): what `bench/torchrec_plans.py` records, re-runs with the plan
tracekit derives from its trace (`record --plan`), and compares. It knows nothing of tracekit.

Shapes (every table one feature; ids Zipf-distributed over the rows, exponent --zipf):

    wide        4 tables: 1M × 128, 200k × 64, 100k × 32, 50k × 32; one id a bag
    small-hot   16 tables of 500 × 32, 4 ids a bag, and 2 of 200k × 32, one id a bag
    long-bags   8 tables of 100k × 32, bags of 64, 32, 16, 8, 1, 1, 1, 1 ids
    criteo      real data: the Criteo sample (--criteo, 10k rows), its 26 categorical features hashed
                into 26 tables of 20k × 16, one id a bag; the first 9,000 rows train (rank r takes
                rows r, r + world, ...), the last 1,000 are held out: rank 0 prints eval_auc and
                eval_logloss over them after training (what a change of plan or of comms precision
                does to the model)

Needs the TorchRec venv (bash bench/setup_torchrec_venv.sh). From the repo root:

    bench/.venv-torchrec/bin/torchrun --standalone --nproc-per-node 2 bench/torchrec_shapes.py --shape wide

It pre-generates a pool of batches per rank (seed + rank; criteo: the rank's training rows), runs --warmup steps, then --steps steps
between barriers; rank 0 prints one JSON line (samples/s, step_ms, the plan) with --json.
"""

import argparse
import gc
import gzip
import json
import math
import sys
import time
import zlib
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.optim import _apply_optimizer_in_backward
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
from torchrec.datasets.utils import Batch
from torchrec.distributed import DistributedModelParallel
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter

SHAPES = {  # name -> [(rows, dim, ids a bag)]
    "wide": [(1_000_000, 128, 1), (200_000, 64, 1), (100_000, 32, 1), (50_000, 32, 1)],
    "small-hot": [(500, 32, 4)] * 16 + [(200_000, 32, 1)] * 2,
    "long-bags": [(100_000, 32, p) for p in (64, 32, 16, 8, 1, 1, 1, 1)],
    "criteo": [(20_000, 16, 1)] * 26,
}
DENSE, POOL = 13, 8
CRITEO = Path(__file__).resolve().parents[2] / "shared" / "data" / "criteo-sample" / "criteo_dac_train_first10k.txt.gz"
HELD_OUT = 1000  # the criteo shape's last rows, never trained on


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES), required=True)
    p.add_argument("--batch-size", type=int, default=512, help="samples per rank per step")
    p.add_argument("--zipf", type=float, default=1.05, help="Zipf exponent of the ids over each table's rows")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=0.01, help="SGD's learning rate, dense and sparse")
    p.add_argument("--criteo", type=Path, default=CRITEO, help="the criteo shape's data (Criteo's TSV, gzipped)")
    p.add_argument("--json", action="store_true")
    return p.parse_args()


def build(shape: list[tuple[int, int, int]]) -> tuple[torch.nn.Module, EmbeddingBagCollection]:
    """The model (OverArch) and its EmbeddingBagCollection, on the meta device."""
    tables = [EmbeddingBagConfig(name=f"t{i}", embedding_dim=dim, num_embeddings=rows, feature_names=[f"f{i}"])
              for i, (rows, dim, _) in enumerate(shape)]
    ebc = EmbeddingBagCollection(tables=tables, device=torch.device("meta"))
    return OverArch(ebc, sum(d for _, d, _ in shape), DENSE), ebc


class OverArch(torch.nn.Module):
    """The pooled embeddings, concatenated with the dense features' projection, through an MLP to a
    logit; BCE loss. (TorchRec's DLRM needs every table of one dim; these shapes have several.)"""

    def __init__(self, ebc: EmbeddingBagCollection, width: int, dense: int) -> None:
        super().__init__()
        self.ebc = ebc
        self.dense = torch.nn.Linear(dense, 64)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(width + 64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1))

    def forward(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        pooled = self.ebc(batch.sparse_features).values()
        logit = self.mlp(torch.cat([pooled, self.dense(batch.dense_features)], dim=1)).squeeze(1)
        return torch.nn.functional.binary_cross_entropy_with_logits(logit, batch.labels), logit.detach()


def zipf_ids(rows: int, n: int, exponent: float, g: torch.Generator) -> torch.Tensor:
    """n ids over [0, rows) with P(id = k) ∝ 1 / (k + 1)^exponent (the hot rows first)."""
    weights = 1.0 / torch.arange(1, rows + 1, dtype=torch.float64) ** exponent
    return torch.multinomial(weights, n, replacement=True, generator=g)


def batches(shape: list[tuple[int, int, int]], args: argparse.Namespace, rank: int) -> list[Batch]:
    g = torch.Generator().manual_seed(args.seed * 1000 + rank)
    out = []
    for _ in range(POOL):
        lengths, values = [], []
        for rows, _, pooling in shape:
            lengths.append(torch.full((args.batch_size,), pooling, dtype=torch.int64))
            values.append(zipf_ids(rows, args.batch_size * pooling, args.zipf, g))
        kjt = KeyedJaggedTensor.from_lengths_sync(keys=[f"f{i}" for i in range(len(shape))],
                                                  values=torch.cat(values), lengths=torch.cat(lengths))
        out.append(Batch(dense_features=torch.rand((args.batch_size, DENSE), generator=g), sparse_features=kjt,
                         labels=torch.randint(0, 2, (args.batch_size,), generator=g).float()))
    return out


def criteo_rows(path: Path) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Labels, dense features (log(1 + x), missing and negative as 0) and ids (each categorical
    value's CRC-32 modulo its table's rows, missing as row 0) of every row of Criteo's TSV."""
    if not path.is_file():
        raise SystemExit(f"--criteo {path}: no such file (the Criteo sample lives in ../shared/data)")
    labels, dense, ids = [], [], []
    rows = SHAPES["criteo"][0][0]
    with gzip.open(path, "rt") as f:
        for line in f:
            fields = line.rstrip("\n").split("\t")
            labels.append(float(fields[0]))
            dense.append([math.log1p(max(int(x), 0)) if x else 0.0 for x in fields[1:14]])
            ids.append([zlib.crc32(x.encode()) % rows if x else 0 for x in fields[14:40]])
    return torch.tensor(labels), torch.tensor(dense), torch.tensor(ids, dtype=torch.int64)


def criteo_batches(args: argparse.Namespace, rows: slice, rank: int, world_size: int, size: int) -> list[Batch]:
    """The rank's share (every world_size-th row from `rank`) of `rows`, in whole batches of `size`."""
    labels, dense, ids = (t[rows][rank::world_size] for t in criteo_rows(args.criteo))
    keys = [f"f{i}" for i in range(ids.shape[1])]
    out = []
    for i in range(0, len(labels) - size + 1, size):
        part = slice(i, i + size)
        kjt = KeyedJaggedTensor.from_lengths_sync(keys=keys, values=ids[part].t().reshape(-1),
                                                  lengths=torch.ones(len(keys) * size, dtype=torch.int64))
        out.append(Batch(dense_features=dense[part], sparse_features=kjt, labels=labels[part]))
    return out


def auc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """The area under the ROC curve: the chance a positive outranks a negative (ties count half)."""
    ranks = torch.empty(len(scores), dtype=torch.float64)
    order = scores.argsort()
    ranks[order] = torch.arange(1, len(scores) + 1, dtype=torch.float64)
    for value in scores.unique():  # ties share their mean rank
        tied = scores == value
        if tied.sum() > 1:
            ranks[tied] = ranks[tied].mean()
    positives = labels.bool()
    n_pos, n_neg = int(positives.sum()), int((~positives).sum())
    return float((ranks[positives].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def evaluate(dmp: torch.nn.Module, held_out: list[Batch], world_size: int) -> dict:
    """eval_auc and eval_logloss over every rank's held-out batches (gathered on every rank)."""
    dmp.eval()
    with torch.no_grad():
        logits = torch.cat([dmp(batch)[1] for batch in held_out])
    labels = torch.cat([batch.labels for batch in held_out])
    gathered = [torch.empty_like(logits) for _ in range(world_size)], [torch.empty_like(labels) for _ in range(world_size)]
    dist.all_gather(gathered[0], logits)
    dist.all_gather(gathered[1], labels)
    logits, labels = torch.cat(gathered[0]), torch.cat(gathered[1])
    loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, labels)
    return {"eval_auc": auc(logits, labels), "eval_logloss": float(loss), "eval_rows": len(labels)}


def train(args: argparse.Namespace, rank: int, world_size: int) -> dict:
    """Shard the model with TorchRec's planner, time --steps steps; what rank 0 prints."""
    shape = SHAPES[args.shape]
    torch.manual_seed(args.seed)
    model, ebc = build(shape)
    _apply_optimizer_in_backward(torch.optim.SGD, ebc.parameters(), {"lr": args.lr})
    sharders = [EmbeddingBagCollectionSharder()]
    planner = EmbeddingShardingPlanner(topology=Topology(world_size=world_size, compute_device="cpu"),
                                       batch_size=args.batch_size)
    plan = planner.collective_plan(model, sharders, dist.GroupMember.WORLD)
    dmp = DistributedModelParallel(model, device=torch.device("cpu"), plan=plan, sharders=sharders)
    dense = dict(in_backward_optimizer_filter(dmp.named_parameters()))
    optimizer = CombinedOptimizer([dmp.fused_optimizer,
                                   KeyedOptimizerWrapper(dense, lambda ps: torch.optim.SGD(ps, lr=args.lr))])
    if args.shape == "criteo":
        pool = criteo_batches(args, slice(0, -HELD_OUT), rank, world_size, args.batch_size)
        held_out = criteo_batches(args, slice(-HELD_OUT, None), rank, world_size, 100)
    else:
        pool = batches(shape, args, rank)

    def run(n: int, first: int) -> None:
        for i in range(first, first + n):
            optimizer.zero_grad()
            loss, _ = dmp(pool[i % len(pool)])
            loss.backward()
            optimizer.step()

    dmp.train()
    run(args.warmup, 0)
    dist.barrier()
    t0 = time.perf_counter()
    run(args.steps, args.warmup)
    dist.barrier()
    elapsed = time.perf_counter() - t0
    quality = evaluate(dmp, held_out, world_size) if args.shape == "criteo" else {}
    return {**quality, "shape": args.shape, "world_size": world_size, "batch_size_per_rank": args.batch_size,
            "steps": args.steps, "samples_per_s": world_size * args.batch_size * args.steps / elapsed,
            "step_ms": 1000 * elapsed / args.steps,
            "plan": {t: [p.sharding_type, p.ranks] for m in dmp.plan.plan.values() for t, p in m.items()}}


def main() -> None:
    args = parse_args()
    dist.init_process_group(backend="gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    try:
        summary = train(args, rank, world_size)
        if rank == 0:
            print(json.dumps(summary) if args.json else summary, flush=True)
    finally:
        gc.collect()  # DDP's reducer gone, and a barrier, before destroying the group (env.md §2)
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())

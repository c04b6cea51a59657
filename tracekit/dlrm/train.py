"""The training loop of the reference DLRM: hybrid parallel, deterministic, honest timing.

    python train.py --steps 200                                  # one process
    torchrun --standalone --nproc-per-node 2 train.py --steps 200  # two ranks (gloo on CPU)
    torchrun ... train.py --policy runs/base/policy.json           # its recommended sections applied

Step s consumes global samples [s*B, (s+1)*B) of the training split (B = batch per rank x
world size); rank r takes its contiguous slice. So a run at world 1 with batch 1024 and one at
world 2 with batch 512 see the same samples in the same steps, and give the same losses.

With `--policy FILE`, rank 0 prints which sections apply and one line for each section skipped
(tracekit/dlrm/policies.py); the manifest, when traced, names both.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel

import tracekit
from tracekit.dlrm import config as config_mod
from tracekit.dlrm import inference
from tracekit.dlrm import policies
from tracekit.dlrm.compression import DctDpState, dct_dp_hook
from tracekit.dlrm.config import TrainConfig
from tracekit.dlrm.data import Dataset, open_dataset
from tracekit.dlrm.metrics import log_loss, roc_auc
from tracekit.dlrm.model import DenseArch
from tracekit.dlrm.optim import dense_optimizer, sparse_optimizer
from tracekit.dlrm.output_codec import OutputCodec
from tracekit.dlrm.policies import AppliedPolicy
from tracekit.dlrm.node_tier import NodeTier, node_groups
from tracekit.dlrm.replicas import Replicas
from tracekit.dlrm.runtime import avx512_gemm_on_amd, keep_freed_memory, pin_to_cores
from tracekit.dlrm.schedule import make_schedule, prefetched
from tracekit.dlrm.sharding import ShardedEmbeddings, ShardingPlan
from tracekit.dlrm.tables import TableSpec, init_rows
from tracekit.errors import TracekitError


@dataclass
class TrainResult:
    world_size: int
    backend: str
    device: str
    threads: int
    steps: int
    samples: int
    samples_per_s: float  # global, after warm-up
    epoch_samples: int  # the training split: the samples of one epoch
    train_loss: float  # mean over the last log window
    eval_auc: float | None
    eval_logloss: float | None
    elapsed_s: float
    losses: list[float] = field(default_factory=list)  # global mean loss of every step
    # in-process use (tests): {"tables": {name: (first row, weight)}, "dense": state_dict}
    weights: dict = field(default_factory=dict, repr=False)

    def summary(self) -> dict:
        out = asdict(self)
        del out["losses"], out["weights"]
        return out


def build_tables(cfg: TrainConfig, dataset: Dataset) -> list[TableSpec]:
    names = getattr(dataset, "table_names", None) or [f"t{i}" for i in range(len(dataset.table_rows))]
    return [TableSpec(name, rows, cfg.dim, pooled=t >= cfg.sequence_tables)
            for t, (name, rows) in enumerate(zip(names, dataset.table_rows))]


def _sum_allreduce_hook(group, bucket):
    """DDP comm hook: sum gradients instead of averaging them; the loss is already divided
    by the global batch, so the sum is the gradient of the global mean loss."""
    work = dist.all_reduce(bucket.buffer(), group=group, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


def _log(cfg: TrainConfig, rank: int, message: str) -> None:
    if rank == 0:
        print(message, file=sys.stderr if cfg.json else sys.stdout, flush=True)


def run(cfg: TrainConfig, dataset: Dataset, *, rank: int, world_size: int,
        device: torch.device, policy: AppliedPolicy | None = None) -> TrainResult:
    """Train on an initialised process group (or none at world size 1) and evaluate, applying
    `policy` (loaded and checked before the process group started) if given."""
    backend = dist.get_backend() if dist.is_initialized() else "none"
    if policy is not None:  # named in the manifest when traced
        tracekit.policy_applied(policy.path, applied=policy.sections, skipped=policy.skipped)
    schedule = make_schedule(cfg, dataset, world_size, policy.fae_rows if policy is not None else None)
    plan = ShardingPlan.build(build_tables(cfg, dataset), world_size, cfg.sharding)

    # model: dense part replicated under DDP, tables sharded over the ranks
    torch.manual_seed(cfg.seed)
    # --precision bf16: the dense part computes in bf16 (autocast); weights, optimizer state, tables and loss stay fp32
    dense = DenseArch(dataset.num_dense, cfg.bottom_mlp, cfg.top_mlp, len(plan.tables),
                      precision=cfg.precision).to(device)
    if world_size > 1:
        # the only buffer is a constant index: broadcasting it every forward would add a collective
        dense = DistributedDataParallel(dense, device_ids=[device.index] if device.type == "cuda" else None,
                                        forward_sync_buffers=False, gradient_as_bucket_view=True)
        if policy is not None and policy.dct_dp is not None:  # DCT-DP: only the largest gradient entries sent
            dense.register_comm_hook(DctDpState(policy.dct_dp), dct_dp_hook)
        else:
            dense.register_comm_hook(None, _sum_allreduce_hook)
    elif policy is not None and policy.dct_dp is not None:
        _log(cfg, rank, "compression.dp: world size 1, no gradient all-reduce to compress")
    # the tables' all-to-alls get their own group, so they never queue behind DDP's all-reduce
    group = dist.new_group() if world_size > 1 else None
    sparse = sparse_optimizer(cfg.optimizer, cfg.lr)
    replicas = None
    if policy is not None and policy.replicated_rows:
        replicas = Replicas(policy.replicated_rows, [t.rows for t in plan.tables], cfg.dim, sparse, sync=policy.sync,
                            init_rows=lambda t, rows: init_rows(plan.tables[t], t, rows, cfg.seed),
                            device=device, group=group)
    node_tier = None
    if policy is not None and policy.tier2_rows and sum(r.numel() for r in policy.tier2_rows):
        node_group, column_group = node_groups(world_size, policy.ranks_per_node)
        node_tier = NodeTier(plan, rank, policy.ranks_per_node, policy.tier2_rows, sparse, sync=policy.tier2_sync,
                             init_rows=lambda t, rows: init_rows(plan.tables[t], t, rows, cfg.seed), device=device,
                             node_group=node_group, column_group=column_group)
    # output all-to-all: quantized (--a2a-dtype) and/or DCT-MP (compression.mp); fp32 rows as they are by default
    codec = OutputCodec(cfg.a2a_dtype, policy.mp_keep_ratio if policy is not None else None)
    if not codec.identity and world_size > 1:
        _log(cfg, rank, f"output all-to-all: {codec.describe(cfg.dim)}")
    embeddings = ShardedEmbeddings(plan, rank, sparse, seed=cfg.seed, device=device, group=group,
                                   replicas=replicas, node_tier=node_tier, codec=None if codec.identity else codec)
    optimizer = dense_optimizer(cfg.optimizer, dense.parameters(), cfg.lr)

    losses = torch.zeros(schedule.steps, dtype=torch.float64)
    timed_samples, t_timed = 0, None
    t_begin = time.perf_counter()
    batches = prefetched(schedule.local_batches(dataset, rank, range(schedule.steps)), depth=2)
    for step, (n, sizes, batch) in zip(range(schedule.steps), batches):
        if step == min(cfg.warmup_steps, schedule.steps - 1):
            t_timed, timed_samples = time.perf_counter(), 0
        batch = batch.to(device)

        kind = schedule.kind(step)
        tracekit.step_schedule(kind, samples=sizes[rank])  # named in the trace's steps row when traced
        # a hot (FAE) batch holds only replicated rows: no embedding all-to-all
        embedded = embeddings(batch.lengths, batch.values, sizes, local_only=kind == "hot")
        logits = dense(batch.dense, embedded)
        loss_sum = torch.nn.functional.binary_cross_entropy_with_logits(logits, batch.labels, reduction="sum")
        (loss_sum / n).backward()  # embedding rows are updated inside backward
        embeddings.synchronise()  # replicated rows: gradients summed over ranks, then updated
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

        losses[step] = loss_sum.detach().double()
        timed_samples += n
        if (step + 1) % cfg.log_every == 0 or step + 1 == schedule.steps:
            _log_progress(cfg, rank, world_size, step, schedule, losses, device)
        if cfg.eval_every and (step + 1) % cfg.eval_every == 0 and step + 1 < schedule.steps:
            auc, ll = evaluate(cfg, dataset, schedule, embeddings, dense, rank, world_size, device)
            _log(cfg, rank, f"eval at step {step + 1}: auc {auc:.4f}  logloss {ll:.4f}")
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t_end = time.perf_counter()

    # global mean loss of every step: one all-reduce of the per-step sums at the end
    sizes = torch.tensor([float(schedule.global_size(s)) for s in range(schedule.steps)], dtype=torch.float64)
    if world_size > 1:
        dist.all_reduce(losses)
    step_losses = (losses / sizes).tolist()
    auc = ll = None
    if dataset.num_samples > schedule.num_train:
        auc, ll = evaluate(cfg, dataset, schedule, embeddings, dense, rank, world_size, device)
    window = step_losses[-cfg.log_every:]
    timed_s = t_end - (t_timed if t_timed is not None else t_begin)
    return TrainResult(
        world_size=world_size, backend=backend, device=str(device), threads=torch.get_num_threads(),
        steps=schedule.steps, samples=int(sizes.sum()), epoch_samples=schedule.num_train,
        samples_per_s=timed_samples / timed_s if timed_s > 0 else 0.0,
        train_loss=sum(window) / max(1, len(window)), eval_auc=auc, eval_logloss=ll,
        elapsed_s=t_end - t_begin, losses=step_losses,
        weights={"tables": embeddings.table_weights(),
                 "dense": (dense.module if world_size > 1 else dense).state_dict()},
    )


def _log_progress(cfg, rank, world_size, step, schedule, losses, device) -> None:
    first = max(0, step + 1 - cfg.log_every)
    window = torch.tensor([losses[first:step + 1].sum().item(), 0.0], dtype=torch.float64)
    window[1] = sum(schedule.global_size(s) for s in range(first, step + 1)) / world_size
    if world_size > 1:
        dist.all_reduce(window)
    _log(cfg, rank, f"step {step + 1}/{schedule.steps}  loss {window[0] / window[1]:.4f}")


@torch.no_grad()
def evaluate(cfg, dataset, schedule, embeddings, dense, rank, world_size, device) -> tuple[float, float]:
    """AUC and log loss over the held-out tail of the dataset, gathered from every rank."""
    logits, labels = [], []
    for start in range(schedule.num_train, dataset.num_samples, schedule.global_batch):
        stop = min(start + schedule.global_batch, dataset.num_samples)
        sizes = schedule.local_sizes(start, stop)
        lo = start + sum(sizes[:rank])
        batch = dataset.batch(lo, lo + sizes[rank]).to(device)
        logits.append(dense(batch.dense, embeddings(batch.lengths, batch.values, sizes)))
        labels.append(batch.labels)
    local = torch.stack([torch.cat(logits), torch.cat(labels)]).float()
    if world_size > 1:
        counts = [0] * world_size
        for start in range(schedule.num_train, dataset.num_samples, schedule.global_batch):
            stop = min(start + schedule.global_batch, dataset.num_samples)
            counts = [c + n for c, n in zip(counts, schedule.local_sizes(start, stop))]
        padded = torch.zeros(2, max(counts), device=device)
        padded[:, :local.shape[1]] = local
        gathered = [torch.empty_like(padded) for _ in range(world_size)]
        dist.all_gather(gathered, padded)
        local = torch.cat([g[:, :n] for g, n in zip(gathered, counts)], dim=1)
    local = local.cpu()
    return roc_auc(local[0], local[1]), log_loss(local[0], local[1])


def _device(cfg: TrainConfig) -> torch.device:
    if cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available()):
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def _print_summary(cfg: TrainConfig, result: TrainResult) -> None:
    if cfg.json:
        print(json.dumps(result.summary()), flush=True)
        return
    auc = "n/a" if result.eval_auc is None else f"{result.eval_auc:.4f}"
    ll = "n/a" if result.eval_logloss is None else f"{result.eval_logloss:.4f}"
    print(f"done: {result.steps} steps, {result.samples:,} samples, world {result.world_size} "
          f"({result.backend}, {result.device}, {result.threads} thread(s) per rank)\n"
          f"  samples/s {result.samples_per_s:,.0f} (global, after {cfg.warmup_steps} warm-up steps)\n"
          f"  train loss {result.train_loss:.4f}   eval auc {auc}   eval logloss {ll}", flush=True)


def _infer(cfg, dataset, rank, world_size, device, policy, straggler) -> None:
    """`--inference`: forward only, synchronous or bounded-lag (tracekit/dlrm/inference.py)."""
    bound = cfg.lag_bound if cfg.lag_bound is not None else policy.lag_bound if policy is not None else None
    if policy is not None:
        tracekit.policy_applied(policy.path, applied=policy.sections, skipped=policy.skipped)
    result = inference.run(cfg, dataset, rank=rank, world_size=world_size, device=device,
                           tables=build_tables(cfg, dataset), bound=bound, straggler=straggler)
    tracekit.metrics(eval_auc=result.auc, eval_logloss=result.logloss, makespan_s=result.makespan_s,
                     samples_per_s=result.samples / result.makespan_s)
    if rank == 0:
        exchange = "synchronous collectives" if bound is None or world_size == 1 else f"lag bound {bound}"
        line = {"iterations": result.iterations, "samples": result.samples, "makespan_s": result.makespan_s,
                "auc": result.auc, "logloss": result.logloss, "bound": bound}
        print(json.dumps(line) if cfg.json else
              f"inference: {result.iterations} iterations, {result.samples:,} samples, world {world_size} ({exchange})\n"
              f"  makespan {result.makespan_s:.3f} s   auc {result.auc:.4f}   logloss {result.logloss:.4f}", flush=True)


@record
def main(argv: list[str] | None = None) -> int:
    rank = int(os.environ.get("RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    # everything that can be refused is checked before any process group starts
    try:
        cfg = config_mod.from_args(argv)
        dataset = open_dataset(
            cfg.data, tables=cfg.tables, rows=cfg.rows_for_data(),
            num_dense=cfg.dense, pooling=cfg.pooling, samples=cfg.samples, seed=cfg.seed,
            zipf=cfg.zipf if cfg.zipf is None or len(cfg.zipf) > 1 else cfg.zipf[0],
            drift=cfg.drift, preset=cfg.preset, scale=cfg.scale)
        cfg.check_world(world_size, len(dataset.table_rows))
        if cfg.device == "cuda" and not torch.cuda.is_available():
            raise TracekitError("--device cuda: no CUDA device is available (torch.cuda.is_available() is False)")
        if cfg.sequence_tables > len(dataset.table_rows):
            raise TracekitError(f"--sequence-tables {cfg.sequence_tables} exceeds the {len(dataset.table_rows)} tables")
        policy = None
        if cfg.policy is not None:
            policy = policies.load(cfg.policy, build_tables(cfg, dataset), world_size=world_size,
                                   local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", world_size)),
                                   inference=cfg.inference)
        straggler = None if cfg.straggler is None else inference.Straggler.parse(cfg.straggler)
    except TracekitError as err:
        if rank == 0:
            print(f"train.py: error: {err}", file=sys.stderr)
        return 2
    if policy is not None:  # what the policy file applies, and each section skipped with why
        for line in policy.lines():
            _log(cfg, rank, line)

    device = _device(cfg)
    keep_freed_memory()
    avx512_gemm_on_amd()
    pin_to_cores(int(os.environ.get("LOCAL_RANK", 0)), int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
    if "RANK" in os.environ:
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=timedelta(minutes=10))
    clean = False
    try:
        if cfg.inference:
            _infer(cfg, dataset, rank, world_size, device, policy, straggler)
            clean = True
            return 0
        result = run(cfg, dataset, rank=rank, world_size=world_size, device=device, policy=policy)
        tracekit.metrics(eval_auc=result.eval_auc, eval_logloss=result.eval_logloss,
                         samples_per_s=result.samples_per_s, train_loss=result.train_loss,
                         epoch_samples=result.epoch_samples)
        if rank == 0:
            _print_summary(cfg, result)
        clean = True
    finally:
        if dist.is_initialized():
            # DDP's reducer must be gone, and every rank done, before the group is destroyed,
            # or gloo runs abort at exit now and then (research/env.md, pitfall 1)
            gc.collect()
            if clean:
                dist.barrier()
            dist.destroy_process_group()
    return 0

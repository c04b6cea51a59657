"""Calibration: the seconds each policy's code path adds on a rank per training step, measured on
this machine with the trainer's own code.

    tracekit calibrate runs/base --json                        # print the JSON; write the file
    python -m tracekit.app.calibration --run runs/base         # the same, as analyze starts it

    result = calibrate(inputs)     # inputs: tracekit/dlrm/calibration_inputs.py; result: the file's dict

A policy adds work on the rank, not only on the wire: the replica path splits the ids into hot and
cold, gathers the replica rows, keeps their gradients in backward and, in the sync, finds the rows
touched (unique), sums and updates them; DCT-DP selects each bucket's largest entries; DCT-MP
encodes and decodes every output row. This module times those code paths (ShardedEmbeddings with
Replicas, dct_dp_hook under DDP, OutputCodec.exchange) in ONE process with a world-1 gloo group,
so a collective costs only its call on the rank; the wire is the network model's (fitted from the
run's recorded calls). The sizes come from the run (analyses.run_sizes reads them): its tables, its ids per
sample per table, its rows' access counts (the ids drawn here follow them) and its per-rank batch.
It takes 5-15 s.

Every timing is a median over repeats, taken on `clock` (tracekit/dlrm/timing.py): the calibrating
process's CPU time (all its threads, gloo's included), which is the wall time of the same work on a
core of its own and, unlike wall time, does not grow when other processes share the cores. Torch
runs with the intra-op threads a rank of the run had (1 under torchrun). Each linear model is a non-negative
least-squares fit with its residual (root mean square over the points, in seconds); the points
are in the file, so a reader can check the fit.

RUN/analysis/calibration.json (`schema` tracekit.calibration/1), all seconds per training step
unless said otherwise:

    machine      cpu, cores, torch, threads, host, backend ("gloo"), world_size (1), clock,
                 load_avg (1-minute load when it started: a loaded host makes the figures noisier)
    inputs       run, world_size, batch_per_rank, optimizer, id_source ("accesses": drawn from the
                 run's per-row counts; or a Zipf fallback), tables [{name, rows, dim, pooled,
                 ids_per_sample, rows_calibrated (fewer than rows where the table was scaled down)}]
    replication  per sync kind ("sparse_allreduce", "dense_allreduce"): extra seconds per step of
                 the embedding part (forward, backward, sync) with replicas over without, modelled
                     extra ≈ c0_s + c_ids_s·ids + c_hot_s·hot + c_rows_s·rows
                 ids: ids the rank's local batch looks up per step (all tables); hot: those served
                 by a replica; rows: replica rows synchronised per step (sparse: the rows touched
                 this step; dense: all K). Keys c0_s, c_ids_s, c_hot_s, c_rows_s, residual_s,
                 `collectives`: the collective calls the sync makes per step at world size > 1
                 ({op: calls}; NOT in the coefficients: a world-1 sync makes none; add
                 calls · collective_call_s[op] unless the wire model's latency already holds them),
                 and `points` [{k, batch, ids, hot, rows, base_s, with_s, extra_s, noise_s}]
                 (noise_s: the standard error of the point's median).
    collective_call_s  {all_reduce, all_to_all_single, all_gather_single}: seconds one synchronous
                 call of a small tensor costs on the rank (world 1: no wire), as the trainer calls it
    dct_dp       the DDP comm hook's local work over the plain sum all-reduce hook, per bucket:
                     extra ≈ c_bucket_s + c_elem_s·numel          (thresholds in force)
                     + c_refresh_elem_s·numel                       (in a step that refreshes them)
                 with keep_ratio (the one calibrated), residual_s, refresh_residual_s, points
                 [{numel, plain_s, hook_s, refresh_s}]; a step pays it once per bucket
    dct_mp       encode + decode of the output all-to-all's rows, forward and backward
                 (OutputCodec.exchange), over the uncompressed exchange:
                     extra ≈ c0_s + c_value_s·values + c_kept_s·kept
                 values = rows · dim the rank sends per step, kept = rows · K (K = ⌈keep_ratio · dim⌉),
                 with dim, keep_ratios (those calibrated), residual_s, points
                 [{keep_ratio, rows, values, kept, base_s, with_s, extra_s, noise_s}]
    schedule     FAE: c_sample_s, the seconds per sample that building a batch by index (take)
                 costs over a contiguous slice (batch), for data held in memory (Criteo, Parquet;
                 0 for synthetic data, whose batch is a take); setup_s_per_sample, the one-off
                 split into hot and cold samples per training sample; both run on the prefetch
                 thread, so they cost step time only where the cores are saturated; a `note`
    notes        what could not be measured, and why
    seconds      wall seconds the calibration took

Analyses read this file only; they never import this module (it imports torch).
"""

from __future__ import annotations

import os
import platform
import socket
import statistics
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from tracekit.dlrm.calibration_inputs import MAX_TABLE_BYTES, Batches, Inputs, most_read_rows
from tracekit.dlrm.compression import DctDp, DctDpState, dct_dp_hook
from tracekit.dlrm.data import TabularDataset
from tracekit.dlrm.optim import sparse_optimizer
from tracekit.dlrm.output_codec import OutputCodec
from tracekit.dlrm.replicas import Replicas
from tracekit.dlrm.runtime import keep_freed_memory
from tracekit.dlrm.schedule import hot_samples
from tracekit.dlrm.sharding import ShardedEmbeddings, ShardingPlan
from tracekit.dlrm.tables import init_rows
from tracekit.dlrm.timing import clock, fit_nonnegative, paired
from tracekit.errors import TracekitError
from tracekit.policy import REPLICATION_SYNCS
from tracekit.schema import CALIBRATION_SCHEMA

REPEATS = 7  # timings per point: their noise stays under the fits' residuals (bench/RESULTS.md §37)
DCT_DP_KEEP_RATIO = 0.01
DCT_MP_KEEP_RATIOS = (0.05, 0.25, 0.5)
SYNC_COLLECTIVES = {"sparse_allreduce": {"all_gather_single": 1, "all_to_all_single": 1, "all_reduce": 1},
                    "dense_allreduce": {"all_reduce": 1}}  # replicas.py: Replicas.synchronise, _union


# replication -------------------------------------------------------------------------------------

@dataclass
class Tables:
    """The run's tables twice at world 1, as the trainer builds them: `plain`, and `replicated`,
    whose replica block each point sets (ShardedEmbeddings only keeps the `replicas` it is given, so
    setting it spares initialising the tables again for every point)."""

    plain: ShardedEmbeddings
    replicated: ShardedEmbeddings

    @staticmethod
    def build(inputs: Inputs) -> "Tables":
        optimizer = sparse_optimizer(inputs.optimizer, 0.01)
        plan = ShardingPlan.build(inputs.tables, 1, "table")
        return Tables(*(ShardedEmbeddings(plan, 0, optimizer, seed=0, device=torch.device("cpu")) for _ in range(2)))

    def replicate(self, replicated_rows: list[torch.Tensor], sync: str) -> ShardedEmbeddings:
        """`replicated`, with replicas of `replicated_rows` (per table) synchronised by `sync`."""
        plan = self.replicated.plan
        self.replicated.replicas = Replicas(
            replicated_rows, [t.rows for t in plan.tables], plan.tables[0].dim, self.replicated.optimizer, sync=sync,
            init_rows=lambda t, rows: init_rows(plan.tables[t], t, rows, 0), device=torch.device("cpu"), group=None)
        return self.replicated


def _embedding_step(embeddings: ShardedEmbeddings, batches: Batches) -> Callable[[int], None]:
    """One training step of the embedding part, as train.py runs it: forward, backward, sync."""
    def step(i: int) -> None:
        lengths, values = batches[i]
        embeddings(lengths, values, [lengths.shape[1]]).sum().backward()
        embeddings.synchronise()
    return step


def _counts(replicated_rows: list[torch.Tensor], batches: Batches, sync: str) -> tuple[float, float, float]:
    """Mean ids, ids served by a replica (`hot` in the file) and replica rows synchronised per step
    over the batches."""
    ids = hits = rows = 0.0
    for lengths, values in zip(batches.lengths, batches.values):
        per_table = values.split(lengths.sum(dim=1).tolist())
        touched = [v[torch.isin(v, h)] for v, h in zip(per_table, replicated_rows)]
        ids += values.numel()
        hits += sum(t.numel() for t in touched)
        rows += sum(torch.unique(t).numel() for t in touched) if sync == "sparse_allreduce" else sum(
            h.numel() for h in replicated_rows)
    n = len(batches.values)
    return ids / n, hits / n, rows / n


def replication_grid(inputs: Inputs) -> list[tuple[int, int]]:
    """(K, batch) points drawn from the run's sizes: K from 1% to ~30% of the rows read, the run's
    batch halved, as it is, and doubled."""
    read = sum(int((w > 0).sum()) for w in inputs.weights) or sum(t.rows for t in inputs.tables)
    ks = sorted({max(8, min(read, int(read * f))) for f in (0.01, 0.05, 0.3)})
    return [(k, b) for k in ks for b in (max(1, inputs.batch // 2), inputs.batch, 2 * inputs.batch)]


def measure_replication_point(inputs: Inputs, sync: str, k: int, b: int, *, repeats: int = REPEATS,
                              tables: Tables | None = None, seed: int = 0) -> dict:
    """One point: the embedding part's step with replicas of the K hottest rows against without, on
    a few batches of b samples."""
    tables = tables or Tables.build(inputs)
    replicated_rows = most_read_rows(inputs, k)
    batches = Batches.draw(inputs, b, 4, seed)
    base_s, with_s, extra, noise = paired(_embedding_step(tables.plain, batches),
                                           _embedding_step(tables.replicate(replicated_rows, sync), batches),
                                           repeats)
    ids, hits, rows = _counts(replicated_rows, batches, sync)
    return {"k": k, "batch": b, "ids": ids, "hot": hits, "rows": rows, "base_s": base_s, "with_s": with_s,
            "extra_s": extra, "noise_s": noise}


def replication_model(points: list[dict]) -> dict:
    """The non-negative fit extra ≈ c0 + c_ids·ids + c_hot·hot + c_rows·rows over `points`."""
    x = np.array([[1.0, p["ids"], p["hot"], p["rows"]] for p in points])
    c, residual = fit_nonnegative(x, np.array([p["extra_s"] for p in points]))
    return {"c0_s": c[0], "c_ids_s": c[1], "c_hot_s": c[2], "c_rows_s": c[3], "residual_s": residual}


def predict_replication(model: dict, *, ids: float, hot: float, rows: float) -> float:
    """Extra seconds per step that `model` (one sync kind of the file's `replication`) predicts."""
    return model["c0_s"] + model["c_ids_s"] * ids + model["c_hot_s"] * hot + model["c_rows_s"] * rows


def _replication(inputs: Inputs, sync: str, tables: Tables, repeats: int) -> dict:
    points = [measure_replication_point(inputs, sync, k, b, repeats=repeats, tables=tables, seed=i)
              for i, (k, b) in enumerate(replication_grid(inputs))]
    return {**replication_model(points), "collectives": SYNC_COLLECTIVES[sync], "points": points}


# collectives, DCT-DP, DCT-MP, schedule -----------------------------------------------------------

def _collectives(blocks: int = 15, calls: int = 20) -> dict:
    """Seconds one synchronous call of a small tensor costs on the rank (world-1 gloo group)."""
    x, counts, one = torch.zeros(8), torch.zeros(1, dtype=torch.int64), torch.ones(1, dtype=torch.int64)
    ids, received = torch.arange(8), torch.empty(8, dtype=torch.int64)
    ops = {"all_reduce": lambda: dist.all_reduce(x),
           "all_to_all_single": lambda: dist.all_to_all_single(received, ids, [8], [8]),
           "all_gather_single": lambda: dist.all_gather_single(counts, one)}
    out = {}
    for op, call in ops.items():
        times = []
        for _ in range(blocks + 1):
            t = clock()
            for _ in range(calls):
                call()
            times.append((clock() - t) / calls)
        out[op] = statistics.median(times[1:])
    return out


def _sum_hook(state, bucket):
    """The plain run's DDP hook (train.py's `_sum_allreduce_hook`): one all-reduce of the bucket."""
    work = dist.all_reduce(bucket.buffer(), async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


def _dct_dp(steps: int = 12) -> dict:
    """Per-bucket time of dct_dp_hook (thresholds in force, and refreshed every step) and of the
    plain hook, each timed to its result, on DDP buckets of a few sizes."""
    widths = [16, 32, 64, 128, 256, 512, 256, 1]  # buckets of ~1k to ~130k entries
    times: dict[str, dict[int, list[float]]] = {"plain": {}, "hook": {}, "refresh": {}}
    models, states = [], []
    for kind, state, hook in (("plain", None, _sum_hook),
                              ("hook", DctDpState(DctDp(DCT_DP_KEEP_RATIO, refresh_every=10**9)), dct_dp_hook),
                              ("refresh", DctDpState(DctDp(DCT_DP_KEEP_RATIO, refresh_every=1)), dct_dp_hook)):
        torch.manual_seed(0)
        mlp = nn.Sequential(*(m for a, b in zip(widths, widths[1:]) for m in (nn.Linear(a, b), nn.ReLU())))
        ddp = DistributedDataParallel(mlp, bucket_cap_mb=0.01, gradient_as_bucket_view=True)
        ddp.register_comm_hook(state, _timed_hook(hook, times[kind]))
        models.append(ddp)
        states.append(state)
    x = torch.randn(4, widths[0])
    for step in range(steps + 2):
        for ddp, state in zip(models, states):
            if state is not None:  # the same gradient every step: without this, error feedback's residual
                state.residual.clear()  # grows, and the stale thresholds send more entries step by step
            ddp(x).sum().backward()
        if step == 1:  # the first two steps build and rebuild DDP's buckets: not timed
            for per in times.values():
                per.clear()
    points = [{"numel": n, "plain_s": statistics.median(times["plain"][n]), "hook_s": statistics.median(v),
               "refresh_s": statistics.median(times["refresh"][n])} for n, v in sorted(times["hook"].items())]
    ones = [[1.0, p["numel"]] for p in points]
    c, residual = fit_nonnegative(np.array(ones), np.array([p["hook_s"] - p["plain_s"] for p in points]))
    r, refresh_residual = fit_nonnegative(np.array(ones)[:, 1:], np.array([p["refresh_s"] - p["hook_s"] for p in points]))
    return {"keep_ratio": DCT_DP_KEEP_RATIO, "c_bucket_s": c[0], "c_elem_s": c[1], "c_refresh_elem_s": r[0],
            "residual_s": residual, "refresh_residual_s": refresh_residual, "points": points}


def _timed_hook(hook, log: dict[int, list[float]]):
    """`hook`, timed from its call to its result (the future waited on), per bucket size."""
    def timed(state, bucket):
        t = clock()
        fut = hook(state, bucket)
        fut.wait()
        log.setdefault(bucket.buffer().numel(), []).append(clock() - t)
        return fut
    return timed


def _dct_mp(inputs: Inputs, repeats: int) -> dict:
    """OutputCodec.exchange (forward and backward) with DCT-MP against the plain fp32 exchange."""
    dim, rows = inputs.tables[0].dim, inputs.batch * len(inputs.tables)
    plain, points = OutputCodec("fp32"), []
    gen = torch.Generator().manual_seed(0)
    for keep in DCT_MP_KEEP_RATIOS:
        coded = OutputCodec("fp32", keep)
        for n in (max(1, rows // 2), rows, 2 * rows):
            send, grad = torch.randn(n, dim, generator=gen).requires_grad_(), torch.randn(n, dim, generator=gen)
            base_s, with_s, extra, noise = paired(_exchange_step(plain, send, grad),
                                                   _exchange_step(coded, send, grad), repeats)
            points.append({"keep_ratio": keep, "rows": n, "values": n * dim, "kept": n * coded.keep(dim),
                           "base_s": base_s, "with_s": with_s, "extra_s": extra, "noise_s": noise})
    c, residual = fit_nonnegative(np.array([[1.0, p["values"], p["kept"]] for p in points]),
                                  np.array([p["extra_s"] for p in points]))
    return {"dim": dim, "keep_ratios": list(DCT_MP_KEEP_RATIOS), "c0_s": c[0], "c_value_s": c[1], "c_kept_s": c[2],
            "residual_s": residual, "points": points}


def _exchange_step(codec: OutputCodec, send: torch.Tensor, grad: torch.Tensor) -> Callable[[int], None]:
    """The output all-to-all of `send` through `codec`, forward and backward (world 1: to itself)."""
    def step(i: int) -> None:
        codec.exchange(send, [send.shape[0]], [send.shape[0]], None).backward(grad)
    return step


def _schedule(inputs: Inputs, repeats: int) -> dict:
    """FAE's batching: take (by index) against batch (a slice) on in-memory data, and the hot split."""
    b = inputs.batch
    n = 8 * b
    batches = Batches.draw(inputs, n, 1, seed=7)
    lengths, values = batches[0]
    dataset = TabularDataset(dense=torch.randn(n, 13), labels=torch.zeros(n), lengths=lengths,
                             values=list(values.split(lengths.sum(dim=1).tolist())),
                             table_rows=[t.rows for t in inputs.tables], table_names=[t.name for t in inputs.tables])
    gen = torch.Generator().manual_seed(0)
    picks = [torch.sort(torch.randperm(n, generator=gen)[:b])[0] for _ in range(4)]
    _, _, extra, noise = paired(lambda i: dataset.batch((i % 7) * b, (i % 7 + 1) * b),
                                 lambda i: dataset.take(picks[i % 4]), repeats)
    fae_rows = most_read_rows(inputs, max(1, sum(t.rows for t in inputs.tables) // 20))
    t = clock()
    hot_samples(dataset, n, fae_rows)
    setup = (clock() - t) / n
    return {"c_sample_s": max(0.0, extra / b), "noise_s": noise / b, "setup_s_per_sample": setup,
            "note": "batches are built on the prefetch thread, beside the step: they cost step time only where "
                    "the cores are saturated; synthetic data builds every batch by index, so c_sample_s is 0 there"}


# the whole calibration ---------------------------------------------------------------------------

def calibrate(inputs: Inputs, *, repeats: int = REPEATS, progress: Callable[[str], None] | None = None) -> dict:
    """Every measurement of the module docstring, in this process, with a world-1 gloo group of its
    own (TracekitError if this process already has a process group)."""
    progress = progress or (lambda what: None)
    if dist.is_initialized():
        raise TracekitError("calibration needs a process without a process group (it makes a world-1 one)")
    started, load = time.perf_counter(), os.getloadavg()[0]
    threads = torch.get_num_threads()
    torch.set_num_threads(inputs.threads)
    keep_freed_memory()  # as train.py's ranks do: no page faults on each step's buffers
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        out = {"schema": CALIBRATION_SCHEMA, "machine": _machine(load), "inputs": inputs.describe(),
               "replication": {}}
        tables = Tables.build(inputs)
        for sync in REPLICATION_SYNCS:
            progress(f"replication ({sync})")
            out["replication"][sync] = _replication(inputs, sync, tables, repeats)
        del tables  # its memory serves what follows: the calibration's peak stays the replication's
        progress("collectives")
        out["collective_call_s"] = _collectives()
        progress("DCT-DP hook")
        out["dct_dp"] = _dct_dp()
        progress("DCT-MP codec")
        out["dct_mp"] = _dct_mp(inputs, repeats)
        progress("FAE schedule")
        out["schedule"] = _schedule(inputs, repeats)
    finally:
        dist.destroy_process_group()
        torch.set_num_threads(threads)
    out["notes"] = _notes(inputs)
    out["seconds"] = time.perf_counter() - started
    return out


def _machine(load: float) -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    return {"cpu": cpu, "cores": len(os.sched_getaffinity(0)), "torch": torch.__version__,
            "threads": torch.get_num_threads(), "host": socket.gethostname(), "backend": "gloo", "world_size": 1,
            "clock": "process_cpu", "load_avg": round(load, 2)}


def _notes(inputs: Inputs) -> list[str]:
    notes = ["replication at world 1 makes no collective and no union of the ranks' touched rows: the sync's "
             "all-gather/all-to-all/all-reduce calls are in `collectives` × collective_call_s, and the union's "
             "unique over the W ranks' ids is counted as one rank's (rows), not W's",
             "collective_call_s is a world-1 call: the wire (latency and bandwidth at world > 1) is the network "
             "model's, fitted from the run's recorded calls, whose latency already holds each call's overhead",
             f"DCT-DP at keep ratio {DCT_DP_KEEP_RATIO} only; its encoding (chosen per bucket from the counts) "
             "may differ at another ratio"]
    if any(t.rows < rows for t, rows in zip(inputs.tables, inputs.run_rows)):
        notes.append(f"tables scaled down to {MAX_TABLE_BYTES >> 20} MiB in all (rows_calibrated): a lookup in "
                     "the run's larger tables misses caches more often than here")
    if inputs.id_source != "accesses":
        notes.append(f"ids drawn from {inputs.id_source}, not from the run's counts")
    return notes

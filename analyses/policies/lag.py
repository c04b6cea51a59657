"""The BLS lag bound (research/papers.md §6, B.7): how far a fast rank may run ahead of the slowest
before it blocks, chosen by replaying the run's own per-rank step times.

Per rank p and step t the step splits into the rank's own compute, its exchange, and its blocking
wait (analyses/timeline.py), over the steps every rank completed, the first analyses.network.warmup_steps(n) left out
(start-up, not training):

    c[p][t] = compute_s = step_s − comm_s       (neither waiting nor communicating)
    x[p][t] = comm_s − wait_s                   (the exchange's own cost: its transfer, no waiting)

With lag bound L, the exchange of step t runs on a thread of its own (tracekit/dlrm/inference.py)
once every rank has finished t−1−L, and rank p computes step t once it has finished t−1 and the
rows of t have arrived:

    E[p][t] = max(E[p][t−1], max_q F[q][t−1−L]) + x[p][t]      (F[·][t'] = 0 for t' < 0)
    F[p][t] = max(F[p][t−1], E[p][t]) + c[p][t]
    makespan(L) = max_p F[p][T−1]

That gives the exchange thread and the compute a resource each (a GPU's streams, or a spare core a
rank). Where a rank has one core, the two share it and the exchange is work in series with the
compute, whichever thread does it:

    F[p][t] = max(F[p][t−1], max_q F[q][t−1−L]) + c[p][t] + x[p][t]

`overlaps(manifest)` says which of the two a recorded run had. Either way L = 0 is the
bulk-synchronous run, F[p][t] = max_q F[q][t−1] + x + c, so makespan(0) replays the recorded
synchronous run, and L = ∞ lets each rank run alone: the ideal without synchronisation, the
slowest rank's own time.

The recurrence is replayed for L = 0..MAX_BOUND and ∞ (table `lag_makespan`: bound (null for ∞),
makespan_s, step_time_s = makespan / T, gain = 1 − makespan(L) / makespan(0)), and the policy takes
the smallest L whose makespan is within TOLERANCE of the best (the best finite L if none is). On a
balanced run with one core a rank every L gives the same makespan: the bound is 0 and the
predicted gain ~0; where the exchange overlaps the compute, L = 1 gains that overlap, and the
`why` tells it from a straggler's.

BLS keeps results exact in inference-only runs (read-only tables); in training, L > 0 means
stale-synchronous updates, which the `why` says.

    with open_context("runs/base") as ctx:
        policy = derive(ctx)
    policy.section     # Lag(bound=2, prediction=Prediction({"step_time_s", "makespan_s", "gain", ...}, why))
"""

from __future__ import annotations

import numpy as np
import polars as pl

from analyses.context import Context, PolicyResult
from analyses.network import warmup_steps
from analyses.timeline import compute as timeline
from tracekit.figures import STEP_TIME
from tracekit.manifest import Manifest
from tracekit.policy import Lag, Prediction

MAX_BOUND = 8
TOLERANCE = 0.01


def replay(c: np.ndarray, bound: int | None, x: np.ndarray | float = 0.0, *, overlap: bool = True) -> float:
    """makespan of the recurrence for compute c[p][t] (ranks × steps), exchange x (ranks × steps, or
    one number for every rank and step) and lag bound `bound` (None: ∞); `overlap`: the exchange
    has a resource of its own, else it shares the rank's core with the compute."""
    ranks, steps = c.shape
    x = np.broadcast_to(np.asarray(x, dtype=float), c.shape)
    arrived, finish = np.zeros(ranks), np.zeros(ranks)  # E[p][t], F[p][t]
    slowest = np.zeros(steps)  # max_q F[q][t]
    for t in range(steps):
        gate = slowest[t - 1 - bound] if bound is not None and t - 1 - bound >= 0 else 0.0
        if overlap:
            arrived = np.maximum(arrived, gate) + x[:, t]
            finish = np.maximum(finish, arrived) + c[:, t]
        else:
            finish = np.maximum(finish, gate) + c[:, t] + x[:, t]
        slowest[t] = finish.max()
    return float(slowest[-1]) if steps else 0.0


def overlaps(manifest: Manifest) -> bool:
    """Whether a run's ranks could exchange while they compute: NCCL (the GPU's streams), or at least
    two cores a rank on each host."""
    if manifest.backend == "nccl":
        return True
    cores = (manifest.devices or {}).get("cores") or 1
    per_host = max(1, (manifest.world_size or 1) // max(1, len(manifest.hosts or [None])))
    return cores // per_host >= 2


def work_matrix(frame: pl.DataFrame) -> tuple[np.ndarray, np.ndarray, list[int], list[int]]:
    """c[p][t] = compute_s and x[p][t] = comm_s − wait_s from a timeline frame: ranks × steps
    completed by every rank, after the warm-up steps; with the ranks and steps they cover."""
    ranks = sorted(frame["rank"].unique().to_list())
    complete = frame.group_by("step").agg(pl.len()).filter(pl.col("len") == len(ranks))["step"]
    first = frame["step"].min()
    skip = warmup_steps(frame["step"].n_unique())
    kept = frame.filter(pl.col("step").is_in(complete.implode()) & (pl.col("step") >= first + skip))
    kept = kept.with_columns(pl.col("compute_s").clip(lower_bound=0).alias("c"),
                             (pl.col("comm_s") - pl.col("wait_s")).clip(lower_bound=0).alias("x"))
    steps = sorted(kept["step"].unique().to_list())
    if not steps:
        empty = np.zeros((len(ranks), 0))
        return empty, empty, ranks, steps
    c, x = ([kept.pivot(on="rank", index="step", values=name).sort("step").select([str(r) for r in ranks])
             .to_numpy().T for name in ("c", "x")])
    return c, x, ranks, steps


def sweep(c: np.ndarray, x: np.ndarray | float = 0.0, *, overlap: bool = True) -> pl.DataFrame:
    bounds: list[int | None] = [*range(MAX_BOUND + 1), None]
    makespans = [replay(c, b, x, overlap=overlap) for b in bounds]
    steps = max(c.shape[1], 1)
    return pl.DataFrame({"bound": bounds, "makespan_s": makespans}, schema={"bound": pl.Int64, "makespan_s": pl.Float64}
                        ).with_columns((pl.col("makespan_s") / steps).alias(STEP_TIME),
                                       (1 - pl.col("makespan_s") / makespans[0]).alias("gain"))


def choose(table: pl.DataFrame) -> int:
    """The smallest bound within TOLERANCE of the best makespan (∞ included), else the best finite."""
    best = table["makespan_s"].min()
    finite = table.drop_nulls("bound")
    near = finite.filter(pl.col("makespan_s") <= best * (1 + TOLERANCE))
    pick = near if near.height else finite.sort("makespan_s").head(1)
    return int(pick["bound"].min())


def derive(ctx: Context, bandwidth: dict | None = None) -> PolicyResult:
    """The lag section; `bandwidth` is not used: the replay runs on the recorded step times."""
    result = PolicyResult("lag")
    frame = timeline(ctx).tables.get("timeline")
    if frame is None or frame.height == 0:
        result.reason = "no steps table: the per-rank step times BLS replays were not recorded"
        return result
    c, x, ranks, steps = work_matrix(frame)
    if len(ranks) < 2:
        result.reason = f"a lag bound needs at least 2 ranks; the run has {len(ranks)}"
        return result
    if len(steps) < 2:
        result.reason = (f"a lag bound needs at least 2 steps completed by every rank after the "
                         f"{warmup_steps(frame['step'].n_unique())} warm-up step(s); the run has {len(steps)}")
        return result
    overlap = overlaps(ctx.manifest)
    table = sweep(c, x, overlap=overlap)
    bound = choose(table)
    row = table.filter(pl.col("bound") == bound).row(0, named=True)
    unbounded = table.filter(pl.col("bound").is_null()).row(0, named=True)
    totals = (c + x).sum(axis=1)
    spread = float((c.max(axis=0) - c.min(axis=0)).mean())
    result.tables["lag_makespan"] = table
    result.section = Lag(bound=bound, prediction=Prediction(
        {STEP_TIME: row[STEP_TIME], "makespan_s": row["makespan_s"], "gain": row["gain"],
         "sync_step_time_s": table[STEP_TIME][0], "unbounded_gain": unbounded["gain"]},
        _why(bound, row["gain"], unbounded["gain"], _overlap_gain(c, x, overlap), spread, float((c + x).mean())),
    ))
    result.evidence = {
        "ranks": ranks, "steps": [steps[0], steps[-1]], "steps_replayed": len(steps),
        "warmup_steps_excluded": warmup_steps(frame["step"].n_unique()),
        "work": "c[p][t] = compute_s = step_s - comm_s (timeline)",
        "exchange": "x[p][t] = comm_s - wait_s (the collectives' transfer, without blocking wait)",
        "exchange_per_step_s": float(x.mean()),
        "recurrence": ("E[p][t] = max(E[p][t-1], max_q F[q][t-1-L]) + x[p][t]; F[p][t] = max(F[p][t-1], E[p][t]) "
                       "+ c[p][t]; makespan = max_p F[p][T-1]" if overlap else
                       "F[p][t] = max(F[p][t-1], max_q F[q][t-1-L]) + c[p][t] + x[p][t]; makespan = max_p F[p][T-1]"),
        "exchange_overlaps_compute": overlap,
        "rule": f"smallest L in 0..{MAX_BOUND} within {TOLERANCE:.0%} of the best makespan (L = inf included)",
        "work_per_rank_s": {str(r): float(t) for r, t in zip(ranks, totals)},
        "mean_step_spread_s": spread,
    }
    return result


def _overlap_gain(c: np.ndarray, x: np.ndarray | float, overlap: bool) -> float:
    """The unbounded gain of the same run with every rank's compute set to the ranks' mean: what a
    bound gains by overlapping the exchange with the compute alone, with no straggler to hide."""
    balanced = np.broadcast_to(c.mean(axis=0), c.shape)
    return 1 - replay(balanced, None, x, overlap=overlap) / replay(balanced, 0, x, overlap=overlap)


def _why(bound: int, gain: float, unbounded_gain: float, overlap_gain: float, spread: float,
         mean_work: float) -> str:
    imbalance = f"ranks' step work differs by {spread * 1e3:.2f} ms on average ({spread / mean_work:.1%} of a step)"
    if unbounded_gain <= TOLERANCE:
        return (f"balanced run: {imbalance}; even an unbounded lag gains {unbounded_gain:.1%}, so L = 0 "
                "(synchronous) is kept and the predicted gain is ~0")
    if unbounded_gain - overlap_gain <= TOLERANCE:
        return (f"balanced run: {imbalance}; a bound hides no straggler here, and L = {bound} gains {gain:.1%} "
                "only by exchanging the next step's rows during this step's compute")
    caveat = ("" if bound == 0 else "; exact for inference-only runs, stale-synchronous in training")
    return (f"{imbalance}; L = {bound} is the smallest bound within {TOLERANCE:.0%} of the best replayed makespan, "
            f"predicted gain {gain:.1%} (unbounded: {unbounded_gain:.1%}, of which {overlap_gain:.1%} the exchange "
            f"overlapping the compute){caveat}")

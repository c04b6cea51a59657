"""A policy's step time from what it leaves on the embedding exchange (analyses.exchange): the
exchange's remote bytes it leaves per collective, the replica sync it adds (dense or sparse:
`sync_choice` picks) and the rank work that sync costs.

Priced by analyses.network's model of communication time from the baseline's measured exchange, or,
where the run's steps replay, by the replay of the recorded steps with the policy as a change of their
graph (analyses.replay).

    t = timing(ctx, s, remote, sparse, sync_bytes, hot_ids, rows)   # Timing(comm_s, work_s, step_s, error_s)
    change(ctx, s, remote, ...)          # the same policy, one point, as a change of the replayed graph
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from analyses import network
from analyses.context import Context
from analyses.exchange import COLLECTIVES, ExchangeBaseline, log_points
from analyses.replay.change import Added, Change
from analyses.replay.prediction import replay
from tracekit import tags


@dataclass
class Timing:
    """A policy's predicted step (arrays over a curve's K, or floats): seconds."""

    comm_s: Any
    work_s: Any
    step_s: Any  # None without a measured step time
    error_s: Any


def sync_choice(ctx: Context, s: ExchangeBaseline, remote: dict[str, Any], dense: Any, sparse: Any, hot_ids: Any,
                union_rows: Any, rows: Any) -> Any:
    """The one rule for a replica sync: sparse (True) or dense, whichever predicts less time
    (collectives, bytes and calibrated rank work: `timing`), or fewer bytes under `--objective
    bytes`. Arrays broadcast."""
    if ctx.options.objective == "bytes":
        return np.asarray(sparse) <= np.asarray(dense)
    t_sparse = timing(ctx, s, remote, True, sparse, hot_ids, union_rows)
    t_dense = timing(ctx, s, remote, False, dense, hot_ids, rows)
    return t_sparse.comm_s + t_sparse.work_s <= t_dense.comm_s + t_dense.work_s


def timing(ctx: Context, s: ExchangeBaseline, remote: dict[str, Any], sparse: Any, sync_bytes: Any, hot_ids: Any,
           rows: Any, skipped_calls: Any = 0.0) -> Timing:
    """The predicted step of a policy that leaves `remote[c]` remote bytes per step on each
    collective c of the exchange (its busiest link scaled alike), syncs `sync_bytes` per step
    (sparse where `sparse`), serves `hot_ids` lookups per rank and step from replicas and syncs
    `rows` replica rows per step; `skipped_calls`: exchange calls per step it no longer makes.
    step = measured step − the baseline exchange's time + the policy's (exchange, sync, rank work);
    error: analyses.network's (each changed call's residual, a tenth of the wire time changed, the
    calibration's residual, the baseline's drift).

    Where the run's steps replay (analyses.replay), the step is the replay's instead: the recorded steps
    with the exchange's bytes scaled, the sync added after the backward, the exchange skipped on the
    share of steps that make none, and the work added; its error the spread of the per-step replays."""
    replayed = _replayed(ctx, s, remote, sparse, sync_bytes, hot_ids, rows, skipped_calls)
    if replayed is not None:
        return replayed
    net = network.network(ctx)
    beta, alpha = net.fit.beta_s_per_byte, net.alpha(network.A2A)
    collectives = tuple(s.base)  # the exchange's collectives: COLLECTIVES
    # each collective: α + β · its busiest link's bytes (the transfer, scaled with its remote bytes),
    # and what it measurably held the ranks beyond that (waits for a rank late from the link's
    # previous transfers), scaled with the step's transfer time; on a link whose bytes cost nothing
    # (β ≈ 0: loopback) the waits stay as they are
    transfer = {c: beta * s.busiest[c] for c in collectives}
    waits = sum(max(s.cost.get(c, 0.0) - alpha - transfer[c], 0.0) for c in collectives)
    ratio = {c: np.asarray(remote[c], dtype=np.float64) / s.base[c][1] if s.base[c][1] else 0.0 for c in collectives}
    base_transfer = sum(transfer.values())
    new_transfer = sum(transfer[c] * ratio[c] for c in collectives)
    sync_bytes = np.asarray(sync_bytes, dtype=np.float64)
    sparse = np.asarray(sparse, dtype=bool)
    syncing = sync_bytes > 0
    calls = np.where(syncing, np.where(sparse, len(network.SPARSE_SYNC_OPS), 1), 0)
    sync_alpha = np.where(sparse, sum(net.alpha(op) for op in network.SPARSE_SYNC_OPS),
                          net.alpha(network.ALL_REDUCE))
    sync = np.where(syncing, sync_alpha + beta * sync_bytes / max(s.world, 1), 0.0)
    link = new_transfer + beta * sync_bytes / max(s.world, 1)
    held = waits * (link / base_transfer if base_transfer > 0 else 1.0)
    exchange = (len(collectives) - np.asarray(skipped_calls, dtype=np.float64)) * alpha + new_transfer + held
    ids = s.lookups_per_rank
    work_sparse = net.work("replication.sparse_allreduce", ids=ids, hot=hot_ids, rows=rows)
    work_dense = net.work("replication.dense_allreduce", ids=ids, hot=hot_ids, rows=rows)
    work = (np.zeros_like(sync) if work_sparse is None or work_dense is None
            else np.where(syncing, np.where(sparse, work_sparse, work_dense), 0.0))
    comm = exchange + sync
    base_comm = len(collectives) * alpha + base_transfer + waits
    step = None if s.step_time_s is None else np.maximum(0.0, s.step_time_s - base_comm + comm + work)
    changed = calls + np.asarray(skipped_calls, dtype=np.float64)
    wire_change = np.abs(new_transfer + held - base_transfer - waits) + beta * sync_bytes / max(s.world, 1)
    work_residual = np.where(sparse, net.work_residual("replication.sparse_allreduce"),
                             net.work_residual("replication.dense_allreduce")) * syncing
    error = (np.sqrt(changed * net.fit.residual_s ** 2 + (wire_change * net.wire_error) ** 2
                     + work_residual ** 2) + net.step.spread_s)
    return Timing(comm, work, step, error)


CURVE_POINTS = 16  # points of a curve the replay prices; the step between them is interpolated


def _replayed(ctx: Context, s: ExchangeBaseline, remote: dict[str, Any], sparse: Any, sync_bytes: Any, hot_ids: Any,
              rows: Any, skipped_calls: Any) -> Timing | None:
    """`timing` by the replay, at up to CURVE_POINTS log-spaced points of a curve, interpolated between them;
    None where the run does not replay (no steps every rank completed, or no measured step)."""
    rp = replay(ctx)
    if not rp.steps or rp.measured_median_s is None or s.step_time_s is None:
        return None
    values = {"sparse": sparse, "sync": sync_bytes, "hot": hot_ids, "rows": rows, "skipped": skipped_calls,
              **{c: remote[c] for c in s.base}}
    shape = np.broadcast(*(np.asarray(v) for v in values.values())).shape
    size = int(np.prod(shape)) if shape else 1
    flat = {name: np.broadcast_to(np.asarray(v, dtype=np.float64), shape).reshape(-1) for name, v in values.items()}
    points = log_points(size - 1, CURVE_POINTS) if size > 1 else [0]
    step, low, high, work = (np.empty(len(points)) for _ in range(4))
    for n, i in enumerate(points):
        c = change(ctx, s, {col: flat[col][i] for col in s.base}, bool(flat["sparse"][i]), flat["sync"][i],
                   flat["hot"][i], flat["rows"][i], flat["skipped"][i])
        p = rp.predict(c)
        step[n], low[n], high[n], work[n] = p.step_s, p.low_s, p.high_s, c.work_s
    at = np.arange(size)
    step_s, low_s, high_s, work_s = (np.interp(at, points, v) for v in (step, low, high, work))
    error = np.maximum(step_s - low_s, high_s - step_s)  # the per-step spread and the baseline's drift
    comm = np.maximum(step_s - work_s - rp.compute_s, 0.0)
    return Timing(*(v.reshape(shape) if shape else float(v[0]) for v in (comm, work_s, step_s, error)))


def change(ctx: Context, s: ExchangeBaseline, remote: dict[str, float], sparse: bool, sync_bytes: float,
           hot_ids: float, rows: float, skipped_calls: float = 0.0) -> Change:
    """A policy that leaves `remote[c]` remote bytes on each exchange collective c (`timing`'s arguments, one
    point) as a change of the replayed graph: the exchange scaled, skipped on its share of steps, the sync's
    collectives and its calibrated rank work added after the backward."""
    net = network.network(ctx)
    kind = "replication.sparse_allreduce" if sparse else "replication.dense_allreduce"
    work = net.work(kind, ids=s.lookups_per_rank, hot=hot_ids, rows=rows) if sync_bytes > 0 else None
    skip = min(float(skipped_calls) / len(COLLECTIVES), 1.0)
    # remote[c] is a mean over every step: the steps that make the exchange carry it over their share
    scale = {c: float(remote[c]) / s.base[c][1] / max(1.0 - skip, 1e-12) if s.base[c][1] else 1.0 for c in s.base}
    return Change(scale, skip, sync_calls(sparse, float(sync_bytes), s.world), 0.0 if work is None else float(work))


def sync_calls(sparse: bool, sync_bytes: float, world: int) -> tuple:
    """A replica sync of `sync_bytes` a step (Σ ranks' wire bytes, analyses.exchange.sync_bytes's
    formulas) as the collectives the trainer issues after the backward: dense, one ring all-reduce; sparse,
    the count's all-gather, the ids' all-to-all and the rows' all-reduce (its bytes given to the all-reduce)."""
    if sync_bytes <= 0 or world < 2:
        return ()
    ring = Added(network.ALL_REDUCE, sync_bytes / (2 * (world - 1)), tag=tags.REPLICA_SYNC)
    if not sparse:
        return (ring,)
    bytes_per_rank = {network.ALL_GATHER: 8.0, network.A2A: 0.0, network.ALL_REDUCE: ring.bytes_per_rank}
    return tuple(Added(op, bytes_per_rank[op], tag=tags.REPLICA_SYNC) for op in network.SPARSE_SYNC_OPS)

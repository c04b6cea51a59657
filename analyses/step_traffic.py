"""One training step's communication by class of collective (`Traffic`), and its compute time, as the
run recorded them: what `tracekit simulate` (analyses.simulate) projects onto another cluster.

From the run, each training step's communication by class of collective (training rows, averaged
over the N training steps, analyses.traffic.training_steps):

    exchange  the all-to-alls, per part (analyses.roles.part: the tag, the reference trainer's input
              dist's two calls as one): bytes from rank to rank (Σ splits_out), calls per step
    ring      the all-reduces: bytes per rank S (DDP's buckets and the rest), calls per step
    gather    the all-gathers: bytes per rank g, calls per step
    other     every other collective: calls per step (latency only)

and its compute time: per step the slowest rank's step less the union of its collective intervals
(analyses.timeline's compute_s), the median over the steps after warm-up.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import polars as pl

from analyses import attribution, network, traffic
from analyses.context import Context
from analyses.roles import part_sql
from analyses.traffic import A2A_OPS, GATHER_OPS, sql_list
from tracekit.figures import A2A_BYTES, A2A_REMOTE_BYTES, ALLREDUCE_BYTES, STEP_TIME, SYNC_BYTES


@dataclass
class Traffic:
    """One training step's communication on `world` ranks (module docstring)."""

    world: int
    exchange: dict[str, np.ndarray]  # tag or part -> world × world bytes per step, rank to rank
    exchange_calls: float
    ring: float  # bytes per rank per step through all-reduces
    ring_calls: float
    gather: float
    gather_calls: float
    other_calls: float
    sync_wire: float = 0.0  # a policy's replica sync: wire bytes per step, all ranks
    sync_calls: float = 0.0
    sync_ring: float = 0.0  # ... when it is one dense all-reduce: its bytes per rank
    replica_bytes: float = 0.0  # a policy's replicas per rank (Σ rb), the dense sync's size
    float_tags: frozenset[str] = frozenset()  # all-to-all tags carrying floating-point rows (outputs, grads)
    node_wire: float = 0.0  # tiers across nodes: the node copies' sync, wire bytes per step between nodes
    node_calls: float = 0.0
    node_ring: float = 0.0  # ... when it is dense: one node's tier-2 bytes, in a ring of the nodes
    node_bytes: float = 0.0  # one node's tier-2 rows (Σ rb), the dense node sync's size

    @property
    def calls(self) -> float:
        return (self.exchange_calls + self.ring_calls + self.gather_calls + self.other_calls + self.sync_calls
                + self.node_calls)

    def figures(self) -> dict[str, float]:
        """Bytes per step in `comms`' convention (Σ ranks' bytes_out), and the sync's wire bytes."""
        w, total = self.world, self.total_exchange
        return {A2A_BYTES: float(total.sum()),
                A2A_REMOTE_BYTES: float(total.sum() - np.trace(total)),
                ALLREDUCE_BYTES: self.ring * w, SYNC_BYTES: self.sync_wire + self.node_wire,
                "bytes_per_step": float(total.sum()) + self.ring * w + self.gather * w
                                  + (self.sync_ring * w if self.sync_ring else self.sync_wire) + self.node_wire}

    @property
    def total_exchange(self) -> np.ndarray:
        return sum(self.exchange.values(), np.zeros((self.world, self.world)))


def recorded(ctx: Context) -> tuple[Traffic, dict]:
    """The run's training step: its Traffic (sync calls of a policy run left in as they are) and
    {steps, batch (mean samples per device), compute_s, step_time_s, latency_s}."""
    steps = max(traffic.training_steps(ctx), 1)
    w = ctx.model.world_size
    exchange: dict[str, np.ndarray] = {}
    float_tags = set()
    for tag, src, dst, b, is_float in ctx.sql(f"""
            SELECT part, rank, i - 1, sum(splits_out[i])::DOUBLE,
                   bool_or(dtype LIKE '%float%' OR dtype LIKE '%half%')
            FROM (SELECT {part_sql()} AS part, rank, dtype, splits_out, generate_subscripts(splits_out, 1) AS i
                  FROM train_comms
                  WHERE op IN ({sql_list(A2A_OPS)}) AND group_size = {w})
            GROUP BY ALL""").fetchall():
        if 0 <= src < w and 0 <= dst < w:
            exchange.setdefault(tag, np.zeros((w, w)))[src, dst] = b / steps
            if is_float:
                float_tags.add(tag)
    per_op = {op: (calls / steps / w, per_rank / steps) for op, calls, per_rank in ctx.sql(f"""
        SELECT CASE WHEN op IN ({sql_list(A2A_OPS)}) THEN 'a2a' WHEN op = 'all_reduce' THEN 'ring'
                    WHEN op IN ({sql_list(GATHER_OPS)}) THEN 'gather' ELSE 'other' END AS kind,
               count(*)::DOUBLE, max(per_rank)
        FROM (SELECT op, rank, sum(bytes_out) OVER (PARTITION BY op, rank)::DOUBLE AS per_rank FROM train_comms)
        GROUP BY kind""").fetchall()}
    none = (0.0, 0.0)
    run = Traffic(w, exchange, per_op.get("a2a", none)[0], per_op.get("ring", none)[1], per_op.get("ring", none)[0],
                  per_op.get("gather", none)[1], per_op.get("gather", none)[0], per_op.get("other", none)[0],
                  float_tags=frozenset(float_tags))
    return run, {"steps": steps, **_times(ctx, steps, w)}


def _times(ctx: Context, steps: int, world: int) -> dict:
    samples = ctx.sql("SELECT sum(samples)::DOUBLE FROM steps").fetchall()[0][0] if ctx.has("steps") else None
    if not samples:
        samples = float(attribution.batches(ctx)["b"].sum()) if ctx.has("comms") else 0.0
    out = {"batch": samples / steps / world if samples else None, "compute_s": None, STEP_TIME: None,
           "latency_s": network.network(ctx).alpha(network.A2A)}
    if not ctx.has("steps"):
        return out
    frame = compute_times(ctx)
    skip = network.warmup_steps(frame["step"].n_unique())
    per_step = (frame.filter(pl.col("step") >= frame["step"].min() + skip).group_by("step")
                .agg(pl.col("compute_s").max(), pl.col("step_s").max()))
    out["compute_s"] = float(per_step["compute_s"].median())
    out[STEP_TIME] = float(per_step["step_s"].median())
    return out


def compute_times(ctx: Context) -> pl.DataFrame:
    """Per (rank, training step): step_s and compute_s, the step less the time the rank spent in
    collectives: its synchronous calls, and its asynchronous ones only after the step's last
    synchronous call ended (waiting for them; before that they overlap the rank's computing, as
    DDP's bucket all-reduces overlap backward)."""
    steps = ctx.frame("SELECT rank, step, t_start_ns, t_end_ns FROM steps")
    calls = (ctx.frame("""SELECT rank, step, t_start_ns AS t0, t_end_ns AS t1, "async" FROM train_comms
                          WHERE t_end_ns > t_start_ns""") if ctx.has("comms")
             else pl.DataFrame(schema={"rank": pl.Int64, "step": pl.Int64, "t0": pl.Int64, "t1": pl.Int64,
                                       "async": pl.Boolean}))
    by_key = {key: part for key, part in calls.partition_by("rank", "step", as_dict=True).items()}
    rows = []
    for rank, step, w0, w1 in steps.iter_rows():
        part = by_key.get((rank, step))
        busy = 0 if part is None else _busy_ns(part, w0, w1)
        rows.append((rank, step, (w1 - w0) / 1e9, (w1 - w0 - busy) / 1e9))
    return pl.DataFrame(rows, schema={"rank": pl.Int64, "step": pl.Int64, "step_s": pl.Float64,
                                      "compute_s": pl.Float64}, orient="row")


def _busy_ns(calls: pl.DataFrame, w0: int, w1: int) -> int:
    sync = calls.filter(~pl.col("async"))
    last = int(sync["t1"].max()) if sync.height else w0
    spans = [(t0, t1) for t0, t1 in sync.select("t0", "t1").iter_rows()]
    spans += [(max(t0, last), t1) for t0, t1 in calls.filter(pl.col("async")).select("t0", "t1").iter_rows()]
    busy, end = 0, w0
    for t0, t1 in sorted((max(t0, w0), min(t1, w1)) for t0, t1 in spans):
        if t1 > max(t0, end):
            busy += t1 - max(t0, end)
            end = t1
    return busy


"""Traffic: what the run's collectives moved, per op, tag, rank and step; who sent what to whom;
how fast the network moved it; and how evenly the ranks shared it.

Bytes are exact and come from `comms` only. Training figures use `train_comms`
(`phase = 'train'`) and are per training step, summed over all ranks' `bytes_out` (DESIGN.md §5):
with N training steps (the steps table's count, else the distinct steps of the training comms),

    bytes_per_step(op, tag) = Σ_{ranks, training calls of (op, tag)} bytes_out / N

Evaluation rows are reported beside them (total bytes, no per-step figure), never mixed in.

Tables (`compute(ctx).tables`):
- `traffic_by_op`: op, tag, phase, calls, bytes_out, bytes_per_step (null for eval rows).
- `traffic_by_rank_step`: rank, step, phase, op, bytes_out.
- `traffic_matrix`: src, dst (global ranks), bytes (Σ src's splits_out[dst] over training
  all-to-all and send calls), bytes_received (Σ dst's splits_in[src] over training all-to-all and
  receive calls: equal to bytes unless rows were lost), bytes_per_step. The diagonal is what a rank
  hands itself (inside the all-to-all's buffers, not over the network). Splits are indexed by
  group rank: in a group spanning the whole world group rank i is global rank i (the default
  group, and torch's `new_group` orders members by global rank); in a smaller group the members
  are taken as the sorted ranks that recorded calls in it, and its rows are left out (and said
  so in the notes) when not all of them did.
- `bandwidth`: op, group_size, size_lo_bytes, size_hi_bytes (a power-of-two bucket of the call
  size S), calls, median_size_bytes, median_time_s, algbw_bytes_per_s, busbw_bytes_per_s (medians
  over the bucket's calls), bus_factor. nccl-tests definitions, per call on each rank:
      time = t_end_ns - t_start_ns  (calls with t_end_ns = -1, completion unknown, are skipped)
      S = bytes_in for all_gather and receives (the gathered output), bytes_out otherwise
      algbw = S / time;  busbw = algbw × factor(n), n = group_size:
      all_reduce 2(n-1)/n; all_gather, reduce_scatter, all_to_all (n-1)/n; broadcast, reduce,
      send/recv 1.
  A rank's time includes waiting for the last rank to enter, so these are lower bounds on the
  link's speed. Calls in groups of one rank and barriers (no bytes) are left out.
- `traffic_imbalance`: op, max_rank, max_rank_bytes_per_step, mean_rank_bytes_per_step,
  imbalance = max / mean over the world's ranks of each rank's training bytes_out (1 = even).

`measured_bandwidth(ctx)` is the summary's bus bandwidth (predictions use analyses.network's fit): per op, the
median busbw of its largest calls (S at or above the op's 75th percentile; small calls measure
latency, not bandwidth). The time of a call moving S bytes per rank is S × factor(n) / busbw.
`baseline(ctx)` is policy.json's `baseline`.

    with open_context("runs/base") as ctx:
        result = compute(ctx)
    result.tables["traffic_by_op"]        # op | tag | phase | calls | bytes_out | bytes_per_step
    result.summary["train_bytes_per_step"], result.summary["bandwidth"]
"""

from __future__ import annotations

import polars as pl

from analyses.clocks import clock_offsets, offset_sql
from analyses.context import Context, Result
from tracekit.figures import A2A_BYTES, ALLREDUCE_BYTES, STEP_TIME

A2A_OPS = ("all_to_all_single", "all_to_all")
SEND_OPS = ("send", "isend")
RECV_OPS = ("recv", "irecv")
GATHER_OPS = ("all_gather", "all_gather_into_tensor", "all_gather_single")
TWO_N = ("all_reduce",)
N_MINUS_ONE = (*GATHER_OPS, "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single", *A2A_OPS)
BANDWIDTH_OPS = ("all_to_all_single", "all_reduce")
"""The ops `measured_bandwidth` reports, by name."""
LARGE_QUANTILE = 0.75
MIN_BANDWIDTH_BYTES = 1 << 16
"""Calls smaller than this measure latency, not bandwidth: `measured_bandwidth` leaves them out."""


def sql_list(values: tuple[str, ...]) -> str:
    return ", ".join(f"'{v}'" for v in values)


BUS_FACTOR_SQL = (f"CASE WHEN op IN ({sql_list(TWO_N)}) THEN 2.0 * (group_size - 1) / group_size "
                  f"WHEN op IN ({sql_list(N_MINUS_ONE)}) THEN (group_size - 1)::DOUBLE / group_size ELSE 1.0 END")
SIZE_SQL = f"CASE WHEN op IN ({sql_list(GATHER_OPS + RECV_OPS)}) THEN bytes_in ELSE bytes_out END"


def bus_factor(op: str, n: int) -> float:
    """nccl-tests' busbw / algbw for `op` in a group of `n` ranks."""
    if op in TWO_N:
        return 2 * (n - 1) / n
    if op in N_MINUS_ONE:
        return (n - 1) / n
    return 1.0


def training_steps(ctx: Context) -> int:
    """N, the training steps per-step figures divide by: the steps table's distinct steps, else the
    distinct steps of the training comms (a run whose steps were not recorded)."""
    steps = ctx.train_steps()
    if steps == 0 and ctx.has("comms"):
        steps = int(ctx.sql("SELECT count(DISTINCT step) FROM train_comms").fetchall()[0][0])
    return steps


def compute(ctx: Context) -> Result:
    if not ctx.has("comms"):
        return Result(notes=["traffic: the run has no comms table (a world of one rank, or recorded without "
                             "the comm collector): no traffic to report"])
    result = Result()
    steps = training_steps(ctx)
    world = ctx.model.world_size
    result.tables = {
        "traffic_by_op": by_op(ctx, steps),
        "traffic_by_rank_step": ctx.frame(
            "SELECT rank, step, phase, op, sum(bytes_out)::BIGINT AS bytes_out FROM comms "
            "GROUP BY ALL ORDER BY rank, step, phase DESC, op"),
        "traffic_matrix": matrix(ctx, steps, result.notes),
        "bandwidth": bandwidth(ctx),
        "traffic_imbalance": imbalance(ctx, steps),
    }
    ops = result.tables["traffic_by_op"]
    train, held_out = ops.filter(pl.col("phase") == "train"), ops.filter(pl.col("phase") != "train")
    matrix_frame = result.tables["traffic_matrix"]
    result.summary = {
        "steps": steps,
        "world_size": world,
        "train_bytes_per_step": train["bytes_out"].sum() / steps if steps else None,
        "train_bytes_per_step_by_op": _per_step(train, "op", steps),
        "train_bytes_per_step_by_tag": _per_step(train, "tag", steps),
        "eval_bytes": int(held_out["bytes_out"].sum()),
        "eval_bytes_by_op": dict(held_out.group_by("op").agg(pl.col("bytes_out").sum()).rows()),
        "cross_rank_bytes_per_step": (matrix_frame.filter(pl.col("src") != pl.col("dst"))["bytes"].sum() / steps
                                      if steps else None),
        "bandwidth": measured_bandwidth(ctx),
        "imbalance": dict(result.tables["traffic_imbalance"].select("op", "imbalance").rows()),
        "matrix_ranks": "global ranks (whole-world groups: group rank = global rank; "
                        "subgroups: the sorted ranks that called in them)",
    }
    return result


def _per_step(frame: pl.DataFrame, key: str, steps: int) -> dict[str, float]:
    totals = frame.group_by(key).agg(pl.col("bytes_out").sum()).sort("bytes_out", descending=True).rows()
    return {k: v / steps for k, v in totals} if steps else {}


def by_op(ctx: Context, steps: int) -> pl.DataFrame:
    return ctx.frame(
        "SELECT op, tag, phase, count(*) AS calls, sum(bytes_out)::BIGINT AS bytes_out, "
        "CASE WHEN phase = 'train' AND ? > 0 THEN sum(bytes_out)::DOUBLE / ? END AS bytes_per_step "
        "FROM comms GROUP BY op, tag, phase ORDER BY phase DESC, bytes_out DESC, op, tag", [steps, steps])


def _peer_to_rank(world: int) -> str:
    """SQL mapping a split's index `peer` in a group to a global rank (see the module docstring)."""
    return (f"CASE WHEN s.group_size = {int(world)} THEN s.peer "
            "WHEN len(m.ranks) = s.group_size THEN m.ranks[s.peer + 1] END")


def matrix(ctx: Context, steps: int, notes: list[str]) -> pl.DataFrame:
    world = ctx.model.world_size
    splits = """
        SELECT c.rank, c."group", c.group_size, unnest(c.{col}) AS bytes,
               generate_subscripts(c.{col}, 1) - 1 AS peer
        FROM train_comms c WHERE c.op IN ({ops})"""
    ctx.sql("CREATE OR REPLACE TEMP TABLE traffic_members AS "
            'SELECT "group", list_sort(list(DISTINCT rank)) AS ranks FROM comms GROUP BY ALL')
    mapped = f"""
        SELECT s.rank, {_peer_to_rank(world)} AS peer_rank, s.bytes
        FROM ({{splits}}) s JOIN traffic_members m USING ("group")"""
    sent = mapped.format(splits=splits.format(col="splits_out", ops=sql_list(A2A_OPS + SEND_OPS)))
    received = mapped.format(splits=splits.format(col="splits_in", ops=sql_list(A2A_OPS + RECV_OPS)))
    unmapped = ctx.sql(f"SELECT coalesce(sum(bytes), 0)::BIGINT FROM ({sent}) WHERE peer_rank IS NULL").fetchall()[0][0]
    if unmapped:
        notes.append(f"traffic_matrix: {unmapped:,} bytes sent in subgroups whose members did not all record "
                     "calls are left out (their group ranks cannot be mapped to global ranks)")
    return ctx.frame(f"""
        WITH out_ AS (SELECT rank AS src, peer_rank AS dst, sum(bytes)::BIGINT AS bytes
                      FROM ({sent}) WHERE peer_rank IS NOT NULL GROUP BY ALL),
             in_ AS (SELECT peer_rank AS src, rank AS dst, sum(bytes)::BIGINT AS bytes_received
                     FROM ({received}) WHERE peer_rank IS NOT NULL GROUP BY ALL)
        SELECT coalesce(o.src, i.src) AS src, coalesce(o.dst, i.dst) AS dst,
               coalesce(o.bytes, 0) AS bytes, coalesce(i.bytes_received, 0) AS bytes_received,
               CASE WHEN ? > 0 THEN coalesce(o.bytes, 0)::DOUBLE / ? END AS bytes_per_step
        FROM out_ o FULL OUTER JOIN in_ i ON o.src = i.src AND o.dst = i.dst
        ORDER BY src, dst""", [steps, steps])


_CALLS = f"""
    SELECT op, group_size, {SIZE_SQL} AS size_bytes, (t_end_ns - t_start_ns) / 1e9 AS time_s,
           {BUS_FACTOR_SQL} AS bus_factor, rank, step, "group", seq, "async", t_start_ns, t_end_ns
    FROM train_comms
    WHERE t_end_ns >= 0 AND t_end_ns > t_start_ns AND group_size >= 2 AND op <> 'barrier'
      AND {SIZE_SQL} > 0"""


def bandwidth(ctx: Context) -> pl.DataFrame:
    return ctx.frame(f"""
        SELECT op, group_size, (1::BIGINT << floor(log2(size_bytes))::INT) AS size_lo_bytes,
               (2::BIGINT << floor(log2(size_bytes))::INT) AS size_hi_bytes, count(*) AS calls,
               median(size_bytes)::DOUBLE AS median_size_bytes, median(time_s) AS median_time_s,
               median(size_bytes / time_s) AS algbw_bytes_per_s,
               median(size_bytes / time_s * bus_factor) AS busbw_bytes_per_s, any_value(bus_factor) AS bus_factor
        FROM ({_CALLS}) GROUP BY ALL ORDER BY op, group_size, size_lo_bytes""")


def measured_bandwidth(ctx: Context) -> dict[str, float | None]:
    """{"all_to_all_single": busbw, "all_reduce": busbw} in bytes/s from the run's synchronous training
    calls of at least MIN_BANDWIDTH_BYTES (median over each op's largest quarter of them), None for an
    op the run did not time so.

    A call's time is its transfer time, as analyses.network takes it: from the last rank's entry to
    the last exit (calls matched across ranks by step, op, group and order), since the ranks before
    the last waited, which says nothing about the link. Async calls are left out: from issue to
    completion they wait behind the computation they overlap (DDP's bucket all-reduce during backward)."""
    measured = {op: None for op in BANDWIDTH_OPS}
    if not ctx.has("comms"):
        return measured
    rows = ctx.sql(f"""
        WITH c AS (SELECT *, size_bytes >= quantile_cont(size_bytes, {LARGE_QUANTILE}) OVER (PARTITION BY op) AS large
                   FROM ({transfers_sql(ctx)})
                   WHERE op IN ({sql_list(BANDWIDTH_OPS)}) AND size_bytes >= {MIN_BANDWIDTH_BYTES})
        SELECT op, median(size_bytes / time_s * bus_factor) FROM c WHERE large GROUP BY op""").fetchall()
    measured.update({op: float(bw) for op, bw in rows})
    return measured


def transfers_sql(ctx: Context) -> str:
    """SQL: one row per synchronous training collective (matched across ranks by step, op, group and
    order within them): op, group_size, size_bytes (the largest rank's), bus_factor and time_s, its
    transfer time (measured_bandwidth; a call missing a rank's row: the least duration a rank saw)."""
    offset = offset_sql(clock_offsets(ctx.manifest)[0])
    return f"""
        SELECT op, any_value(group_size) AS group_size, max(size_bytes) AS size_bytes,
               CASE WHEN count(DISTINCT rank) = any_value(group_size) THEN (max(t1) - max(t0)) / 1e9
                    ELSE min(time_s) END AS time_s,
               any_value(bus_factor) AS bus_factor
        FROM (SELECT *, t_start_ns + {offset} AS t0, t_end_ns + {offset} AS t1,
                     row_number() OVER (PARTITION BY rank, step, op, "group" ORDER BY seq) AS nth
              FROM ({_CALLS} AND NOT "async"))
        GROUP BY step, op, "group", nth"""


def imbalance(ctx: Context, steps: int) -> pl.DataFrame:
    per_rank = ctx.frame("SELECT op, rank, sum(bytes_out)::DOUBLE AS bytes FROM train_comms GROUP BY ALL")
    world = max(ctx.model.world_size, per_rank["rank"].n_unique()) if per_rank.height else ctx.model.world_size
    return (per_rank.sort("bytes", "rank", descending=[True, False]).group_by("op", maintain_order=True)
            .agg(pl.col("rank").first().alias("max_rank"), pl.col("bytes").max().alias("max_rank_bytes"),
                 (pl.col("bytes").sum() / world).alias("mean_rank_bytes"))
            .with_columns((pl.col("max_rank_bytes") / pl.col("mean_rank_bytes")).alias("imbalance"),
                          (pl.col("max_rank_bytes") / max(steps, 1)).alias("max_rank_bytes_per_step"),
                          (pl.col("mean_rank_bytes") / max(steps, 1)).alias("mean_rank_bytes_per_step"))
            .select("op", "max_rank", "max_rank_bytes_per_step", "mean_rank_bytes_per_step", "imbalance")
            .sort("op"))


def baseline(ctx: Context) -> dict[str, float | None]:
    """policy.json's `baseline`: all-to-all and all-reduce bytes per training step (summed over
    ranks' bytes_out, training calls) and the step time (analyses.network's baseline rule). None where the run has no such table."""
    steps = training_steps(ctx)
    out: dict[str, float | None] = {A2A_BYTES: None, ALLREDUCE_BYTES: None, STEP_TIME: None}
    if ctx.has("comms") and steps:
        a2a, ar = ctx.sql(f"""
            SELECT coalesce(sum(bytes_out) FILTER (WHERE op IN ({sql_list(A2A_OPS)})), 0)::DOUBLE,
                   coalesce(sum(bytes_out) FILTER (WHERE op = 'all_reduce'), 0)::DOUBLE
            FROM train_comms""").fetchall()[0]
        out[A2A_BYTES], out[ALLREDUCE_BYTES] = a2a / steps, ar / steps
    if ctx.has("steps"):
        from analyses.network import step_time

        out[STEP_TIME] = step_time(ctx).median_s
    return out

"""Timeline: where each rank's steps went (computing, communicating, waiting for the others) and
which rank the others waited for.

Clocks: every time below is on the ranks' common clock (analyses.clocks.clock_offsets).

Per rank and training step (table `timeline`, from `steps` and `train_comms`):
- step_s = t_end_ns − t_start_ns of the step (a step runs from the end of the previous one);
- comm_s = the length of the union of the rank's training comm intervals [t_start_ns, t_end_ns]
  clipped to the step's window (async calls overlapping compute count too; calls whose completion
  is unknown, t_end_ns = −1, are left out);
- compute_s = step_s − comm_s;
- wait_s = blocking time: the time the rank spent inside synchronous collectives before the last
  rank of the group entered them,
      wait = max(0, min(t_end, latest entry) − t_start),  latest entry = max over the group's
  ranks of t_start of the matching call. The k-th call of a group on one rank matches the k-th on
  every other (collectives of a group are issued in the same order everywhere), counting calls of
  every phase and leaving point-to-point calls out; a match missing a rank, or whose ops differ
  (lost rows), counts no wait. Async calls count none: the rank computes meanwhile.
  This is Scalasca's "wait at N×N": time lost to a late peer, not the collective's transfer
  time, and unlike "time beyond the fastest rank's" it does not need equal transfer times.

Stragglers (table `stragglers`, one row per step that at least two ranks completed):
step, last_rank (the rank whose step ended last), end_spread_s (its end − the first end),
margin_s (its end − the runner-up's), blocking_rank (the rank that entered the step's collectives
last the most, weighted: the one the others waited for longest) and blocked_s (that waiting,
summed over the other ranks).

The first analyses.network.warmup_steps(n) steps are kept in the tables but left out of the
summary's means and counts (the one warm-up rule of every baseline): the first step's window opens
when the collectors start, so it holds start-up, not training.

    with open_context("runs/base") as ctx:
        result = compute(ctx)
    result.tables["timeline"]     # rank | step | t_start_ns | t_end_ns | step_s | comm_s | compute_s | wait_s
    result.summary["stragglers"]  # {"last": {"1": 37, ...}, "blocking": {...}, "mean_end_spread_s": ...}
"""

from __future__ import annotations

import polars as pl

from analyses.clocks import clock_offsets
from analyses.context import Context, Result
from analyses.network import warmup_steps
from analyses.traffic import RECV_OPS, SEND_OPS, sql_list

P2P_OPS = SEND_OPS + RECV_OPS


def compute(ctx: Context) -> Result:
    """The timeline and stragglers tables and their summary; once per context (ctx.memo: the lag
    policy reads them too)."""
    return ctx.memo(compute, lambda: _compute(ctx))


def _compute(ctx: Context) -> Result:
    if not ctx.has("steps"):
        return Result(notes=["timeline: the run has no steps table (no optimizer step and no tracekit.step() "
                             "call was seen): no per-step timeline"])
    result = Result()
    offsets, clock = clock_offsets(ctx.manifest)
    _prepare(ctx, offsets)
    frame = _timeline_frame(ctx)
    stragglers = _stragglers_frame(ctx, frame)
    result.tables = {"timeline": frame, "stragglers": stragglers}
    result.summary = _summarise(frame, stragglers, clock)
    if ctx.has("comms"):
        unmatched = ctx.sql("SELECT count(*) FROM timeline_matched WHERE NOT matched").fetchall()[0][0]
        result.summary["unmatched_collective_calls"] = int(unmatched)
        if unmatched:
            result.notes.append(f"timeline: {unmatched} collective call(s) had no matching call on every rank of "
                                "their group (lost rows?); they count no waiting")
    else:
        result.notes.append("timeline: no comms table: communication and waiting are 0")
    return result


def _prepare(ctx: Context, offsets: dict[int, int]) -> None:
    """Temp tables, this module's own: the clock offsets (timeline_clock), the comm calls on the
    common clock (timeline_calls), and matched collectives with each call's wait (timeline_matched)."""
    values = ", ".join(f"({rank}, {offset})" for rank, offset in offsets.items()) or "(NULL, NULL)"
    ctx.sql(f"CREATE OR REPLACE TEMP TABLE timeline_clock AS SELECT * FROM (VALUES {values}) v(rank, offset_ns) "
            "WHERE rank IS NOT NULL")
    if not ctx.has("comms"):
        return
    ctx.sql("""
        CREATE OR REPLACE TEMP TABLE timeline_calls AS
        SELECT c.rank, c.step, c.seq, c.phase, c.op, c."group", c.group_size, c."async",
               c.t_start_ns + coalesce(o.offset_ns, 0) AS t0,
               CASE WHEN c.t_end_ns >= 0 THEN c.t_end_ns + coalesce(o.offset_ns, 0) END AS t1
        FROM comms c LEFT JOIN timeline_clock o USING (rank)""")
    ctx.sql(f"""
        CREATE OR REPLACE TEMP TABLE timeline_matched AS
        WITH numbered AS (
            SELECT *, row_number() OVER (PARTITION BY rank, "group" ORDER BY seq) AS k
            FROM timeline_calls WHERE op NOT IN ({sql_list(P2P_OPS)})),
        m AS (
            SELECT *, max(t0) OVER w AS latest, count(*) OVER w AS n, min(op) OVER w AS op_lo,
                   max(op) OVER w AS op_hi, arg_max(rank, t0) OVER w AS last_rank
            FROM numbered WINDOW w AS (PARTITION BY "group", k))
        SELECT rank, step, phase, "group", k, last_rank, (n = group_size AND op_lo = op_hi) AS matched,
               CASE WHEN n = group_size AND op_lo = op_hi AND NOT "async"
                    THEN greatest(0, least(coalesce(t1, latest), latest) - t0) ELSE 0 END AS wait_ns
        FROM m""")


def _timeline_frame(ctx: Context) -> pl.DataFrame:
    windows = """
        SELECT s.rank, s.step, s.t_start_ns + coalesce(o.offset_ns, 0) AS w0,
               s.t_end_ns + coalesce(o.offset_ns, 0) AS w1
        FROM steps s LEFT JOIN timeline_clock o USING (rank)"""
    if not ctx.has("comms"):
        return ctx.frame(f"""
            SELECT rank, step, w0 AS t_start_ns, w1 AS t_end_ns, (w1 - w0) / 1e9 AS step_s, 0.0::DOUBLE AS comm_s,
                   (w1 - w0) / 1e9 AS compute_s, 0.0::DOUBLE AS wait_s
            FROM ({windows}) ORDER BY rank, step""")
    return ctx.frame(f"""
        WITH iv AS (SELECT rank, t0, t1 FROM timeline_calls WHERE phase = 'train' AND t1 IS NOT NULL AND t1 > t0),
        flagged AS (
            SELECT *, CASE WHEN t0 <= max(t1) OVER (PARTITION BY rank ORDER BY t0, t1
                                                     ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING)
                           THEN 0 ELSE 1 END AS opens
            FROM iv),
        numbered AS (SELECT *, sum(opens) OVER (PARTITION BY rank ORDER BY t0, t1 ROWS UNBOUNDED PRECEDING) AS island
                     FROM flagged),
        islands AS (SELECT rank, min(t0) AS t0, max(t1) AS t1 FROM numbered GROUP BY rank, island),
        win AS (SELECT *, row_number() OVER (PARTITION BY rank ORDER BY w0, w1) AS wi FROM ({windows})),
        {_island_pieces(ctx, windows)}
        comm AS (SELECT w.rank, w.step, sum(least(p.t1, w.w1) - greatest(p.t0, w.w0)) AS comm_ns
                 FROM pieces p JOIN win w USING (rank, wi) WHERE p.t0 < w.w1 AND p.t1 > w.w0 GROUP BY ALL),
        waits AS (SELECT rank, step, sum(wait_ns) AS wait_ns FROM timeline_matched WHERE phase = 'train' GROUP BY ALL)
        SELECT w.rank, w.step, w.w0 AS t_start_ns, w.w1 AS t_end_ns, (w.w1 - w.w0) / 1e9 AS step_s,
               coalesce(c.comm_ns, 0) / 1e9 AS comm_s, (w.w1 - w.w0 - coalesce(c.comm_ns, 0)) / 1e9 AS compute_s,
               coalesce(x.wait_ns, 0) / 1e9 AS wait_s
        FROM win w LEFT JOIN comm c USING (rank, step) LEFT JOIN waits x USING (rank, step)
        ORDER BY w.rank, w.step""")


def _island_pieces(ctx: Context, windows: str) -> str:
    """SQL CTE `pieces` (rank, t0, t1, wi): each island of communication with the index of every
    step window `win` it may overlap. Steps follow one another on a rank, so those are the windows
    from the one it starts in to the one it ends in (two ASOF joins), not every step tried against
    every island; were any two windows of a rank to overlap, every window of its rank."""
    overlapping = ctx.sql(f"""SELECT count(*) FROM (
        SELECT w0 < lag(w1) OVER (PARTITION BY rank ORDER BY w0, w1) AS o FROM ({windows})) WHERE o""").fetchall()[0][0]
    if overlapping:
        return "pieces AS (SELECT i.rank, i.t0, i.t1, w.wi FROM islands i JOIN win w USING (rank)),"
    return """spans AS (SELECT i.rank, i.t0, i.t1, coalesce(a.wi, 1) AS a, b.wi AS b
                  FROM islands i ASOF LEFT JOIN win a ON i.rank = a.rank AND i.t0 >= a.w0
                                 ASOF LEFT JOIN win b ON i.rank = b.rank AND i.t1 > b.w0),
        pieces AS (SELECT rank, t0, t1, unnest(generate_series(a, b)) AS wi FROM spans WHERE b IS NOT NULL),"""


def _stragglers_frame(ctx: Context, frame: pl.DataFrame) -> pl.DataFrame:
    ends = (frame.sort("step", "t_end_ns", "rank", descending=[False, True, False])
            .group_by("step", maintain_order=True)
            .agg(pl.len().alias("ranks"), pl.col("rank").first().alias("last_rank"),
                 ((pl.col("t_end_ns").first() - pl.col("t_end_ns").min()) / 1e9).alias("end_spread_s"),
                 ((pl.col("t_end_ns").first() - pl.col("t_end_ns").get(1, null_on_oob=True)) / 1e9).alias("margin_s"))
            .filter(pl.col("ranks") >= 2).drop("ranks"))
    if ctx.has("comms"):
        blocking = ctx.frame("""
            SELECT step, arg_max(last_rank, blocked) AS blocking_rank, max(blocked) / 1e9 AS blocked_s
            FROM (SELECT step, last_rank, sum(wait_ns) AS blocked FROM timeline_matched
                  WHERE phase = 'train' AND matched GROUP BY ALL)
            GROUP BY step""")
    else:
        blocking = pl.DataFrame(schema={"step": pl.Int64, "blocking_rank": pl.Int64, "blocked_s": pl.Float64})
    return (ends.join(blocking, on="step", how="left")
            .with_columns(pl.col("blocking_rank").cast(pl.Int64), pl.col("blocked_s").fill_null(0.0))
            .sort("step"))


def _summarise(frame: pl.DataFrame, stragglers: pl.DataFrame, clock: str) -> dict:
    first = frame["step"].min() if frame.height else 0
    skip = warmup_steps(frame["step"].n_unique())
    kept = frame.filter(pl.col("step") >= first + skip) if skip else frame
    late = stragglers.filter(pl.col("step") >= first + skip) if skip else stragglers
    means = kept.group_by("rank").agg(pl.col("step_s", "comm_s", "compute_s", "wait_s").mean()).sort("rank")
    return {
        "clock": clock,
        "steps": frame["step"].n_unique(),
        "ranks": frame["rank"].n_unique(),
        "warmup_steps_excluded": skip,
        "per_rank": {str(row["rank"]): {k: row[k] for k in ("step_s", "comm_s", "compute_s", "wait_s")}
                     for row in means.to_dicts()},
        "stragglers": {
            "last": _times(late, "last_rank"),
            "blocking": _times(late.filter(pl.col("blocked_s") > 0), "blocking_rank"),
            "mean_end_spread_s": late["end_spread_s"].mean() if late.height else None,
            "mean_margin_s": late["margin_s"].mean() if late.height else None,
            "mean_blocked_s": late["blocked_s"].mean() if late.height else None,
        },
    }


def _times(stragglers: pl.DataFrame, column: str) -> dict[str, int]:
    """{rank: how many steps it was `column`}."""
    rows = stragglers.drop_nulls(column).group_by(column).agg(pl.len()).sort(column).rows()
    return {str(rank): n for rank, n in rows}

"""Hybrid hot-row replication (SCARS papers.md §2 steps 3-5, HugeCTR §7, FlexShard tier 1 §5):
the rows chosen are replicated on every rank and looked up where the sample is; the rest stay
sharded and go through the all-to-all.

Rows are taken in order of benefit per replica byte (SCARS B.1, FlexShard B.6), net of the sparse
synchronisation they add, in bytes per step (one link carries both: analyses.network; rows whose
score is not positive follow, by all-to-all bytes freed per replica byte alone):

    score_i = (a2a_i − sync_i) / rb_i
    a2a_i   = remote all-to-all bytes per step row i's lookups free: a sequence lookup's ids and
              rows, a pooled bag's lengths, ids and rows shared among its ids (exact for one-hot
              bags; a bag leaves only when all its ids are hot, which the replay counts exactly)
    sync_i  = ((W−1) · id_bytes · (step, rank) pairs touching i + 2(W−1) · rb_i · steps touching i) / steps

The rows' figures come from EVERY training step's `accesses` (exact counts; `estimated_rows`), each
row's bytes per lookup from the sampled `lookups`: choosing the hot set on the sampled steps that
then evaluate it would be optimistic by construction (a row seen once in a few sampled steps looks
hot). Every prefix K of that order is replayed over the recorded lookups
(exchange.replication_savings: an item leaves at K > its last position), with both syncs per step:
dense 2(W−1)·Σ rb over the K rows, sparse over the union of hot rows touched that step. Where
lookups were sampled, the bytes at the chosen K are estimates with an interval over the sampled
steps (exchange.step_interval); with --lookup-every 1 they are exact. The sync is
exchange_timing.sync_choice's; the K is the one of least predicted step time
(exchange_timing.timing: the measured step less the baseline exchange's time, plus the policy's
exchange, sync collectives and calibrated rank-side work, analyses.network), with Σ rb ≤ the budget
per rank (Options.budget_bytes, or budget_fraction of all embedding bytes; without one, the
unconstrained optimum). Its step time carries the model's error as an interval; analyses.decision
recommends it only when the gain exceeds that error.

HugeCTR's frequent set is computed beside it (calibration_data.cu, papers B.3): over the I sampled
steps with global batch B and per-rank batch M = B/W, a row is frequent if its count ≥
B·I·sqrt(2·p_dup/(M(M−1))) (one node, p_dup 0.01) or ≥ I·N·(BW_a2a/BW_ar)·N/(N−1) (N > 1 nodes,
Options.topology); the count is rounded up to a multiple of W. It is replayed the same way
(rows by count) and shown in the evidence and the sweep.

Outputs: the `replication` section (sync, budget_bytes_per_rank, predicted {a2a_bytes_per_step,
a2a_remote_bytes_per_step, sync_bytes_per_step, step_time_s, ...}), policy/hot_rows.parquet
(table_name, row, count, benefit_bytes = a2a_i), and analysis table `replication_sweep` (one row
per budget point; `point` says which is the optimum, HugeCTR's, the given budget).

Temporary tables it creates that other modules read (call the function named first):

    tk_order_replication  (`benefit_curve(ctx)`) the rows by benefit per replica byte
    tk_order_count        (`count_curve(ctx)`) the rows by count, most read first
        both: tid, row, rb, kind, lookups, remote_lookups, steps, src_steps, samples, placed,
        benefit_out, benefit_rem (as analyses.exchange's tk_rows, over every step), table_name,
        pos (0, 1, ... in the order)

`order_table` and `curve` write such a table under the caller's name (a test's, a benchmark's).
tk_rows_est (`estimated_rows`) is its own step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import polars as pl

from analyses import attribution, exchange, exchange_timing, network
from analyses.context import Context, PolicyResult
from analyses.exchange import ExchangeBaseline
from analyses.replay.prediction import changes
from analyses.row_totals import row_totals
from tracekit.figures import A2A_BYTES, A2A_REMOTE_BYTES, COMM_TIME, STEP_TIME, SYNC_BYTES
from tracekit.policy import Prediction, Replication

P_DUP_MAX = 0.01  # HugeCTR's default


@dataclass
class Curve:
    """Every prefix K = 0..n of a row order, replayed: per-step figures as arrays of n + 1."""

    order: pl.DataFrame  # tid, table_name, row, rb, lookups, benefit_rem, steps, src_steps, pos
    replica_bytes: np.ndarray  # per rank
    a2a_out: np.ndarray
    a2a_rem: np.ndarray
    dense: np.ndarray
    sparse: np.ndarray
    is_sparse: np.ndarray  # exchange_timing.sync_choice at each K
    coverage: np.ndarray  # share of lookups on hot rows
    union_rows: np.ndarray  # hot rows touched per step (union over ranks)
    comm_time: np.ndarray
    work: np.ndarray  # rank-side seconds per step (analyses.network's calibration; 0 without one)
    step_time: np.ndarray | None
    error: np.ndarray  # the model's error on step_time, seconds
    saved: dict[str, np.ndarray]  # '<collective>_out'/'_rem': bytes freed per step, exchange.replication_savings

    def collectives(self, s: ExchangeBaseline, k: int) -> dict[str, dict[str, float]]:
        """Per collective of the exchange: bytes_out and remote bytes per step left at K = k."""
        return {c: {"bytes_per_step": s.base[c][0] - float(self.saved[f"{c}_out"][k]),
                    "remote_bytes_per_step": s.base[c][1] - float(self.saved[f"{c}_rem"][k])}
                for c in exchange.COLLECTIVES}

    @property
    def sync(self) -> np.ndarray:
        return np.where(self.is_sparse, self.sparse, self.dense)

    def sync_kind(self, k: int) -> str:
        return "sparse_allreduce" if self.is_sparse[k] else "dense_allreduce"


def cannot(ctx: Context) -> str | None:
    """Why no embedding policy can be derived from this run, or None."""
    if not ctx.has("lookups"):
        return "the run has no lookups (record with --lookup-every N > 0)"
    if ctx.model.world_size < 2:
        return "one rank: every lookup is already local, nothing travels"
    if not ctx.has("comms"):
        return "the run has no comms: the source rank of each lookup is unknown"
    s = exchange.baseline(ctx)
    if s.sampled_steps == 0 or not s.base_remote:
        return "no training lookup could be attributed to a source rank (no input-dist all-to-all)"
    return None


def budget(ctx: Context) -> int | None:
    """Replica bytes per rank allowed by the options, None for no limit."""
    options = ctx.options
    if options.budget_bytes is not None:
        return int(options.budget_bytes)
    if options.budget_fraction is not None:
        return int(options.budget_fraction * ctx.model.embedding_bytes)
    return None


def replica_budget(ctx: Context) -> float:
    """Replica bytes per rank a policy building on replication's may use (tiers, schedule): the
    options' budget, else the replica bytes replication chose."""
    limit = budget(ctx)
    if limit is None:
        section = derive(ctx).section
        limit = section.prediction.figures.get("replica_bytes_per_rank", 0) if section else 0
    return limit


def estimated_rows(ctx: Context, s: ExchangeBaseline) -> str:
    """A temp table like tk_rows (per row: rb, lookups, steps, src_steps, benefit_rem ...), its
    figures over EVERY training step where `accesses` has them (exact counts), in units of the
    sampled steps' replay (lookups scaled by S/T; steps and src_steps too): choosing rows on the
    steps that then evaluate them would be optimistic (module docstring). A row's bytes freed per
    lookup are its table's mean: whether a lookup crossed ranks depends on which rank's sample made
    it, so a row's own sampled share (all remote, or all local, in a few sampled steps) is noise
    that would favour exactly the rows the sampled replay then finds remote. A row the sampled
    steps never saw counts one source rank per step touched."""
    return ctx.memo(estimated_rows, lambda: _estimated_rows(ctx, s))


def _estimated_rows(ctx: Context, s: ExchangeBaseline) -> str:
    names, rows = attribution.attributed(ctx).tables.names, exchange.baseline(ctx).tables.rows
    total = ctx.sql("SELECT count(DISTINCT step) FROM train_accesses").fetchall()[0][0] if ctx.has("accesses") else 0
    if not total:
        ctx.sql(f"CREATE OR REPLACE TEMP TABLE tk_rows_est AS SELECT * FROM {rows}")
        return "tk_rows_est"
    scale = max(s.sampled_steps, 1) / total
    ctx.sql(f"""CREATE OR REPLACE TEMP TABLE tk_rows_est AS
        WITH a AS (SELECT tid, "row", n_all, steps_all FROM {access_rows(ctx)}),
             per_table AS (SELECT tid, sum(benefit_rem)::DOUBLE / nullif(sum(lookups), 0) AS b,
                                  sum(benefit_out)::DOUBLE / nullif(sum(lookups), 0) AS b_out
                           FROM {rows} GROUP BY tid)
        SELECT a.tid, a."row", n.rb, n.kind,
               a.n_all * {scale!r} AS lookups, a.n_all * {scale!r} AS remote_lookups,
               a.steps_all * {scale!r} AS steps,
               a.steps_all * {scale!r} * coalesce(r.src_steps::DOUBLE / nullif(r.steps, 0), 1) AS src_steps,
               a.n_all * {scale!r} AS samples, a.n_all * {scale!r} AS placed,
               a.n_all * {scale!r} * coalesce(t.b_out, 0) AS benefit_out,
               a.n_all * {scale!r} * coalesce(t.b, 0) AS benefit_rem
        FROM a JOIN {names} n USING (tid) JOIN per_table t USING (tid) LEFT JOIN {rows} r USING (tid, "row")""")
    return "tk_rows_est"


def access_rows(ctx: Context, *, count_distinct: bool = False) -> str:
    """A temp table (its name returned): per row of a sharded table, its ids over every training step (n_all) and the
    steps that read it (steps_all). `accesses` holds one row per (step, rank, table, row), so a row
    only one rank recorded was read on exactly as many steps as it has accesses rows; only rows
    several ranks recorded (column-wise shards) need the costlier count of distinct steps (every row
    with `count_distinct`, which the tests compare): tid, row, n_all, steps_all, one_rank."""
    names = attribution.attributed(ctx).tables.names
    ctx.sql(f"""CREATE OR REPLACE TEMP TABLE tk_access_rows AS
                SELECT n.tid, x."row", x.lookups AS n_all, x.accesses::DOUBLE AS steps_all,
                       x.min_rank = x.max_rank AS one_rank
                FROM {row_totals(ctx)} x JOIN {names} n USING (table_name) WHERE n.sharded""")
    several = f"NOT one_rank OR {count_distinct}"
    if ctx.sql(f"SELECT count(*) FROM tk_access_rows WHERE {several}").fetchall()[0][0]:
        ctx.sql(f"""UPDATE tk_access_rows r SET steps_all = m.steps_all
                   FROM (SELECT n.tid, x."row", count(DISTINCT x.step)::DOUBLE AS steps_all
                         FROM train_accesses x JOIN {names} n USING (table_name)
                         SEMI JOIN (SELECT tid, "row" FROM tk_access_rows WHERE {several}) m
                              ON m.tid = n.tid AND m."row" = x."row"
                         GROUP BY ALL) m
                   WHERE r.tid = m.tid AND r."row" = m."row" """)
    return "tk_access_rows"


def order_table(ctx: Context, name: str, order_by: str) -> pl.DataFrame:
    """Write temp table `name` (module docstring) ordering the rows (`estimated_rows`) by the SQL
    `order_by` list, ties by lookups, tid, row; return the ordered rows with their figures."""
    names = attribution.attributed(ctx).tables.names
    rows = estimated_rows(ctx, exchange.baseline(ctx))
    ctx.sql(f"""CREATE OR REPLACE TEMP TABLE {name} AS
                SELECT r.*, n.table_name,
                       (row_number() OVER (ORDER BY {order_by}, r.lookups DESC, r.tid, r."row") - 1)::BIGINT AS pos
                FROM {rows} r JOIN (SELECT tid, table_name FROM {names}) n USING (tid)""")
    return ctx.frame(f"""SELECT tid, table_name, "row", rb, lookups, benefit_rem, steps, src_steps, pos
                         FROM {name} ORDER BY pos""")


def curve(ctx: Context, s: ExchangeBaseline, name: str, order_by: str) -> Curve:
    """Replay every prefix of the order `order_by` (module docstring)."""
    order = order_table(ctx, name, order_by)
    n = order.height
    saved = exchange.replication_savings(ctx, name, n)
    a2a_out, a2a_rem = exchange.curve_totals(s, saved, np.arange(n + 1))
    rb, steps, src_steps = (order[c].to_numpy().astype(np.float64) for c in ("rb", "steps", "src_steps"))
    dense, sparse = exchange.sync_bytes(s.world, s.id_bytes, rb, steps, src_steps, s.sampled_steps)
    zero = np.zeros(1)
    dense, sparse = np.concatenate([zero, dense]), np.concatenate([zero, sparse])
    lookups = order["lookups"].to_numpy().astype(np.float64)
    coverage = np.concatenate([zero, np.cumsum(lookups)]) / max(lookups.sum(), 1.0)
    union_rows = np.concatenate([zero, np.cumsum(steps)]) / max(s.sampled_steps, 1)
    remote = {c: s.base[c][1] - saved[f"{c}_rem"] for c in exchange.COLLECTIVES}
    hot_ids = coverage * s.lookups_per_rank
    k = np.arange(n + 1, dtype=np.float64)
    is_sparse = exchange_timing.sync_choice(ctx, s, remote, dense, sparse, hot_ids, union_rows, k)
    t = exchange_timing.timing(ctx, s, remote, is_sparse, np.where(is_sparse, sparse, dense), hot_ids,
                        np.where(is_sparse, union_rows, k))
    replica = np.concatenate([zero, np.cumsum(rb)])
    return Curve(order, replica, a2a_out, a2a_rem, dense, sparse, is_sparse, coverage, union_rows, t.comm_s,
                 t.work_s, t.step_s, t.error_s, saved)


def benefit_curve(ctx: Context) -> Curve:
    """Every prefix of the rows by benefit per replica byte (`benefit_key`), replayed once per
    context (ctx.memo); its order in tk_order_replication."""
    def replay() -> Curve:
        s = exchange.baseline(ctx)
        return curve(ctx, s, "tk_order_replication", benefit_key(s, network.network(ctx)))
    return ctx.memo(benefit_curve, replay)


def count_curve(ctx: Context) -> Curve:
    """Every prefix of the rows by count (HugeCTR's and FAE's order), replayed once per context
    (ctx.memo); its order in tk_order_count."""
    return ctx.memo(count_curve, lambda: curve(ctx, exchange.baseline(ctx), "tk_order_count", "r.lookups DESC"))


def benefit_key(s: ExchangeBaseline, net: network.Network) -> str:
    """SQL ORDER BY list over the rows: score_i descending (module docstring) while it is positive,
    then the rows that do not pay for their sync by all-to-all bytes freed per replica byte, so
    the curve past the optimum says what more memory would still take off the all-to-all."""
    w1 = s.world - 1
    sync = f"(({w1} * {s.id_bytes} * src_steps + 2 * {w1} * rb * steps) / {max(s.sampled_steps, 1)})"
    score = f"((benefit_rem - {sync}) / rb)"
    return f"{score} > 0 DESC, CASE WHEN {score} > 0 THEN {score} ELSE benefit_rem / rb END DESC"


def best(c: Curve, limit: int | None, objective: str = "time") -> int:
    """The K of least predicted step time (objective "time"; communication time where the run has no
    steps) or least network bytes, remote all-to-all plus sync ("bytes"), with replica bytes within
    `limit` (the smallest on ties)."""
    allowed = c.replica_bytes <= (limit if limit is not None else math.inf)
    if objective == "time":
        merit = c.step_time if c.step_time is not None else c.comm_time + c.work
    else:
        merit = c.a2a_rem + c.sync
    return int(np.argmin(np.where(allowed, merit, np.inf)))


def hugectr(ctx: Context, s: ExchangeBaseline) -> dict:
    """HugeCTR's count threshold (papers B.3) over the sampled steps, and how many rows pass it."""
    steps = max(s.sampled_steps, 1)
    batch = s.samples / steps
    per_rank = batch / s.world
    nodes = ctx.options.topology.nodes if ctx.options.topology else 1
    if nodes > 1:
        threshold = steps * nodes * nodes / (nodes - 1)  # BW_a2a / BW_ar = 1: one fitted link (analyses.network)
        rule = "I·N·(BW_a2a/BW_ar)·N/(N−1), BW_a2a = BW_ar"
    else:
        threshold = batch * steps * math.sqrt(2 * P_DUP_MAX / max(per_rank * (per_rank - 1), 1e-12))
        rule = "B·I·sqrt(2·p_dup/(M(M−1)))"
    passing, seen = ctx.sql(f"""SELECT count(*) FILTER (WHERE lookups >= {threshold!r}), count(*)
                                FROM {exchange.baseline(ctx).tables.rows}""").fetchall()[0]
    frequent = int(math.ceil(passing / s.world) * s.world)
    if frequent > seen:
        frequent = max(frequent - s.world, 0)
    return {"threshold": threshold, "rule": rule, "iterations": steps, "global_batch": batch,
            "per_rank_batch": per_rank, "nodes": nodes, "p_dup_max": P_DUP_MAX, "rows": frequent}


def sweep(s: ExchangeBaseline, c: Curve, points: dict[str, int], ordering: str) -> pl.DataFrame:
    """One row per K of `points` (label -> K), sorted by K."""
    rows = []
    for label, k in points.items():
        rows.append({"point": label, "ordering": ordering, "budget_bytes": float(c.replica_bytes[k]), "hot_rows": k,
                     A2A_BYTES: float(c.a2a_out[k]), A2A_REMOTE_BYTES: float(c.a2a_rem[k]),
                     "sparse_sync_bytes_per_step": float(c.sparse[k]), "dense_sync_bytes_per_step": float(c.dense[k]),
                     SYNC_BYTES: float(c.sync[k]), "sync": c.sync_kind(k),
                     "total_bytes_per_step": float(c.a2a_out[k] + c.sync[k]),
                     "total_remote_bytes_per_step": float(c.a2a_rem[k] + c.sync[k]),
                     COMM_TIME: float(c.comm_time[k]),
                     STEP_TIME: None if c.step_time is None else float(c.step_time[k]),
                     "lookup_coverage": float(c.coverage[k]), "union_hot_rows_per_step": float(c.union_rows[k])})
    return pl.DataFrame(rows, schema_overrides={STEP_TIME: pl.Float64}).sort("hot_rows", maintain_order=True)


def derive(ctx: Context) -> PolicyResult:
    """The replication section, its hot_rows list, the budget sweep and the evidence; once per
    context (ctx.memo)."""
    return ctx.memo(derive, lambda: _derive(ctx))


def _derive(ctx: Context) -> PolicyResult:
    reason = cannot(ctx)
    if reason:
        return PolicyResult("replication", reason=reason)
    s = exchange.baseline(ctx)
    net = network.network(ctx)
    c = benefit_curve(ctx)
    limit = budget(ctx)
    objective = ctx.options.objective
    k = best(c, limit, objective)
    h = hugectr(ctx, s)
    by_count = count_curve(ctx)
    points = {f"sweep {i}": p for i, p in enumerate(exchange.log_points(c.order.height))}
    points.update({"optimum": best(c, None, objective)} if limit is None
                  else {"optimum": best(c, None, objective), "budget": k})
    table = pl.concat([sweep(s, c, points, "benefit"), sweep(s, by_count, {"hugectr": h["rows"]}, "count")])
    table = table.with_columns(pl.col("point").str.replace(r"^sweep \d+$", "sweep"),
                               (pl.col("point") == ("budget" if limit is not None else "optimum")).alias("chosen"))
    replicated = c.order.head(k)
    rows = replicated.select("table_name", "row", pl.col("lookups").alias("count"),
                      pl.col("benefit_rem").alias("benefit_bytes"))
    sync = c.sync_kind(k)
    predicted = {A2A_BYTES: float(c.a2a_out[k]), A2A_REMOTE_BYTES: float(c.a2a_rem[k]),
                 SYNC_BYTES: float(c.sync[k]),
                 STEP_TIME: None if c.step_time is None else float(c.step_time[k]),
                 COMM_TIME: float(c.comm_time[k]), "rank_work_s": float(c.work[k]), "hot_rows": k,
                 "replica_bytes_per_rank": float(c.replica_bytes[k]), "lookup_coverage": float(c.coverage[k])}
    saved = s.base_remote - c.a2a_rem[k]
    why = (f"{k} rows by benefit per replica byte ({c.coverage[k]:.0%} of lookups): the all-to-all sends "
           f"{saved / max(s.base_remote, 1):.0%} fewer remote bytes for a {sync.replace('_', ' ')} of "
           f"{c.sync[k] / max(saved, 1):.2f}× those bytes; "
           + ("predicted step time least at this budget" if objective == "time"
              else "network bytes per step least at this budget"))
    if k == 0:
        why = (f"no row frees more all-to-all {objective} than its replica's synchronisation costs "
               f"({net.alpha(network.ALL_REDUCE) * 1e3:.2f} ms per added all-reduce"
               + (", with the rank-side work calibrated" if net.calibration else "") + "): nothing to replicate")
    section = Replication(kind="hybrid", rows="policy/hot_rows.parquet", sync=sync,
                          budget_bytes_per_rank=int(limit if limit is not None else c.replica_bytes[k]),
                          prediction=Prediction(predicted, why, intervals(ctx, s, c, k, "tk_order_replication")))
    if k:
        changes(ctx)["replication"] = exchange_timing.change(
            ctx, s, {col: v["remote_bytes_per_step"] for col, v in c.collectives(s, k).items()},
            sync == "sparse_allreduce", float(c.sync[k]), float(c.coverage[k]) * s.lookups_per_rank,
            float(c.union_rows[k]) if sync == "sparse_allreduce" else float(k))
    evidence = _evidence(s, c, k, limit, h, by_count, net)
    return PolicyResult("replication", section=section, rows={"hot_rows": rows}, evidence=evidence,
                        tables={"replication_sweep": table})


def intervals(ctx: Context, s: ExchangeBaseline, c: Curve, k: int, order: str) -> dict[str, list[float]]:
    """The estimated figures at K = k with their intervals: the all-to-all bytes (from sampled
    steps: exchange.step_interval, none where every step was sampled) and the step time (± the
    model's error, analyses.network)."""
    out = exchange.step_interval(ctx, s, order, k)
    if c.step_time is not None:
        out[STEP_TIME] = [float(max(c.step_time[k] - c.error[k], 0.0)), float(c.step_time[k] + c.error[k])]
    return out


def _evidence(s: ExchangeBaseline, c: Curve, k: int, limit: int | None, h: dict, by_count: Curve,
              net: network.Network) -> dict:
    """Which trace rows and formulas the section comes from, and HugeCTR's rule beside it."""
    return {
        "trace": f"train_lookups of {s.sampled_steps} sampled steps, source ranks from the input dist "
                 f"({'exact' if s.attribution.exact else 'approximate'})",
        "ordering": "score_i = (a2a_i − sync_i)/rb_i over every step's accesses, descending",
        "baseline": {A2A_BYTES: s.base_out, A2A_REMOTE_BYTES: s.base_remote,
                     STEP_TIME: s.step_time_s},
        "a2a_remote_bytes_saved_per_step": float(s.base_remote - c.a2a_rem[k]),
        "collectives": c.collectives(s, k),
        "sparse_sync_bytes_per_step": float(c.sparse[k]), "dense_sync_bytes_per_step": float(c.dense[k]),
        "union_hot_rows_per_step": float(c.union_rows[k]),
        "budget_bytes_per_rank": limit, "network": net.summary(), "step_error_s": float(c.error[k]),
        "hugectr": {**h, A2A_REMOTE_BYTES: float(by_count.a2a_rem[h["rows"]]),
                    SYNC_BYTES: float(by_count.sync[h["rows"]]),
                    COMM_TIME: float(by_count.comm_time[h["rows"]]),
                    "lookup_coverage": float(by_count.coverage[h["rows"]])},
        "notes": s.notes,
    }

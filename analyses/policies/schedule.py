"""FAE hot/cold scheduling (papers.md §4, B.2): the hot rows replicated on every rank, samples
whose every id is hot batched together, so those steps skip the all-to-all.

- Hot set: the global top-K rows across tables by count (lookups over the sampled steps), taken
  while their bytes fit the budget per rank (FAE: K = budget / row_bytes; Options.budget_bytes or
  budget_fraction). Without one, K is the schedule's own (`own_budget`): the hot-sample fraction
  grows with K, so every K along the count order is priced as the chosen one is below (its hot
  samples' steps skip the exchange, its replicas are synchronised) and the least predicted step
  time wins (the fewest network bytes under --objective bytes) within FAE's default share of the
  tables (FAE_HOT_SHARE), not replication's budget.
- A sample is hot when every id it holds, in every table, is hot (FAE's input classification).
  Samples are named across tables by the global sample id of analyses.attribution (sampled step,
  source rank, position in the source's batch). A sequence id that cannot be placed in a sample
  (row-wise sequence tables) makes every sample of its (step, source) batch cold if its row is
  cold (conservative). hot_sample_fraction H = hot samples / samples; with batches formed from each
  pool separately, a fraction H of the steps are hot (⌊H·N/B⌋ of N/B batches) and skip the
  all-to-all: hot_step_fraction = H.
- The trainer batches the whole epoch by a hot set chosen on the sampled steps. Counted on those
  same steps (in-sample), a hot set of every row they touch makes nearly every sampled sample
  all-hot, while the epoch's other samples are not (bench/RESULTS.md §33: 99.6% predicted in-sample, 75% of the
  steps ran hot). So H and the bytes are each a weighing of two figures: in-sample, for the share of
  the epoch the sampled steps hold (`coverage`: their samples over the run's `epoch_samples` metric,
  which the reference trainer reports; 0 where a run does not), and held out, for the rest: the
  sampled steps dealt into FOLDS folds, each classified and replayed with the top K rows by count
  on the others (held_out_ranks). The two figures are the intervals' ends.
- The trainer replicates the hot set and serves hot ids from the replicas in every step, hot or
  cold (tracekit/dlrm). So the predicted all-to-all bytes per step are replication's replay of that
  hot set less the lengths entries of the hot samples, which hot steps do not send:
  a2a = a2a_rep(K) − H · lengths, in-sample and held out each, weighed as H is (above).
- The replicas are synchronised every step: dense 2(W−1)·Σ rb over the hot set (exact), or sparse
  as replication's replay of the recorded batches (approximate: hot and cold batches touch other
  unions); the kind of less time (a collective's latency each: 3 sparse, 1 dense), or of fewer
  bytes under --objective bytes. `sync_bytes_per_hot_step` (evidence) replays the hot batches alone:
  the hot samples in order, cut into global batches of B (ranks' sub-batches of b).
- Each switch between phases moves the hot block between owners and replicas:
  switch_bytes = 2(W−1)·Σ rb over the hot set (FAE's public code switches twice per epoch;
  not in the per-step figures).

`schedule_sweep` (analysis table) gives the hot-sample fraction, the a2a bytes left and the merit
(predicted step time, or bytes) for hot sets of every size along the count order, so the budget FAE
needs is visible.

Outputs: the `schedule` section (kind "fae", hot_rows, hot_sample_fraction, predicted
{a2a_bytes_per_step, sync_bytes_per_step, step_time_s, hot_step_fraction, switch_bytes, ..., and the
model-quality change a calibration run measured, analyses.quality: batching hot samples apart changes the
order the model sees them in}) and its
row list: policy/hot_rows.parquet when the hot set is replication's, else policy/fae_hot_rows.parquet.
Its temporary tables (tk_fae_hot, tk_fae_cold_batches, tk_fae_cold, tk_fae_batches) are its own.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import polars as pl

from analyses import attribution, exchange, exchange_timing, network, quality
from analyses.context import Context, PolicyResult
from analyses.exchange import ExchangeBaseline
from analyses.policies import replication
from analyses.replay.prediction import changes
from tracekit.figures import A2A_BYTES, A2A_REMOTE_BYTES, HOT_SAMPLE_FRACTION, HOT_STEP_FRACTION, STEP_TIME, SYNC_BYTES
from tracekit.policy import Prediction, Schedule


def hot_set(ctx: Context, limit: float) -> pl.DataFrame:
    """Temp table tk_fae_hot (tid, row) and its rows (table_name, row, count, benefit_bytes): the
    most counted rows while their bytes fit `limit`."""
    names, rows = attribution.attributed(ctx).tables.names, exchange.baseline(ctx).tables.rows
    ctx.sql(f"""CREATE OR REPLACE TEMP TABLE tk_fae_hot AS
                SELECT tid, "row", lookups, benefit_rem FROM (
                    SELECT *, sum(rb) OVER (ORDER BY lookups DESC, tid, "row"
                                            ROWS BETWEEN UNBOUNDED PRECEDING AND CURRENT ROW) AS used
                    FROM {rows}) WHERE used <= {float(limit)!r}""")
    return ctx.frame(f"""SELECT n.table_name, h."row", h.lookups AS count, h.benefit_rem AS benefit_bytes
                         FROM tk_fae_hot h JOIN (SELECT tid, table_name FROM {names}) n USING (tid)
                         ORDER BY h.lookups DESC, h.tid, h."row" """)


def classify(ctx: Context) -> int:
    """Temp tables tk_fae_cold_batches (step, src: a batch holding an unplaced cold sequence id,
    every sample of it cold), tk_fae_cold (gid, step, src: the other samples holding a cold id)
    and tk_fae_batches (step, src, b, hot: hot samples per sampled batch); returns the cold count."""
    a, x = attribution.attributed(ctx).tables, exchange.baseline(ctx).tables.x
    ctx.sql(f"""CREATE OR REPLACE TEMP TABLE tk_fae_cold_batches AS
               SELECT DISTINCT l.step, l.src FROM {x} l ANTI JOIN tk_fae_hot h USING (tid, "row")
               WHERE l.gid IS NULL""")
    ctx.sql(f"""CREATE OR REPLACE TEMP TABLE tk_fae_cold AS
               SELECT DISTINCT l.gid, l.step, l.src FROM {x} l ANTI JOIN tk_fae_hot h USING (tid, "row")
               ANTI JOIN tk_fae_cold_batches USING (step, src) WHERE l.gid IS NOT NULL""")
    ctx.sql(f"""CREATE OR REPLACE TEMP TABLE tk_fae_batches AS
               SELECT b.step, b.src, b.b,
                      CASE WHEN w.step IS NOT NULL THEN 0 ELSE b.b - coalesce(c.n, 0) END AS hot
               FROM {a.batches} b JOIN {a.steps} USING (step)
               LEFT JOIN tk_fae_cold_batches w USING (step, src)
               LEFT JOIN (SELECT step, src, count(*) AS n FROM tk_fae_cold GROUP BY ALL) c USING (step, src)""")
    return int(ctx.sql("SELECT coalesce(sum(b - hot), 0) FROM tk_fae_batches").fetchall()[0][0])


def hot_batch_sync(ctx: Context, s: ExchangeBaseline, hot_bytes: float, hot_rows: int) -> tuple[float, str, float]:
    """(sync bytes per hot step, kind, hot batches replayed): hot samples in gid order cut into
    global batches of B (module docstring)."""
    names, x = attribution.attributed(ctx).tables.names, s.tables.x
    batch = max(int(round(s.samples / max(s.sampled_steps, 1))), 1)
    per_rank = max(batch // max(s.world, 1), 1)
    w1 = s.world - 1
    rows = ctx.sql(f"""
        WITH hot AS (SELECT DISTINCT l.gid FROM {x} l ANTI JOIN tk_fae_cold c USING (gid)
                     ANTI JOIN tk_fae_cold_batches USING (step, src) WHERE l.gid IS NOT NULL),
             numbered AS (SELECT gid, (row_number() OVER (ORDER BY gid) - 1) AS i FROM hot),
             full_batches AS (SELECT count(*) // {batch} AS n FROM numbered),
             cut AS (SELECT gid, i // {batch} AS hb, (i % {batch}) // {per_rank} AS r FROM numbered
                     WHERE i < greatest((SELECT n FROM full_batches), 1) * {batch}),
             touched AS (SELECT DISTINCT c.hb, c.r, l.tid, l."row" FROM {x} l JOIN cut c USING (gid)),
             per_rank AS (SELECT hb, count(*) AS u_r FROM touched GROUP BY hb),
             per_batch AS (SELECT u.hb, any_value(p.u_r) AS u_r, sum(n.rb) AS union_rb
                           FROM (SELECT DISTINCT hb, tid, "row" FROM touched) u JOIN {names} n USING (tid)
                           JOIN per_rank p USING (hb) GROUP BY u.hb)
        SELECT count(*), avg({w1} * {s.id_bytes} * u_r + 2 * {w1} * union_rb) FROM per_batch""").fetchall()[0]
    hot_batches, sparse = rows[0], float(rows[1] or 0.0) + exchange.count_exchange(s.world)
    dense = 2 * w1 * hot_bytes
    remote = {c: 0.0 for c in exchange.COLLECTIVES}
    is_sparse = bool(exchange_timing.sync_choice(ctx, s, remote, dense, sparse, s.lookups_per_rank, hot_rows, hot_rows))
    return (sparse if is_sparse else dense), ("sparse_allreduce" if is_sparse else "dense_allreduce"), hot_batches


@dataclass
class HotSampleCurve:
    """Per hot-set size K = 0..n along the count order (arrays of n + 1): the samples all-hot, and
    the a2a bytes (all, remote) those samples send, summed over the sampled steps; and the samples
    all-hot when each fold of the sampled steps is classified by the top K rows on the others
    (`held_out_samples`, `_held_out`; None from one sampled step)."""

    samples: np.ndarray
    out_bytes: np.ndarray
    remote_bytes: np.ndarray
    held_out_samples: np.ndarray | None = None

    def fraction(self, k: int | np.ndarray, samples: int, coverage: float) -> float | np.ndarray:
        """The share of the epoch's samples all-hot at hot-set size k: the `coverage` share the hot set
        was chosen on as counted in-sample, the rest as on held-out folds."""
        inside = self.samples[k] / max(samples, 1)
        if self.held_out_samples is None:
            return inside
        return coverage * inside + (1 - coverage) * self.held_out_samples[k] / max(samples, 1)


def coverage(ctx: Context, s: ExchangeBaseline) -> float:
    """The share of the epoch the trainer schedules that the sampled steps hold: their samples over
    the run's `epoch_samples` metric (the reference trainer's training split), at most 1; 0 where the
    run does not say (every sample then counts as unseen: the pessimistic end)."""
    epoch = (ctx.manifest.metrics or {}).get("epoch_samples")
    return min(1.0, s.samples / epoch) if isinstance(epoch, (int, float)) and epoch > 0 else 0.0


def hot_sample_curve(ctx: Context) -> HotSampleCurve:
    """The hot samples of every hot-set size, in one pass (a sample is hot for K > the last count
    position of its ids); sequence ids not placed in samples are left out. Once per context."""
    return ctx.memo(hot_sample_curve, lambda: _hot_sample_curve(ctx, exchange.baseline(ctx)))


def _hot_sample_curve(ctx: Context, s: ExchangeBaseline) -> HotSampleCurve:
    names, x, tshards = attribution.attributed(ctx).tables.names, s.tables.x, s.tables.tshards
    n = replication.count_curve(ctx).order.height  # its order in tk_order_count
    hist = ctx.frame(f"""
        WITH per_sample AS (
            SELECT l.gid, any_value(l.src) AS src, max(o.pos) AS maxpos,
                   sum({s.id_bytes} + CASE WHEN l.seq THEN 2 * n.rb ELSE 0 END) AS out_b,
                   sum(CASE WHEN l.owner <> l.src THEN {s.id_bytes} + CASE WHEN l.seq THEN 2 * n.rb ELSE 0 END
                            ELSE 0 END) AS rem_b
            FROM {x} l JOIN tk_order_count o USING (tid, "row") JOIN {names} n USING (tid)
            WHERE l.gid IS NOT NULL GROUP BY l.gid),
             fixed AS (
            SELECT t.src, sum(CASE WHEN n.kind = 'pooled' THEN {s.len_bytes} + 2 * n.rb ELSE {s.len_bytes} END
                              * t.n_shards) AS out_b,
                          sum(CASE WHEN n.kind = 'pooled' THEN {s.len_bytes} + 2 * n.rb ELSE {s.len_bytes} END
                              * t.n_remote_shards) AS rem_b
            FROM {tshards} t JOIN {names} n USING (tid) WHERE n.sharded GROUP BY t.src)
        SELECT maxpos, count(*) AS samples, sum(p.out_b + f.out_b)::DOUBLE AS out_b,
               sum(p.rem_b + f.rem_b)::DOUBLE AS rem_b
        FROM per_sample p JOIN fixed f USING (src) GROUP BY maxpos""")

    return HotSampleCurve(_cumulative(hist, "samples", n), _cumulative(hist, "out_b", n),
                          _cumulative(hist, "rem_b", n), _held_out(ctx, n))


def _cumulative(hist: pl.DataFrame, column: str, n: int) -> np.ndarray:
    """Per K = 0..n, `column` summed over the histogram's positions below K (maxpos n: never)."""
    per = np.zeros(n + 2)
    np.add.at(per, hist["maxpos"].to_numpy().astype(np.int64) + 1, hist[column].to_numpy())
    return np.cumsum(per)[:n + 1]


FOLDS = 8
"""Folds of the sampled steps the held-out hot share and bytes are estimated over (fewer with fewer
steps): each fold is classified by a hot set chosen on the others, so on 7/8 of the counts the
trainer's hot set is chosen on."""


def held_out_ranks(ctx: Context) -> int:
    """Temp tables tk_fae_folds (step, fold: the sampled steps dealt in turn into min(FOLDS, steps)
    folds) and tk_fae_ranked (tid, row, fold, pos: the rows by count on every other fold, most read
    first); the folds made, 0 from one sampled step. Once per context."""
    x = exchange.baseline(ctx).tables.x

    def build() -> int:
        folds = min(FOLDS, ctx.sql(f"SELECT count(DISTINCT step) FROM {x}").fetchall()[0][0])
        if folds < 2:
            return 0
        ctx.sql(f"""CREATE OR REPLACE TEMP TABLE tk_fae_folds AS
                    SELECT step, dense_rank() OVER (ORDER BY step) % {folds} AS fold
                    FROM (SELECT DISTINCT step FROM {x})""")
        ctx.sql(f"""CREATE OR REPLACE TEMP TABLE tk_fae_ranked AS
            WITH per AS (SELECT tid, "row", fold, count(*) AS c FROM {x} JOIN tk_fae_folds USING (step)
                         GROUP BY ALL),
                 total AS (SELECT tid, "row", sum(c) AS c FROM per GROUP BY ALL),
                 others AS (SELECT t.tid, t."row", f.fold, t.c - coalesce(p.c, 0) AS c
                            FROM total t CROSS JOIN (SELECT range AS fold FROM range({folds})) f
                            LEFT JOIN per p ON p.tid = t.tid AND p."row" = t."row" AND p.fold = f.fold)
            SELECT tid, "row", fold, row_number() OVER (PARTITION BY fold ORDER BY c DESC, tid, "row") - 1 AS pos
            FROM others WHERE c > 0""")
        return folds
    return ctx.memo(held_out_ranks, build)


def _held_out(ctx: Context, n: int) -> np.ndarray | None:
    """Per hot-set size K = 0..n, the samples all-hot when each fold of the sampled steps is
    classified by the top K rows by count on the other folds (held_out_ranks); None from one step."""
    if not held_out_ranks(ctx):
        return None
    hist = ctx.frame(f"""
        WITH per_sample AS (
            SELECT l.gid, max(coalesce(least(r.pos, {n}), {n})) AS maxpos
            FROM {exchange.baseline(ctx).tables.x} l JOIN tk_fae_folds f USING (step)
            LEFT JOIN tk_fae_ranked r ON r.tid = l.tid AND r."row" = l."row" AND r.fold = f.fold
            WHERE l.gid IS NOT NULL GROUP BY l.gid)
        SELECT maxpos, count(*) AS samples FROM per_sample GROUP BY maxpos""")
    return _cumulative(hist, "samples", n)


def held_out_a2a(ctx: Context, s: ExchangeBaseline, k: int) -> tuple[float, float] | None:
    """(all, remote) all-to-all bytes per step left when each fold of the sampled steps is replayed
    with the top k rows by count on the other folds replicated (held_out_ranks): replication's replay
    (analyses.exchange.items_sql) of a hot set on steps it was not chosen from. None from one step."""
    folds = held_out_ranks(ctx)
    if not folds:
        return None
    freed_out = freed_rem = 0.0
    for fold in range(folds):
        ctx.sql(f"""CREATE OR REPLACE TEMP TABLE tk_fae_order AS
                    SELECT tid, "row", pos FROM tk_fae_ranked WHERE fold = {fold} AND pos < {int(k)}""")
        out, rem = ctx.sql(f"""
            SELECT coalesce(sum(len_out + ids_out + 2 * row_out), 0)::DOUBLE,
                   coalesce(sum(len_rem + ids_rem + 2 * row_rem), 0)::DOUBLE
            FROM ({exchange.items_sql(ctx, "tk_fae_order")}) i JOIN tk_fae_folds f USING (step)
            WHERE i.maxpos IS NOT NULL AND f.fold = {fold}""").fetchall()[0]
        freed_out, freed_rem = freed_out + out, freed_rem + rem
    steps = max(s.sampled_steps, 1)
    return s.base_out - freed_out / steps, s.base_remote - freed_rem / steps


FAE_HOT_SHARE = 0.124
"""The most of the embedding bytes the schedule's own budget replicates: FAE's default hot memory
(256 MiB at d = 16, `--hot-emb-gpu-mem`) is 12.4% of Criteo Kaggle's rows (papers.md §4). Past it
the hot set is no longer hot: replicating every table is data parallelism, which a memory budget
(--budget) may still ask for."""


def own_budget(ctx: Context, s: ExchangeBaseline) -> tuple[float, np.ndarray, bool]:
    """FAE's hot set sized by its own benefit where the options name no budget: the K along the
    count order of least predicted step time (or of fewest network bytes under --objective bytes)
    within FAE_HOT_SHARE of the embedding bytes, each K priced as `_derive` prices the chosen one
    (its hot samples' steps skip the exchange). Returns (its replica bytes per rank, the merit per K,
    whether the merit is a step time)."""
    c, h = replication.count_curve(ctx), hot_sample_curve(ctx)
    fraction = h.fraction(np.arange(c.order.height + 1), s.samples, coverage(ctx, s))
    lengths_rem = s.base["input_lengths"][1]
    remote = {col: (1 - fraction) * (s.base[col][1] - c.saved[f"{col}_rem"]) for col in exchange.COLLECTIVES}
    k = np.arange(c.order.height + 1, dtype=np.float64)
    t = exchange_timing.timing(ctx, s, remote, c.is_sparse, c.sync, c.coverage * s.lookups_per_rank,
                        np.where(c.is_sparse, c.union_rows, k), skipped_calls=fraction * len(exchange.COLLECTIVES))
    by_time = ctx.options.objective == "time" and t.step_s is not None
    merit = np.asarray(t.step_s, dtype=np.float64) if by_time else c.a2a_rem - fraction * lengths_rem + c.sync
    allowed = c.replica_bytes <= _hot_cap(ctx)
    return float(c.replica_bytes[int(np.argmin(np.where(allowed, merit, np.inf)))]), merit, by_time


def _hot_cap(ctx: Context) -> float:
    return FAE_HOT_SHARE * ctx.model.embedding_bytes


def sweep(ctx: Context, s: ExchangeBaseline, chosen: int, merit: np.ndarray | None) -> pl.DataFrame:
    """Table `schedule_sweep`: per hot-set size K (rows by count) the hot-sample fraction, the a2a
    bytes per step left and the merit the budget was chosen by (where it was)."""
    order, h = replication.count_curve(ctx).order, hot_sample_curve(ctx)
    budget = np.concatenate([[0.0], np.cumsum(order["rb"].to_numpy().astype(np.float64))])
    steps = max(s.sampled_steps, 1)
    points = sorted({*exchange.log_points(order.height), chosen})
    return pl.DataFrame({"hot_rows": points, "budget_bytes": budget[points],
                         "hot_sample_fraction": h.fraction(np.asarray(points), s.samples, coverage(ctx, s)),
                         "hot_sample_fraction_in_sample": h.samples[points] / max(s.samples, 1),
                         "hot_sample_fraction_held_out": (h.samples if h.held_out_samples is None
                                                          else h.held_out_samples)[points] / max(s.samples, 1),
                         A2A_BYTES: s.base_out - h.out_bytes[points] / steps,
                         A2A_REMOTE_BYTES: s.base_remote - h.remote_bytes[points] / steps,
                         "merit": np.full(len(points), np.nan) if merit is None else merit[points],
                         "chosen": [p == chosen for p in points]})


def derive(ctx: Context) -> PolicyResult:
    """The schedule section and its hot-row list (module docstring); once per context (ctx.memo)."""
    return ctx.memo(derive, lambda: _derive(ctx))


def _derive(ctx: Context) -> PolicyResult:
    reason = replication.cannot(ctx)
    if reason:
        return PolicyResult("schedule", reason=reason)
    s = exchange.baseline(ctx)
    rep = replication.derive(ctx)
    merit, by_time = None, False
    limit = replication.budget(ctx)
    if limit is None:
        limit, merit, by_time = own_budget(ctx, s)
    rows = hot_set(ctx, limit)
    names = attribution.attributed(ctx).tables.names
    hot_bytes = float(ctx.sql(f"SELECT coalesce(sum(n.rb), 0) FROM tk_fae_hot JOIN {names} n USING (tid)")
                      .fetchall()[0][0])
    cold = classify(ctx)
    k = rows.height
    in_sample = 1 - cold / s.samples if s.samples else 0.0
    held = hot_sample_curve(ctx).held_out_samples
    held = in_sample if held is None else min(in_sample, float(held[k]) / max(s.samples, 1))
    covered = coverage(ctx, s)
    fraction = covered * in_sample + (1 - covered) * held
    sync_hot, _, hot_batches = hot_batch_sync(ctx, s, hot_bytes, k)
    replicated = replication.count_curve(ctx)
    lengths_out, lengths_rem = s.base["input_lengths"]
    # each figure as on the samples the hot set was chosen on (in-sample) and as on held-out folds,
    # weighed by the share of the epoch each is (module docstring)
    rep_in = (float(replicated.a2a_out[k]), float(replicated.a2a_rem[k]))
    rep_held = held_out_a2a(ctx, s, k) or rep_in
    inside = {A2A_BYTES: rep_in[0] - in_sample * lengths_out, A2A_REMOTE_BYTES: rep_in[1] - in_sample * lengths_rem}
    outside = {A2A_BYTES: rep_held[0] - held * lengths_out, A2A_REMOTE_BYTES: rep_held[1] - held * lengths_rem}
    a2a_out, a2a_rem = (covered * inside[f] + (1 - covered) * outside[f] for f in (A2A_BYTES, A2A_REMOTE_BYTES))
    # hot steps make no exchange call: every collective of the exchange keeps (1 − H) of its bytes
    remote = {c: (1 - fraction) * replicated.collectives(s, k)[c]["remote_bytes_per_step"]
              for c in exchange.COLLECTIVES}
    sync_kind = replicated.sync_kind(k)
    sync = float(replicated.sync[k]) if k else 0.0
    rows_synced = replicated.union_rows[k] if sync_kind == "sparse_allreduce" else k
    t = exchange_timing.timing(ctx, s, remote, sync_kind == "sparse_allreduce", sync,
                        replicated.coverage[k] * s.lookups_per_rank, rows_synced,
                        skipped_calls=fraction * len(exchange.COLLECTIVES))
    if k:
        changes(ctx)["schedule"] = exchange_timing.change(
            ctx, s, remote, sync_kind == "sparse_allreduce", sync, replicated.coverage[k] * s.lookups_per_rank,
            rows_synced, fraction * len(exchange.COLLECTIVES))
    step_time = None if t.step_s is None else float(t.step_s)
    saved_rem = s.base_remote - a2a_rem
    switch = 2 * (s.world - 1) * hot_bytes
    predicted = {A2A_BYTES: a2a_out, A2A_REMOTE_BYTES: a2a_rem, SYNC_BYTES: sync,
                 STEP_TIME: step_time, HOT_STEP_FRACTION: fraction, HOT_SAMPLE_FRACTION: fraction,
                 "hot_rows": rows.height, "switch_bytes": switch}
    shared = rep.section is not None and _same_rows(rows, rep.rows["hot_rows"])
    name = "hot_rows" if shared else "fae_hot_rows"
    rows = rep.rows["hot_rows"] if shared else rows  # one file, written the same by either policy
    why = (f"{fraction:.0%} of samples hold only the {rows.height} most-read rows: batched apart, that share "
           f"of steps skips the all-to-all ({saved_rem / max(s.base_remote, 1):.0%} of its remote bytes)")
    if merit is not None:
        why += "; " + _own_budget_why(ctx, s, k, merit, by_time)
    spans = {}
    if step_time is not None:
        error = float(t.error_s)
        spans[STEP_TIME] = (max(step_time - error, 0.0), step_time + error)
    # from sampled steps the hot set's exchange is an estimate: replication's interval at this hot set,
    # less the hot samples' lengths as the figure itself
    # and between the held-out and the in-sample figure, the ends of the weighing
    spans[HOT_SAMPLE_FRACTION] = spans[HOT_STEP_FRACTION] = (held, in_sample)
    sampled = exchange.step_interval(ctx, s, "tk_order_count", k)
    for figure in inside:
        low, high = sampled.get(figure, (predicted[figure], predicted[figure]))
        shift = predicted[figure] - (rep_in[0] if figure == A2A_BYTES else rep_in[1])
        ends = (inside[figure], outside[figure])
        spans[figure] = (min(low + shift, *ends), max(high + shift, *ends))
    section = Schedule(hot_rows=f"policy/{name}.parquet", hot_sample_fraction=fraction, sync=sync_kind,
                       budget_bytes_per_rank=int(limit), prediction=Prediction(predicted, why, spans))
    evidence = {"samples": s.samples, "cold_samples": cold, "epoch_coverage": covered,
                "hot_sample_fraction_in_sample": in_sample, "hot_sample_fraction_held_out": held,
                "hot_batches_replayed": hot_batches,
                "hot_step_sync": sync_kind, "sync_bytes_per_hot_step": sync_hot, "hot_set_bytes": hot_bytes,
                "shared_with_replication": shared, "network": network.network(ctx).summary(),
                "notes": list(s.notes)}
    section = quality.attach(section, "schedule", quality.load(ctx.path), evidence)
    return PolicyResult("schedule", section=section, rows={name: rows}, evidence=evidence,
                        tables={"schedule_sweep": sweep(ctx, s, rows.height, merit)})


def _own_budget_why(ctx: Context, s: ExchangeBaseline, k: int, merit: np.ndarray, by_time: bool) -> str:
    """How the schedule's own budget chose `k`, and what the largest hot set it allows would do."""
    largest = int(np.searchsorted(replication.count_curve(ctx).replica_bytes, _hot_cap(ctx), side="right") - 1)

    def shown(value: float) -> str:
        return f"{value * 1e3:.2f} ms" if by_time else f"{value:,.0f} network bytes"

    share = hot_sample_curve(ctx).fraction(largest, s.samples, coverage(ctx, s))
    return (f"its hot set is the one of {'least predicted step time' if by_time else 'fewest network bytes'} "
            f"({shown(merit[k])}) up to {FAE_HOT_SHARE:.1%} of the tables; the largest, {largest} rows, would "
            f"make {share:.0%} of samples all-hot at {shown(merit[largest])}")


def _same_rows(a: pl.DataFrame, b: pl.DataFrame) -> bool:
    key = ["table_name", "row"]
    return a.height == b.height and a.select(key).sort(key).equals(b.select(key).sort(key))

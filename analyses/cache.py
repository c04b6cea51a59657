"""What a software embedding cache would do with the recorded training lookups: FBGEMM TBE's LRU and
LFU caches and the static top-K oracle (replayed by analyses.cache_sim), per table over a range of
cache sizes (miss-ratio curves, `cache_mrc`), and the inputs TorchRec's planner takes for a cached
table (`analysis/torchrec_cache_stats.json`, analyses.torchrec_cache_stats).

The caches:
- one cache per table and rank (the rows that rank holds: its shards in the manifest, or the whole
  table), of load factor lf: `sets` = ceil(rows * lf / 32), 32 ways;
- a batch is one step's lookups on one rank, deduplicated (the `accesses` rows of that step and
  rank); miss_ratio = misses / ids over all batches (FBGEMM's unique-miss ratio);
- the oracle keeps the K = sets * 32 rows of the rank's table that appear in the most batches
  resident for the whole run.

`cache_mrc`: a row per table, policy (lru | lfu | oracle) and load factor: cache_rows (the real
caches' slots, every rank's together), miss_ratio, unique_miss_per_batch (misses per training step,
every rank together: miss_ratio times the table's exact ids per step), sample_rate, simulated_rows.

At scale (SHARDS, Waldspurger et al., FAST '15): the replay runs on a hashed row sample
(`replay_sample`: rate R_t per table, `sample_rate`, keeping at least MIN_SAMPLED_ROWS distinct rows of
a table, all of a smaller one); a sampled cache has R_t times the slots, as ceil(sets * R_t) sets of
round(32 * sets * R_t / those sets) ways (at most 32), so that a sampled row meets as much
competition per slot as it would in the full cache. Where R_t = 1 the replay is exact. A sampled
table's few hottest rows (HOT_ROWS, HOT_SHARE) are replayed whatever their hash, each standing for
itself where a sampled row stands for 1/R_t rows (`Stream.weight`), and given their own slots in the
sampled cache (R_t * slots + (1 - R_t) * hot rows): which of them a hash keeps would otherwise move
the whole curve (stratified sampling; the slots assume the hot rows stay resident, which is why
they are kept to a few percent of the smallest cache). A long run's
sample would outgrow the replay's budget: it is then replayed over the run's last steps only, the
first WARMUP_SHARE of them warming the caches uncounted (a steady state; `compute` names those
tables). `simulated_rows` is the sampled cache's size, `cache_rows` the real one.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import polars as pl

from analyses.cache_sim import Stream, oracle, simulate
from analyses.context import Context, Result
from analyses.row_totals import row_totals, shared_tables
from analyses.skew import (SAMPLE_ROWS, Sample, access_sample, hashed_sample, lookup_histogram,
                           no_training_accesses, sampled_tables)
from analyses.torchrec_cache_stats import planner_stats, write_stats

LOAD_FACTORS = (0.01, 0.02, 0.05, 0.1, 0.2, 0.5)
MIN_SAMPLED_ROWS = 16384  # distinct rows a table's hashed sample keeps at least (all, for a smaller table)
SAMPLE_BOOST = 4  # the replay samples this many times the accesses rows skew samples (sample_rows)
WINDOW_AFTER = 4  # a table's sample longer than this many times sample_rows is replayed over a step window
WARMUP_SHARE = 0.25  # of a step window: replayed to fill the caches, not counted
HOT_ROWS = 1024  # a sampled table's rows read most in the replayed steps are replayed whatever their hash ...
HOT_SHARE = 0.0003  # ... at most this share of its distinct rows: 3% of the smallest cache (lf 0.01)
WAYS = 32
POLICIES = ("lru", "lfu", "oracle")


# ---------------------------------------------------------------------------------------------- geometry

def rows_held(ctx: Context, table: str, rank: int, fallback: int) -> int:
    """Rows of `table` on `rank`: its shards there, else the whole table."""
    try:
        info = ctx.model.table(table)
    except KeyError:
        return fallback
    mine = info.rows_on(rank)
    return mine or info.num_rows or fallback


def geometry(full_sets: np.ndarray, rate: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Sets and ways of the sampled caches: `rate` (per cache, or per cache and load factor) times
    the slots of `full_sets` x 32 (module docstring); the full caches themselves where it is 1."""
    rate = rate if rate.ndim == 2 else rate[:, None]
    scaled = full_sets * rate
    sets = np.maximum(1, np.ceil(scaled)).astype(np.int64)
    ways = np.maximum(1, np.round(WAYS * scaled / sets)).astype(np.int64)  # <= 32
    exact = rate >= 1
    return np.where(exact, full_sets, sets), np.where(exact, WAYS, ways)


# ---------------------------------------------------------------------------------------------- compute

@dataclass
class Replay:
    """The caches replayed over one row sample: `mrc` is the `cache_mrc` table, `totals` per table
    its exact lookups, accesses rows and rows seen (skew's histogram), `steps` the steps replayed."""

    sample: Sample  # skew's row sample (analyses.skew.access_sample), for the planner's figures
    totals: dict[str, dict]
    steps: int
    mrc: pl.DataFrame
    replayed: Windowed  # what the caches replayed


def replay(ctx: Context, *, sample_rows: int | None = SAMPLE_ROWS, load_factors: tuple[float, ...] = LOAD_FACTORS,
           tables: tuple[str, ...] | None = None) -> Replay | None:
    """LRU, LFU and the oracle replayed over the training accesses (module docstring), of `tables`
    only when given; once per context and arguments (ctx.memo). None without training accesses."""
    if no_training_accesses(ctx):
        return None
    load_factors = tuple(load_factors)
    return ctx.memo((replay, sample_rows, load_factors, tables),
                    lambda: _replay(ctx, sample_rows, load_factors, tables))


def miss_ratio_curves(ctx: Context) -> pl.DataFrame:
    """`cache_mrc` as `compute` writes it (the default sample and load factors): what analyses.planner
    reads; no rows (table_name, policy, load_factor, miss_ratio) without training accesses."""
    done = replay(ctx)
    if done is None:
        return pl.DataFrame(schema={"table_name": pl.String, "policy": pl.String, "load_factor": pl.Float64,
                                    "miss_ratio": pl.Float64})
    return done.mrc


@dataclass
class Windowed:
    """The caches' own row sample (`replay_sample`): `sample` (its rates R_t, at least
    MIN_SAMPLED_ROWS distinct rows of each table), per table the first step replayed and the first
    counted (`first`, `counted`; both the first training step where the whole run is replayed)."""

    sample: Sample
    first: np.ndarray
    counted: np.ndarray

    def windowed(self) -> list[str]:
        return [name for name, f in zip(self.sample.names, self.first) if f > self.first.min()]


def replay_sample(ctx: Context, sample_rows: int | None, tables: tuple[str, ...] | None) -> Windowed:
    """The accesses the caches replay: every one where `sample_rows` is None; else per table a
    hashed row sample (SHARDS) at R_t = min(1, max(SAMPLE_BOOST · sample_rows / A_t,
    MIN_SAMPLED_ROWS / D_t)), A_t its accesses rows and D_t its distinct rows: a sample of a few rows
    cannot stand for a cache of hundreds. Where R_t · A_t exceeds WINDOW_AFTER · `sample_rows`, only
    the last steps whose share of the run holds that many are replayed, the first WARMUP_SHARE of
    them filling the caches uncounted: a steady state, in place of the run's every step. A sampled
    table's `hot_rows` rows read in the most replayed steps are replayed whatever their hash, so that
    the sample's error does not rest on which of the few hottest rows its hash happens to keep."""
    if sample_rows is None:
        sample = access_sample(ctx, None, tables)
        start = np.full(len(sample.names), sample.step.min(initial=0), dtype=np.int64)
        return Windowed(sample, start, start)
    per_table = lookup_histogram(ctx).group_by("table_name").agg(pl.col("accesses").sum(), pl.col("rows").sum()) \
        .sort("table_name")
    if tables is not None:
        per_table = per_table.filter(pl.col("table_name").is_in(tables))
    names = per_table["table_name"].to_list()
    accesses = np.maximum(per_table["accesses"].to_numpy(), 1).astype(np.float64)
    distinct = np.maximum(per_table["rows"].to_numpy(), 1).astype(np.float64)
    rate = np.minimum(1.0, np.maximum(SAMPLE_BOOST * sample_rows / accesses, MIN_SAMPLED_ROWS / distinct))
    first_step, last_step = ctx.sql("SELECT min(step), max(step) FROM train_accesses").fetchall()[0]
    span = last_step - first_step + 1
    share = np.minimum(1.0, WINDOW_AFTER * sample_rows / (rate * accesses))  # of the run's steps replayed
    first = np.where(share < 1, last_step + 1 - np.ceil(share * span), first_step).astype(np.int64)
    counted = np.where(share < 1, first + np.ceil(WARMUP_SHARE * (last_step + 1 - first)), first).astype(np.int64)
    hot = np.where(rate < 1, np.minimum(HOT_ROWS, np.floor(HOT_SHARE * distinct)), 0).astype(np.int64)
    return Windowed(hashed_sample(ctx, names, rate, first, hot_rows(ctx, names, first, hot)), first, counted)


def hot_rows(ctx: Context, names: list[str], first: np.ndarray, hot: np.ndarray) -> pl.DataFrame:
    """(tid, row): the hot[t] rows of table names[t] in the most training steps from step first[t] on."""
    ctx.con.register("tk_hot_counts", pl.DataFrame(
        {"table_name": names, "tid": np.arange(len(names), dtype=np.int32), "first": first, "hot": hot})
        .filter(pl.col("hot") > 0).to_arrow())
    try:
        return ctx.frame("""
            SELECT r.tid, a."row" FROM train_accesses a JOIN tk_hot_counts r USING (table_name)
            WHERE a.step >= r.first GROUP BY r.tid, a."row", r.hot
            QUALIFY row_number() OVER (PARTITION BY r.tid ORDER BY count(*) DESC, a."row") <= r.hot""")
    finally:
        ctx.con.unregister("tk_hot_counts")


def _replay(ctx: Context, sample_rows: int | None, load_factors: tuple[float, ...],
            tables: tuple[str, ...] | None) -> Replay:
    histogram = lookup_histogram(ctx)
    replayed = replay_sample(ctx, sample_rows, tables)
    sample = replayed.sample
    totals = histogram.group_by("table_name").agg(
        (pl.col("lookups") * pl.col("rows")).sum().alias("lookups"), pl.col("accesses").sum(),
        (pl.col("max_row").max() + 1).alias("seen_rows"))
    totals = {row["table_name"]: row for row in totals.iter_rows(named=True)}

    n_tables = len(sample.names)  # a cache per (rank, table), numbered in the sample's order
    pairs, group = np.unique(sample.rank * n_tables + sample.table, return_inverse=True)
    table_of = pairs % n_tables
    held = np.array([rows_held(ctx, sample.names[t], int(p // n_tables), totals[sample.names[t]]["seen_rows"])
                     for p, t in zip(pairs, table_of)], dtype=np.int64)
    lf = np.asarray(load_factors, dtype=np.float64)
    full_sets = np.maximum(1, np.ceil(held[:, None] * lf[None, :] / WAYS)).astype(np.int64)
    rate = sample.rates[sample.table]
    weight = (sample.step >= replayed.counted[sample.table]) / rate
    hot_slots = np.zeros(len(pairs))
    if sample.hot is not None:  # hot rows stand for themselves only, and hold their own slots
        weight[sample.hot] *= rate[sample.hot]
        hot_slots = np.bincount(np.unique(group.ravel()[sample.hot] * (1 << 48) + sample.row[sample.hot]) >> 48,
                                minlength=len(pairs))
    stream = Stream(sample.step, group.ravel().astype(np.int64), sample.row, sample.count,
                    None if (weight == 1).all() else weight)
    cache_rate = sample.rates[table_of][:, None]
    sets, ways = geometry(full_sets, np.minimum(1, cache_rate + (1 - cache_rate) * hot_slots[:, None]
                                                / (full_sets * WAYS)))

    events = stream.tally(len(pairs))
    _, ugroup, ukey = stream.ids  # computed once, before the replays share it
    prior = lfu_prior(ctx, sample.names, table_of[ugroup], ukey, stream)
    with ThreadPoolExecutor(2) as pool:  # numpy releases the GIL in the replays' heavy calls
        lru, lfu = pool.map(lambda policy: simulate(policy, stream, sets, ways, prior)[0], ("lru", "lfu"))
    misses = {"lru": lru, "lfu": lfu, "oracle": oracle(stream, sets * ways)[0]}
    events = {policy: events for policy in misses}
    whole, missed, counted = exact_oracle(ctx, sample.names, pairs // n_tables, table_of, full_sets * WAYS)
    misses["oracle"] = np.where(whole[:, None], missed, misses["oracle"])  # caches the totals give exactly
    events["oracle"] = np.where(whole, counted, events["oracle"])
    steps = len(np.unique(access_sample(ctx, sample_rows, tables).step))  # the run's, not the window's
    ids_per_step = np.array([totals[name]["accesses"] for name in sample.names]) / steps  # exact, unsampled
    mrc = mrc_table(sample, table_of, events, misses, full_sets, sets * ways, lf, ids_per_step)
    return Replay(access_sample(ctx, sample_rows, tables), totals, steps, mrc, replayed)


def lfu_prior(ctx: Context, names: list[str], table: np.ndarray, key: np.ndarray, stream: Stream) -> np.ndarray | None:
    """Per uid (of table names[table[u]], row key[u]), its lookups before the stream's first step:
    the run's (analyses.row_totals) less the stream's own, so that LFU's counts over a window of
    steps start where the whole run's stood; for tables whose every row one rank read (a count
    per cache), else 0. None where the stream starts at the run's first step."""
    first = ctx.sql("SELECT min(step) FROM train_accesses").fetchall()[0][0]
    if not len(stream.step) or stream.step.min() <= first:
        return None
    uid = stream.ids[0]
    seen = np.bincount(uid, weights=stream.count, minlength=len(key))
    ctx.con.register("tk_lfu_keys", pl.DataFrame({"u": np.arange(len(key)), "table_name": np.asarray(names)[table],
                                                  "row": key}).to_arrow())
    try:
        totals = ctx.frame(f"""SELECT k.u, t.lookups FROM tk_lfu_keys k JOIN {row_totals(ctx)} t USING (table_name, "row")
                               WHERE k.table_name NOT IN ({shared_tables(ctx)})""")
    finally:
        ctx.con.unregister("tk_lfu_keys")
    prior = np.zeros(len(key))
    prior[totals["u"].to_numpy()] = totals["lookups"].to_numpy() - seen[totals["u"].to_numpy()]
    return np.maximum(prior, 0).round()


def exact_oracle(ctx: Context, names: list[str], rank: np.ndarray, table_of: np.ndarray,
                 capacity: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The oracle over the whole run, unsampled, from the per-row totals (analyses.row_totals), for
    the caches (rank[c], names[table_of[c]]) of tables whose every row one rank read (so that a row's
    accesses rows are its batches on that rank): (which caches, misses per cache and capacity
    `capacity[c, v]`, ids per cache). The others' entries are 0: the replay's oracle stands there."""
    caches = len(rank)
    whole = np.zeros(caches, dtype=bool)
    missed, counted = np.zeros(capacity.shape), np.zeros(caches)
    runs = ctx.frame(f"""SELECT table_name, min_rank AS rank, accesses, count(*) AS rows FROM {row_totals(ctx)}
                         WHERE table_name IN (SELECT unnest(?::VARCHAR[]))
                           AND table_name NOT IN ({shared_tables(ctx)})
                         GROUP BY ALL ORDER BY table_name, rank, accesses DESC""", [names])
    where = {(name, r): c for c, (name, r) in enumerate(zip((names[t] for t in table_of), rank.tolist()))}
    for (name, r), part in runs.group_by(["table_name", "rank"], maintain_order=True):
        c = where.get((name, r))
        if c is None:
            continue
        value, rows = part["accesses"].to_numpy().astype(np.float64), part["rows"].to_numpy()
        rows_before, hits_before = np.r_[0, np.cumsum(rows)], np.r_[0, np.cumsum(value * rows)]
        k = np.minimum(capacity[c], rows_before[-1])  # the capacity's most read rows
        run = np.maximum(np.searchsorted(rows_before, k, side="right") - 1, 0)  # the run holding the k-th
        tail = np.where(run < len(value), (k - rows_before[run]) * value[np.minimum(run, len(value) - 1)], 0)
        whole[c], counted[c] = True, hits_before[-1]
        missed[c] = counted[c] - (hits_before[run] + tail)
    return whole, missed, counted


def compute(ctx: Context, *, sample_rows: int | None = SAMPLE_ROWS, load_factors: tuple[float, ...] = LOAD_FACTORS,
            tables: tuple[str, ...] | None = None) -> Result:
    """The `cache_mrc` table, torchrec_cache_stats.json and per-table figures (of `tables` only when
    given: every row of a few tables replays in a check of the sampled curves)."""
    missing = no_training_accesses(ctx)
    if missing:
        return Result(notes=[f"{missing}: the cache replay needs the per-step ids"])
    done = replay(ctx, sample_rows=sample_rows, load_factors=load_factors, tables=tables)
    sample, mrc = done.sample, done.mrc
    result = Result(tables={"cache_mrc": mrc})
    stats = ctx.memo((planner_stats, sample_rows, tuple(load_factors), tables),
                     lambda: planner_stats(ctx, sample, mrc, done.totals, done.steps, result.notes))
    path = write_stats(ctx, stats) if tables is None else None
    if (done.replayed.sample.rates < 1).any():
        result.notes.append(f"miss ratios from a hashed row sample (SHARDS) for {sampled_tables(done.replayed.sample)}")
    if windowed := done.replayed.windowed():
        result.notes.append(f"miss ratios of {', '.join(windowed)} over the run's last steps only (a steady "
                            f"state: its first {WARMUP_SHARE:.0%} warm the caches), to bound the replay")
    result.summary = {"phase": "train", "load_factors": list(load_factors), "policies": list(POLICIES),
                      "torchrec_cache_stats": path and str(path), "steps": done.steps,
                      "tables": {name: {**entry, "miss_ratio": curves(mrc, name)}
                                 for name, entry in stats["tables"].items()}}
    return result


def mrc_table(sample: Sample, table_of: np.ndarray, events: dict[str, np.ndarray], misses: dict[str, np.ndarray],
              full_sets: np.ndarray, slots: np.ndarray, lf: np.ndarray, ids_per_step: np.ndarray) -> pl.DataFrame:
    """Per table, policy and load factor, the caches of every rank together (misses over ids, each
    policy's own per cache); misses per batch are the miss ratio times the table's (exact) ids per
    step, all ranks together."""
    tables = len(sample.names)
    per_table = lambda x: np.stack([np.bincount(table_of, weights=x[:, v], minlength=tables)  # noqa: E731
                                    for v in range(x.shape[1])], axis=1)
    cache_rows, simulated = per_table(full_sets * WAYS), per_table(slots)
    frames = []
    for policy, m in misses.items():
        missed = per_table(m)
        ids = np.bincount(table_of, weights=events[policy], minlength=tables)
        for t, name in enumerate(sample.names):
            if not ids[t]:
                continue
            frames.append(pl.DataFrame({
                "table_name": name, "policy": policy, "load_factor": lf, "cache_rows": cache_rows[t].astype(np.int64),
                "miss_ratio": missed[t] / ids[t], "unique_miss_per_batch": missed[t] / ids[t] * ids_per_step[t],
                "sample_rate": float(sample.rates[t]), "simulated_rows": simulated[t].astype(np.int64)}))
    return pl.concat(frames).sort("table_name", "policy", "load_factor")


def curves(mrc: pl.DataFrame, table: str) -> dict[str, dict[str, float]]:
    part = mrc.filter(table_name=table)
    return {p: {str(lf): round(r, 5) for lf, r in part.filter(policy=p).select("load_factor", "miss_ratio").iter_rows()}
            for p in POLICIES}


def torchrec_stats(ctx: Context) -> dict[str, Any] | None:
    """`planner_stats` of the default replay, as compute writes it to torchrec_cache_stats.json (once
    per context); None without training accesses."""
    done = replay(ctx)
    if done is None:
        return None
    return ctx.memo((planner_stats, SAMPLE_ROWS, LOAD_FACTORS, None),
                    lambda: planner_stats(ctx, done.sample, done.mrc, done.totals, done.steps, []))



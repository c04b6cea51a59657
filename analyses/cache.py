"""What a software embedding cache would do with the recorded training lookups: FBGEMM TBE's LRU and
LFU caches and the static top-K oracle, replayed per table over a range of cache sizes (miss-ratio
curves, `cache_mrc`), and the inputs TorchRec's planner takes for a cached table
(`analysis/torchrec_cache_stats.json`).

The cache (FBGEMM `SplitTableBatchedEmbeddingBagsCodegen`, research/papers.md §8 and B.8):
- one cache per table and rank (the rows that rank holds: its shards in the manifest, or the whole
  table), of load factor lf: `sets` = ceil(rows * lf / 32), 32 ways; row r lives in set
  fmix64(r) mod sets (MurmurHash3's 64-bit finaliser, FBGEMM's `cache_slot`);
- a batch is one step's lookups on one rank, deduplicated (the `accesses` rows of that step and
  rank); an id of a batch not resident when the batch arrives is a miss (it is fetched, inserted or
  not); miss_ratio = misses / ids over all batches (FBGEMM's unique-miss ratio);
- LRU: resident ids of the batch get the batch's timestamp; then, per set, the missed ids in
  ascending row order take the ways in ascending timestamp order (empty first, ties by way),
  stopping at a way stamped in this batch; ids left over stay uncached;
- LFU: first each id's global count grows by its lookups in the batch (never decays); per set, the
  missed ids in descending count (ties: ascending row) are matched in turn with the ways in ascending
  resident count (empty = -1), the ways sorted once per batch; the i-th id replaces the i-th way iff
  its count >= that way's count; the first id that is colder ends the set's insertions;
- oracle: the K = sets * 32 rows of the rank's table that appear in the most batches stay resident
  for the whole run (fully associative): the fewest misses any fixed set of K rows can have.

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

TorchRec (`torchrec.distributed.types.CacheStatistics`, passed as `CacheParams(stats=...)`):
- expected_lookups = distinct rows per global training batch, the mean over training steps (each
  rank's distinct rows per step summed, less rows read on two ranks in one step, as the sample shows);
- expected_miss_rate(clf) = the LRU curve at the load factors simulated (`expected_miss_rate`), with
  1.0 at clf = 0 and 0.0 at clf = 1 per TorchRec's convention (interpolate between);
- cacheability = the area under that curve over clf in [0, 1] (TorchRec's `EmbeddingOffloadStats`);
- offload_stats = `EmbeddingOffloadStats`' own arguments (`offload_stats`): the curve as a histogram of
  HIST_BINS bins of the rows, with the table's height, for `CacheParams(stats=...)`;
- pooling_factor = `ids_per_sample`: ids per sample, every feature of the table together (lookups /
  samples of the `steps` table, else ids per non-empty bag in `lookups`): TorchRec's pooling
  factor where one feature looks the table up. The per-feature one that
  `ParameterConstraints(pooling_factors=[...])` takes is analyses.planner's `ids_per_bag`.

    class TraceCacheStatistics(CacheStatistics):
        def __init__(self, entry):
            self.entry = entry
            clf = [0.0, *map(float, entry["expected_miss_rate"]), 1.0]
            self.curve = (clf, [1.0, *entry["expected_miss_rate"].values(), 0.0])
        expected_lookups = property(lambda self: self.entry["expected_lookups"])
        cacheability = property(lambda self: self.entry["cacheability"])
        def expected_miss_rate(self, clf):
            return float(numpy.interp(clf, *self.curve))
"""

from __future__ import annotations

import functools
import json
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import polars as pl

from tracekit.files import write_text

from analyses.context import Context, Result
from analyses.row_totals import row_totals, shared_tables
from analyses.skew import (SAMPLE_ROWS, Sample, access_sample, hashed_sample, lookup_histogram,
                           no_training_accesses, sampled_tables)

LOAD_FACTORS = (0.01, 0.02, 0.05, 0.1, 0.2, 0.5)
MIN_SAMPLED_ROWS = 16384  # distinct rows a table's hashed sample keeps at least (all, for a smaller table)
SAMPLE_BOOST = 4  # the replay samples this many times the accesses rows skew samples (sample_rows)
WINDOW_AFTER = 4  # a table's sample longer than this many times sample_rows is replayed over a step window
WARMUP_SHARE = 0.25  # of a step window: replayed to fill the caches, not counted
HOT_ROWS = 1024  # a sampled table's rows read most in the replayed steps are replayed whatever their hash ...
HOT_SHARE = 0.0003  # ... at most this share of its distinct rows: 3% of the smallest cache (lf 0.01)
WAYS = 32
POLICIES = ("lru", "lfu", "oracle")
STATS_FILE = "torchrec_cache_stats.json"
EMPTY, PAD = -1, -2  # a free way; a way beyond a sampled cache's associativity (never used)
NEVER = np.iinfo(np.int64).max  # the LFU count of a PAD way: no id replaces it
LATEST = np.iinfo(np.int32).max  # the LRU stamp of a PAD way: never the least recent


def fmix64(x: np.ndarray) -> np.ndarray:
    """MurmurHash3's 64-bit finaliser of each element (as FBGEMM's `cache_slot` hashes ids)."""
    h = np.asarray(x).astype(np.uint64)
    with np.errstate(over="ignore"):
        h ^= h >> np.uint64(33)
        h *= np.uint64(0xFF51AFD7ED558CCD)
        h ^= h >> np.uint64(33)
        h *= np.uint64(0xC4CEB9FE1A85EC53)
        h ^= h >> np.uint64(33)
    return h


def set_of(rows: np.ndarray, sets: np.ndarray | int) -> np.ndarray:
    """The set each row lives in, in a cache of `sets` sets."""
    return (fmix64(rows) % np.asarray(sets).astype(np.uint64)).astype(np.int64)


@dataclass
class Stream:
    """Batches to replay: entry i is id `key[i]` of cache group `group[i]` at step `step[i]`, looked
    up `count[i]` times; sorted by (step, group, key), one entry per (step, group, key). Its hit or
    miss counts `weight[i]` times (None: once): the entries of the run a sampled entry stands for,
    0 for an entry that only warms the caches."""

    step: np.ndarray
    group: np.ndarray
    key: np.ndarray
    count: np.ndarray
    weight: np.ndarray | None = None

    def tally(self, groups: int) -> np.ndarray:
        """The counted entries of each group (weighted)."""
        return np.bincount(self.group, weights=self.weight, minlength=groups).astype(np.float64)

    @functools.cached_property
    def ids(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(uid of each entry, group of each uid, key of each uid), uid dense over (group, key)."""
        order = np.lexsort((self.key, self.group))
        g, k = self.group[order], self.key[order]
        new = np.r_[True, (g[1:] != g[:-1]) | (k[1:] != k[:-1])] if len(k) else np.zeros(0, bool)
        uid = np.empty(len(k), dtype=np.int64)
        uid[order] = np.cumsum(new) - 1
        return uid, g[new], k[new]


@dataclass
class State:
    """Every simulated set's ways (`tags`: uid, EMPTY or PAD; `stamp`: LRU time of the last batch
    that used the way), where each (variant, uid) is resident (`where`: set * width + way, or -1),
    and the LFU count of each uid."""

    tags: np.ndarray
    stamp: np.ndarray | None
    where: np.ndarray
    freq: np.ndarray | None
    n_ids: int


def simulate(policy: str, stream: Stream, sets: np.ndarray, ways: np.ndarray,
             prior: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Replay `stream` through one cache per (group, variant): `sets[g, v]` sets of `ways[g, v]` ways,
    policy "lru" or "lfu" (module docstring), LFU's counts starting at `prior` (per uid of
    `stream.ids`: the lookups before the stream's first step). Returns misses (groups x variants)
    and ids per group."""
    groups, variants = sets.shape
    uid, ugroup, ukey = stream.ids
    n_ids = len(ukey)
    events = stream.tally(groups)
    misses = np.zeros(groups * variants, dtype=np.float64)
    if n_ids == 0:
        return misses.reshape(groups, variants), events
    cache = ugroup[None, :] * variants + np.arange(variants)[:, None]  # (variants, ids): each id's cache
    base = np.r_[0, np.cumsum(sets.ravel())]
    set_index = base[cache] + set_of(ukey[None, :], sets.ravel()[cache])
    if base[-1] > max(1 << 20, 2 * set_index.size):  # keep state only for the sets some id maps to
        used, set_index = np.unique(set_index, return_inverse=True)
        limit = ways.ravel()[np.searchsorted(base, used, side="right") - 1]  # ways of each set
    else:
        limit = np.repeat(ways.ravel(), sets.ravel())
    set_index = set_index.ravel()
    width = int(ways.max())
    beyond = np.arange(width)[None, :] >= limit[:, None]
    state = State(tags=np.where(beyond, PAD, EMPTY).astype(np.int32),
                  stamp=np.where(beyond, LATEST, -1).astype(np.int32) if policy == "lru" else None,
                  where=np.full(variants * n_ids, -1, dtype=np.int64),
                  freq=(np.zeros(n_ids, dtype=np.int64) if prior is None else prior.astype(np.int64))
                  if policy == "lfu" else None, n_ids=n_ids)
    variant = np.arange(variants, dtype=np.int64)[:, None]
    insert = _insert_lru if policy == "lru" else _insert_lfu
    bounds = np.flatnonzero(np.r_[True, stream.step[1:] != stream.step[:-1], True])
    for a, b in zip(bounds[:-1], bounds[1:]):
        ids, step = uid[a:b], int(stream.step[a])
        if policy == "lfu":
            state.freq[ids] += stream.count[a:b]
        flat = (variant * n_ids + ids).ravel()  # variant-major, then stream order: keys ascend per cache
        slot = state.where[flat]
        missed = slot < 0
        weight = None if stream.weight is None else np.tile(stream.weight[a:b], variants)[missed]
        misses += np.bincount((ugroup[ids] * variants + variant).ravel()[missed], weights=weight,
                              minlength=misses.size)
        if policy == "lru":
            state.stamp.ravel()[slot[~missed]] = step
        flat = flat[missed]
        insert(state, set_index[flat], flat, step)
    return misses.reshape(groups, variants), events


def _by_set(sets: np.ndarray, width: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Candidates (already ordered as they compete within a set) grouped by set: for the first
    `width` of each set, their position, their position j within the set and their set's index among
    the distinct sets; and those sets."""
    order = np.argsort(sets, kind="stable")
    s = sets[order]
    first = np.r_[True, s[1:] != s[:-1]]
    start = np.flatnonzero(first)
    group = np.cumsum(first) - 1
    j = np.arange(len(s)) - start[group]
    keep = j < width
    return order[keep], j[keep], group[keep], s[start]


def _ways_in_order(cost: np.ndarray, group: np.ndarray, j: np.ndarray) -> np.ndarray:
    """The way holding the j-th smallest cost of its set's row of `cost` (ties: lower way first):
    an argmin for sets with one candidate, a sort of the ways for the others."""
    way = np.argmin(cost, axis=1)[group]  # right for each set's first candidate
    several = np.flatnonzero(np.bincount(group, minlength=len(cost)) > 1)
    if len(several):
        row = np.full(len(cost), -1)
        row[several] = np.arange(len(several))
        ranked = np.argsort(cost[several], axis=1, kind="stable")
        later = row[group] >= 0
        way[later] = ranked[row[group[later]], j[later]]
    return way


def _place(state: State, sets: np.ndarray, way: np.ndarray, flat: np.ndarray) -> np.ndarray:
    """Put the ids of `flat` (variant * n_ids + uid) into (set, way), evicting the residents; the slots."""
    width = state.tags.shape[1]
    slot = sets * width + way
    old = state.tags.ravel()[slot]
    evicted = old >= 0
    state.where[flat[evicted] - flat[evicted] % state.n_ids + old[evicted]] = -1
    state.tags.ravel()[slot] = flat % state.n_ids
    state.where[flat] = slot
    return slot


def _insert_lru(state: State, sets: np.ndarray, flat: np.ndarray, step: int) -> None:
    """Per set, missed ids in ascending key order into the ways by ascending stamp; a way stamped in
    this step (or PAD) ends the set's insertions, and every later way is one too."""
    if not len(flat):
        return
    pick, j, group, distinct = _by_set(sets, state.tags.shape[1])
    stamps = state.stamp[distinct]
    way = _ways_in_order(stamps, group, j)
    free = stamps[group, way] < step
    pick = pick[free]
    slot = _place(state, sets[pick], way[free], flat[pick])
    state.stamp.ravel()[slot] = step


def _insert_lfu(state: State, sets: np.ndarray, flat: np.ndarray, step: int) -> None:
    """Per set, missed ids by descending count (ties: ascending key) against the ways by ascending
    resident count (empty = -1); the i-th id replaces the i-th way iff its count >= that way's. The
    first colder id ends the set's insertions, and every later one is colder than its way too."""
    if not len(flat):
        return
    count = state.freq[flat % state.n_ids]
    by_count = np.argsort(-count, kind="stable")  # stable: equal counts keep ascending keys
    sets, flat, count = sets[by_count], flat[by_count], count[by_count]
    pick, j, group, distinct = _by_set(sets, state.tags.shape[1])
    tags = state.tags[distinct]
    cost = np.where(tags >= 0, state.freq[np.maximum(tags, 0)], np.where(tags == EMPTY, -1, NEVER))
    way = _ways_in_order(cost, group, j)
    ok = count[pick] >= cost[group, way]
    pick = pick[ok]
    _place(state, sets[pick], way[ok], flat[pick])


def oracle(stream: Stream, capacity: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Misses (groups x variants) with each group's `capacity[g, v]` rows that appear in the most
    batches always resident, and ids per group."""
    groups, variants = capacity.shape
    uid, ugroup, ukey = stream.ids
    events = stream.tally(groups)
    appearances = np.bincount(uid, minlength=len(ukey))  # the rows kept: by every entry replayed, warm-up too
    counted = np.bincount(uid, weights=stream.weight, minlength=len(ukey)).astype(np.float64)
    order = np.lexsort((-appearances, ugroup))
    g, counts = ugroup[order], counted[order]
    cumulative = np.cumsum(counts)
    start = np.searchsorted(g, np.arange(groups), side="left")
    end = np.searchsorted(g, np.arange(groups), side="right")
    before = np.where(start > 0, cumulative[np.maximum(start - 1, 0)], 0)
    last = np.minimum(start[:, None] + capacity, end[:, None]) - 1  # last resident position
    hits = np.where(last >= start[:, None], cumulative[np.maximum(last, 0)] - before[:, None], 0)
    return events[:, None] - hits, events


# ---------------------------------------------------------------------------------------------- geometry

def rows_held(ctx: Context, table: str, rank: int, fallback: int) -> int:
    """Rows of `table` on `rank`: its shards there, else the whole table."""
    try:
        info = ctx.model.table(table)
    except KeyError:
        return fallback
    mine = sum(int(s["num_rows"]) for s in info.shards if int(s["rank"]) == rank)
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
    path = write_json(ctx, stats) if tables is None else None
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


def planner_stats(ctx: Context, sample: Sample, mrc: pl.DataFrame, totals: dict, steps: int,
                  notes: list[str]) -> dict[str, Any]:
    """The TorchRec planner inputs of the module docstring, per table."""
    pooling, source = ids_per_sample(ctx, totals, notes)
    repeated = cross_rank_repeats(sample)
    tables = {}
    for t, name in enumerate(sample.names):
        lru = mrc.filter(table_name=name, policy="lru").sort("load_factor")
        if lru.is_empty():
            continue
        lf, rate = lru["load_factor"].to_list(), lru["miss_ratio"].to_list()
        height = _num_rows(ctx, name, totals[name]["seen_rows"])
        expected = totals[name]["accesses"] * (1 - repeated[t]) / steps
        tables[name] = {
            "num_embeddings": height,
            "expected_lookups": expected,
            "offload_stats": offload_stats(lf, rate, height, expected),
            "expected_miss_rate": {str(x): y for x, y in zip(lf, rate)},
            "expected_miss_rate_lfu": dict(zip(map(str, lf), mrc.filter(table_name=name, policy="lfu")
                                               .sort("load_factor")["miss_ratio"].to_list())),
            "cacheability": float(np.trapezoid([1.0, *rate, 0.0], [0.0, *lf, 1.0])),
            "pooling_factor": pooling.get(name), "sample_rate": float(sample.rates[t])}
    return {"schema": "tracekit.torchrec_cache_stats/1", "run": str(ctx.path), "phase": "train",
            "policy": "lru (FBGEMM TBE semantics)", "pooling_factor_source": source, "steps": steps,
            "tables": tables}


HIST_BINS = 100
"""Bins of the miss-ratio histogram TorchRec's EmbeddingOffloadStats takes, each 1/HIST_BINS of the rows."""


def offload_stats(load_factors: list[float], miss_ratios: list[float], height: int, expected_lookups: float) -> dict:
    """The arguments of TorchRec's `EmbeddingOffloadStats` from an LRU curve: `mrc_hist_counts`, bin i
    the lookups per step a cache of (i+1)/HIST_BINS of the rows hits beyond one of i/HIST_BINS (the
    curve interpolated, 1.0 at load factor 0 and 0.0 at 1, TorchRec's convention), `height` the
    table's rows, `expected_lookups` distinct rows per global batch (an integer, as it takes),
    `cacheability` the area under the curve."""
    grid = np.linspace(0.0, 1.0, HIST_BINS + 1)
    miss = np.interp(grid, [0.0, *load_factors, 1.0], [1.0, *miss_ratios, 0.0])
    return {"cacheability": float(np.trapezoid([1.0, *miss_ratios, 0.0], [0.0, *load_factors, 1.0])),
            "expected_lookups": round(expected_lookups), "height": int(height),
            "mrc_hist_counts": [round(float(x), 6) for x in (miss[:-1] - miss[1:]) * expected_lookups]}


def _num_rows(ctx: Context, name: str, seen: int) -> int:
    try:
        return ctx.model.table(name).num_rows or seen
    except KeyError:
        return seen


def cross_rank_repeats(sample: Sample) -> np.ndarray:
    """Per table, the fraction of sampled (step, rank, row) entries whose (step, row) another rank
    also read: what summing ranks' distinct rows counts twice."""
    tables = len(sample.names)
    ranks = int(sample.rank.max()) + 1
    on_ranks = np.bincount(np.unique(sample.table * ranks + sample.rank) // ranks, minlength=tables)
    shared = np.flatnonzero(np.isin(sample.table, np.flatnonzero(on_ranks > 1)))  # only tables read on 2+ ranks
    repeats = np.zeros(tables)
    if len(shared):
        order = shared[np.lexsort((sample.row[shared], sample.step[shared], sample.table[shared]))]
        t, s, r = sample.table[order], sample.step[order], sample.row[order]
        again = (t[1:] == t[:-1]) & (s[1:] == s[:-1]) & (r[1:] == r[:-1])
        repeats = np.bincount(t[1:][again], minlength=tables).astype(np.float64)
    return repeats / np.maximum(np.bincount(sample.table, minlength=tables), 1)


def ids_per_sample(ctx: Context, totals: dict, notes: list[str]) -> tuple[dict[str, float], str | None]:
    """Ids per sample per table, every feature together (the stats' `pooling_factor`): training
    lookups over the samples of the `steps` table, else ids per non-empty bag in `lookups`."""
    if ctx.has("steps"):
        samples = ctx.sql("SELECT sum(samples)::BIGINT FROM steps").fetchall()[0][0] or 0
        if samples > 0:
            return {name: row["lookups"] / samples for name, row in totals.items()}, "accesses / steps.samples"
    if ctx.has("lookups"):
        rows = ctx.sql("""SELECT table_name, count(*)::DOUBLE / count(DISTINCT (step, rank, sample))
                          FROM train_lookups GROUP BY ALL""").fetchall()
        if rows:
            return dict(rows), "lookups (ids per non-empty bag)"
    notes.append("pooling factors: no samples in a steps table and no lookups table")
    return {}, None


def write_json(ctx: Context, stats: dict) -> os.PathLike:
    return write_text(ctx.path / "analysis" / STATS_FILE, json.dumps(stats, indent=2, default=_plain) + "\n")


def _plain(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    raise TypeError(f"{type(value).__name__} is not JSON serialisable")


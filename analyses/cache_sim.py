"""FBGEMM TBE's software embedding caches replayed on numpy arrays: LRU, LFU and the static top-K
oracle, over many caches (groups) and cache sizes (variants) at once. analyses.cache feeds them the
recorded training lookups, one cache per table and rank, and turns their misses into miss-ratio curves.

    misses, ids = simulate("lru", Stream(step, group, key, count), sets, ways)   # groups x variants

The cache (FBGEMM `SplitTableBatchedEmbeddingBagsCodegen`, research/papers.md §8 and B.8):
- `sets` sets of `ways` ways (32 in FBGEMM; fewer in a sampled cache, analyses.cache); row r lives in set
  fmix64(r) mod sets (MurmurHash3's 64-bit finaliser, FBGEMM's `cache_slot`);
- a batch is one step's ids of one cache, deduplicated; an id of a batch not resident when the batch
  arrives is a miss (it is fetched, inserted or not);
- LRU: resident ids of the batch get the batch's timestamp; then, per set, the missed ids in
  ascending row order take the ways in ascending timestamp order (empty first, ties by way),
  stopping at a way stamped in this batch; ids left over stay uncached;
- LFU: first each id's global count grows by its lookups in the batch (never decays); per set, the
  missed ids in descending count (ties: ascending row) are matched in turn with the ways in ascending
  resident count (empty = -1), the ways sorted once per batch; the i-th id replaces the i-th way iff
  its count >= that way's count; the first id that is colder ends the set's insertions;
- oracle: the K = capacity rows of a cache that appear in the most batches stay resident for the
  whole stream (fully associative): the fewest misses any fixed set of K rows can have.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

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

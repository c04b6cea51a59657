"""analyses/cache_sim.py: the vectorised LRU, LFU and oracle replays against a straightforward Python
implementation of FBGEMM's rules on random streams; analyses/cache.py: the whole analysis on written runs
(exact where nothing is sampled, within a few points of exact where SHARDS samples), and the TorchRec
planner inputs (analyses/torchrec_cache_stats.py)."""

from __future__ import annotations

import json
import math
from collections import Counter, defaultdict
from pathlib import Path

import numpy as np
import polars as pl
import pytest

from tests.manifests import write_manifest
from analyses import cache, cache_sim, skew, torchrec_cache_stats
from analyses.context import open_context
from tests.test_skew import accesses_of, table_entry, write_run, zipf_ranks, zipf_steps
from tracekit.store import RunWriter

MASK = (1 << 64) - 1


def fmix64_by_hand(x: int) -> int:
    h = x & MASK
    h ^= h >> 33
    h = (h * 0xFF51AFD7ED558CCD) & MASK
    h ^= h >> 33
    h = (h * 0xC4CEB9FE1A85EC53) & MASK
    return h ^ (h >> 33)


def test_rows_hash_to_sets_as_fbgemm_does() -> None:
    rows = [0, 1, 2, 12345, 2**40 + 7, 2**62]
    assert cache_sim.fmix64(np.array(rows)).tolist() == [fmix64_by_hand(r) for r in rows]
    assert cache_sim.set_of(np.array(rows), 7).tolist() == [fmix64_by_hand(r) % 7 for r in rows]


class ReferenceCache:
    """One set-associative cache, FBGEMM's rules written out plainly (module docstring of
    analyses/cache_sim.py): `slots[set]` is a list of [key or None, lru stamp] per way."""

    def __init__(self, sets: int, ways: int, policy: str, freq: dict) -> None:
        self.sets, self.policy, self.freq = sets, policy, freq
        self.slots = [[[None, -1] for _ in range(ways)] for _ in range(sets)]

    def batch(self, step: int, keys: list[int]) -> int:
        """Look up the batch's distinct keys; returns the misses."""
        missed = defaultdict(list)
        for key in sorted(keys):
            s = fmix64_by_hand(key) % self.sets
            way = next((w for w in self.slots[s] if w[0] == key), None)
            if way is None:
                missed[s].append(key)
            elif self.policy == "lru":
                way[1] = step
        for s, candidates in missed.items():
            (self.lru if self.policy == "lru" else self.lfu)(self.slots[s], candidates, step)
        return sum(len(c) for c in missed.values())

    def lru(self, ways: list, candidates: list[int], step: int) -> None:
        order = sorted(range(len(ways)), key=lambda w: (ways[w][1], w))
        for key, w in zip(candidates, order):
            if ways[w][1] == step:
                break
            ways[w][:] = [key, step]

    def lfu(self, ways: list, candidates: list[int], step: int) -> None:
        cost = [-1 if key is None else self.freq[key] for key, _ in ways]
        order = sorted(range(len(ways)), key=lambda w: (cost[w], w))
        for key, w in zip(sorted(candidates, key=lambda k: (-self.freq[k], k)), order):
            if cost[w] > self.freq[key]:
                break
            ways[w][0] = key


def reference(policy: str, entries: list[tuple[int, int, int, int]], sets: np.ndarray, ways: np.ndarray):
    """Misses per (group, variant) of (step, group, key, count) entries, one cache per pair."""
    groups, variants = sets.shape
    freq = [Counter() for _ in range(groups)]
    caches = {(g, v): ReferenceCache(int(sets[g, v]), int(ways[g, v]), policy, freq[g])
              for g in range(groups) for v in range(variants)}
    misses = np.zeros((groups, variants), dtype=np.int64)
    by_step = defaultdict(list)
    for entry in entries:
        by_step[entry[0]].append(entry)
    for step in sorted(by_step):
        batch = defaultdict(list)
        for _, g, key, count in by_step[step]:
            freq[g][key] += count  # counts grow before the batch's insertions
            batch[g].append(key)
        for g, keys in batch.items():
            for v in range(variants):
                misses[g, v] += caches[(g, v)].batch(step, keys)
    return misses


def reference_oracle(entries, capacity: np.ndarray) -> np.ndarray:
    groups, variants = capacity.shape
    appearances = [Counter() for _ in range(groups)]
    for step, g, key, count in entries:
        appearances[g][key] += 1
    misses = np.zeros((groups, variants), dtype=np.int64)
    for g in range(groups):
        ranked = sorted(appearances[g], key=lambda k: (-appearances[g][k], k))
        for v in range(variants):
            resident = set(ranked[: capacity[g, v]])
            misses[g, v] = sum(n for k, n in appearances[g].items() if k not in resident)
    return misses


def random_stream(seed: int, steps: int = 60, groups: int = 3, keys: int = 300) -> cache_sim.Stream:
    rng = np.random.default_rng(seed)
    rows = []
    for step in range(steps):
        for g in range(groups):
            batch = np.unique(rng.permutation(keys)[zipf_ranks(rng, keys, 0.9, 40)] * (g + 1))
            rows += [(step, g, int(k), int(rng.integers(1, 4))) for k in batch]  # few counts: many ties
    step, group, key, count = map(np.array, zip(*rows))
    return cache_sim.Stream(step, group, key, count)


GEOMETRIES = [
    (np.array([[1, 2, 5, 16], [3, 1, 4, 2], [2, 2, 2, 8]]), np.array([[4, 2, 3, 32], [1, 4, 2, 32], [32, 2, 5, 1]])),
    (np.array([[1], [1], [1]]), np.array([[8], [16], [3]])),
]


@pytest.mark.parametrize("policy", ["lru", "lfu"])
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("geometry", range(len(GEOMETRIES)))
def test_replays_equal_the_reference_implementation(policy: str, seed: int, geometry: int) -> None:
    stream = random_stream(seed)
    sets, ways = GEOMETRIES[geometry]
    misses, events = cache_sim.simulate(policy, stream, sets, ways)
    entries = list(zip(*(x.tolist() for x in (stream.step, stream.group, stream.key, stream.count))))
    expected = reference(policy, entries, sets, ways)
    np.testing.assert_array_equal(misses, expected)
    np.testing.assert_array_equal(events, np.bincount(stream.group))
    assert (0 < misses).all() and (misses < events[:, None]).any()


def test_the_oracle_equals_the_reference_and_bounds_lfu_and_lru() -> None:
    stream = random_stream(5)
    sets, ways = GEOMETRIES[0]
    misses, _ = cache_sim.oracle(stream, sets * ways)
    entries = list(zip(*(x.tolist() for x in (stream.step, stream.group, stream.key, stream.count))))
    np.testing.assert_array_equal(misses, reference_oracle(entries, sets * ways))
    for policy in ("lru", "lfu"):
        assert (misses <= cache_sim.simulate(policy, stream, sets, ways)[0]).all()


def cache_run(path: Path, *, steps: int = 40, rows: int = 4000, batch: int = 600, split_steps: bool = False) -> tuple:
    """Two tables on 2 ranks: `a` on rank 0; `b` row-wise, its halves on ranks 0 and 1."""
    rng = np.random.default_rng(7)
    accesses = accesses_of(zipf_steps(rng, rows, 0.9, batch, steps), "a", 0)
    for s, draws in enumerate(zipf_steps(rng, 2 * rows, 1.1, 2 * batch, steps)):
        for rank in (0, 1):
            mine = draws[(draws >= rows) == bool(rank)]
            accesses += accesses_of([mine], "b", rank, first_step=s)
    tables = [table_entry("a", rows), {**table_entry("b", 2 * rows), "shards": [
        {"rank": 0, "first_row": 0, "num_rows": rows}, {"rank": 1, "first_row": rows, "num_rows": rows}]}]
    return write_run(path, accesses, tables, samples_per_step=batch, split_steps=split_steps), accesses


def exact_by_hand(accesses, rows: int, load_factors) -> dict:
    """(table, policy, load factor) -> miss ratio, each (table, rank) its own cache of
    ceil(held rows * lf / 32) sets of 32 ways, replayed with the reference implementation."""
    held = {("a", 0): rows, ("b", 0): rows, ("b", 1): rows}
    groups = sorted(held, key=lambda p: (p[1], p[0]))
    index = {p: g for g, p in enumerate(groups)}
    merged = Counter()
    for step, rank, table, row, count, phase in accesses:
        merged[(step, index[(table, rank)], row)] += count
    entries = sorted((s, g, r, c) for (s, g, r), c in merged.items())
    sets = np.array([[max(1, math.ceil(held[p] * lf / 32)) for lf in load_factors] for p in groups])
    ways = np.full_like(sets, 32)
    out = {}
    results = {"lru": reference("lru", entries, sets, ways), "lfu": reference("lfu", entries, sets, ways),
               "oracle": reference_oracle(entries, sets * ways)}
    events = np.bincount([e[1] for e in entries])
    for policy, misses in results.items():
        for table in ("a", "b"):
            gs = [index[p] for p in groups if p[0] == table]
            for v, lf in enumerate(load_factors):
                out[(table, policy, lf)] = misses[gs, v].sum() / events[gs].sum()
    return out


def test_the_analysis_replays_every_table_and_rank_exactly_when_nothing_is_sampled(tmp_path: Path) -> None:
    run, accesses = cache_run(tmp_path / "run", steps=20, rows=1000, batch=200, split_steps=True)
    with open_context(run) as ctx:
        lfs = (0.02, 0.1, 0.5)
        result = cache.compute(ctx, load_factors=lfs)
        mrc = result.tables["cache_mrc"]
        expected = exact_by_hand(accesses, 1000, lfs)
        assert len(mrc) == len(expected) and (mrc["sample_rate"] == 1.0).all()
        ids = Counter(a[2] for a in accesses)  # (step, rank, row) is one id of a batch
        for row in mrc.iter_rows(named=True):
            miss_ratio = expected[(row["table_name"], row["policy"], row["load_factor"])]
            assert row["miss_ratio"] == pytest.approx(miss_ratio)
            assert row["unique_miss_per_batch"] == pytest.approx(miss_ratio * ids[row["table_name"]] / 20)
        b = mrc.filter(table_name="b", policy="lru").sort("load_factor")
        assert b["cache_rows"].to_list() == [2 * 32 * math.ceil(1000 * lf / 32) for lf in lfs]  # both ranks' caches
        assert not any("sample" in note for note in result.notes)
        only_a = cache.compute(ctx, load_factors=lfs, tables=("a",))
        assert only_a.tables["cache_mrc"].equals(mrc.filter(table_name="a"))
        assert only_a.summary["torchrec_cache_stats"] is None  # a check of some tables leaves the run's file alone


def test_torchrec_planner_inputs_come_from_the_trace(tmp_path: Path) -> None:
    run, accesses = cache_run(tmp_path / "run", steps=20, rows=1000, batch=200)
    with open_context(run) as ctx:
        result = cache.compute(ctx, load_factors=(0.05, 0.2))
    stats = json.loads((run / "analysis" / torchrec_cache_stats.STATS_FILE).read_text())
    assert result.summary["torchrec_cache_stats"] == str(run / "analysis" / torchrec_cache_stats.STATS_FILE)
    train = [a for a in accesses if a[5] == "train"]
    for name in ("a", "b"):
        entry = stats["tables"][name]
        distinct = Counter(a[0] for a in train if a[2] == name)  # (step, row) pairs never repeat across ranks here
        assert entry["expected_lookups"] == pytest.approx(sum(distinct.values()) / 20)
        lookups = sum(a[4] for a in train if a[2] == name)
        assert entry["pooling_factor"] == pytest.approx(lookups / (20 * 2 * 200))  # steps.samples on 2 ranks
        lru = result.tables["cache_mrc"].filter(table_name=name, policy="lru").sort("load_factor")
        assert entry["expected_miss_rate"] == dict(zip(["0.05", "0.2"], lru["miss_ratio"].to_list()))
        m1, m2 = lru["miss_ratio"].to_list()
        assert entry["cacheability"] == pytest.approx((1 + m1) / 2 * 0.05 + (m1 + m2) / 2 * 0.15 + m2 / 2 * 0.8)
    assert stats["pooling_factor_source"] == "accesses / steps.samples"


def test_rows_read_on_two_ranks_in_a_step_count_once_in_the_expected_lookups(tmp_path: Path) -> None:
    rng = np.random.default_rng(2)
    per_step = [rng.integers(0, 50, 80) for _ in range(10)]
    accesses = accesses_of(per_step, "r", 0) + accesses_of([d[::2] for d in per_step], "r", 1)
    tables = [{**table_entry("r", 50, placement="replicated"),
               "shards": [{"rank": q, "first_row": 0, "num_rows": 50} for q in (0, 1)]}]
    with open_context(write_run(tmp_path / "run", accesses, tables)) as ctx:
        cache.compute(ctx, load_factors=(0.5,))
    stats = json.loads((tmp_path / "run" / "analysis" / torchrec_cache_stats.STATS_FILE).read_text())
    assert stats["tables"]["r"]["expected_lookups"] == pytest.approx(np.mean([len(set(d)) for d in per_step]))


def test_shards_sampled_curves_stay_within_two_points_of_exact(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(cache, "SAMPLE_BOOST", 1)  # rates under 0.25 on this small run: SHARDS itself checked
    monkeypatch.setattr(cache, "MIN_SAMPLED_ROWS", 1024)
    run, _ = cache_run(tmp_path / "run", steps=60, rows=40_000, batch=3000)
    with open_context(run) as ctx:
        exact = cache.compute(ctx, sample_rows=None).tables["cache_mrc"]
    with open_context(run) as ctx:
        sampled_result = cache.compute(ctx, sample_rows=15_000)
    sampled = sampled_result.tables["cache_mrc"]
    assert (sampled["sample_rate"] < 0.25).all() and (exact["sample_rate"] == 1).all()
    assert "SHARDS" in " ".join(sampled_result.notes)
    joined = exact.join(sampled, on=["table_name", "policy", "load_factor"], suffix="_sampled")
    error = (joined["miss_ratio"] - joined["miss_ratio_sampled"]).abs()
    assert error.max() < 0.02, joined.filter(error >= 0.02)
    assert (joined["cache_rows"] == joined["cache_rows_sampled"]).all()
    missing = joined.filter(pl.col("unique_miss_per_batch") > 0)
    # misses per batch scale the sampled miss ratio by the exact ids per step, as the exact replay does
    per_batch = missing["unique_miss_per_batch_sampled"] / missing["unique_miss_per_batch"]
    assert len(missing) > 30
    assert np.allclose(per_batch, missing["miss_ratio_sampled"] / missing["miss_ratio"], rtol=1e-9)
    assert (joined["miss_ratio"].max() - joined["miss_ratio"].min()) > 0.3  # a curve, not a constant


def test_a_sampled_tables_hottest_rows_are_replayed_whatever_their_hash(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(cache, "SAMPLE_BOOST", 1)
    monkeypatch.setattr(cache, "MIN_SAMPLED_ROWS", 1024)
    monkeypatch.setattr(cache, "HOT_SHARE", 0.001)
    run, accesses = cache_run(tmp_path / "run", steps=60, rows=40_000, batch=3000)
    with open_context(run) as ctx:
        replayed = cache.replay(ctx, sample_rows=15_000).replayed
        sample = replayed.sample
        hashed = {(t, r): h for t, r, h in ctx.sql(
            "SELECT tid, \"row\", hash(\"row\") % 4294967296 FROM (SELECT DISTINCT \"row\" FROM train_accesses), "
            "(SELECT unnest([0, 1]) AS tid)").fetchall()}
    steps_of = Counter((table, row) for step, rank, table, row, count, phase in accesses)
    hot_rows = {}
    for t, name in enumerate(sample.names):
        mine = sample.table == t
        hot = set(sample.row[mine & sample.hot].tolist())
        by_steps = sorted(((-n, r) for (table, r), n in steps_of.items() if table == name))
        assert hot == {r for _, r in by_steps[:len(hot)]} and len(hot) == int(0.001 * len({r for _, r in by_steps}))
        rate = sample.rates[t]
        assert rate < 0.25 and all(hashed[(t, r)] < rate * 2**32 for r in sample.row[mine & ~sample.hot].tolist())
        assert any(hashed[(t, r)] >= rate * 2**32 for r in hot)  # kept only as a hot row
        hot_rows[name] = len(hot)
    with open_context(run) as ctx:
        exact = cache.compute(ctx, sample_rows=None).tables["cache_mrc"]
    with open_context(run) as ctx:
        stratified = cache.compute(ctx, sample_rows=15_000).tables["cache_mrc"]
    joined = stratified.join(exact, on=["table_name", "policy", "load_factor"], suffix="_exact")
    error = (joined["miss_ratio"] - joined["miss_ratio_exact"]).abs()
    assert error.max() < 0.02, joined.filter(error >= 0.02)
    # the sampled caches hold the hot rows at their own rate, 1, and the others' slots at the sample's
    hot = joined["table_name"].replace_strict(hot_rows)
    expected = joined["sample_rate"] * joined["cache_rows"] + (1 - joined["sample_rate"]) * hot
    assert ((joined["simulated_rows"] - expected).abs() <= expected / 32 + 2).all()  # whole ways per set


def test_a_long_run_is_replayed_over_its_last_steps_warmed(tmp_path: Path) -> None:
    run, _ = cache_run(tmp_path / "run", steps=1500, rows=1000, batch=100)
    with open_context(run) as ctx:
        exact = cache.compute(ctx, sample_rows=None).tables["cache_mrc"]
    with open_context(run) as ctx:
        windowed = cache.compute(ctx, sample_rows=5000)
        replayed = cache.replay(ctx, sample_rows=5000).replayed
    assert (replayed.sample.rates == 1).all()  # fewer rows than MIN_SAMPLED_ROWS: every row, over a window
    assert (replayed.first > 1000).all() and (replayed.counted > replayed.first).all()
    assert replayed.sample.step.min() == replayed.first.min()
    assert any("over the run's last steps only" in note for note in windowed.notes)
    joined = exact.join(windowed.tables["cache_mrc"], on=["table_name", "policy", "load_factor"], suffix="_w")
    error = joined.with_columns((pl.col("miss_ratio") - pl.col("miss_ratio_w")).abs().alias("error"))
    worst = dict(error.group_by("policy").agg(pl.col("error").max()).iter_rows())
    # LRU forgets: its window's steady state is the run's. LFU's counts start where the run's stood
    # (lfu_prior), but its early churn is not in the window. The oracle comes from the whole run's
    # per-row totals, not from the window: exact.
    assert worst["lru"] < 0.01 and worst["lfu"] < 0.03 and worst["oracle"] < 1e-12, worst
    assert (joined["miss_ratio"].max() - joined["miss_ratio"].min()) > 0.3


def test_lfu_over_a_window_starts_from_the_counts_before_it(tmp_path: Path) -> None:
    run, accesses = cache_run(tmp_path / "run", steps=1500, rows=1000, batch=100)
    with open_context(run) as ctx:
        sample = cache.replay(ctx, sample_rows=5000).replayed.sample
        first = cache.replay(ctx, sample_rows=5000).replayed.first
        stream = cache_sim.Stream(sample.step, sample.table, sample.row, sample.count)
        _, table, key = stream.ids
        prior = cache.lfu_prior(ctx, sample.names, table, key, stream)
    before = Counter()
    for step, rank, name, row, count, phase in accesses:
        if phase == "train" and step < first[sample.names.index(name)]:
            before[(name, row)] += count
    assert prior is not None and prior.sum() > 0
    assert prior.tolist() == [before[(sample.names[t], r)] for t, r in zip(table.tolist(), key.tolist())]


def test_without_a_steps_table_pooling_factors_come_from_lookups(tmp_path: Path) -> None:
    bags = {0: [[1, 2], [3], [1, 4, 5], [2, 2]], 1: [[7], [1, 1, 1], [2, 3, 3]]}  # step -> ids per sample
    accesses = [(s, 0, "t", row, n, "train") for s, bag in bags.items()
                for row, n in Counter(r for b in bag for r in b).items()]
    run = write_run(tmp_path / "run", accesses, [table_entry("t", 10)], world=1)
    writer = RunWriter(run, 0)
    rows = [(s, k, pos, r) for s, bag in bags.items() for k, b in enumerate(bag) for pos, r in enumerate(b)]
    rows.append((2, 0, 0, 9))  # an evaluation bag does not count
    writer.append("lookups", {"step": [r[0] for r in rows], "table_name": ["t"] * len(rows),
                              "sample": [r[1] for r in rows], "pos": [r[2] for r in rows], "row": [r[3] for r in rows],
                              "phase": ["train"] * (len(rows) - 1) + ["eval"], "feature": [0] * len(rows)})
    writer.close()
    with open_context(run) as ctx:
        result = cache.compute(ctx, load_factors=(0.5,))
    stats = json.loads((run / "analysis" / torchrec_cache_stats.STATS_FILE).read_text())
    assert stats["tables"]["t"]["pooling_factor"] == pytest.approx(15 / 7)
    assert stats["pooling_factor_source"].startswith("lookups")
    assert result.summary["tables"]["t"]["pooling_factor"] == pytest.approx(15 / 7)


def test_tables_the_manifest_does_not_list_are_analysed_by_name(tmp_path: Path) -> None:
    rng = np.random.default_rng(9)
    accesses = accesses_of(zipf_steps(rng, 300, 1.0, 200, 12), "x", 0) + accesses_of(
        zipf_steps(rng, 50, 0.5, 100, 12), "y", 1)
    run = write_run(tmp_path / "run", accesses, [])
    with open_context(run) as ctx:
        skew_result = skew.compute(ctx)
        assert set(skew_result.tables["skew"]["table_name"]) == {"x", "y"}
        largest = max(a[3] for a in accesses if a[2] == "x")
        assert skew_result.tables["skew"].filter(table_name="x")["num_rows"][0] == largest + 1
        mrc = cache.compute(ctx, load_factors=(0.1,)).tables["cache_mrc"]
        assert set(mrc["table_name"]) == {"x", "y"} and len(mrc) == 2 * 3


def test_a_run_without_accesses_is_a_note_not_an_error(tmp_path: Path) -> None:
    writer = RunWriter(tmp_path / "run", 0)
    writer.append("steps", {"step": [0], "t_start_ns": [0], "t_end_ns": [1], "samples": [4], "loss": [None]})
    writer.close()
    write_manifest(tmp_path / "run", {"schema_version": "1.1", "status": "completed", "world_size": 1, "tables": []})
    with open_context(tmp_path / "run") as ctx:
        for module in (skew, cache):
            result = module.compute(ctx)
            assert not result.tables and "no accesses table" in result.notes[0]

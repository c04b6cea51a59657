"""The inputs TorchRec's planner takes for a cached table, per table, from the cache replay's
miss-ratio curves (analyses.cache), and their file `analysis/torchrec_cache_stats.json` (STATS_FILE).

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

import json
import os
from typing import Any

import numpy as np
import polars as pl

from tracekit.files import write_text

from analyses.context import Context
from analyses.skew import Sample
from tracekit.run_dir import RunDir

STATS_FILE = "torchrec_cache_stats.json"


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


def write_stats(ctx: Context, stats: dict) -> os.PathLike:
    """Write `stats` (planner_stats) as RUN/analysis/torchrec_cache_stats.json; its path."""
    return write_text(RunDir.at(ctx.path).analysis / STATS_FILE, json.dumps(stats, indent=2, default=_plain) + "\n")


def _plain(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    raise TypeError(f"{type(value).__name__} is not JSON serialisable")


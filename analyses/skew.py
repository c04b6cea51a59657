"""How skewed each embedding table's training lookups are: the `skew`, `coverage` and
`hot_set_stability` tables, and the two passes over `accesses` that this analysis and `cache` share.

Definitions, per table, over training rows (`train_accesses`); n_r is the number of lookups of row r
(the sum of `count` over steps and ranks), T = sum of n_r, N = num_rows (from the manifest, else the
largest row seen + 1), rows ranked by n_r, most read first:

- top_p_share (p = 0.1%, 1%, 10%): the fraction of T taken by the ceil(p * N) most-read rows.
- rows_for_x (x = 50, 80, 90, 99%): the fewest rows whose lookups together reach x * T.
- gini: over all N rows (rows never read count as 0), with n sorted ascending and i = 1..N:
  G = 2 * sum(i * n_(i)) / (N * T) - (N + 1) / N; 0 = every row equally read, -> 1 = one row takes all.
- zipf_alpha: the maximum-likelihood exponent of P(rank k) = k^-a / sum_{j=1..K} j^-a over the K rows
  read (the model `tracekit.dlrm.presets.fit_zipf_exponent` fits): the root of
  E_a[ln k] = sum(n_k ln k) / T, found by bisection (E_a[ln k] falls as a grows). Equally read rows
  give 0. Rows never read are outside the support, so a short trace of a large table reads low.
- coverage: share of T taken by the top-k rows at log-spaced k from 1 to the rows read.
- hot_set_stability: the steps are cut into WINDOWS equal ranges; in each, the top-k rows (k =
  rows_for_80pct of the whole trace; ties broken by the smaller row id) form the window's hot set;
  `jaccard` = |A ∩ B| / |A ∪ B| of consecutive windows' hot sets. It is computed on the row sample
  (below) with k scaled by the table's sampling rate, so it is exact where that rate is 1 and an
  estimate (`sample_rate` says which) elsewhere.

Tables: `skew` (table_name and the figures above, with num_rows, rows_touched, lookups), `coverage`
(table_name, rows, row_fraction = rows / N, share), `hot_set_stability` (table_name, window: the
later of the two, first_step and last_step of it, k, jaccard, sample_rate).

Passes over `accesses` (never a Python loop over rows; memory bounded by DuckDB's limit):
1. `lookup_histogram`: one GROUP BY (table, row) in DuckDB, reduced at once to how many rows of each
   table were read exactly n times. Every figure above except the hot set is exact from it, since
   rows read equally often are interchangeable: ranks within a run of equal counts are summed in
   closed form (sum of ln k over k = a..b is lgamma(b + 1) - lgamma(a)).
2. `access_sample`: training accesses of a spatially hashed sample of rows (SHARDS, Waldspurger et
   al., FAST '15): a row of table t is kept iff hash(row) mod 2^32 < R_t * 2^32 (DuckDB's hash, not
   the cache's set hash), every step and rank of a kept row alike, with R_t = min(1, SAMPLE_ROWS /
   accesses rows of t); ordered by step. The cache replays run on it; the hot sets are read from it.
Both are computed once per context (ctx.memo); `analyses.cache` reads the histogram (its replay
draws a sample of its own) and shares the first check, `no_training_accesses`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import polars as pl

from analyses.context import Context, Result
from analyses.row_totals import row_totals

TOP_SHARES = {"top_0_1pct_share": 0.001, "top_1pct_share": 0.01, "top_10pct_share": 0.1}
ROWS_FOR = {"rows_for_50pct": 50, "rows_for_80pct": 80, "rows_for_90pct": 90, "rows_for_99pct": 99}
HOT_SET_PERCENT = 80  # hot set size k = rows_for_80pct
WINDOWS = 10
COVERAGE_POINTS = 40
SAMPLE_ROWS = 100_000  # accesses rows kept per table by the row sample: R_t = min(1, this / its accesses rows)
HASH_RANGE = 1 << 32


# ---------------------------------------------------------------------------------------------- passes

def lookup_histogram(ctx: Context) -> pl.DataFrame:
    """Per table, how many rows were read exactly `lookups` times in training: table_name, lookups,
    rows, accesses (the accesses rows of those rows: (step, rank) batches they appear in), max_row."""
    return ctx.memo(lookup_histogram, lambda: _lookup_histogram(ctx))


def no_training_accesses(ctx: Context) -> str | None:
    """Why the run has no training accesses to analyse, or None (skew's and the cache replay's check)."""
    if not ctx.has("accesses"):
        return "no accesses table"
    if lookup_histogram(ctx).is_empty():
        return "no training rows in accesses (phase = 'train')"
    return None


def _lookup_histogram(ctx: Context) -> pl.DataFrame:
    return ctx.frame(f"""SELECT table_name, lookups::BIGINT AS lookups, count(*) AS rows,
                                sum(accesses)::BIGINT AS accesses, max("row") AS max_row
                         FROM {row_totals(ctx)} GROUP BY ALL ORDER BY table_name, lookups""")


@dataclass
class Sample:
    """Training accesses of the hashed row sample, ordered by (step, rank, table, row), one entry per
    (step, rank, table, row): `table` indexes `names`, `rates[table]` is R_t."""

    step: np.ndarray
    rank: np.ndarray
    table: np.ndarray
    row: np.ndarray
    count: np.ndarray
    names: list[str]
    rates: np.ndarray
    hot: np.ndarray | None = None  # entries of the rows kept whatever their hash (`hashed_sample`'s `hot`)

    def __len__(self) -> int:
        return len(self.row)


def access_sample(ctx: Context, sample_rows: int | None = SAMPLE_ROWS, tables: tuple[str, ...] | None = None) -> Sample:
    """The hashed row sample with about `sample_rows` accesses rows per table (None: every row), of
    every table or of `tables` only."""
    return ctx.memo((access_sample, sample_rows, tables), lambda: _access_sample(ctx, sample_rows, tables))


def _access_sample(ctx: Context, sample_rows: int | None, tables: tuple[str, ...] | None) -> Sample:
    per_table = lookup_histogram(ctx).group_by("table_name").agg(pl.col("accesses").sum()).sort("table_name")
    if tables is not None:
        per_table = per_table.filter(pl.col("table_name").is_in(tables))
    names = per_table["table_name"].to_list()
    accesses = np.maximum(per_table["accesses"].to_numpy(), 1)
    rate = np.ones(len(names)) if sample_rows is None else np.minimum(1.0, sample_rows / accesses)
    return hashed_sample(ctx, names, rate)


def hashed_sample(ctx: Context, names: list[str], rate: np.ndarray, first: np.ndarray | None = None,
                  hot: pl.DataFrame | None = None) -> Sample:
    """The training accesses of table names[t]'s rows whose hash falls under rate[t] (from step
    first[t] on, where given), ordered by (step, rank, table, row), one entry per such key; with
    `hot` (tid, row), those rows' accesses too whatever their hash (`Sample.hot` marks them)."""
    threshold = np.minimum(HASH_RANGE, np.ceil(rate * HASH_RANGE)).astype(np.int64)
    first = np.zeros(len(names), dtype=np.int64) if first is None else first
    ctx.con.register("tk_sample_rates", pl.DataFrame(
        {"table_name": names, "tid": np.arange(len(names), dtype=np.int32), "threshold": threshold,
         "first": first}).to_arrow())
    if hot is not None:
        ctx.con.register("tk_sample_hot", hot.select(pl.col("tid").cast(pl.Int32), "row").to_arrow())
    kept = "h.tid IS NOT NULL" if hot is not None else "false"
    try:
        frame = ctx.frame(f"""
            SELECT a.step, a.rank, r.tid, a."row", a."count", {kept} AS hot
            FROM train_accesses a JOIN tk_sample_rates r USING (table_name)
            {'LEFT JOIN tk_sample_hot h ON h.tid = r.tid AND h."row" = a."row"' if hot is not None else ''}
            WHERE (hash(a."row") % {HASH_RANGE} < r.threshold OR {kept}) AND a.step >= r.first
            ORDER BY a.step, a.rank, r.tid, a."row" """)
    finally:
        ctx.con.unregister("tk_sample_rates")
        if hot is not None:
            ctx.con.unregister("tk_sample_hot")
    columns = [frame[c].to_numpy() for c in ("step", "rank", "tid", "row", "count", "hot")]
    step, rank, table, row, count, is_hot = _merge_duplicates(*columns)
    return Sample(step, rank, table.astype(np.int64), row, count, names, threshold / HASH_RANGE,
                  is_hot if hot is not None else None)


def _merge_duplicates(step, rank, table, row, count, hot):
    """One entry per (step, rank, table, row), counts summed (a step written in two parts)."""
    if len(row) < 2:
        return step, rank, table, row, count.astype(np.int64), hot
    same = (step[1:] == step[:-1]) & (rank[1:] == rank[:-1]) & (table[1:] == table[:-1]) & (row[1:] == row[:-1])
    if not same.any():
        return step, rank, table, row, count.astype(np.int64), hot
    first = np.flatnonzero(np.r_[True, ~same])
    return (step[first], rank[first], table[first], row[first], np.add.reduceat(count.astype(np.int64), first),
            hot[first])


# ---------------------------------------------------------------------------------------------- figures

@dataclass
class Ranked:
    """One table's per-row lookup counts as runs of equal counts, most read first: `value[i]` lookups
    for each of `mult[i]` rows; `rows_before[i]`/`lookups_before[i]` are the rows/lookups of the runs
    before run i."""

    value: np.ndarray
    mult: np.ndarray

    def __post_init__(self) -> None:
        order = np.argsort(-self.value, kind="stable")
        self.value, self.mult = self.value[order].astype(np.int64), self.mult[order].astype(np.int64)
        self.cum_rows = np.cumsum(self.mult)
        self.cum_lookups = np.cumsum(self.value * self.mult)
        self.rows_before = self.cum_rows - self.mult
        self.lookups_before = self.cum_lookups - self.value * self.mult

    @property
    def touched(self) -> int:
        return int(self.cum_rows[-1])

    @property
    def total(self) -> int:
        return int(self.cum_lookups[-1])

    def share_of_top(self, k: np.ndarray) -> np.ndarray:
        """Fraction of lookups taken by the k most-read rows (k an array of row counts >= 0)."""
        k = np.minimum(np.asarray(k, dtype=np.int64), self.touched)
        i = np.minimum(np.searchsorted(self.cum_rows, k, side="left"), len(self.value) - 1)
        top = self.lookups_before[i] + (k - self.rows_before[i]) * self.value[i]
        return np.where(k > 0, top, 0) / self.total

    def rows_for(self, percent: int) -> int:
        """The fewest rows whose lookups reach percent% of all (integer arithmetic, no rounding)."""
        need = percent * self.total  # compared against 100 * lookups
        i = int(np.searchsorted(100 * self.cum_lookups, need, side="left"))
        missing = need - 100 * int(self.lookups_before[i])
        return int(self.rows_before[i]) + -(-missing // (100 * int(self.value[i])))

    def gini(self, num_rows: int) -> float:
        """Gini coefficient over num_rows rows, those never read counting as 0."""
        value, mult = self.value[::-1].astype(np.float64), self.mult[::-1].astype(np.float64)  # ascending
        first = (num_rows - self.touched) + 1 + np.cumsum(mult) - mult  # 1-based position of each run
        weighted = float((value * (mult * first + mult * (mult - 1) / 2)).sum())
        return 2 * weighted / (num_rows * self.total) - (num_rows + 1) / num_rows

    def zipf_alpha(self) -> float:
        """Maximum-likelihood Zipf exponent over the rows read (module docstring); NaN under 2 rows."""
        if self.touched < 2:
            return math.nan
        lgamma = np.vectorize(math.lgamma, otypes=[np.float64])
        log_ranks = lgamma(self.cum_rows.astype(np.float64) + 1) - lgamma(self.rows_before.astype(np.float64) + 1)
        observed = float((self.value * log_ranks).sum()) / self.total
        return solve_zipf(observed, self.touched)


def solve_zipf(mean_log_rank: float, n: int, tolerance: float = 1e-9) -> float:
    """The exponent a at which E_a[ln k] over k = 1..n equals `mean_log_rank` (0 if it is at or above
    the uniform value)."""
    if model_mean_log_rank(0.0, n) <= mean_log_rank:
        return 0.0
    low, high = 0.0, 1.0
    while model_mean_log_rank(high, n) > mean_log_rank:
        low, high = high, 2 * high
    while high - low > tolerance:
        middle = (low + high) / 2
        low, high = (middle, high) if model_mean_log_rank(middle, n) > mean_log_rank else (low, middle)
    return (low + high) / 2


_HEAD = 1 << 14  # ranks summed term by term; beyond, Euler-Maclaurin
_NODES, _WEIGHTS = np.polynomial.legendre.leggauss(96)


def model_mean_log_rank(a: float, n: int) -> float:
    """E[ln k] under P(k) ~ k^-a on k = 1..n."""
    head = np.arange(1, min(n, _HEAD) + 1, dtype=np.float64)
    log_head = np.log(head)
    weights = np.exp(-a * log_head)
    mass, moment = float(weights.sum()), float((weights * log_head).sum())
    if n > _HEAD:  # sum over k = m+1..n ~ integral from m to n + (f(n) - f(m)) / 2 (Euler-Maclaurin)
        lo, hi = math.log(_HEAD), math.log(n)
        u = (hi - lo) / 2 * _NODES + (hi + lo) / 2  # x = e^u: integral of x^-a g(x) dx = of e^((1-a)u) g du
        weights = np.exp((1 - a) * u) * (hi - lo) / 2 * _WEIGHTS
        mass += float(weights.sum()) + (n ** -a - _HEAD ** -a) / 2
        moment += float((weights * u).sum()) + (n ** -a * hi - _HEAD ** -a * lo) / 2
    return moment / mass


def table_figures(ranked: Ranked, num_rows: int) -> dict[str, Any]:
    figures: dict[str, Any] = {"num_rows": num_rows, "rows_touched": ranked.touched, "lookups": ranked.total}
    for column, p in TOP_SHARES.items():
        figures[column] = float(ranked.share_of_top(np.array([math.ceil(p * num_rows)]))[0])
    figures["gini"] = ranked.gini(num_rows)
    figures["zipf_alpha"] = ranked.zipf_alpha()
    for column, percent in ROWS_FOR.items():
        figures[column] = ranked.rows_for(percent)
    return figures


def coverage_points(touched: int, points: int = COVERAGE_POINTS) -> np.ndarray:
    """Log-spaced row counts from 1 to `touched`, both included."""
    return np.unique(np.round(np.logspace(0, math.log10(touched), points)).astype(np.int64).clip(1, touched))


# ---------------------------------------------------------------------------------------------- hot set

def hot_set_stability(sample: Sample, hot_rows: dict[str, int], windows: int = WINDOWS) -> pl.DataFrame:
    """Jaccard of consecutive windows' top-k sets per table (module docstring), from the sample."""
    schema = {"table_name": pl.String, "window": pl.Int64, "first_step": pl.Int64, "last_step": pl.Int64,
              "k": pl.Int64, "jaccard": pl.Float64, "sample_rate": pl.Float64}
    if len(sample) == 0:
        return pl.DataFrame(schema=schema)
    first, last = int(sample.step.min()), int(sample.step.max())
    windows = max(1, min(windows, last - first + 1))
    span = last - first + 1
    window = (sample.step - first) * windows // span
    k_full = np.array([hot_rows.get(name, 0) for name in sample.names], dtype=np.int64)
    k_sampled = np.where(k_full > 0, np.maximum(1, np.round(k_full * sample.rates)), 0).astype(np.int64)

    # lookups per (table, window, row), then each (table, window)'s top-k by (lookups desc, row asc)
    order = np.lexsort((sample.row, window, sample.table))
    t, w, r, c = sample.table[order], window[order], sample.row[order], sample.count[order]
    start = np.flatnonzero(np.r_[True, (t[1:] != t[:-1]) | (w[1:] != w[:-1]) | (r[1:] != r[:-1])])
    t, w, r, c = t[start], w[start], r[start], np.add.reduceat(c, start)
    order = np.lexsort((r, -c, w, t))
    t, w, r = t[order], w[order], r[order]
    group_start = np.flatnonzero(np.r_[True, (t[1:] != t[:-1]) | (w[1:] != w[:-1])])
    position = np.arange(len(t)) - np.repeat(group_start, np.diff(np.r_[group_start, len(t)]))
    hot = position < k_sampled[t]
    t, w, r = t[hot], w[hot], r[hot]

    sizes = np.zeros((len(sample.names), windows), dtype=np.int64)
    np.add.at(sizes, (t, w), 1)
    order = np.lexsort((w, r, t))
    t, w, r = t[order], w[order], r[order]
    both = (t[1:] == t[:-1]) & (r[1:] == r[:-1]) & (w[1:] == w[:-1] + 1)  # in window w-1 and w
    common = np.zeros_like(sizes)
    np.add.at(common, (t[1:][both], w[1:][both]), 1)

    bounds = first + np.arange(windows + 1) * span // windows
    rows = []
    for table, name in enumerate(sample.names):
        for later in range(1, windows):
            union = sizes[table, later - 1] + sizes[table, later] - common[table, later]
            if union:
                rows.append((name, later, int(bounds[later]), int(bounds[later + 1] - 1), int(k_full[table]),
                             common[table, later] / union, float(sample.rates[table])))
    return pl.DataFrame(rows, schema=schema, orient="row")


# ---------------------------------------------------------------------------------------------- compute

def compute(ctx: Context, *, sample_rows: int | None = SAMPLE_ROWS) -> Result:
    """The `skew`, `coverage` and `hot_set_stability` tables and per-table figures."""
    missing = no_training_accesses(ctx)
    if missing:
        return Result(notes=[f"{missing}: skew needs per-row lookup counts"])
    histogram = lookup_histogram(ctx)
    result = Result()
    known = {t.name: t.num_rows for t in ctx.model.tables}
    skew_rows, coverage = [], []
    for (name,), part in histogram.group_by("table_name", maintain_order=True):
        ranked = Ranked(part["lookups"].to_numpy(), part["rows"].to_numpy())
        seen = int(part["max_row"].max()) + 1
        num_rows = known.get(name) or seen
        if name not in known:
            result.notes.append(f"{name}: not in the manifest; num_rows taken as the largest row read + 1 ({seen})")
        elif seen > num_rows:
            result.notes.append(f"{name}: row {seen - 1} read but the manifest lists {num_rows} rows; using {seen}")
            num_rows = seen
        skew_rows.append({"table_name": name, **table_figures(ranked, num_rows)})
        k = coverage_points(ranked.touched)
        coverage.append(pl.DataFrame({"table_name": name, "rows": k, "row_fraction": k / num_rows,
                                      "share": ranked.share_of_top(k)}))
    skew = pl.DataFrame(skew_rows).sort("table_name")
    result.tables["skew"] = skew
    result.tables["coverage"] = pl.concat(coverage).sort("table_name", "rows")

    sample = access_sample(ctx, sample_rows)
    hot_rows = dict(zip(skew["table_name"], skew[f"rows_for_{HOT_SET_PERCENT}pct"]))
    stability = hot_set_stability(sample, hot_rows)
    result.tables["hot_set_stability"] = stability
    if (sample.rates < 1).any():
        result.notes.append(f"hot-set stability estimated on a hashed row sample for {sampled_tables(sample)}")
    result.summary = summary(skew, stability)
    return result


def sampled_tables(sample: Sample) -> str:
    """'k of n tables (rates a-b; column sample_rate)' for the tables sampled at a rate below 1."""
    rates = sample.rates[sample.rates < 1]
    return (f"{len(rates)} of {len(sample.rates)} tables (rates {rates.min():.3g}-{rates.max():.3g}; "
            "column sample_rate)")


def summary(skew: pl.DataFrame, stability: pl.DataFrame) -> dict[str, Any]:
    mean_jaccard = dict(stability.group_by("table_name").agg(pl.col("jaccard").mean()).iter_rows())
    tables = {}
    for row in skew.iter_rows(named=True):
        figures = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items() if k != "table_name"}
        jaccard = mean_jaccard.get(row["table_name"])
        figures["hot_set_jaccard"] = None if jaccard is None else round(jaccard, 4)
        tables[row["table_name"]] = figures
    lookups = skew["lookups"].sum()
    return {"phase": "train", "tables": tables, "lookups": int(lookups),
            "rows_touched": int(skew["rows_touched"].sum()),
            "top_10pct_share_overall": float((skew["top_10pct_share"] * skew["lookups"]).sum() / lookups)}

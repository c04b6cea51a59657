"""compression.dp from the DCT-DP replay (`dct_replay`, collectors/dct_replay.py): the keep ratio and
refresh period, and the gradient bytes the trainer's hook (tracekit/dlrm/compression.py) would send
with error feedback. analyses/policies/compression.py calls `derive` when the run has the table.

The replay gives, per rank, step, parameter p (n_p entries) and pair (X, R), `sent` of `replayed`
entries, so est = sent · n_p / replayed (exact when every entry is replayed). Per step t and DDP
bucket b, the hook pads every rank's entries to the largest count, so it puts out
    K_bt = max over ranks of Σ_{p in b} est,    bytes_bt = W · (4 + min(8K, 6K + 4·blocks, ⌈n_b/8⌉ + 4K, 4·n_b))
(its count, then int32 index + fp32 value, int16 offset + value after each 65,536-entry block's
count (blocks = ⌈n_b/65536⌉, none for one block), a bitmap, or dense; nothing after the count when
K = 0), and dp_bytes_per_step(X, R) = Σ_{t,b} bytes_bt / T over the T replayed steps. Buckets are
DDP's as `comms` shows them (the DP calls of a step, in order: bucket 0 first; their sizes the most
common over steps), filled with parameters in the order their gradients became ready (`position`,
DDP's order after its first step). Where they do not match, the prediction takes each parameter as
its own bucket for the padding (an upper bound); the interval's ends are that bound and one bucket
per rank (a lower bound), widened by two standard deviations of the subsets' sampling error, taken
from the two halves of each subset: sd = √Σ_p (n_p / replayed_p · (mean first half − mean second half))²
(entries, converted to bytes at the chosen encoding's bytes per entry), then by RERUN_ALLOWANCE (10%)
either way for the re-run's own gradients (below).

Drift of (X, R): D = Σ_{t,b} K_bt / (T · Σ_p target_p), target_p = ⌈X · n_p⌉ (n_p for a parameter
the hook sends whole): how many times the target's entries the stale threshold lets through on
average, error feedback's growth between refreshes included; and the same by steps since the last
refresh (table `dct_dp_drift`). The section keeps the smallest X (the most compression; the replay
cannot tell model quality) and the largest R of the ladder whose D ≤ DRIFT_BOUND; where no R of the
ladder holds X's drift, R = 1: the threshold refreshed every step, which sends exactly the target
(an exact figure, with no replay needed).

What the replay cannot know: a run that applies the section trains on the compressed gradients,
not on this run's, so its counts drift differently (on the criteo-kaggle preset, +4.7% at 1,000
steps: bench/RESULTS.md §21). `why` says so, and the interval allows RERUN_ALLOWANCE for it.
"""

from __future__ import annotations

import math

import polars as pl

from analyses.context import Context, PolicyResult
from tracekit.figures import DP_BYTES, STEP_TIME
from tracekit.policy import DctDp, Prediction
from tracekit.schema import DCT_WHOLE_BELOW
from tracekit.manifest import dtype_bytes

DRIFT_BOUND = 2.0
BLOCK = 65536  # the hook's int16 offsets are within blocks of this many entries
SAMPLING_SDS = 2.0  # the interval's half-width in standard deviations of the subsets' sampling error
RERUN_ALLOWANCE = 0.10
"""The interval's further relative widening for what the replay cannot see: a run that applies the
section trains on compressed gradients. Measured, not derived: +4.7% on the criteo-kaggle preset at
keep 0.1% every 5 steps, 1,000 steps (bench/RESULTS.md §21); +2.8% at every 20 steps (the replay's
prototype against §9's run); +0.7% on the tests' TINY trainer."""


def derive(ctx: Context, world: int, steps: int, baseline_dp: float | None, dp_rows: str,
           result: PolicyResult, keep: float | None = None) -> tuple[dict | None, str | None]:
    """The compression.dp section from `dct_replay`, or the reason there is none. `baseline_dp`: DDP's
    gradient bytes per step in the run; `dp_rows`: the SQL condition on `train_comms` of its calls;
    `keep`: the keep ratio (a replayed one) its model-quality calibration chose, else the smallest."""
    params = ctx.frame("""
        SELECT name, any_value(numel) AS numel, any_value(replayed) AS replayed,
               median(position) FILTER (WHERE position >= 0) AS position
        FROM dct_replay GROUP BY name ORDER BY position NULLS LAST, name""")
    if params.height == 0:
        return None, "the dct_replay table is empty: no optimizer stepped a dense gradient"
    buckets, matched = _buckets(ctx, params, dp_rows)
    ctx.con.register("dct_dp_buckets", buckets.to_arrow())
    sizes = buckets.group_by("bucket").agg(pl.col("numel").sum().alias("n"))
    one = pl.DataFrame({"bucket": [0], "n": [int(params["numel"].sum())]})
    calls = max(buckets["bucket"].n_unique(), _calls_per_rank(ctx, steps, world, dp_rows))
    kept = {"matched": _kept(ctx, "bucket"), "upper": _kept(ctx, "name"), "lower": _kept(ctx, "0")}
    bytes_ = {how: _bytes(frame, sizes if how == "matched" else one, world,
                          calls=0 if how == "matched" else calls)
              for how, frame in kept.items()}
    targets = _targets(ctx)
    pairs = (bytes_["matched"].join(bytes_["upper"], on=["keep_ratio", "refresh_every"], suffix="_upper")
             .join(bytes_["lower"], on=["keep_ratio", "refresh_every"], suffix="_lower")
             .join(targets, on="keep_ratio").join(_sampling(ctx), on=["keep_ratio", "refresh_every"]))
    point = "kept" if matched else "kept_upper"
    pairs = pairs.with_columns((pl.col(point) / pl.col("target")).alias("drift"),
                               (pl.col("kept_max") / pl.col("target")).alias("drift_max"))
    point_bytes = "bytes" if matched else "bytes_upper"
    count_bytes = world * 4 * (sizes.height if matched else calls)  # the counts' all-gathers, per step
    per_entry = (pl.col(point_bytes) - count_bytes) / pl.col(point).clip(lower_bound=1e-9)
    spread = SAMPLING_SDS * pl.col("sd") * per_entry
    low = (pl.min_horizontal("bytes_lower", point_bytes) - spread) * (1 - RERUN_ALLOWANCE)
    high = (pl.max_horizontal("bytes_upper", point_bytes) + spread) * (1 + RERUN_ALLOWANCE)
    pairs = pairs.with_columns(pl.col(point_bytes).alias(DP_BYTES),
                               low.clip(lower_bound=0).alias("low"), high.alias("high"))
    keep, refresh, row = _choose(pairs, keep)
    pairs = pairs.with_columns(((pl.col("keep_ratio") == keep) & (pl.col("refresh_every") == refresh)).alias("chosen"))
    result.tables["dct_dp_replay"] = pairs.select(
        "keep_ratio", "refresh_every", "replayed_steps", "drift", "drift_max", "kept", "target", "sd",
        DP_BYTES, "low", "high", "chosen").sort("keep_ratio", "refresh_every")
    result.tables["dct_dp_drift"] = _drift_curve(ctx, targets)
    if row is None:  # refreshed every step: the target exactly, per bucket
        target = float(targets.filter(pl.col("keep_ratio") == keep)["target"].item())
        exact = _bytes_of(sizes if matched else one, world, _bucket_targets(buckets, keep),
                          calls=0 if matched else calls)
        dp_bytes, interval, kept_per_rank, drift = exact, None, target, 1.0
    else:
        dp_bytes, interval = float(row[DP_BYTES]), [float(row["low"]), float(row["high"])]
        kept_per_rank, drift = float(row[point]), float(row["drift"])
    return _section(keep, refresh, dp_bytes, interval, kept_per_rank, drift, baseline_dp, world, matched, pairs,
                    result), None


def _buckets(ctx: Context, params: pl.DataFrame, dp_rows: str) -> tuple[pl.DataFrame, bool]:
    """Each parameter's DDP bucket (parameters in ready order filled into the buckets' sizes from
    `comms`), and whether they matched; else every parameter in bucket 0."""
    fallback = params.select("name", "numel", pl.lit(0).alias("bucket"))
    if not ctx.has("comms") or params["position"].null_count():
        return fallback, False
    calls = ctx.frame(f"""
        SELECT rank, step, string_agg(bytes_out::VARCHAR, ',' ORDER BY seq) AS sizes, any_value(dtype) AS dtype
        FROM train_comms WHERE {dp_rows} AND step > 0 GROUP BY rank, step""")
    if calls.height == 0:
        return fallback, False
    common = calls.group_by("sizes", "dtype").len().sort("len", "sizes", descending=True).row(0, named=True)
    value_bytes = dtype_bytes(str(common["dtype"]))
    ends, total = [], 0
    for size in map(int, common["sizes"].split(",")):
        total += size // value_bytes
        ends.append(total)
    cumulative = params["numel"].cum_sum().to_list()
    if cumulative[-1] != total or not set(ends) <= set(cumulative):
        return fallback, False
    bucket = [sum(c > e for e in ends) for c in cumulative]
    return params.select("name", "numel").with_columns(pl.Series("bucket", bucket)), True


def _calls_per_rank(ctx: Context, steps: int, world: int, dp_rows: str) -> int:
    if not ctx.has("comms") or not steps:
        return 1
    (calls,) = ctx.sql(f"SELECT count(*)::DOUBLE FROM train_comms WHERE {dp_rows}").fetchall()[0]
    return max(round(calls / steps / max(world, 1)), 1)


def _kept(ctx: Context, group: str) -> pl.DataFrame:
    """Per pair, step and group (a bucket, a parameter, or one for all): the largest over ranks of
    the scaled count, K."""
    return ctx.frame(f"""
        WITH per_rank AS (
            SELECT keep_ratio, refresh_every, step, {group} AS part, rank,
                   sum(sent::DOUBLE * r.numel / replayed) AS est
            FROM dct_replay r JOIN dct_dp_buckets b USING (name) GROUP BY ALL)
        SELECT keep_ratio, refresh_every, step, {"part AS bucket" if group == "bucket" else "0 AS bucket"},
               sum(k) AS k
        FROM (SELECT keep_ratio, refresh_every, step, part, max(est) AS k FROM per_rank GROUP BY ALL)
        GROUP BY ALL""")


def _payload(k: pl.Expr, n: pl.Expr) -> pl.Expr:
    """Bytes of one rank's kept entries in the cheapest encoding (the module docstring's), 0 for none."""
    blocks = (n / BLOCK).ceil()
    blocks = pl.when(blocks > 1).then(blocks).otherwise(0)
    cheapest = pl.min_horizontal(8 * k, 6 * k + 4 * blocks, (n / 8).ceil() + 4 * k, 4 * n)
    return pl.when(k > 0).then(cheapest).otherwise(0.0)


def _bytes(kept: pl.DataFrame, sizes: pl.DataFrame, world: int, *, calls: int) -> pl.DataFrame:
    """Per pair: K and bytes per step, each bucket-step's count (4 bytes) and payload, Σ over ranks;
    `calls`: the count's all-gathers per rank and step where the buckets are not known (0: per bucket)."""
    per_bucket = kept.join(sizes, on="bucket").with_columns(
        (world * (4 * (calls == 0) + _payload(pl.col("k"), pl.col("n").cast(pl.Float64)))).alias("b"))
    per_step = per_bucket.group_by("keep_ratio", "refresh_every", "step").agg(pl.col("k").sum(), pl.col("b").sum())
    return per_step.group_by("keep_ratio", "refresh_every").agg(
        pl.col("k").mean().alias("kept"), pl.col("k").max().alias("kept_max"),
        (pl.col("b").mean() + world * 4 * calls).alias("bytes"), pl.len().alias("replayed_steps"))


def _bytes_of(sizes: pl.DataFrame, world: int, targets: dict[int, float], *, calls: int) -> float:
    """Bytes per step when every rank sends exactly its target per bucket (a refresh every step)."""
    frame = sizes.with_columns(pl.col("bucket").replace_strict(targets, return_dtype=pl.Float64).alias("k"))
    per_bucket = world * (4 * (calls == 0) + _payload(pl.col("k"), pl.col("n").cast(pl.Float64)))
    return float(frame.select(per_bucket.sum()).item()) + world * 4 * calls


def target(numel: int, keep: float) -> int:
    """The entries a fresh threshold sends, as the hook computes k (a float product, then ceil)."""
    k = max(1, math.ceil(keep * numel))
    return numel if numel < DCT_WHOLE_BELOW or k >= numel else k


def _targets(ctx: Context) -> pl.DataFrame:
    """Per keep ratio: Σ_p target_p, the entries a fresh threshold sends per rank."""
    numel = ctx.frame("SELECT name, any_value(numel) AS numel FROM dct_replay GROUP BY name")["numel"].to_list()
    keeps = ctx.frame("SELECT DISTINCT keep_ratio FROM dct_replay")["keep_ratio"].to_list()
    return pl.DataFrame({"keep_ratio": keeps, "target": [float(sum(target(n, k) for n in numel)) for k in keeps]})


def _bucket_targets(buckets: pl.DataFrame, keep: float) -> dict[int, float]:
    """Per bucket: Σ target_p over its parameters."""
    totals: dict[int, float] = {}
    for numel, bucket in buckets.select("numel", "bucket").iter_rows():
        totals[bucket] = totals.get(bucket, 0.0) + target(numel, keep)
    return totals


def _sampling(ctx: Context) -> pl.DataFrame:
    """Per pair: the sampling error's standard deviation of K (entries), from the subsets' halves."""
    return ctx.frame("""
        WITH halves AS (
            SELECT keep_ratio, refresh_every, name, any_value(numel) AS numel, any_value(replayed) AS replayed,
                   avg(sent_first_half) AS first, avg(sent - sent_first_half) AS second
            FROM dct_replay GROUP BY keep_ratio, refresh_every, name)
        SELECT keep_ratio, refresh_every,
               sqrt(sum(CASE WHEN replayed < numel THEN pow(numel::DOUBLE / replayed * (first - second), 2)
                             ELSE 0 END)) AS sd
        FROM halves GROUP BY ALL""")


def _drift_curve(ctx: Context, targets: pl.DataFrame) -> pl.DataFrame:
    """Per pair and steps since the last refresh: the mean over ranks and refresh periods of the
    scaled count, over its target."""
    frame = ctx.frame("""
        WITH numbered AS (
            SELECT *, dense_rank() OVER (ORDER BY step) - 1 AS replay_step FROM dct_replay),
        per_rank AS (
            SELECT keep_ratio, refresh_every, replay_step % refresh_every AS steps_since_refresh, step, rank,
                   sum(sent::DOUBLE * numel / replayed) AS est
            FROM numbered GROUP BY ALL)
        SELECT keep_ratio, refresh_every, steps_since_refresh, avg(est) AS kept
        FROM per_rank GROUP BY ALL""")
    return (frame.join(targets, on="keep_ratio").with_columns((pl.col("kept") / pl.col("target")).alias("drift"))
            .select("keep_ratio", "refresh_every", "steps_since_refresh", "drift")
            .sort("keep_ratio", "refresh_every", "steps_since_refresh"))


def _choose(pairs: pl.DataFrame, keep: float | None = None) -> tuple[float, int, dict | None]:
    """`keep` (a replayed keep ratio), else the smallest, and the largest replayed refresh period
    whose drift is held (its row), else 1 (no row)."""
    replayed = set(pairs["keep_ratio"].to_list())
    keep = next((k for k in replayed if keep is not None and math.isclose(k, keep)), float(min(replayed)))
    held = pairs.filter((pl.col("keep_ratio") == keep) & (pl.col("drift") <= DRIFT_BOUND)).sort("refresh_every")
    if held.height == 0:
        return keep, 1, None
    row = held.row(-1, named=True)
    return keep, int(row["refresh_every"]), row


def _section(keep: float, refresh: int, dp_bytes: float, interval: list[float] | None, kept: float, drift: float,
             baseline_dp: float | None, world: int, matched: bool, pairs: pl.DataFrame,
             result: PolicyResult) -> dict:
    ladder = sorted(set(pairs["refresh_every"].to_list()), reverse=True)
    at_keep = pairs.filter(pl.col("keep_ratio") == keep).sort("refresh_every", descending=True)
    drifts = ", ".join(f"{r}: {d:.2f}x" for r, d in zip(at_keep["refresh_every"], at_keep["drift"]))
    if refresh == 1:
        how = (f"no replayed refresh period holds its drift within {DRIFT_BOUND:g}x ({drifts}), so the threshold "
               "is refreshed every step (top-k every step), which sends exactly the target")
    elif refresh < ladder[0]:
        how = (f"refreshed every {refresh} steps: the longest replayed period whose threshold, with error "
               f"feedback's growth, lets through at most {DRIFT_BOUND:g}x its target on average ({drifts}); "
               "longer periods drift further")
    else:
        how = (f"refreshed every {refresh} steps, the longest replayed period; its threshold, with error "
               f"feedback's growth, lets through {drift:.2f}x its target on average ({drifts})")
    why = (f"keep {keep:.1%} of each gradient (the smallest replayed ratio), {how}; {dp_bytes / world:,.0f} bytes "
           f"per rank per step")
    if baseline_dp:
        why += f", {dp_bytes / baseline_dp:.2%} of the {baseline_dp:,.0f} bytes DDP all-reduces"
    why += ("; replayed on this run's gradients: a run that applies it trains on compressed ones and drifts a "
            "little differently")
    predicted = {**figures(world, dp_bytes, baseline_dp, kept), "drift": drift}
    section = DctDp(keep_ratio=keep, refresh_every=refresh, error_feedback=True,
                    prediction=Prediction(predicted, why, {} if interval is None else {DP_BYTES: tuple(interval)})).to_json()
    result.evidence["dp"] = {
        "rows": "dct_replay: sent of replayed entries per (rank, step, parameter, keep ratio, refresh period), "
                "scaled to the parameter; comms: DDP's bucket sizes and calls",
        "buckets": "DDP's, from comms and the gradients' ready order" if matched else
                   "not matched to DDP's: each parameter padded alone (an upper bound)",
        "drift": {f"{k}/{r}": d for k, r, d in pairs.select("keep_ratio", "refresh_every", "drift").iter_rows()},
        "drift_bound": DRIFT_BOUND,
        "formula": "K_bt = max over ranks of sum over the bucket's parameters of sent * numel / replayed; "
                   "dp_bytes_per_step = mean over steps of sum over buckets of W * (4 + min(8K, 6K + 4 blocks, "
                   "ceil(n/8) + 4K, 4n)); drift = mean K / sum of targets",
        "caveats": "replayed on the recorded run's gradients; a run that applies the section trains on compressed "
                   f"ones (the interval allows {RERUN_ALLOWANCE:.0%} for it, as measured). Subsampled parameters' "
                   "counts are estimates (the interval holds two standard deviations of their sampling error).",
    }
    return section


def figures(world: int, dp_bytes: float, baseline_dp: float | None, kept: float) -> dict:
    """The predicted figures of a compression.dp section sending `dp_bytes` per step (Σ ranks) in
    place of DDP's `baseline_dp`; its step time is set afterwards (compression.step_time)."""
    return {DP_BYTES: dp_bytes, "baseline_dp_bytes_per_step": baseline_dp,
            "ratio": dp_bytes / baseline_dp if baseline_dp else None,
            "dp_wire_bytes_per_step": (world - 1) * dp_bytes,
            "baseline_dp_wire_bytes_per_step": 2 * (world - 1) / world * baseline_dp if baseline_dp is not None else None,
            "kept_elements_per_rank": kept, STEP_TIME: None}

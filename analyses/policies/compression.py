"""DCT compression (research/papers.md §3, B.4, B.5): hard-threshold the data-parallel gradients
(compression.dp) and the model-parallel embedding outputs (compression.mp), with the bytes each
would put in `comms`.

compression.dp, from the DCT-DP replay (`dct_replay`, collectors/dct_replay.py, `record --dct-replay`)
where the run has it: the keep ratio, the refresh period and the bytes with error feedback's growth
between refreshes (analyses/policies/dct_dp.py).

compression.dp without the replay, from `grads` (collectors/grads.py): what error feedback makes of a
stale threshold is not in the trace (on the Kaggle layout at dim 128 a threshold left in force for
60 steps let through 12x what the uncompressed gradients' statistics said: bench/RESULTS.md §33), so
the threshold is refreshed every step (refresh_every 1), which sends each parameter exactly its target
⌈X · numel⌉ (the whole of a parameter of fewer than DCT_WHOLE_BELOW entries), at the smallest X of
KEEP_RATIOS: its model-quality cost is what decides (analyses.quality). Bytes, in `comms` terms (per
training step, Σ over ranks of bytes_out), as the trainer's hook sends them (tracekit/dlrm/compression.py):
per DDP bucket an all-gather of each rank's count (4 bytes), then an all-gather of its kept entries in
the cheapest encoding; taking the model's N gradient entries as one bucket, K = Σ_p target_p per rank
and B the buckets (DDP all-reduces per step and rank in the run):
    dp_bytes_per_step = W · (min(8K, 6K + 4⌈N/65536⌉, ⌈N/8⌉ + 4K, 4N) + 4B)
(int32 index + fp32 value; int16 offset within 65,536-entry blocks + value, after each block's
count; a bitmap; dense). Table `dct_dp` keeps, per parameter and X, the stale threshold's drift_X =
max_t count_above_keep_X / target over the sampled steps (thr_keep_X left in force for REFRESH_EVERY
steps) and the smallest X whose drift stays within DRIFT_BOUND, for the record. Baseline: the training
all-reduce of DDP's gradient buckets in `comms` (tag `ddp_bucket_<i>`, or an async all-reduce: a comm
hook's, as the reference trainer's `_sum_allreduce_hook`), ratio = dp / baseline. On the wire each rank's
pairs reach W − 1 peers, (W − 1) · dp_bytes_per_step in all, against 2(W − 1)/W · baseline for a
ring all-reduce, so the sparse exchange loses its edge as W grows (`dp_wire_bytes_per_step`).

compression.mp. The trace holds no activation statistics. The keep ratio is the most compressive
one whose measured model-quality cost keeps the budget (analyses.quality: calibration runs that
`tracekit optimize` makes); without them it is the paper's (MP_KEEP_RATIO = 5% per sample, its 20×
fewer elements), with its cost stated as not measured, so not recommended. The boundary tensor is the
embedding output all-to-all: training all-to-all calls whose dtype is floating point (the input
dist sends integer lengths and ids). The gradients' calls are those of role output_bwd (comms.role,
analyses.roles: the reference trainer's, plain or through a codec, TorchRec's of one sharding
group) or whose tag ends in `backward` (TorchRec's `All2All_Pooled_Wait.backward` in a step of
several groups); the others carry rows. n = bytes_out / (value_bytes · D) rows of D values. As the trainer encodes them
(tracekit/dlrm/output_codec.py), a row keeps K = ⌈keep · D⌉ values (at least 1); forward it
carries them and their positions, one uint8 each (int16 beyond D = 256) or a D-bit mask when that
is fewer bytes; backward only the K gradient values:
    forward  n · (K · value_bytes + min(K · position_bytes, ⌈D / 8⌉)),   backward  n · K · value_bytes
`a2a_bytes_per_step` adds the input dist's integer all-to-alls, unchanged. Beside it, in the
evidence, what TorchRec-style quantized payloads would send instead (`--a2a-dtype`): bf16 and fp16
half the fp32 bytes, fp8 D + 4 bytes a row (e4m3 values and an fp32 scale). Table `dct_mp`, per
tag and dtype: calls, bytes_per_step, predicted_bytes_per_step.

Model quality, both parts: `eval_auc_change` and `eval_logloss_rel_change` as measured at the keep
ratio applied (null where not measured; analyses.quality), in `predicted` beside bytes and time.

Predicted step times (`step_time`, both parts) come from analyses.network: dp swaps DDP's bucket
all-reduces (their ring bytes at β: asynchronous, their calls' α overlaps backward) for the hook's
all-gathers (two per bucket, α each + β · their bytes) and adds
the hook's calibrated work (selection per entry and bucket, a threshold refresh every
`refresh_every` steps); mp shrinks what the output all-to-alls held the ranks (beyond their α) by
its byte ratio and adds the codec's calibrated work. As if the exchange were not overlapped with
compute: an upper bound on the saving, which analyses.decision weighs against the model's error.

    with open_context("runs/base") as ctx:
        policy = derive(ctx)
    policy.parts["compression.dp"].keep_ratio, policy.parts["compression.mp"].prediction.figures["ratio"]
"""

from __future__ import annotations

import math
from dataclasses import replace

import polars as pl

from analyses import network, quality, traffic
from analyses.context import Context, PolicyResult
from analyses.policies import dct_dp
from analyses.policies.dct_dp import DRIFT_BOUND
from analyses.replay.change import Change
from analyses.replay.prediction import changes, replay
from tracekit import tags
from tracekit.figures import A2A_BYTES, DP_BYTES, OUTPUT_A2A_BYTES, STEP_TIME
from tracekit.policy import DctDp, DctMp, Prediction
from tracekit.schema import DCT_WHOLE_BELOW, KEEP_RATIOS
from tracekit.manifest import DTYPE_BYTES

REFRESH_EVERY = 1000
"""Steps a DCT-DP threshold stays in force: the period the grads collector refreshes its thresholds
at (kraken's `life_span`; the paper's "once every few thousand iterations")."""
MP_KEEP_RATIO = 0.05
FLOAT_BYTES = {dtype: size for dtype, size in DTYPE_BYTES.items() if "float" in dtype}
FLOAT_DTYPE_SQL = "dtype LIKE '%float%' OR dtype LIKE '%half%'"  # the embedding outputs and their gradients
DP_ROWS = "op = 'all_reduce' AND (tag LIKE 'ddp_bucket_%' OR \"async\")"


def derive(ctx: Context) -> PolicyResult:
    """The compression section (dp and/or mp), each part's step time from analyses.network."""
    result = PolicyResult("compression")
    world = ctx.model.world_size
    steps = traffic.training_steps(ctx)
    calibration = quality.load(ctx.path)
    dp, dp_reason = _derive_dp(ctx, world, steps, result, calibration)
    mp, mp_reason = _derive_mp(ctx, world, steps, result, calibration)
    for name, body, kind in (("dp", dp, DctDp), ("mp", mp, DctMp)):
        if body is not None:
            step_time(ctx, name, body)
            result.parts[kind.label] = quality.attach(kind.from_json(body), kind.label, calibration,
                                                      result.evidence.setdefault(name, {}))
    reasons = {name: why for name, why in (("dp", dp_reason), ("mp", mp_reason)) if why}
    result.evidence["not_derived"] = reasons
    if not result.parts:
        result.reason = "; ".join(f"compression.{name}: {why}" for name, why in reasons.items())
    return result


def step_time(ctx: Context, name: str, body: dict) -> None:
    """Set body's predicted step_time_s and its interval: the replay of the recorded steps with the part's
    collectives changed (dp: the dense gradients' all-reduce bytes scaled to the kept entries'; mp: the
    output all-to-all's bytes scaled by its ratio) and its calibrated rank-side work added (each value
    encoded and decoded; the hook's selection), analyses/replay/; where the run does not replay,
    `_per_call`."""
    net = network.network(ctx)
    predicted = body["predicted"]
    if net.step.median_s is None:
        return
    world = max(ctx.model.world_size, 1)
    if name == "dp":
        baseline = predicted.get("baseline_dp_bytes_per_step")
        if not baseline:
            return
        buckets = _dp_calls_per_rank(ctx, traffic.training_steps(ctx), world)
        elements = baseline / world / 4  # fp32 gradient entries a rank all-reduces per step
        refresh = max(int(body.get("refresh_every") or 1), 1)  # thresholds recomputed every `refresh` steps
        work = net.work("dct_dp", elem=elements, bucket=buckets, refresh_elem=elements / refresh)
        kind, change = "dct_dp", Change(dense=predicted[DP_BYTES] / baseline)
    else:
        # fp32 values a rank sends each way: the baseline's bytes hold the forward and the backward
        # all-to-all, and the calibration's point is one exchange of `values` both ways (calibrate._dct_mp)
        values = predicted["baseline_output_a2a_bytes_per_step"] / 4 / world / 2
        work = net.work("dct_mp", value=values, kept=values * body["keep_ratio"])
        kind, change = "dct_mp", Change(scale={"output_fwd": predicted["ratio"], "output_bwd": predicted["ratio"]})
    change = replace(change, work_s=0.0 if work is None else float(work))
    rp = replay(ctx)
    if rp.steps and rp.measured_median_s is not None:
        changes(ctx)[f"compression.{name}"] = change
        p = rp.predict(change)
        residual = net.work_residual(kind) if work is not None else 0.0
        step, low, high = p.step_s, p.low_s - residual, p.high_s + residual
    else:
        step, error = _per_call(ctx, net, name, predicted, work, world)
        low, high = step - error, step + error
    predicted[STEP_TIME] = step
    predicted["rank_work_s"] = None if work is None else float(work)
    body.setdefault("intervals", {})[STEP_TIME] = [max(low, 0.0), high]


def _per_call(ctx: Context, net: network.Network, name: str, predicted: dict, work, world: int) -> tuple[float, float]:
    """(step, error) as analyses.network prices calls one by one: the baseline step less the collectives a
    part takes away, plus those it adds and its work (dp: B all-reduces of DDP's buckets become 2B
    all-gathers of counts and kept entries; mp: the output all-to-all's bytes shrink), as if the
    collectives were not overlapped with compute."""
    beta = net.fit.beta_s_per_byte
    if name == "dp":
        baseline = predicted["baseline_dp_bytes_per_step"]
        buckets = _dp_calls_per_rank(ctx, traffic.training_steps(ctx), world)
        # DDP's bucket all-reduces are asynchronous, overlapped with backward: taking them away saves at
        # most their bytes on the link, and no more than they held the step past its last synchronous call
        removed = min(beta * 2 * (world - 1) / world * baseline / world, network.exposed_async(ctx, DP_ROWS))
        added = 2 * buckets * net.alpha(network.ALL_GATHER) + beta * (world - 1) / world * predicted[DP_BYTES]
        calls, kind = 3 * buckets, "dct_dp"
    else:
        removed = network.shrunk(ctx, f"op = 'all_to_all_single' AND ({FLOAT_DTYPE_SQL})", predicted["ratio"])
        added, calls, kind = 0.0, 0, "dct_mp"
    step = max(0.0, net.step.median_s - removed + added + (0.0 if work is None else float(work)))
    return step, net.error(calls, added - removed, kind if work is not None else None)


def drift_table(ctx: Context) -> tuple[pl.DataFrame, pl.DataFrame]:
    """Per parameter: numel, sampled steps, and per keep ratio X the mean count above the stale
    threshold (kept_X), its target ⌈X·numel⌉ and drift_X = max count / target, ranks averaged;
    and the same per (parameter, sampled step)."""
    parts = []
    for suffix, keep in KEEP_RATIOS.items():  # {keep} is a DECIMAL literal to DuckDB: the ceiling is exact
        parts.append(f"CASE WHEN any_value(numel) < {DCT_WHOLE_BELOW} THEN any_value(numel) "
                     f"ELSE avg(count_above_keep_{suffix}) END::DOUBLE AS kept_{suffix}, "
                     f"CASE WHEN any_value(numel) < {DCT_WHOLE_BELOW} THEN any_value(numel) "
                     f"ELSE greatest(1, ceil({keep} * any_value(numel))) END::DOUBLE AS target_{suffix}")
    per_step = ctx.frame(f"""
        SELECT name, step, any_value(numel) AS numel, {', '.join(parts)}
        FROM grads GROUP BY name, step""")
    drifts = [(pl.col(f"kept_{s}") / pl.col(f"target_{s}")).max().alias(f"drift_{s}") for s in KEEP_RATIOS]
    return (per_step.group_by("name")
            .agg(pl.col("numel").first(), pl.len().alias("sampled_steps"), *drifts,
                 *[pl.col(f"kept_{s}").mean() for s in KEEP_RATIOS],
                 *[pl.col(f"target_{s}").first() for s in KEEP_RATIOS])
            .sort("name")), per_step


def _derive_dp(ctx: Context, world: int, steps: int, result: PolicyResult,
               calibration: quality.Calibration | None) -> tuple[dict | None, str | None]:
    calibrated = None if calibration is None else calibration.choose("compression.dp", ctx.options.quality_budget)
    if ctx.has("dct_replay"):  # error feedback replayed: the keep ratio, refresh period and bytes from it
        return dct_dp.derive(ctx, world, steps, _dp_baseline(ctx, steps), DP_ROWS, result,
                             keep=calibrated.setting if calibrated else None)
    if not ctx.has("grads"):
        return None, "no grads table (recorded with --grad-every 0?): no gradient statistics to set thresholds from"
    table, per_step = drift_table(ctx)
    ordered = sorted(KEEP_RATIOS.items(), key=lambda item: item[1])
    chosen = pl.lit(None, dtype=pl.Float64)
    for suffix, keep in reversed(ordered):  # smallest bounded ratio wins: it is applied last
        chosen = pl.when(pl.col(f"drift_{suffix}") <= DRIFT_BOUND).then(pl.lit(keep)).otherwise(chosen)
    table = table.with_columns(chosen.alias("keep_ratio"))
    result.tables["dct_dp"] = table.select("name", "numel", "sampled_steps",
                                           *[f"drift_{s}" for s in KEEP_RATIOS], "keep_ratio",
                                           *[f"kept_{s}" for s in KEEP_RATIOS])
    totals = per_step.group_by("step").agg(pl.col([f"kept_{s}" for s in KEEP_RATIOS] +
                                                  [f"target_{s}" for s in KEEP_RATIOS]).sum())
    overall = {s: float((totals[f"kept_{s}"] / totals[f"target_{s}"]).max()) for s in KEEP_RATIOS}
    # Without the replay, what error feedback makes of a stale threshold is not known (on the Kaggle
    # layout at dim 128, 12x the stale count of the uncompressed gradients: bench/RESULTS.md §33), so
    # the threshold is refreshed every step, which sends each parameter's target exactly.
    suffix, keep = next(((name, k) for name, k in ordered if calibrated and math.isclose(k, calibrated.setting)),
                        ordered[0])
    kept = float(sum(dct_dp.target(int(n), keep) for n in table["numel"]))
    # a parameter sent whole sends its nonzero entries, which `grads` does not count: all of them at most
    whole = float(sum(int(n) for n in table["numel"] if dct_dp.target(int(n), keep) == int(n)))
    numel = float(table["numel"].sum())
    buckets = _dp_calls_per_rank(ctx, steps, world)

    def dp_bytes_of(k: float) -> float:
        payload = min(8 * k, 6 * k + 4 * math.ceil(numel / 65536), math.ceil(numel / 8) + 4 * k, 4 * numel)
        return world * (payload + 4 * buckets)

    dp_bytes = dp_bytes_of(kept)
    baseline_dp = _dp_baseline(ctx, steps)
    predicted = dct_dp.figures(world, dp_bytes, baseline_dp, kept)
    spans = {DP_BYTES: (dp_bytes_of(kept - whole), dp_bytes)} if whole else {}
    which = ("the smallest of " + ", ".join(f"{k:.1%}" for k in KEEP_RATIOS.values()) if calibrated is None else
             quality.source(calibrated, ctx.options.quality_budget))
    why = (f"keep {keep:.1%} of each gradient ({which}), "
           f"the threshold refreshed every step: without the DCT-DP replay (record --dct-replay) a stale "
           f"threshold's growth under error feedback is not known (uncompressed, it let through "
           f"{overall[suffix]:.2f}x its target over {per_step['step'].n_unique()} sampled steps); "
           f"{dp_bytes / world:,.0f} bytes of kept entries and counts per rank per step")
    if baseline_dp:
        why += f", {dp_bytes / baseline_dp:.1%} of the {baseline_dp:,.0f} bytes DDP all-reduces"
    result.evidence["dp"] = {
        "rows": "grads: count_above_keep_X per (name, step), averaged over ranks (the drift, for the record); "
                f"comms: training {DP_ROWS}",
        "drift": {f"{KEEP_RATIOS[s]}": d for s, d in overall.items()},
        "formula": "dp_bytes_per_step = W * (min(8K, 6K + 4 ceil(N/65536), ceil(N/8) + 4K, 4N) + 4B): the "
                   "all-gathers of counts and kept entries in the cheapest encoding, K = sum over parameters of "
                   "their targets (ceil(X n), whole below DCT_WHOLE_BELOW), N their entries, B buckets",
        "caveats": "the model's entries taken as one bucket for the encoding (DDP's buckets are each encoded)",
    }
    if whole:
        why += (f"; {whole:,.0f} of them in parameters sent whole, of which only the nonzero are sent (the interval's "
                "low end: none)")
    return DctDp(keep_ratio=keep, refresh_every=1, error_feedback=True,
                 prediction=Prediction(predicted, why, spans)).to_json(), None


def _common_dim(ctx: Context) -> int | None:
    dims = {t.dim for t in ctx.model.tables}
    return dims.pop() if len(dims) == 1 else None


def _dp_calls_per_rank(ctx: Context, steps: int, world: int) -> float:
    """DDP's gradient all-reduces per step and rank: the buckets the hook exchanges one by one."""
    if not ctx.has("comms") or not steps:
        return 1.0
    (calls,) = ctx.sql(f"SELECT count(*)::DOUBLE FROM train_comms WHERE {DP_ROWS}").fetchall()[0]
    return max(calls / steps / max(world, 1), 1.0)


def _dp_baseline(ctx: Context, steps: int) -> float | None:
    if not ctx.has("comms") or not steps:
        return None
    (total,) = ctx.sql(f"SELECT coalesce(sum(bytes_out), 0)::DOUBLE FROM train_comms WHERE {DP_ROWS}").fetchall()[0]
    return total / steps


def _derive_mp(ctx: Context, world: int, steps: int, result: PolicyResult,
               calibration: quality.Calibration | None) -> tuple[dict | None, str | None]:
    if not ctx.has("comms") or not steps:
        return None, "no training comms: no embedding output all-to-all to compress"
    calls = ctx.frame(f"""
        SELECT tag, dtype, count(*) AS calls, sum(bytes_out)::DOUBLE / {steps} AS bytes_per_step,
               bool_or(role IS NOT DISTINCT FROM '{tags.OUTPUT_BWD}' OR ends_with(coalesce(tag, ''), 'backward'))
                   AS backward
        FROM train_comms WHERE op IN ({traffic.sql_list(traffic.A2A_OPS)}) GROUP BY ALL ORDER BY tag, dtype""")
    value_bytes = pl.col("dtype").str.replace("torch.", "", literal=True).replace_strict(
        FLOAT_BYTES, default=None, return_dtype=pl.Int64)
    calls = calls.with_columns(value_bytes.alias("value_bytes"))
    output = calls.filter(pl.col("value_bytes").is_not_null())
    if output.height == 0:
        return None, "no floating-point all-to-all in the training comms: no embedding outputs cross ranks"
    dim = _common_dim(ctx)
    if dim is None:
        return None, "the tables have different dims: the output rows' width is unknown"
    chosen = None if calibration is None else calibration.choose("compression.mp", ctx.options.quality_budget)
    keep = MP_KEEP_RATIO if chosen is None else chosen.setting
    source = ("the DCT paper's 5% (its 20x fewer elements; the trace has no activation statistics)" if chosen is None
              else quality.source(chosen, ctx.options.quality_budget))
    k = max(1, min(dim, math.ceil(keep * dim - 1e-9)))
    positions = min(k * (1 if dim <= 256 else 2), math.ceil(dim / 8))
    rows = pl.col("bytes_per_step") / (pl.col("value_bytes") * dim)
    forward = ~pl.col("backward")
    output = output.with_columns(
        (rows * (k * pl.col("value_bytes") + pl.when(forward).then(positions).otherwise(0)))
        .alias("predicted_bytes_per_step"))
    result.tables["dct_mp"] = output.select("tag", "dtype", "calls", "bytes_per_step", "predicted_bytes_per_step")
    measured, predicted_out = float(output["bytes_per_step"].sum()), float(output["predicted_bytes_per_step"].sum())
    input_dist = float(calls["bytes_per_step"].sum()) - measured
    predicted = {
        OUTPUT_A2A_BYTES: predicted_out,
        "baseline_output_a2a_bytes_per_step": measured,
        "ratio": predicted_out / measured,
        A2A_BYTES: input_dist + predicted_out,
        STEP_TIME: None,
    }
    fp32_rows = float((output["bytes_per_step"] / (output["value_bytes"] * dim)).sum())
    result.evidence["mp"] = {
        "quantized_alternatives_bytes_per_step": {"bf16": fp32_rows * dim * 2, "fp16": fp32_rows * dim * 2,
                                                  "fp8": fp32_rows * (dim + 4)},
        "kept_values_per_row": k, "dim": dim,
        "rows": "comms: training all-to-all calls of a floating-point dtype (embedding outputs and their "
                f"gradients; tags {', '.join(sorted(set(output['tag'])))})",
        "keep_ratio_source": source,
        "formula": "rows n = bytes_out / (value_bytes * D); forward n * (K * value_bytes + min(K * position_bytes, "
                   "ceil(D / 8))), backward n * K * value_bytes, K = ceil(keep_ratio * D)",
    }
    why = (f"keep the largest {keep:.1%} of each sample's embedding outputs ({source}): {measured:,.0f} -> "
           f"{predicted_out:,.0f} output all-to-all bytes per step (the top {k} of {dim} values a row, with their "
           "positions forward)")
    return DctMp(keep_ratio=keep, prediction=Prediction(predicted, why)).to_json(), None

"""The SCARS cost model (papers.md §2, B.1): the embedding exchange's expected bytes per step from
per-row inclusion probabilities, checked against the replay (analyses.exchange) and the replay
against `comms`; the policies' replayed bytes and times beside them.

Expected values (i.i.d. samples, SCARS): per-sample inclusion probability p_i = samples containing
row i / samples; per device batch b, E[U] = Σ_i 1 − (1 − p_i)^b distinct rows, expected remote rows
E[U]·(W−1)/W, and E[union] = Σ_{i∈H} 1 − (1 − p_i)^{bW} hot rows touched per step. A sequence
table's ids are not placed in samples (analyses.attribution), so there p_i = 1 − (1 − π_i)^L (π_i:
share of the table's lookups, L: its lookups per sample; papers §1.2). The SCARS row-fetch layout
(`dedup_fetch`, model B of §1.2) fetches each distinct remote row once per device: id_bytes + 2·rb
per row. Times are analyses.network's (one all-to-all call per collective).

`compute(ctx, policies)` (after the policies: it reads what they derived, never derives them)
writes two tables:
- `costmodel`: policy (baseline, dedup_fetch, replication, tiers, schedule), collective, method
  (replay | expected), bytes_per_step, remote_bytes_per_step, time_s;
- `costmodel_check`: check, subject, predicted, measured, diff, rel_diff — `bytes_out` per
  collective (the replayed baseline against `comms` on the sampled steps: diff 0 when the
  attribution and the layout hold), `distinct_rows` and `remote_rows` per table (E[U] against the
  replay's mean per device batch), `replication_a2a_remote` and `replication_union_rows` (the
  formulas against the replay at the chosen hot set);
and a summary (baseline bytes and time, the network model's fit, baseline_matches_comms,
distinct_rows_max_rel_diff, source_attribution_exact).

    result = compute(ctx, {"replication": derived, ...})   # tables costmodel, costmodel_check; summary
"""

from __future__ import annotations

from typing import Any

import numpy as np
import polars as pl

from analyses import attribution, exchange, network
from analyses.context import Context, Result
from analyses.exchange import ExchangeBaseline, comms_replay, count_exchange
from analyses.policies import replication
from tracekit.figures import A2A_BYTES, A2A_REMOTE_BYTES, STEP_TIME, SYNC_BYTES


# the formulas ----------------------------------------------------------------------------------

def expected_distinct(p: np.ndarray, b: float) -> float:
    """SCARS E[U] = Σ_i 1 − (1 − p_i)^b: distinct rows a batch of b i.i.d. samples holds."""
    p = np.asarray(p, dtype=np.float64)
    if not len(p) or b <= 0:
        return 0.0
    certain = p >= 1.0  # in every sample: log1p(-1) is -inf, the row is simply there
    rest = np.clip(p[~certain], 0.0, 1.0)
    return float(np.count_nonzero(certain) + np.sum(-np.expm1(b * np.log1p(-rest))))


# compute ---------------------------------------------------------------------------------------

def compute(ctx: Context, policies: dict[str, Any] | None = None) -> Result:
    """Tables `costmodel` (bytes and time per step per policy and collective, expected and replayed)
    and `costmodel_check` (formula vs replay, replay vs comms), and the summary. `policies`: the
    embedding policies analyze derived (name -> PolicyResult), read rather than derived here."""
    result = Result()
    if not ctx.has("lookups"):
        result.notes.append("no lookups in this run: the cost model needs the sampled per-sample lookups "
                            "(record with --lookup-every N > 0)")
        return result
    if ctx.model.world_size < 2:
        result.notes.append("one rank: every table is local, no embedding exchange to model")
        return result
    if not any(t.placement in (None, "sharded") and t.shards for t in ctx.model.tables):
        result.notes.append("no sharded table (every table data-parallel or rank-local, e.g. TorchRec's "
                            "data_parallel plan): no embedding exchange to model")
        return result
    s = exchange.baseline(ctx)
    net = network.network(ctx)
    result.notes.extend(s.notes)
    policy_rows, policy_checks = _policy_rows(ctx, s, policies or {})
    extra = _diffs(pl.DataFrame(policy_checks, schema={"check": pl.String, "subject": pl.String,
                                                       "predicted": pl.Float64, "measured": pl.Float64}))
    check = pl.concat([_comms_check(ctx), _distinct_check(ctx, s), extra], how="vertical_relaxed")
    rows = _baseline_rows(s, net) + _dedup_rows(ctx, s, net) + policy_rows
    table = pl.DataFrame(rows, schema={"policy": pl.String, "collective": pl.String, "method": pl.String,
                                       "bytes_per_step": pl.Float64, "remote_bytes_per_step": pl.Float64,
                                       "time_s": pl.Float64})
    result.tables = {"costmodel": table, "costmodel_check": check}
    bytes_check = check.filter(pl.col("check").str.starts_with("bytes"))
    result.summary = {
        "sampled_steps": s.sampled_steps, "world_size": s.world, "batch_per_device": s.batch,
        "baseline_a2a_bytes_per_step": s.base_out, "baseline_a2a_remote_bytes_per_step": s.base_remote,
        "baseline_comm_time_s": float(sum(r["time_s"] for r in _baseline_rows(s, net))),
        STEP_TIME: s.step_time_s, "network": net.summary(),
        "baseline_matches_comms": bool(len(bytes_check) and (bytes_check["diff"] == 0).all()),
        "distinct_rows_max_rel_diff": _max_rel(check, "distinct_rows"),
        "source_attribution_exact": s.attribution.exact,
    }
    return result


def _max_rel(check: pl.DataFrame, name: str) -> float | None:
    part = check.filter(pl.col("check") == name)["rel_diff"].drop_nulls()
    return float(part.abs().max()) if len(part) else None


def _seconds(net: network.Network, remote: float, world: int) -> float:
    """One all-to-all call moving `remote` bytes per step, spread evenly over the ranks."""
    return net.call(network.A2A, remote / max(world, 1))


def _baseline_rows(s: ExchangeBaseline, net: network.Network) -> list[dict]:
    return [_row("baseline", c, "replay", out, rem, net.call(network.A2A, s.busiest[c]))
            for c, (out, rem) in s.base.items()]


def _dedup_rows(ctx: Context, s: ExchangeBaseline, net: network.Network) -> list[dict]:
    """SCARS row fetch (model B): each device fetches each distinct remote row once per step."""
    measured = ctx.sql(f"""SELECT count(*)::DOUBLE FROM (SELECT DISTINCT step, src, tid, "row" FROM {s.tables.x}
                           WHERE owner <> src)""").fetchall()[0][0] / max(s.sampled_steps, 1)
    expected = _expected_remote_total(ctx, s) * s.world
    rows = []
    for method, per_step in (("replay", measured), ("expected", expected)):
        for collective, size in (("input_ids", s.id_bytes), ("output_fwd", None), ("output_bwd", None)):
            b = per_step * (size if size else _mean_rb(ctx))
            rows.append({"policy": "dedup_fetch", "collective": collective, "method": method,
                         "bytes_per_step": b, "remote_bytes_per_step": b, "time_s": _seconds(net, b, s.world)})
    return rows


def _mean_rb(ctx: Context) -> float:
    table = exchange.baseline(ctx).tables.rows
    rows = ctx.sql(f"SELECT sum(rb * lookups)::DOUBLE / nullif(sum(lookups), 0) FROM {table}").fetchall()
    return float(rows[0][0] or 0)


def _policy_rows(ctx: Context, s: ExchangeBaseline, policies: dict[str, Any]) -> tuple[list[dict], list[dict]]:
    """Each derived embedding policy's replayed all-to-all and sync bytes per step, and for
    replication the SCARS expectation beside it; and the checks (expected vs replayed)."""
    net = network.network(ctx)
    rows, checks = [], []
    for name in ("replication", "tiers", "schedule"):
        derived = policies.get(name)
        if derived is None or derived.section is None:
            continue
        p = derived.section.prediction.figures
        a2a = p[A2A_BYTES]
        remote = p.get(A2A_REMOTE_BYTES, a2a)
        per_collective = derived.evidence.get("collectives") or {"all_to_all": {"bytes_per_step": a2a,
                                                                               "remote_bytes_per_step": remote}}
        for collective, b in per_collective.items():
            rows.append(_row(derived.name, collective, "replay", b["bytes_per_step"], b["remote_bytes_per_step"],
                             _seconds(net, b["remote_bytes_per_step"], s.world)))
        sync = p[SYNC_BYTES]
        kind = getattr(derived.section, "sync", None) or getattr(derived.section, "tier1_sync", None) or "sparse_allreduce"
        rows.append(_row(derived.name, "sync", "replay", sync, sync, net.sync(kind, sync)))
        if derived.name == "replication":
            expected = _replication_expected(ctx, s, int(p["hot_rows"]))
            sync_e = expected["sparse"] if kind == "sparse_allreduce" else sync
            rows.append(_row("replication", "all_to_all", "expected", None, expected["a2a_remote"],
                             _seconds(net, expected["a2a_remote"], s.world)))
            rows.append(_row("replication", "sync", "expected", sync_e, sync_e, net.sync(kind, sync_e)))
            checks.append({"check": "replication_a2a_remote", "subject": "replication",
                           "predicted": expected["a2a_remote"], "measured": float(remote)})
            checks.append({"check": "replication_union_rows", "subject": "replication", "predicted": expected["union"],
                           "measured": float(derived.evidence["union_hot_rows_per_step"])})
    return rows, checks


def _row(policy: str, collective: str, method: str, out: float | None, remote: float | None,
         time: float | None) -> dict:
    return {"policy": policy, "collective": collective, "method": method,
            "bytes_per_step": None if out is None else float(out),
            "remote_bytes_per_step": None if remote is None else float(remote),
            "time_s": None if time is None else float(time)}


def _replication_expected(ctx: Context, s: ExchangeBaseline, k: int) -> dict[str, float]:
    """SCARS expectations for the first k rows of replication's order: remote a2a bytes left
    (Σ over the rest of each row's share), union of hot rows touched per step
    Σ 1 − (1 − p_i)^{bW}, and the sparse sync they imply."""
    hot = replication.benefit_curve(ctx).order.filter(pl.col("pos") < k)  # what the policy derived
    p = inclusion(ctx, s).join(hot.select("tid", "row", "rb", "benefit_rem"), on=["tid", "row"])
    left = s.base_remote - float(p["benefit_rem"].sum())
    if p.height == 0:
        return {"a2a_remote": left, "union": 0.0, "sparse": 0.0}
    probability = np.clip(p["p"].to_numpy(), 0, 1)
    rb = p["rb"].to_numpy().astype(np.float64)
    global_batch, device_batch = s.batch * s.world, s.batch
    touched = -np.expm1(global_batch * np.log1p(-np.minimum(probability, 1 - 1e-12)))
    per_rank = -np.expm1(device_batch * np.log1p(-np.minimum(probability, 1 - 1e-12)))
    w1 = s.world - 1
    sparse = (w1 * s.id_bytes * s.world * float(per_rank.sum()) + 2 * w1 * float((rb * touched).sum())
              + count_exchange(s.world))
    return {"a2a_remote": left, "union": float(touched.sum()), "sparse": sparse}


# checks ----------------------------------------------------------------------------------------


def _comms_check(ctx: Context) -> pl.DataFrame:
    frame = comms_replay(ctx)
    return (frame.group_by("collective")
            .agg(pl.col("bytes_out_pred").sum().cast(pl.Float64).alias("predicted"),
                 pl.col("bytes_out_comms").sum().cast(pl.Float64).alias("measured"))
            .with_columns(pl.lit("bytes_out").alias("check"), pl.col("collective").alias("subject"))
            .pipe(_diffs).sort("subject"))


def _diffs(frame: pl.DataFrame) -> pl.DataFrame:
    return frame.select("check", "subject", "predicted", "measured").with_columns(
        (pl.col("predicted") - pl.col("measured")).alias("diff"),
        ((pl.col("predicted") - pl.col("measured")) / pl.col("measured")).alias("rel_diff"))


def inclusion(ctx: Context, s: ExchangeBaseline) -> pl.DataFrame:
    """Per (tid, row): table_name and p, the per-sample inclusion probability (module docstring)."""
    rows, names = exchange.baseline(ctx).tables.rows, attribution.attributed(ctx).tables.names
    return ctx.frame(f"""
        WITH t AS (SELECT tid, sum(lookups)::DOUBLE AS lookups, sum(placed) AS placed FROM {rows} GROUP BY ALL)
        SELECT r.tid, n.table_name, r."row",
               CASE WHEN t.placed = t.lookups THEN r.samples::DOUBLE / {max(s.samples, 1)}
                    ELSE 1 - pow(1 - r.lookups / t.lookups, t.lookups / {max(s.samples, 1)}) END AS p
        FROM {rows} r JOIN t USING (tid) JOIN {names} n USING (tid)""")


def _expected_remote_total(ctx: Context, s: ExchangeBaseline) -> float:
    """Σ over tables of E[U] · (W−1)/W: distinct remote rows per device batch."""
    p = inclusion(ctx, s)
    total = sum(expected_distinct(g["p"].to_numpy(), s.batch) for _, g in p.group_by("tid"))
    return total * (s.world - 1) / max(s.world, 1)


def _distinct_check(ctx: Context, s: ExchangeBaseline) -> pl.DataFrame:
    """Per table: E[U] and expected remote rows per device batch against the replay's mean."""
    p = inclusion(ctx, s)
    expected = {name: expected_distinct(g["p"].to_numpy(), s.batch) for (name,), g in p.group_by("table_name")}
    a, x = attribution.attributed(ctx).tables, exchange.baseline(ctx).tables.x
    measured = ctx.frame(f"""
        WITH per_row AS (SELECT step, src, tid, "row", bool_or(owner <> src) AS remote FROM {x} GROUP BY ALL),
             u AS (SELECT step, src, tid, count(*) AS u, count(*) FILTER (WHERE remote) AS u_rem
                   FROM per_row GROUP BY ALL),  -- two groupings: faster than two count(DISTINCT)s
             cells AS (SELECT b.step, b.src, t.tid FROM {a.batches} b JOIN {a.steps} USING (step)
                       CROSS JOIN (SELECT DISTINCT tid FROM {x}) t WHERE b.b > 0)
        SELECT n.table_name, avg(coalesce(u.u, 0)) AS u, avg(coalesce(u.u_rem, 0)) AS u_rem
        FROM cells c LEFT JOIN u USING (step, src, tid) JOIN {a.names} n USING (tid) GROUP BY n.table_name""")
    frac = (s.world - 1) / max(s.world, 1)
    rows = []
    for name, u, u_rem in measured.iter_rows():
        e = expected.get(name, 0.0)
        rows.append({"check": "distinct_rows", "subject": name, "predicted": e, "measured": float(u)})
        rows.append({"check": "remote_rows", "subject": name, "predicted": e * frac, "measured": float(u_rem)})
    frame = pl.DataFrame(rows, schema={"check": pl.String, "subject": pl.String, "predicted": pl.Float64,
                                       "measured": pl.Float64})
    return _diffs(frame).sort("check", "subject")



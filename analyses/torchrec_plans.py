"""A TorchRec plan from the trace: per table, the sharding type and ranks that balance the measured
exchange, with the bytes the plan moves (analyses.torchrec_plan_bytes) and its predicted step.

Step time (`compute`): the measured step, less the recorded plan's exchange time, plus the derived
plan's (`link_seconds`): per collective the bytes of its busiest rank (the larger of what a rank
sends to and receives from others) at the price per byte that collective measurably took in the
recorded run (`Prices`, from `durations`), α per all-to-all of each sharding group, and a
data-parallel table's ring all-reduce at the link's rate. The lookups' own work moving between
ranks is not modelled (the plan's `why` says so). `derive` picks, per table, data-parallel where its all-reduce moves
fewer bytes than its exchange and it fits `DP_MAX_BYTES`, then places the others table-wise,
heaviest first, on the rank that keeps the exchange shortest, splitting a table column-wise where
it alone outweighs a rank's share. A plan is recommended where its gain exceeds the model's error
(analyses.network); `torchrec_plan.json` keeps the prediction, the interval of its step time and
the recorded plan's figures (`baseline`). `torchrec_plan.qcomms.json` is the same plan with TorchRec's
quantized comms (fp16 forward, bf16 backward: the output dist's bytes halved), a lossy alternative
never recommended without a measurement of the loss.

    L = loads(ctx, len_bytes, id_bytes)     # analyses.torchrec_plan_bytes
    prices = Prices.of_run(s, durations(ctx), alpha, link_s_per_byte)
    derived = derive(L, plan["tables"], prices)   # a plan file's tables
"""

from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from analyses import attribution, exchange, network, traffic
from analyses.context import Context, Result
from analyses.torchrec_plan_bytes import COLLECTIVES, Loads, figures, loads, pairs_of
from analyses.replay.change import Change
from analyses.replay.prediction import Prediction, replay
from tracekit.figures import ALLREDUCE_BYTES, STEP_TIME
from tracekit.topology import Topology
from tracekit.torchrec_plan import PLAN_FILE, QCOMMS_PLAN_FILE, PlanError, from_manifest, write_plan

DP_MAX_BYTES = 64 * 2**20  # a data-parallel table is a full copy on every rank: at most this large
ESTIMATE_TIMEOUT_S = 120  # TorchRec's planner, run in the job's Python (tracekit/app/torchrec_estimates.py)


@dataclass
class Prices:
    """Seconds of the exchange, calibrated on the recorded run: `alpha`, one all-to-all's fixed
    cost (analyses.network); `per_byte`, per collective, what it measurably held the ranks beyond α
    per byte of its busiest rank (analyses.exchange's cost over the replayed busiest bytes)."""

    alpha: float
    per_byte: dict[str, float]
    ring_per_byte: float  # a data-parallel table's all-reduce: seconds per byte a rank sends
    timed: bool = True  # False: no collective was timed after warm-up; bytes alone rank plans

    @classmethod
    def of_run(cls, s: exchange.ExchangeBaseline, cost: dict[str, float], alpha: float,
               link_s_per_byte: float | None) -> Prices:
        """From the replay `s` and each collective's measured `cost` (seconds a step); a collective
        with no measured time or no remote bytes at the mean price of the others; without any, every
        byte at one unit and α nothing. The all-reduce's bytes go at `link_s_per_byte` (the link's
        own rate: an all-to-all's time also holds its waits for the slowest rank's compute, an
        all-reduce of gradients does not), else at the mean price."""
        measured = {c: max(cost[c] - alpha, 0.0) / s.busiest[c] for c in COLLECTIVES
                    if cost.get(c) and s.busiest.get(c)}
        if not measured:
            return cls(0.0, dict.fromkeys(COLLECTIVES, 1.0), 1.0, timed=False)
        mean = sum(measured.values()) / len(measured)
        return cls(alpha, {c: measured.get(c, mean) for c in COLLECTIVES}, link_s_per_byte or mean)


def link_seconds(L: Loads, tables: dict[str, dict], prices: Prices, qcomms: dict | None = None) -> float:
    """The plan's exchange time per step: each collective's price × its busiest rank's bytes; the
    data-parallel tables' ring all-reduce, 2(W−1)/W of their bytes a rank, at the link's rate; and α
    for each all-to-all of each sharding group (TorchRec runs table-wise and column-wise tables as
    two groups, each its own input and output dist)."""
    f = figures(L, tables, qcomms)
    return (sum(prices.per_byte[c] * f[f"busiest_{c}"] for c in COLLECTIVES) + ring_seconds(L, tables, prices)
            + prices.alpha * len(COLLECTIVES) * len(_groups(tables)))


def ring_seconds(L: Loads, tables: dict[str, dict], prices: Prices) -> float:
    """The data-parallel tables' ring all-reduce on the link, 2(W−1)/W of their bytes a rank. DDP
    runs it bucketed and asynchronously, beside the backward pass: how much of it the step waits
    for is not modelled, so `compute` counts it whole and half of it as error."""
    dp = pairs_of(L, tables)["dp_allreduce"]
    return prices.ring_per_byte * 2 * (L.world - 1) / L.world * float(dp.max(initial=0.0))


QCOMMS = {"forward": "fp16", "backward": "bf16"}
"""The quantized comms tried beside the derived plan: TorchRec's QCommsConfig, bf16 backward for its range."""


def compute(ctx: Context) -> Result:
    """For a TorchRec run: its recorded plan's bytes replayed and checked against `comms`; the
    derived plan with its predicted bytes and step, written as RUN/torchrec_plan.json (the plan
    file `record --plan` takes); and the same with quantized comms (QCOMMS), a lossy alternative
    never recommended without a measurement of what it does to the loss, as
    RUN/torchrec_plan.qcomms.json. Nothing for any other run."""
    result = Result()
    try:
        base = from_manifest(ctx.manifest, str(ctx.path))
    except PlanError:
        return result  # not a TorchRec run
    why_not = _not_planned(ctx, base)
    if why_not:
        result.notes.append(why_not)
        return result
    s = exchange.baseline(ctx)
    L = loads(ctx, s.len_bytes, s.id_bytes)
    net = network.network(ctx)
    prices = Prices.of_run(s, durations(ctx), net.alpha(network.A2A), _link_s_per_byte(ctx))
    recorded = figures(L, base["tables"])
    allreduce = ctx.sql(f"""SELECT coalesce(sum(bytes_out), 0)::DOUBLE / {max(traffic.training_steps(ctx), 1)}
                            FROM train_comms WHERE op = 'all_reduce'""").fetchall()[0][0]
    recorded[ALLREDUCE_BYTES] = allreduce
    before = link_seconds(L, base["tables"], prices)
    baseline = {**recorded, "exchange_s": before if prices.timed else None, STEP_TIME: s.step_time_s}
    priced = any(p > 0 for p in prices.per_byte.values())
    derived = derive(L, base["tables"], prices) if priced else base["tables"]
    estimates = torchrec_estimates(ctx, L, base["tables"], derived)  # TorchRec's own planner, for comparison
    if "error" in estimates:
        result.notes.append(f"TorchRec's own planner estimates: not computed ({estimates['error']})")
    plans = {}
    for name, qcomms in ((PLAN_FILE, None), (QCOMMS_PLAN_FILE, QCOMMS)):
        step = s.step_time_s if prices.timed else None
        after = link_seconds(L, derived, prices, qcomms)
        predicted = {**figures(L, derived, qcomms), "exchange_s": after if prices.timed else None}
        predicted[ALLREDUCE_BYTES] = allreduce - recorded["dp_allreduce_bytes_per_step"] + predicted[
            "dp_allreduce_bytes_per_step"]  # the rest of the model's DDP all-reduce stays
        replayed, unreplayed = plan_replay(ctx, L, base["tables"], derived, qcomms, allreduce)
        if replayed is not None:
            measured = replay(ctx).measured_median_s
            predicted[STEP_TIME], interval = replayed.step_s, [replayed.low_s, replayed.high_s]
            recommended = qcomms is None and replayed.high_s < measured
            why = _why_replayed(replayed, measured, base["tables"] == derived, qcomms)
        else:
            error = (net.error(_calls(base["tables"], derived), abs(after - before))
                     + abs(ring_seconds(L, derived, prices) - ring_seconds(L, base["tables"], prices)) / 2)
            predicted[STEP_TIME] = None if step is None else max(step - before + after, 0.0)
            interval = None if step is None else [predicted[STEP_TIME] - error, predicted[STEP_TIME] + error]
            recommended = step is not None and before - after > error and qcomms is None
            why = _why(prices, priced, base["tables"] == derived, before, after, error, qcomms)
            if unreplayed:
                why += f" (priced per call: {unreplayed})"
        plans[name] = {**base, "tables": derived, **({"qcomms": qcomms} if qcomms else {}), "predicted": predicted,
                       "intervals": {} if interval is None else {STEP_TIME: interval},
                       "why": why, "recommended": recommended, "baseline": baseline,
                       **({} if "error" in estimates else {"torchrec_estimate": estimates})}
        write_plan(ctx.path / name, plans[name])
    plan = plans[PLAN_FILE]
    result.summary = {"torchrec_estimate": estimates, "recorded": base["tables"], "derived": derived,
                      "baseline": baseline, "predicted": plan["predicted"], "recommended": plan["recommended"],
                      "why": plan["why"],
                      "qcomms": {"qcomms": QCOMMS, "predicted": plans[QCOMMS_PLAN_FILE]["predicted"],
                                 "why": plans[QCOMMS_PLAN_FILE]["why"]},
                      "replay_matches": abs(recorded["a2a_bytes_per_step"] - s.base_out) < 1e-6 * max(s.base_out, 1.0),
                      "written": [str(ctx.path / name) for name in plans]}
    return result


def plan_change(L: Loads, recorded: dict[str, dict], plan: dict[str, dict], qcomms: dict | None,
                allreduce: float) -> Change | None:
    """`plan` against the `recorded` one as a change of the replayed graph: each exchange collective's bytes
    per (sender, receiver) scaled by the plan's over the recorded plan's (`pairs_of`), DDP's all-reduce by
    its data-parallel tables' bytes; None where the plan sends between two ranks that the recorded exchange
    left unpaired (nothing there to scale), or runs another set of sharding groups (their calls differ)."""
    if _groups(recorded) != _groups(plan):
        return None
    before, after = pairs_of(L, recorded), pairs_of(L, plan, qcomms)
    off = ~np.eye(L.world, dtype=bool)
    scale = {}
    for c in COLLECTIVES:
        if ((after[c] > 0) & (before[c] <= 0) & off).any():
            return None
        scale[c] = np.divide(after[c], before[c], out=np.ones_like(after[c]), where=before[c] > 0)
    dense = ((allreduce - before["dp_allreduce"].sum() + after["dp_allreduce"].sum()) / allreduce) if allreduce else 1.0
    return Change(scale, dense=float(dense))


def plan_replay(ctx: Context, L: Loads, recorded: dict[str, dict], plan: dict[str, dict], qcomms: dict | None,
                allreduce: float) -> tuple[Prediction | None, str | None]:
    """The plan's step by the replay of the recorded steps (analyses.replay) with `plan_change`, or None and
    why not (None and None where the run does not replay at all)."""
    rp = replay(ctx)
    if not rp.steps or rp.measured_median_s is None:
        return None, None
    named = {c.collective for s in rp.steps for c in s.calls.values()}
    if not set(COLLECTIVES) <= named:
        return None, "the recorded steps' all-to-alls are not one sharding group's four"
    change = plan_change(L, recorded, plan, qcomms, allreduce)
    if change is None:
        return None, "the plan changes the sharding groups or pairs ranks the recorded exchange did not"
    return rp.predict(change), None


def _groups(tables: dict[str, dict]) -> set[str]:
    """The plan's sharding groups: each kind of all-to-all sharding its tables use."""
    return {t["sharding_type"] for t in tables.values() if t["sharding_type"] != "data_parallel"}


def _why_replayed(p: Prediction, measured: float, same: bool, qcomms: dict | None) -> str:
    """One line: why the plan is recommended or not, by the replay."""
    how = (f"the recorded steps replayed with the plan's bytes: {measured * 1e3:.1f} → {p.step_s * 1e3:.1f} ms a step "
           f"[{p.low_s * 1e3:.1f}, {p.high_s * 1e3:.1f}]; the lookups' own work moving between ranks is not modelled")
    if qcomms:
        return (f"quantized comms ({qcomms['forward']} forward, {qcomms['backward']} backward) change the numbers: "
                f"never recommended without measuring the loss (optimize --check-all re-runs it); {how}")
    if same:
        return "the run's own plan is the lightest found; " + how
    if p.high_s < measured:
        return how
    return f"a gain within the replay's interval; {how}"


def torchrec_estimates(ctx: Context, L: Loads, recorded: dict[str, dict], derived: dict[str, dict]) -> dict:
    """What TorchRec's own planner estimates for the recorded and the derived plan (per rank: its
    estimator's forward and backward compute and comms, ms), from tracekit/app/torchrec_estimates.py run
    in the job's own Python; {"error": why} where that cannot be done."""
    python = _job_python(ctx.manifest.command or [])
    if python is None:
        return {"error": "the recorded command names no Python to run TorchRec's planner in"}
    from analyses.planner import ids_per_bag

    pooling, _ = ids_per_bag(ctx, attribution.features(ctx))
    topology = Topology.of_run(ctx.manifest, L.world)
    request = {"world_size": L.world, "ranks_per_node": topology.ranks_per_node,
               "batch_size": max(1, round(float(L.batch.mean()))),
               "link_bytes_per_s": (ctx.manifest.topology or {}).get("link_bytes_per_s"),
               "tables": [{"name": name, "num_embeddings": int(L.rows[t]), "embedding_dim": int(L.dims[t]),
                           "features": int(L.features[t]), "pooling_factor": pooling.get(name)}
                          for t, name in enumerate(L.names)],
               "plans": {"recorded": recorded, "derived": derived}}
    try:
        done = subprocess.run([python, "-m", "tracekit.app.torchrec_estimates"], input=json.dumps(request),
                              capture_output=True, text=True, timeout=ESTIMATE_TIMEOUT_S)
        return json.loads(done.stdout.strip().splitlines()[-1])
    except (OSError, subprocess.TimeoutExpired, ValueError, IndexError) as err:
        return {"error": f"{python} -m tracekit.app.torchrec_estimates: {type(err).__name__}: {err}"}


def _job_python(command: list[str]) -> str | None:
    """The Python a recorded TorchRec job ran in: its first word, or the one beside its torchrun."""
    if not command:
        return None
    first = Path(command[0])
    if first.name.startswith("python"):
        return command[0]
    if first.name == "torchrun" and first.with_name("python").exists():
        return str(first.with_name("python"))
    return None


def _link_s_per_byte(ctx: Context) -> float | None:
    """Seconds per byte on the link between an emulated cluster's nodes (manifest `topology`, at
    TCP's wire efficiency); None on one host, whose all-to-alls' own prices stand in for it."""
    rate = (ctx.manifest.topology or {}).get("link_bytes_per_s")
    return 1.0 / (rate * network.WIRE_EFFICIENCY) if rate else None


def _not_planned(ctx: Context, base: dict) -> str | None:
    """Why no plan is derived for this TorchRec run, if none is."""
    if ctx.model.world_size < 2:
        return "one rank: every table is local, no plan to derive"
    unplanned = sorted({t["sharding_type"] for t in base["tables"].values()} - {"table_wise", "column_wise",
                                                                                   "data_parallel"})
    if unplanned:
        return (f"the run's plan has {', '.join(unplanned)} tables, which this planner does not model yet: "
                "no plan derived")
    if not exchange.baseline(ctx).attribution.exact:
        return "the lookups' source ranks are not exact (analyses.attribution): no plan derived"
    return None


def _why(prices: Prices, priced: bool, same: bool, before: float, after: float, error: float,
         qcomms: dict | None) -> str:
    """One line: why the plan is recommended or not, and on what its step rests."""
    how = (f"the exchange on its busiest ranks {before * 1e3:.2f} → {after * 1e3:.2f} ms a step (priced per byte "
           f"as the run's own collectives took, α {prices.alpha * 1e3:.2f} ms a call); the lookups' own work moving "
           "between ranks is not modelled")
    if qcomms:
        return (f"quantized comms ({qcomms['forward']} forward, {qcomms['backward']} backward) change the numbers: "
                f"never recommended without measuring the loss (optimize --check-all re-runs it); {how}")
    if not prices.timed:
        return ("no exchange was timed after the warm-up steps: the plan moving the fewest bytes on the busiest "
                "ranks, its step time not predicted; the lookups' own work moving between ranks is not modelled")
    if not priced:
        return "the exchange's bytes cost nothing measurable on this run: its own plan is kept"
    if before - after > error:
        return how
    if same:
        return "the run's own plan is the lightest found; " + how
    return (f"a gain of {(before - after) * 1e3:.2f} ms is within the model's error "
            f"±{error * 1e3:.2f} ms; {how}")


def durations(ctx: Context) -> dict[str, float]:
    """Per collective of the exchange, seconds a step from its call to its completion: each rank's
    training all-to-all of that role (analyses.attribution's `a2a`), the mean over ranks,
    the median over the steps after warm-up. TorchRec's all-to-alls are asynchronous (awaitables);
    a plain training loop waits for each at once, so this is what they hold the step."""
    a2a = attribution.attributed(ctx).tables.a2a
    rows = ctx.sql(f"""
        WITH per AS (SELECT a.role AS collective, c.step, c.rank, (c.t_end_ns - c.t_start_ns) / 1e9 AS d
                     FROM train_comms c JOIN {a2a} a USING (rank, step, seq) WHERE c.t_end_ns > c.t_start_ns),
             steps AS (SELECT collective, step, avg(d) AS d FROM per GROUP BY ALL)
        SELECT collective, median(d) FROM steps
        WHERE step >= (SELECT min(step) FROM per) + {network.warmup_steps(ctx.train_steps())}
        GROUP BY ALL""").fetchall()
    return {c: float(d) for c, d in rows}


def _calls(before: dict[str, dict], after: dict[str, dict]) -> int:
    """All-to-all calls a step gains or loses: 4 per sharding group added or removed."""
    return len(COLLECTIVES) * len(_groups(before) ^ _groups(after))


def derive(L: Loads, base: dict[str, dict], prices: Prices) -> dict[str, dict]:
    """The tables of the plan that `link_seconds` finds lightest (module docstring), each with the
    size and compute kernel `base` (the recorded plan) gives it."""
    W = L.world
    tables: dict[str, dict] = {}
    for t, name in enumerate(L.names):
        size = {k: base[name][k] for k in ("num_embeddings", "embedding_dim")}
        kernel = base[name].get("compute_kernel", "fused")
        if W > 1 and _data_parallel_pays(L, t):
            tables[name] = {"sharding_type": "data_parallel", "ranks": list(range(W)), "compute_kernel": "dense",
                            **size}
        else:
            tables[name] = {"sharding_type": "table_wise", "ranks": [0], "compute_kernel":
                            "fused" if kernel == "dense" else kernel, **size}
    placed = [t for t, name in enumerate(L.names) if tables[name]["sharding_type"] != "data_parallel"]
    placed.sort(key=lambda t: -_weight(L, t))
    share = sum(_weight(L, t) for t in placed) / W  # a table heavier than this alone is split by columns
    so_far = {name: table for name, table in tables.items() if table["sharding_type"] == "data_parallel"}
    for t in placed:  # heaviest first, each where the busiest rank stays lightest
        name = L.names[t]
        splits = _column_splits(L, t) if _weight(L, t) > share else []
        options = [[r] for r in range(W)] + [_split(W, k, r) for k in splits for r in range(W)]

        def placed_on(ranks: list[int]) -> dict:
            return {**tables[name], "sharding_type": "table_wise" if len(ranks) == 1 else "column_wise", "ranks": ranks}

        best = min(options, key=lambda ranks: (link_seconds(L, {**so_far, name: placed_on(ranks)}, prices),
                                               len(ranks), ranks != base[name]["ranks"]))
        tables[name] = so_far[name] = placed_on(best)
    return tables


def _weight(L: Loads, t: int) -> float:
    out = (L.features[t] * L.batch.sum() if L.pooled[t] else L.ids[t].sum()) * L.dims[t] * L.eb[t]
    return L.len_bytes * L.features[t] * L.batch.sum() + L.id_bytes * L.ids[t].sum() + 2 * out


def _column_splits(L: Loads, t: int) -> list[int]:
    """Column shard counts worth trying for table t: 2 .. W dividing its dim."""
    return [k for k in range(2, L.world + 1) if L.dims[t] % k == 0]


def _split(W: int, k: int, first: int) -> list[int]:
    return [(first + i) % W for i in range(k)]


def _data_parallel_pays(L: Loads, t: int) -> bool:
    """A table whose gradient's ring all-reduce moves fewer bytes than its exchange, and small enough
    to copy on every rank."""
    size = L.rows[t] * L.dims[t] * L.eb[t]
    if size > DP_MAX_BYTES:
        return False
    W = L.world
    ring = 2 * (W - 1) * size  # all ranks' wire bytes
    exchange = _weight(L, t) * (W - 1) / W  # the part that crosses ranks, batches alike
    return ring < exchange

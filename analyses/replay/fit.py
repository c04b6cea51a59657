"""The replay's links fitted from the run (analyses.replay), and how well (`Fit`).

The links are fitted from the same run: α per op and the link's rate, by replaying the synchronous
calls, alone or (on a token-bucket link) in their steps, against the time each took from its last entry
to its last exit (analyses.network's rule).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from analyses import network
from analyses.context import Context
from analyses.replay.graph import Step
from analyses.replay.links import Links
from analyses.replay.simulation import alone_time, call_times
from tracekit.topology import tbf_params


@dataclass(frozen=True)
class Fit:
    """How the links were fitted: on `calls` calls (of the `total` it considered: the synchronous ones, or a
    run's async ones where it has none), with the robust spread of their residuals (seconds)."""

    source: str
    calls: int
    total: int
    residual_s: float
    link_given: float | None  # the link's rate where the run names it (tracekit cluster), bytes/s


def fit_links(ctx: Context, steps: list[Step], node_of: tuple[int, ...], topology: dict,
         notes: list[str]) -> tuple[Links, Fit]:
    """The links the recorded `steps` ran on, fitted from them, and how: on one host each call takes the time
    it took; on a token-bucket link its rate by replaying the steps (`_fit_bucket`); else α per op and the
    rate by least squares over the calls that ran alone (module docstring)."""
    given = topology.get("link_bytes_per_s")
    nodes = len(set(node_of))
    alone = [c for s in steps for c in s.calls.values() if not c.is_async and c.alone and c.time_s > 0
             and c.flows.sum() > 0]
    total = sum(1 for s in steps for c in s.calls.values() if not c.is_async)
    fixed = (ctx.options.inter_bw or ctx.options.intra_bw) if nodes > 1 else (ctx.options.intra_bw or ctx.options.inter_bw)
    intra = ctx.options.intra_bw or np.inf
    if nodes == 1 and not fixed:  # one host: a call costs what it took, its bytes changed at the fitted rate
        net = network.network(ctx).fit
        rate = 1 / net.beta_s_per_byte if net.beta_s_per_byte > 0 else np.inf
        return (Links(node_of, np.inf, rate, dict(net.alpha_s), per_call=True),
                Fit(f"one host: each recorded call the time it took, its bytes changed at the rate of analyses.network's "
                    f"fit ({net.source})", net.kept, total, net.residual_s, given))
    burst = float(topology.get("burst_bytes") or tbf_params(given)["burst"]) if nodes > 1 and given else 0.0
    if burst and not fixed and any(c.time_s > 0 and c.flows.sum() > 0 for s in steps for c in s.calls.values()):
        return _fit_bucket(steps, node_of, given, burst, intra)
    if not alone:
        notes.append("replay: no synchronous call ran alone to fit the links on; α = 0, links from the options")
        return Links(node_of, ctx.options.inter_bw or given or np.inf, intra, {}), Fit("none", 0, total, 0.0, given)
    ops = sorted({c.op for c in alone})
    t = np.array([c.time_s for c in alone])
    op_index = np.array([ops.index(c.op) for c in alone])
    unit = Links(node_of, 1.0 if nodes > 1 else np.inf, 1.0 if nodes == 1 else np.inf, {})
    x = np.array([alone_time(c, unit) for c in alone])
    spread = x.max() >= network.MIN_SPREAD * max(x.min(), 1.0)
    beta_fixed = 1 / fixed if fixed else (None if spread else (1 / given if given else 0.0))
    keep = np.ones(len(t), dtype=bool)
    for _ in range(2):
        alpha, beta = network._lstsq(x[keep], t[keep], op_index[keep], len(ops), beta_fixed)
        residual = t - (alpha[op_index] + beta * x)
        scale = network._robust(residual[keep])
        keep = np.abs(residual) <= network.RESIDUAL_CLIP * max(scale, 1e-6)
    rate = 1 / beta if beta > 0 else np.inf
    source = ("α fitted, the link's rate from the options" if fixed else
              "α and the link's rate by least squares over the calls that ran alone" if spread else
              "α fitted; the calls' sizes do not spread enough to tell the rate"
              + (" (the cluster's link rate taken)" if given else " (taken as unbounded)"))
    alphas = dict(zip(ops, map(float, alpha)))
    links = (Links(node_of, rate, intra, alphas) if nodes > 1 else
             Links(node_of, ctx.options.inter_bw or np.inf, rate, alphas))
    return links, Fit(source, int(keep.sum()), total, network._robust(residual[keep]), given)


def _fit_bucket(steps: list[Step], node_of: tuple[int, ...], given: float, burst: float,
                intra: float) -> tuple[Links, Fit]:
    """The rate of a token-bucket link (`tracekit cluster`'s, whose burst is known): the recorded steps
    replayed at rates around the link's payload rate, the one whose synchronous calls' (a run without any:
    its async calls') replayed times
    (their last entry to last exit, the bucket as the steps before left it) are nearest the measured ones,
    with each op's α the median of what its calls took beyond their replayed time."""
    timed = [(i, k, c) for i, s in enumerate(steps) for k, c in s.calls.items() if c.time_s > 0 and c.flows.sum() > 0]
    synchronous = any(not c.is_async for *_, c in timed)  # else (a TorchRec job) its async calls, issue to completion
    measured = {(i, k): (c.op, c.time_s) for i, k, c in timed if c.is_async != synchronous}
    ops = sorted({op for op, _ in measured.values()})
    best = None
    for factor in np.linspace(0.6, 1.4, 17):
        rate = given * network.WIRE_EFFICIENCY * factor
        replayed = call_times(steps, Links(node_of, rate, intra, {}, burst))
        keys = [k for k in measured if k in replayed]
        op_index = np.array([ops.index(measured[k][0]) for k in keys])
        extra = np.array([measured[k][1] - replayed[k] for k in keys])
        alpha = np.array([max(float(np.median(extra[op_index == i])), 0.0) if (op_index == i).any() else 0.0
                          for i in range(len(ops))])
        residual = extra - alpha[op_index]
        score = float(np.median(np.abs(residual)))
        if best is None or score < best[0]:
            best = (score, rate, alpha, residual)
    _, rate, alpha, residual = best
    keep = np.abs(residual) <= network.RESIDUAL_CLIP * max(network._robust(residual), 1e-6)
    if not synchronous:  # async calls overlap others: what one op's calls take beyond the replay is their wait
        alpha = np.full_like(alpha, alpha.min())  # behind the others, not a fixed cost; the least is the op's α
    links = Links(node_of, rate, intra, dict(zip(ops, map(float, alpha))), burst)
    against = "synchronous call's time" if synchronous else "async call's issue to completion (no synchronous one)"
    return links, Fit(f"the link's rate fitted by replaying the steps with its {burst / 1e3:.0f} kB token bucket "
                      f"against each {against}; α per op their median excess", int(keep.sum()), len(measured),
                      network._robust(residual[keep]), given)

"""A policy as a change of the replay's graph (analyses.replay).

A policy is a `Change` of the graph: the exchange's collectives scaled to its replayed bytes, skipped on
the steps that no longer make them, the collectives it adds (a replica sync) after the backward where the
trainer issues them, the dense gradients' bytes scaled, and the rank-side work it adds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import numpy as np

from analyses import network
from analyses.replay.graph import KEYED, Call, Step, one_way, ring_flows
from analyses.replay.links import Links
from tracekit import tags


@dataclass(frozen=True)
class Added:
    """A collective a policy adds on every rank once a step, after the backward (the replica sync): an
    all-reduce of `bytes_per_rank` on a ring, or `op` sending `bytes_per_rank` spread over the others."""

    op: str
    bytes_per_rank: float
    tag: str = "added"


@dataclass(frozen=True)
class Change:
    """A policy as a transformation of the graph: `scale[c]` the factor on exchange collective c's bytes
    between ranks (a number, or an array of factors per (sender, receiver) in the call's group); `skip` the share of steps that make no exchange (FAE's all-hot ones); `added` the
    collectives it adds; `work_s` rank-side seconds a step it adds (after the backward); `dense` the factor
    on the dense gradients' all-reduce bytes (DDP's buckets, the trainer's hook: tracekit.tags.DP_TAGS)."""

    scale: dict[str, float] = field(default_factory=dict)
    skip: float = 0.0
    added: tuple[Added, ...] = ()
    work_s: float = 0.0
    dense: float = 1.0


def compose(changes: list[Change]) -> Change:
    """Changes applied together: their scales multiplied, the largest skip, every added call and all work."""
    scale: dict[str, float] = {}
    for c in changes:
        for name, factor in c.scale.items():
            scale[name] = scale.get(name, 1.0) * factor
    return Change(scale, max((c.skip for c in changes), default=0.0), tuple(a for c in changes for a in c.added),
                  sum(c.work_s for c in changes), math.prod(c.dense for c in changes))


def changed(step: Step, change: Change, links: Links) -> tuple[dict[int, list[tuple]], dict[int, Call]]:
    """The step's programs and calls with `change` applied."""
    calls = dict(step.calls)
    dropped: set[int] = set()
    for k, c in step.calls.items():
        if c.collective is None:
            if change.dense != 1.0 and c.tag.startswith(tags.DP_TAGS):
                calls[k] = _scaled(c, float(change.dense), links)
            continue
        if change.skip >= 1.0:
            dropped.add(k)
        elif c.collective in change.scale:
            calls[k] = _scaled(c, change.scale[c.collective], links)
    ranks = tuple(sorted(step.programs))
    added = []
    for a in change.added:
        key = max(calls, default=-1) + 1
        calls[key] = Call(a.op, a.tag, None, ranks, _added_flows(a, len(ranks)), False, 0.0, 0.0, ())
        added.append(key)
    programs = {}
    for r, program in step.programs.items():
        out = [ins for ins in program if not (ins[0] in KEYED and ins[1] in dropped)]
        if added or change.work_s:
            i = after_backward(out)
            inserted = [("call", k) for k in added] + ([("compute", float(change.work_s))] if change.work_s else [])
            out = out[:i] + inserted + out[i:]
        programs[r] = out
    return programs, calls


def _scaled(c: Call, factor, links: Links) -> Call:
    """`c` with its bytes times `factor` (a number, or one per pair); where a call takes the time it took
    (`Links.per_call`), that time changed by the bytes it gains or loses on its busiest link at the lesser
    of two costs per byte: the link's fitted one, and the call's own (its time beyond the op's α over its
    bytes). On one host a fit over calls whose times follow the cores' scheduling can price a byte far
    above what any recorded call took."""
    flows = c.flows * factor
    took = c.time_s
    before = one_way(c.flows)
    if links.per_call and before > 0:
        own = max(took - links.alpha_of(c.op), 0.0) / before
        per_byte = min(own, 1.0 / links.intra)
        took = max(took + (one_way(flows) - before) * per_byte, 0.0)
    return replace(c, flows=flows, time_s=took)


def _added_flows(a: Added, n: int) -> np.ndarray:
    if a.op == network.ALL_REDUCE:
        return ring_flows(n, a.bytes_per_rank)
    flows = np.zeros((n, n))  # an exchange or a gather: the rank's bytes spread over the others
    if n > 1:
        flows[:] = a.bytes_per_rank / (n - 1)
        np.fill_diagonal(flows, 0.0)
    return flows


def after_backward(program: list[tuple]) -> int:
    """Where the trainer issues what follows the backward: after the wait point, else before the
    step's last compute."""
    for i, ins in enumerate(program):
        if ins[0] == "wait":
            return i + 1
    return max(len(program) - 1, 0)

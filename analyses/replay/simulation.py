"""The discrete-event replay of the ranks' programs (analyses.replay.graph) on the links
(analyses.replay.links), with a policy's change applied (analyses.replay.change).

The ranks run the steps one after another from the first step's recorded offsets, and a replayed step
lasts, as a measured one does, the slowest rank's start to end. How an all-to-all's flows start, and when
a rank leaves a call, is `_Simulation`'s.
"""

from __future__ import annotations

import heapq
import math

import numpy as np

from analyses.replay.change import Change, changed
from analyses.replay.graph import KEYED, Call, Step, one_way
from analyses.replay.links import Links, emptied_in, refill, shares

EPS_BYTES = 1e-3


class Stalled(RuntimeError):
    """The replay cannot go on: a rank waits in a collective that another rank never enters."""


def run_steps(steps: list[Step], links: Links, change: Change | None = None) -> np.ndarray:
    """Each step's replayed time (the slowest rank's start to end) with `change` applied. The ranks run
    the steps one after another from the first step's recorded offsets, so a rank that leaves a step
    early waits at the next one's first collective, as it did."""
    if not steps:
        return np.zeros(0)
    ends = _replay(steps, links, change).ends
    starts = {r: [steps[0].start[r], *(ends[r][:-1])] for r in ends}
    return np.array([max(ends[r][i] - starts[r][i] for r in ends) for i in range(len(steps))])


def call_times(steps: list[Step], links: Links) -> dict[tuple[int, int], float]:
    """Each call's replayed time, its last entry to its last exit (an async call's: to its completion), by
    (step position, call)."""
    sim = _replay(steps, links, None)
    out = {}
    for key, c in sim.calls.items():
        exits = [sim.left.get((key, r)) for r in c.ranks]
        if None not in exits and len(sim.entries.get(key, ())) == len(c.ranks):
            out[key] = max(exits) - max(sim.entries[key].values())
    return out


def alone_time(c: Call, links: Links) -> float:
    """The call's last entry to last exit, replayed alone from its recorded entries on `links` with no α
    (on links of one byte a second, its time is α + this / the link's rate)."""
    first = min(c.entries)
    programs = {r: [("compute", e - first), ("call", 0), ("end", 0)] for r, e in zip(c.ranks, c.entries)}
    ends = _Simulation(links, {0: c}).run(programs, dict.fromkeys(c.ranks, 0.0))
    return max(e[0] for e in ends.values()) - (max(c.entries) - first)


def _replay(steps: list[Step], links: Links, change: Change | None) -> _Simulation:
    programs: dict[int, list[tuple]] = {r: [] for r in steps[0].programs}
    calls: dict[tuple, Call] = {}
    for i, s in enumerate(steps):
        step_programs, step_calls = changed(s, change, links) if change is not None else (s.programs, s.calls)
        calls.update({(i, k): c for k, c in step_calls.items()})
        for r, program in step_programs.items():
            programs[r].extend((kind, (i, arg)) if kind in KEYED else (kind, arg) for kind, arg in program)
            programs[r].append(("end", i))
    sim = _Simulation(links, calls)
    sim.ends = sim.run(programs, steps[0].start)
    return sim


class _Simulation:
    """The discrete-event replay of the ranks' programs on the links.

    An all-reduce's or a gather's flows start once every rank has entered. An all-to-all's data moves as
    gloo's pairs move it (measured on `tracekit cluster`, bench/RESULTS.md §36): a rank entering it tells
    each peer it may send, on the stream that carries its own data to that peer. So between a rank that
    entered early and one that entered later, the later one's
    data crosses first (the early one's notice was waiting), and the early one's only once it has, behind
    which the later one's notice came; ranks that enter together send at once. A rank leaves the call
    when all its data has arrived and all its own has started (handed to the socket), plus the op's α.
    Flows that share a link share it max-min fairly."""

    def __init__(self, links: Links, calls: dict) -> None:
        self.links = links
        self.calls = calls
        self.entries: dict = {}  # call -> {rank: time}
        self.pending: dict = {}  # (call, rank) -> [in-flows not arrived, out-flows not started]
        self.flows: dict = {}  # (call, i, j) -> bytes left, for the flows moving now
        self.after: dict = {}  # (call, i, j) -> the flow that starts once it has arrived
        self.left: dict = {}  # (call, rank) -> when the rank left the call
        self.timers: list = []  # (time, call, rank): the rank leaves the call then
        self.tokens: dict = {}  # a node link's bucket: bytes it may still send at line rate

    def run(self, programs: dict[int, list[tuple]], start: dict[int, float]) -> dict[int, list[float]]:
        pc = dict.fromkeys(programs, 0)
        ready: dict[int, float | None] = dict(start)
        blocked: dict[int, tuple] = {}  # rank -> ("call", key) or ("wait", keys): what it waits for
        issued: dict[int, list] = {r: [] for r in programs}
        ends: dict[int, list[float]] = {r: [] for r in programs}
        finished: set[int] = set()
        now = min(start.values())
        while len(finished) < len(programs):
            moved = True
            while moved:  # run every rank that can run now
                moved = False
                for r in programs:
                    t = ready[r]
                    if r in finished or t is None or t > now:
                        continue
                    if pc[r] >= len(programs[r]):
                        finished.add(r)
                        continue
                    kind, arg = programs[r][pc[r]]
                    pc[r] += 1
                    moved = True
                    if kind == "compute":
                        ready[r] = t + arg
                    elif kind == "end":
                        ends[r].append(t)
                    elif kind in ("call", "issue"):
                        self._enter(arg, r, t)
                        if kind == "issue":
                            issued[r].append(arg)
                        elif (arg, r) in self.left:
                            ready[r] = max(t, self.left[arg, r])
                        else:
                            ready[r], blocked[r] = None, ("call", arg)
                    else:  # wait for one async call, or for those issued so far
                        if kind == "waitfor":
                            keys = [arg]
                            issued[r] = [k for k in issued[r] if k != arg]
                        else:
                            keys, issued[r] = issued[r], []
                        if all((k, r) in self.left for k in keys):
                            ready[r] = max([t, *(self.left[k, r] for k in keys)])
                        else:
                            ready[r], blocked[r] = None, ("wait", keys)
            for r, (kind, arg) in list(blocked.items()):  # ranks whose calls are done
                keys = [arg] if kind == "call" else arg
                if all((k, r) in self.left for k in keys):
                    ready[r] = max([now, *(self.left[k, r] for k in keys)])
                    del blocked[r]
            if len(finished) == len(programs):
                break
            rates = self._rates()
            flowing = self._throughput(rates)
            candidates = [t for r, t in ready.items() if t is not None and r not in finished and t > now]
            candidates += [now + s for s in emptied_in(self.links, self.tokens, flowing)]
            candidates += [t for t, *_ in self.timers[:1]]
            candidates += [now + (0.0 if math.isinf(rate) else left / rate)
                           for f, left in self.flows.items() if (rate := rates[f]) > 0]
            if not candidates:
                if any(t is not None and t <= now for r, t in ready.items() if r not in finished):
                    continue
                raise Stalled("a collective some rank never enters")
            t = max(min(candidates), now)
            if self.links.burst:
                refill(self.links, self.tokens, flowing, t - now)
            for f in list(self.flows):  # a flow on links without a rate (unbounded) arrives at once
                self.flows[f] = 0.0 if math.isinf(rates[f]) else self.flows[f] - rates[f] * (t - now)
            now = t
            for f in [f for f, left in self.flows.items() if left <= EPS_BYTES]:
                del self.flows[f]
                self._arrived(f, now)
            while self.timers and self.timers[0][0] <= now:
                when, key, r = heapq.heappop(self.timers)
                self.left[key, r] = when
        return ends

    def _enter(self, key: tuple, r: int, t: float) -> None:
        c = self.calls[key]
        me = c.ranks.index(r)
        entered = self.entries.setdefault(key, {})
        entered[me] = t
        self.pending[key, me] = [int((c.flows[:, me] > EPS_BYTES).sum()), int((c.flows[me] > EPS_BYTES).sum())]
        if not c.op.startswith("all_to_all"):  # a ring or a gather: every flow once all have entered
            if len(entered) == len(c.ranks):
                for i, j in zip(*np.nonzero(c.flows > EPS_BYTES)):
                    self._start((key, int(i), int(j)), t)
                for i in range(len(c.ranks)):
                    self._check(key, i, t)
            return
        for peer, t_peer in entered.items():
            if peer == me:
                continue
            mine, theirs = c.flows[me, peer] > EPS_BYTES, c.flows[peer, me] > EPS_BYTES
            if mine:
                self._start((key, me, peer), t)
            if theirs:
                if t_peer == t or not mine:
                    self._start((key, peer, me), t)
                else:
                    self.after[key, me, peer] = (key, peer, me)
        self._check(key, me, t)

    def _start(self, f: tuple, t: float) -> None:
        key, i, j = f
        self.flows[f] = float(self.calls[key].flows[i, j])
        self.pending[key, i][1] -= 1
        self._check(key, i, t)

    def _arrived(self, f: tuple, t: float) -> None:
        key, i, j = f
        self.pending[key, j][0] -= 1
        self._check(key, j, t)
        then = self.after.pop(f, None)
        if then is not None:
            self._start(then, t)

    def _check(self, key: tuple, me: int, t: float) -> None:
        if self.pending[key, me] == [0, 0]:
            self.pending[key, me] = [-1, -1]
            c = self.calls[key]
            took = self.links.alpha_of(c.op)
            if self.links.per_call:  # the recorded call's own time; an added one's α and bytes at the rate
                took = c.time_s if c.entries else took + one_way(c.flows) / self.links.intra
            heapq.heappush(self.timers, (t + took, key, c.ranks[me]))

    def _path(self, f: tuple) -> tuple[tuple, tuple]:
        """The links flow `f` crosses: its nodes' links out and in, or within a node its ranks'."""
        key, i, j = f
        c = self.calls[key]
        a, b = c.ranks[i], c.ranks[j]
        na, nb = self.links.node_of[a], self.links.node_of[b]
        return (("up", na), ("down", nb)) if na != nb else (("lo_up", a), ("lo_down", b))

    def _throughput(self, rates: dict) -> dict:
        """Bytes/s each node link carries now."""
        out: dict = {}
        for f, rate in rates.items():
            for link in self._path(f):
                if link[0] in ("up", "down"):
                    out[link] = out.get(link, 0.0) + rate
        return out


    def _rates(self) -> dict:
        """The rates of the flows moving now: their links' max-min fair shares (analyses.replay.links)."""
        if self.links.per_call:  # the calls' times hold their bytes: flows arrive at once
            return dict.fromkeys(self.flows, np.inf)
        return shares({f: self._path(f) for f in self.flows}, self.links, self.tokens)

"""The replay on a target cluster (`tracekit simulate`): the recorded steps' programs run again with every
collective priced on the target's links, as NCCL moves its bytes.

A target is N nodes × R ranks (global rank r on node r // R); a node's link carries `inter` payload
bytes/s each way, a rank within its node `intra`; every collective costs `latency` beyond its bytes
(DEFAULT_LATENCY_S unless given: NCCL's small-message all-to-all and all-reduce across InfiniBand nodes
take some 10-50 µs). No call duration and no α measured where the run was recorded is carried over.

    all-to-all   every pair's transfer at once: latency + the busiest link's bytes over its rate,
                 max( max_n max(out_n, in_n) / inter,  max_r max(out_r, in_r) / intra )
                 out_n, in_n: the bytes node n sends to and receives from the other nodes; out_r, in_r:
                 rank r's to and from the ranks of its node (half duplex: out + in)
    all-reduce   a ring (NCCL's; its tree moves as many bytes across the nodes): S a rank, each ring
                 edge carries 2(W'−1)/W' · S, one edge leaving each node: latency + that over
                 min(inter if N > 1, intra if R > 1)
    all-gather   a ring: every edge carries each part but one: latency + (Σ parts − the least) over the same
    others       latency

Flows are priced per node pair and per rank of a node from the W' × W' matrices, not as W'² objects.

The step. The W recorded ranks' programs (analyses.replay.graph) stand for the W' target ranks (rank
r' runs recorded rank r' mod W's), their compute scaled by `compute_scale` (the batch's b'/b, and
another device's); each call keeps its place and takes its price on the target; the programs run
through the replay (analyses.replay.simulation, with calls that take the time priced: `Links.per_call`),
so an async all-reduce overlaps compute as it did and a synchronous call ends its price after its last
rank entered. Ranks of one recorded program run alike on the target, so the replay is the size of
the recorded world, whatever W'.

    links = TargetLinks(nodes=8, ranks_per_node=8, inter=12.5e9, intra=200e9)
    links.exchange_s(m)              # an all-to-all of m[i, j] bytes from rank i to rank j
    steps = priced_steps(recorded, links, prices, compute_scale=2.0)
    np.median(run_steps(steps, priced_links(steps)))
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from analyses import network
from analyses.replay.change import after_backward
from analyses.replay.graph import KEYED, Call, Step
from analyses.replay.links import Links

DEFAULT_LATENCY_S = 20e-6


@dataclass(frozen=True)
class TargetLinks:
    nodes: int
    ranks_per_node: int
    inter: float  # payload bytes/s of a node's link, each way
    intra: float  # payload bytes/s of a rank within its node, each way
    latency_s: float = DEFAULT_LATENCY_S
    duplex: bool = True

    @property
    def world(self) -> int:
        return self.nodes * self.ranks_per_node

    @property
    def ring_rate(self) -> float:
        """The slowest edge of a ring over every rank."""
        rates = ([self.inter] if self.nodes > 1 else []) + ([self.intra] if self.ranks_per_node > 1 else [])
        return min(rates) if rates else np.inf

    def exchange_s(self, m: np.ndarray) -> float:
        """An all-to-all of m[i, j] bytes from rank i to rank j (module docstring)."""
        n, r = self.nodes, self.ranks_per_node
        if m.shape != (n * r, n * r):
            raise ValueError(f"an exchange on {n}x{r} takes a {n * r} × {n * r} matrix, got {m.shape}")
        blocks = m.reshape(n, r, n, r)
        seconds = 0.0
        if n > 1:
            nodes = blocks.sum(axis=(1, 3))
            np.fill_diagonal(nodes, 0.0)
            out, into = nodes.sum(axis=1), nodes.sum(axis=0)
            seconds = max(seconds, float((np.maximum(out, into) if self.duplex else out + into).max()) / self.inter)
        if r > 1:
            within = blocks[np.arange(n), :, np.arange(n), :].copy()  # n × r × r
            within[:, np.arange(r), np.arange(r)] = 0.0
            out, into = within.sum(axis=2), within.sum(axis=1)
            seconds = max(seconds, float((np.maximum(out, into) if self.duplex else out + into).max()) / self.intra)
        return self.latency_s + seconds

    def ring_s(self, size: float) -> float:
        """A ring all-reduce of `size` bytes a rank."""
        w = self.world
        return self.latency_s + (2 * (w - 1) / w * size / self.ring_rate if w > 1 and size else 0.0)

    def gather_s(self, parts: np.ndarray | float) -> float:
        """A ring all-gather of `parts` bytes a rank (one figure: every rank's)."""
        w = self.world
        if w < 2:
            return self.latency_s
        parts = np.broadcast_to(np.asarray(parts, dtype=np.float64), (w,))
        return self.latency_s + float(parts.sum() - parts.min()) / self.ring_rate


def priced_links(steps: list[Step]) -> Links:
    """The replay's links for priced steps: each call takes its `time_s`, its flows arrive at once."""
    world = max((r + 1 for s in steps for r in s.programs), default=1)
    return Links(tuple(range(world)), np.inf, np.inf, {}, per_call=True)


def scaled_compute(program: list[tuple], factor: float) -> list[tuple]:
    return [("compute", arg * factor) if kind == "compute" else (kind, arg) for kind, arg in program]


def priced_steps(steps: list[Step], price, compute_scale: float, added: tuple[tuple[str, float], ...] = (),
                 drop_exchange: bool = False) -> list[Step]:
    """`steps` with each call's time the target's price (`price(call)`: seconds, or None to leave the call
    out), the compute times `compute_scale`, the calls `added` ((tag, seconds), after the backward, where
    the trainer syncs its replicas) and, with `drop_exchange`, no embedding exchange (FAE's hot steps)."""
    out = []
    for s in steps:
        calls, dropped = {}, set()
        for k, c in s.calls.items():
            seconds = None if drop_exchange and c.collective is not None else price(c)
            if seconds is None:
                dropped.add(k)
            else:
                calls[k] = _timed(c, seconds)
        ranks = tuple(sorted(s.programs))
        keys = []
        for tag, seconds in added:
            key = max([*s.calls, *calls], default=-1) + 1 + len(keys)
            calls[key] = Call(network.ALL_REDUCE, tag, None, ranks, _linked(len(ranks)), False, seconds, 0.0,
                              (0.0,) * len(ranks))
            keys.append(key)
        programs = {}
        for r, program in s.programs.items():
            program = [ins for ins in scaled_compute(program, compute_scale) if not (ins[0] in KEYED and ins[1] in dropped)]
            if keys:
                i = after_backward(program)
                program = program[:i] + [("call", k) for k in keys] + program[i:]
            programs[r] = program
        out.append(Step(s.step, s.start, programs, calls, s.measured_s))
    return out


def _timed(c: Call, seconds: float) -> Call:
    """`c` taking `seconds` once its last rank entered (flows of a byte: the ranks meet, nothing to move)."""
    return replace(c, flows=_linked(len(c.ranks)), time_s=float(seconds), entries=c.entries or (0.0,) * len(c.ranks))


def _linked(n: int) -> np.ndarray:
    flows = np.ones((n, n))
    np.fill_diagonal(flows, 0.0)
    return flows

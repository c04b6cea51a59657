"""The links of the replay (analyses.replay): what each node's and each rank's link carries, and how
the flows moving at once share it.

A flow between nodes crosses its source node's link out and the destination node's link in, each
`inter` bytes/s each way (a token bucket where the run's cluster shaped one); within a node it takes its
ranks' `intra`. Flows that share a link share it max-min fairly (progressive filling).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from analyses import network

LINE_RATE = 100.0  # a token bucket's line rate, as a multiple of its rate (a veth's, in `tracekit cluster`)


@dataclass(frozen=True)
class Links:
    """The links a replay runs on: each rank's node, a node link's and a rank's rate each way, α per op."""

    node_of: tuple[int, ...]  # by rank
    inter: float  # bytes/s of a node's link, each way
    intra: float  # bytes/s of a rank within its node, each way
    alpha: dict[str, float]
    burst: float = 0.0  # bytes a node's link sends at line rate after it idled (a token bucket's; 0: none)
    per_call: bool = False  # a recorded call takes the time it took (one host: bytes are not what costs)

    def alpha_of(self, op: str) -> float:
        return self.alpha.get(op, self.alpha.get(network.A2A, 0.0))


def shares(paths: dict, links: Links, tokens: dict) -> dict:
    """Max-min fair rates of the flows moving now, each with the links it crosses (progressive filling):
    the link whose fair share is least fixes its flows at that share, until every flow is fixed. A node's
    link runs at its line rate while its bucket (`tokens`, filled on first use) holds bytes."""
    capacity = {}
    for f in paths:
        for link in paths[f]:
            if link[0] in ("up", "down"):
                if links.burst and link not in tokens:
                    tokens[link] = links.burst
                line = tokens.get(link, 0.0) > 0
                capacity[link] = links.inter * (LINE_RATE if line else 1.0)
            else:
                capacity[link] = links.intra
    rates = {}
    free = set(paths)
    while free:
        users: dict[tuple, list] = {}  # an unbounded link (inf) shares inf: its flows move at once
        for f in free:
            for link in paths[f]:
                users.setdefault(link, []).append(f)
        link, share = min(((k, capacity[k] / len(v)) for k, v in users.items()), key=lambda kv: kv[1])
        for f in users[link]:
            rates[f] = share
            free.discard(f)
            for other in paths[f]:
                if not math.isinf(share):
                    capacity[other] -= share
    return rates


def emptied_in(links: Links, tokens: dict, flowing: dict) -> list[float]:
    """Seconds until each node link's bucket that drains (carrying `flowing[link]` bytes/s, above its
    rate) is empty."""
    return [tokens[k] / (v - links.inter) for k, v in flowing.items() if tokens.get(k, 0.0) > 0 and v > links.inter]


def refill(links: Links, tokens: dict, flowing: dict, seconds: float) -> None:
    """The buckets after `seconds` carrying `flowing` bytes/s: filled at the link's rate, drained by what
    it carried, at most the burst."""
    for k in tokens:
        left = tokens[k] + (links.inter - flowing.get(k, 0.0)) * seconds
        tokens[k] = min(left, links.burst) if left > 1.0 else 0.0  # under a byte: empty

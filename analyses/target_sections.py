"""The policy sections on a target cluster (`tracekit simulate`): what each one sends a step there, to the
byte where the recorded rows decide it, and the sections derived for the target itself.

A section on the target is a `Case`: the exchange of a step (analyses.target_exchange, its rows
replicated through the regrouped lookups), the replicas' sync it adds, the share of steps that make no
exchange (FAE's hot steps), DCT-MP's factor on the output rows and DCT-DP's gathers in place of the
dense gradients' all-reduce.

Derived for the target, as analyze derives them for the recorded run:
- replication: the rows by the bytes their lookups would free at W' (ids of remote lookups, and the
  rows back of the remote bags and sequence lookups they alone make), per byte of replica; the prefix,
  on a geometric grid within the replica budget (Options.budget_*), refined around its best point, and the sync (dense or sparse) whose
  replayed step is least (objective "time") or whose bytes are fewest (objective "bytes");
- schedule (FAE): the same candidate hot sets, each with its share of all-hot samples h: hot steps make
  no exchange, cold steps carry the cold samples' exchange (a rank's b' cold samples: the lookups'
  bytes over 1 − h of the samples), every step syncs the replicas; the hot set whose mean step is least;
- compression: DCT's settings as the run's analysis chose them within the quality its calibration
  measured (RUN/policy.json): DCT-MP's byte ratio on the output rows; DCT-DP's bytes a rank, gathered
  from every rank instead of the ring all-reduce, two gathers a bucket.
Tiers are not projected at another world yet: a note says so.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

from analyses.target_exchange import DENSE, SPARSE, Routed, TargetExchange, exchange, hot_samples

GRID_POINTS = 8  # candidate hot sets, geometrically spaced
REFINE_POINTS = 4  # ... and more between the best one's neighbours
RECOMMEND_GAIN = 0.05
"""A section derived for a target is recommended where its predicted step is this much faster: the
replay's error on held-out runs at the recorded scale (bench/RESULTS.md) is within it."""


@dataclass
class Case:
    """One section on the target (module docstring)."""

    name: str
    x: TargetExchange
    sync: str | None = None  # the kind of x.syncs it applies
    hot_fraction: float = 0.0  # FAE: the share of steps with no exchange
    cold: TargetExchange | None = None  # FAE: a cold step's exchange
    output_ratio: float = 1.0  # DCT-MP: bytes of an output row sent over its plain bytes
    dp_part: float | None = None  # DCT-DP: bytes each rank gathers to every other a step, in place of the ring
    hot_keys: np.ndarray | None = None  # the replicated rows (tid << 40 | row)
    notes: list[str] = field(default_factory=list)

    def step_exchange(self) -> TargetExchange:
        """The exchange of a step that makes one (FAE: a cold step's)."""
        return self.cold if self.cold is not None else self.x


def ranked_rows(r: Routed) -> np.ndarray:
    """Indices into r.keys, by the bytes a step their replication frees per byte of replica, best first;
    rows that free nothing left out."""
    remote = r.rank != r.owner
    bag_size = np.bincount(r.bag[r.bag >= 0], minlength=len(r.bag_rank)) if len(r.bag_rank) else np.zeros(0)
    alone = np.where(r.bag >= 0, bag_size[np.maximum(r.bag, 0)] == 1 if len(bag_size) else False, True)
    rb = r.tables.rb[r.tid]
    freed = np.where(remote, r.id_bytes + np.where(alone, 2 * rb, 0.0), 0.0)
    per_row = np.bincount(r.row_index, weights=freed, minlength=len(r.keys))
    per_byte = per_row / r.tables.rb[r.keys >> 40]
    order = np.argsort(-per_byte, kind="stable")
    return order[per_row[order] > 0]


def candidates(r: Routed, order: np.ndarray, budget: float | None) -> list[int]:
    """Prefix sizes of `order` to try: a geometric grid up to the budget (bytes of replica a rank)."""
    if not len(order):
        return []
    sizes = np.cumsum(r.tables.rb[r.keys[order] >> 40])
    most = len(order) if budget is None else int(np.searchsorted(sizes, budget, side="right"))
    if most < 1:
        return []
    grid = np.unique(np.round(np.geomspace(1, most, GRID_POINTS)).astype(int))
    return [int(k) for k in grid]


def replication(r: Routed, keys_mask: np.ndarray, name: str = "replication") -> Case:
    x = exchange(r, keys_mask)
    return Case(name, x, hot_keys=r.keys[keys_mask])


def schedule(r: Routed, keys_mask: np.ndarray, replicated: TargetExchange | None = None) -> Case:
    """FAE with the rows of `keys_mask` hot (module docstring); `replicated`: their replication's exchange."""
    x = replicated if replicated is not None else exchange(r, keys_mask)
    h = hot_samples(r, keys_mask)
    cold_share = max(1.0 - h, 1e-12)
    pairs = {c: (m if c == "input_lengths" else m / cold_share) for c, m in x.pairs.items()}
    cold = TargetExchange(x.world, pairs, x.syncs)
    return Case("schedule", x, hot_fraction=h, cold=cold, hot_keys=r.keys[keys_mask])


def with_sync(case: Case, kind: str | None) -> Case:
    return replace(case, sync=kind if kind in case.x.syncs else None)


def sync_kinds(case: Case) -> list[str | None]:
    return [kind for kind in (DENSE, SPARSE) if kind in case.x.syncs] or [None]

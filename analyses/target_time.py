"""The step of a recorded run on a target cluster (`tracekit simulate`): the recording's side of a
projection (`Source`: its lookups routed on the target, its steps, its dense traffic) and each
section's step (`Case`) replayed with every call priced on the target's links (analyses.replay.target).

Each recorded call takes the target's price of what it moves there: an exchange call its role's bytes
from rank to rank under the case (DCT-MP's ratio on the output rows), an all-reduce its recorded bytes a
rank as a ring (dropped under DCT-DP, whose gathers are added), a gather its parts; a recorded policy's
own sync is dropped and the case's added after the backward. A step's communication is what the links
add to it beyond the same replay with free communication (`timed`), so ranks that wait on each other
count as compute.

    src = source(ctx, Target(8, 8, inter_bw=12.5e9), notes)
    step_s, comm_s = timed(src, links_of(target, notes), Case("baseline", exchange(src.routed)))
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

from analyses import attribution, exchange as recorded_exchange, network
from analyses.context import Context
from analyses.regroup import Lookups, recorded_lookups, regroup
from analyses.replay.graph import Call, Step, one_way, recorded_steps
from analyses.replay.simulation import run_steps
from analyses.replay.target import DEFAULT_LATENCY_S, TargetLinks, priced_links, priced_steps
from analyses.target_exchange import DENSE, Routed, TableBytes, TargetExchange, route
from analyses.traffic import A2A_OPS, GATHER_OPS
from tracekit import tags
from tracekit.placement import ShardingPlan, TableSpec
from tracekit.topology import Topology

PREDICT_STEPS = 24  # recorded steps a projection replays, evenly spaced
DEFAULT_INTRA_BW = 10e9
"""Bytes/s a rank each way within a node unless the target gives its own (--intra-bw)."""
OUTPUTS = (tags.OUTPUT_FWD, tags.OUTPUT_BWD)


@dataclass(frozen=True)
class Target(Topology):
    """The cluster projected onto: its topology and rates (bytes/s; None: taken from the run)."""

    inter_bw: float
    intra_bw: float | None = None
    batch: int | None = None  # per device; None: the run's
    latency_s: float | None = None  # per collective; None: analyses.replay.target.DEFAULT_LATENCY_S
    duplex: bool = True  # both directions of a link at once
    sharding: str | None = None  # "table" | "row"; None: the run's
    compute_scale: float = 1.0  # the target device's compute time over the recording's, at the same batch


@dataclass
class Case:
    """A section on the target, as its step is priced: the exchange of a step, the replicas' sync it
    applies, FAE's share of steps with no exchange, DCT's ratio on the output rows and gathered bytes
    (analyses.target_sections builds them)."""

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


@dataclass
class Source:
    """The recording's side: its routed lookups on the target, its steps and their dense traffic."""

    routed: Routed
    looked: Lookups
    steps: list[Step]
    batch: float
    compute_scale: float
    ring_bytes: float  # the dense gradients' all-reduce, bytes a rank a step (DDP's buckets and the rest)
    dp_buckets: int  # the DDP all-reduces a step
    notes: list[str]


def source(ctx: Context, target: Target, notes: list[str]) -> Source | None:
    """The recording on `target`: its lookups regrouped and routed on the trainer's plan there
    (analyses.regroup, analyses.target_exchange) and its steps to replay; None, with a note, where it has
    no lookup to regroup or no step that replays."""
    looked = recorded_lookups(ctx)
    if not looked.samples or not len(looked.g):
        notes.append("the run's lookups hold no sample of a sharded table: nothing to regroup")
        return None
    steps_all = ctx.memo(source, lambda: recorded_steps(ctx, notes))
    if not steps_all:
        notes.append("the run's steps do not replay: no step time projected")
        return None
    steps = spaced(steps_all, PREDICT_STEPS)
    world = ctx.model.world_size
    batch = looked.samples / max(looked.steps, 1) / world
    new_batch = int(target.batch or round(batch))
    on = regroup(looked, target.world, new_batch)
    kind = target.sharding or _run_sharding(ctx)
    specs = [TableSpec(t.name, t.num_rows, t.dim, t.kind != "sequence") for t in ctx.model.tables]
    plan = ShardingPlan.build(specs, target.world, kind)
    routed = route(looked, on, plan, _table_bytes(ctx), *recorded_exchange.element_bytes(ctx))
    ring, buckets = _dense(steps)
    notes.extend(on.notes)
    notes.extend(looked.notes)
    if any(t.sharding_type for t in ctx.manifest.tables or ()):
        notes.append("a TorchRec run: its tables placed on the target by the reference trainer's planner "
                     f"({kind}-wise), not TorchRec's")
    return Source(routed, looked, steps, batch, target.compute_scale * new_batch / batch, ring, buckets, notes)


def spaced(steps: list[Step], n: int) -> list[Step]:
    if len(steps) <= n:
        return steps
    return [steps[int(i)] for i in np.linspace(0, len(steps) - 1, n)]


def _run_sharding(ctx: Context) -> str:
    """"row" where a sharded table of the run lies on several ranks, else "table"."""
    shards = [len(t.shards) for t in ctx.model.tables if t.placement in (None, "sharded")]
    return "row" if any(n > 1 for n in shards) else "table"


def _table_bytes(ctx: Context) -> TableBytes:
    tables, features = ctx.model.tables, attribution.features(ctx)
    return TableBytes(np.array([t.row_bytes for t in tables], dtype=np.float64),
                      np.array([features.get(t.name, 1) for t in tables]),
                      np.array([t.kind != "sequence" for t in tables]),
                      np.array([t.placement in (None, "sharded") for t in tables]))


def _ring_size(c: Call) -> float:
    """A recorded ring all-reduce's bytes a rank (its flows are 2(n−1)/n of them to the next rank)."""
    n = len(c.ranks)
    return float(c.flows[0].sum()) * n / (2 * (n - 1)) if n > 1 else 0.0


def _dense(steps: list[Step]) -> tuple[float, int]:
    """The median step's dense all-reduce bytes a rank, and its DDP buckets."""
    sizes, buckets = [], []
    for s in steps:
        rings = [c for c in s.calls.values() if c.op == network.ALL_REDUCE and not c.tag.startswith(tags.SYNC_TAGS)]
        sizes.append(sum(_ring_size(c) for c in rings))
        buckets.append(sum(1 for c in rings if c.tag.startswith(tags.DP_TAGS)))
    return (float(np.median(sizes)), int(np.median(buckets))) if sizes else (0.0, 0)


def links_of(target: Target, notes: list[str]) -> TargetLinks:
    intra = target.intra_bw or DEFAULT_INTRA_BW
    if target.intra_bw is None and target.ranks_per_node > 1:
        notes.append(f"within a node: {DEFAULT_INTRA_BW / 1e9:g} GB/s a rank each way assumed (--intra-bw sets it; "
                     "no rate measured where the run was recorded is carried over)")
    latency = DEFAULT_LATENCY_S if target.latency_s is None else target.latency_s
    return TargetLinks(target.nodes, target.ranks_per_node, target.inter_bw * network.WIRE_EFFICIENCY, intra,
                       latency, target.duplex)


def step_times(src: Source, links: TargetLinks, case: Case, steps: list[Step] | None = None) -> np.ndarray:
    """Each replayed step's time on `links` under `case` (FAE: its hot and cold steps in their shares)."""
    steps = src.steps if steps is None else steps
    added = _added(src, links, case)
    cold = priced_steps(steps, _price(src, links, case), src.compute_scale, added)
    times = run_steps(cold, priced_links(cold))
    if case.hot_fraction > 0:
        hot = priced_steps(steps, _price(src, links, case), src.compute_scale, added, drop_exchange=True)
        times = (1 - case.hot_fraction) * times + case.hot_fraction * run_steps(hot, priced_links(hot))
    return times


def _price(src: Source, links: TargetLinks, case: Case):
    """The target's price of each recorded call under `case` (analyses.replay.target), None to drop it."""
    x = case.step_exchange()
    cache: dict = {}

    def exchange_s(role: str) -> float:
        if role not in cache:
            m = x.pairs[role] * (case.output_ratio if role in OUTPUTS else 1.0)
            cache[role] = links.exchange_s(m)
        return cache[role]

    def price(c: Call) -> float | None:
        if c.collective in x.pairs:
            return exchange_s(c.collective)
        if c.tag.startswith((*tags.SYNC_TAGS, *tags.TIER2_EXCHANGE)):
            return None  # a recorded policy's own sync or tier: the case brings its own
        n = len(c.ranks)
        if c.op == network.ALL_REDUCE:
            if case.dp_part is not None and c.tag.startswith(tags.DP_TAGS):
                return None
            return links.ring_s(_ring_size(c))
        part = one_way(c.flows) / max(n - 1, 1)
        if c.op in GATHER_OPS:
            return links.gather_s(part)
        if c.op in A2A_OPS:  # an all-to-all of no known role: its bytes a rank spread over the others
            key = ("a2a", part)
            if key not in cache:
                w = links.world
                m = np.full((w, w), part * (n - 1) / max(w - 1, 1))
                np.fill_diagonal(m, 0.0)
                cache[key] = links.exchange_s(m)
            return cache[key]
        return links.latency_s
    return price


def _added(src: Source, links: TargetLinks, case: Case) -> tuple[tuple[str, float], ...]:
    """The calls a case adds after the backward, priced: its replicas' sync, DCT-DP's gathers."""
    out = []
    if case.sync is not None:
        sync = case.x.syncs[case.sync]
        if sync.kind == DENSE:
            out.append((tags.REPLICA_SYNC, links.ring_s(sync.allreduce_bytes)))
        else:
            out += [(tags.REPLICA_SYNC, links.gather_s(8.0)), (tags.REPLICA_SYNC, links.exchange_s(sync.ids)),
                    (tags.REPLICA_SYNC, links.ring_s(sync.allreduce_bytes))]
    if case.dp_part is not None:
        buckets = max(src.dp_buckets, 1)
        for _ in range(buckets):  # the count, then the entries, a bucket
            out += [(tags.DCT_DP, links.gather_s(8.0)), (tags.DCT_DP, links.gather_s(case.dp_part / buckets))]
    return tuple(out)


def free_times(src: Source, links: TargetLinks, case: Case, steps: list[Step] | None = None) -> np.ndarray:
    """Each step with free communication (no latency, no wire time): its compute, and its ranks' waits on
    each other. What the links add beyond it is the step's communication."""
    return step_times(src, replace(links, inter=np.inf, intra=np.inf, latency_s=0.0), case, steps)


def timed(src: Source, links: TargetLinks, case: Case, steps: list[Step] | None = None,
           free: np.ndarray | None = None) -> tuple[float, float]:
    """The step (median over the steps) and its communication (the median of each step's time beyond its
    time with free communication, `free` where known)."""
    times = step_times(src, links, case, steps)
    free = free_times(src, links, case, steps) if free is None else free
    return float(np.median(times)), float(np.median(np.maximum(times - free, 0.0)))

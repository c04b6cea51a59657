"""What-if: a recorded run's training step projected onto another cluster (`tracekit simulate`), with the
policy sections derived for that cluster (or a policy file as written), in bytes and in time.

Bytes. The recorded samples with their ids (`lookups`) are regrouped onto the target's W' ranks of b'
samples in the order the trainer hands samples to ranks (analyses.regroup), the tables placed by the
trainer's own planner at W' (tracekit.placement; the run's sharding or the target's), and every
collective of the exchange counted to the byte, each section's replicated rows taken out as the trainer
serves them (analyses.target_exchange). The dense gradients' all-reduce keeps its size a rank (the
model's). Exact where the recording covers a target step (a note says how many), an estimate of its
samples scaled where it covers less.

Sections. By default each is derived for the target (analyses.target_sections: the replicated rows, the
FAE hot set, DCT's settings within the quality the run measured); with a policy file, its sections as
written. `combined` is the recommended ones together, as the trainer applies them.

Time. The recorded steps' programs replayed with every collective priced on the target's links
(analyses.replay.target): compute from the recorded steps scaled with the batch (and `compute_scale`),
no call time or α of the recording carried over. `simulate_sweep` is the same replay over SWEEP_RATES
between nodes.

    result = simulate(ctx, Target(nodes=8, ranks_per_node=8, inter_bw=12.5e9))
    result.tables["simulate"]         # policy | bytes a step | compute, comm, step time | speedup
    result.tables["simulate_sweep"]   # policy | inter_bw | step_time_s | speedup
    result.sections                   # the sections derived for the target (write_policy writes them)
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import polars as pl

from analyses import attribution, exchange as recorded_exchange, network
from analyses.context import Context, Options, Result, open_context
from analyses.regroup import recorded_lookups, regroup
from analyses.replay.graph import Call, Step, one_way, recorded_steps
from analyses.replay.simulation import run_steps
from analyses.replay.target import DEFAULT_LATENCY_S, TargetLinks, priced_links, priced_steps
from analyses.target_exchange import (DENSE, SPARSE, Routed, TableBytes, TargetExchange, exchange, route)
from analyses.target_sections import (RECOMMEND_GAIN, REFINE_POINTS, Case, candidates, ranked_rows, replication, schedule,
                                      sync_kinds, with_sync)
from analyses.traffic import A2A_OPS, GATHER_OPS
from tracekit import tags
from tracekit.figures import (A2A_BYTES, A2A_REMOTE_BYTES, ALLREDUCE_BYTES, DP_BYTES, HOT_ROWS,
                              HOT_SAMPLE_FRACTION, STEP_TIME, SYNC_BYTES)
from tracekit.placement import ShardingPlan, TableSpec
from tracekit.policy import (MIN_HOT_SAMPLES, Combined, DctDp, DctMp, Policy, Prediction, Replication, Schedule, Section,
                             read_policy, row_path, write_policy)
from tracekit.policy_model import check_model
from tracekit.run_dir import RunDir
from tracekit.topology import Topology

SWEEP_RATES = (10e6, 25e6, 50e6, 100e6, 200e6, 500e6, 1e9, 2.5e9, 10e9, 25e9, 100e9, 400e9)
"""Inter-node link rates of the sweep, bits per second."""
SCALE_WORLDS = (4, 8, 16, 32, 64, 128, 256, 512, 1024)
"""World sizes of the scale curve (`curve=True`), the target's ranks per node each."""
PREDICT_STEPS = 24  # recorded steps a projection replays, evenly spaced
DERIVE_STEPS = 12  # ... a candidate of a derivation
SWEEP_STEPS = 6  # ... a point of the sweep
DEFAULT_INTRA_BW = 10e9
"""Bytes/s a rank each way within a node unless the target gives its own (--intra-bw)."""
OUTPUTS = (tags.OUTPUT_FWD, tags.OUTPUT_BWD)
ROW_LISTS = {"replication": ("hot_rows",), "schedule": ("fae_rows",)}
"""The row lists a derived section's file carries (policy/<name>.parquet)."""


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
class Projection:
    """What `simulate` hands back beside its Result: the sections derived for the target, and their rows."""

    policy: Policy | None = None
    rows: dict[str, pl.DataFrame] = field(default_factory=dict)


@dataclass
class _Source:
    """The recording's side: its routed lookups on the target, its steps and their dense traffic."""

    routed: Routed
    looked: object
    steps: list[Step]
    batch: float
    compute_scale: float
    ring_bytes: float  # the dense gradients' all-reduce, bytes a rank a step (DDP's buckets and the rest)
    dp_buckets: int  # the DDP all-reduces a step
    notes: list[str]


# the projection ----------------------------------------------------------------------------------

def simulate(ctx: Context, target: Target, policy: Policy | None = None, policy_path=None, *,
             derive: bool = True, curve: bool = False, sweep: bool = True) -> tuple[Result, Projection]:
    """Tables `simulate` (the baseline and each section on `target`), with `sweep` `simulate_sweep` (over
    SWEEP_RATES) and with `curve` `simulate_scale` (SCALE_WORLDS), a summary and notes; and the sections
    derived for the target. `policy` (read from `policy_path`, which locates its row lists): project its
    sections as written; else `derive` them for the target (False: the baseline alone)."""
    result, projection = Result(), Projection()
    if target.world < 1:
        raise ValueError("the target needs at least one rank")
    missing = [t for t in ("comms", "steps", "lookups") if not ctx.has(t)]
    if missing:
        result.notes.append(f"the run has no {' or '.join(missing)} table: its exchange cannot be regrouped onto "
                            "another cluster (record with lookups: --lookup-every N)")
        return result, projection
    src = _source(ctx, target, result.notes)
    if src is None:
        return result, projection
    links = _links(ctx, target, result.notes)
    base = Case("baseline", exchange(src.routed))
    cases = [base]
    if policy is not None:
        cases += _as_written(ctx, src, policy, policy_path, result.notes)
    elif derive:
        derived, projection = _derived(ctx, src, links, base, result.notes)
        cases += derived
    combined = _combined(src, cases, policy)
    if combined is not None:
        cases.append(combined)
    rows = [_row(src, links, case, target) for case in cases]
    base_time = rows[0][STEP_TIME]
    for row, case in zip(rows, cases):
        row["speedup"] = base_time / row[STEP_TIME] if row[STEP_TIME] else None
        row["recommended"] = None if case is base else case.name == "combined" or _recommended(case, policy)
    if projection.policy is not None:
        _mark(projection, rows)
    result.tables = {"simulate": pl.DataFrame(rows)}
    if sweep:
        result.tables["simulate_sweep"] = _sweep(src, links, cases)
    if curve:
        result.tables["simulate_scale"] = scale_curve(ctx, target, policy, policy_path, derive=derive)
    result.notes.append("step times: the recorded steps replayed with every collective priced on the target's links "
                        f"(analyses/replay/target.py: latency {links.latency_s * 1e6:.0f} µs a collective, all-to-alls "
                        "per peer, all-reduces and all-gathers a ring), compute scaled with the batch")
    result.summary = {"target": {"topology": target.name, "world": target.world, "inter_bw": target.inter_bw,
                                 "intra_bw": links.intra, "batch_per_device": src.routed.on.batch,
                                 "latency_s": links.latency_s, "full_duplex": target.duplex,
                                 "sharding": src.routed.plan.kind, "compute_scale": target.compute_scale},
                      "source": {"world": ctx.model.world_size, "batch_per_device": src.batch,
                                 "samples": src.looked.samples, "target_steps_covered": src.routed.on.steps,
                                 "covered": src.routed.on.covered, "steps_replayed": len(src.steps)},
                      "method": "regrouped" if src.routed.on.covered else "regrouped, scaled",
                      "derived": policy is None and derive, "rows": rows}
    return result, projection


def scale_curve(ctx: Context, target: Target, policy: Policy | None = None, policy_path=None, *,
                derive: bool = True, worlds: tuple[int, ...] = SCALE_WORLDS) -> pl.DataFrame:
    """Each section's step time and speedup on `target`'s links at each world size of `worlds` (ranks per
    node as the target's, nodes as many as it takes), its sections derived there."""
    out = []
    for world in worlds:
        per_node = min(target.ranks_per_node, world)
        at = replace(target, nodes=max(world // per_node, 1), ranks_per_node=per_node)
        result, _ = simulate(ctx, at, policy, policy_path, derive=derive, sweep=False)
        for row in result.tables.get("simulate", pl.DataFrame()).iter_rows(named=True):
            out.append({"policy": row["policy"], "world": at.world, "topology": at.name, STEP_TIME: row[STEP_TIME],
                        "comm_s": row["comm_s"], "speedup": row["speedup"], A2A_BYTES: row[A2A_BYTES]})
    return pl.DataFrame(out)


def exchange_on(ctx: Context, target: Target, rows: Path | None = None) -> TargetExchange:
    """The exchange of one step on `target` (analyses.target_exchange) with the rows of the row list `rows`
    (a policy's Parquet: table_name, row) replicated; None: the baseline."""
    src = _source(ctx, target, [])
    if src is None:
        raise ValueError(f"{ctx.path}: no lookups or steps to regroup")
    return exchange(src.routed, None if rows is None else src.routed.rows_in(_keys(ctx, rows)))


def _source(ctx: Context, target: Target, notes: list[str]) -> _Source | None:
    looked = recorded_lookups(ctx)
    if not looked.samples or not len(looked.g):
        notes.append("the run's lookups hold no sample of a sharded table: nothing to regroup")
        return None
    steps_all = ctx.memo(_source, lambda: recorded_steps(ctx, notes))
    if not steps_all:
        notes.append("the run's steps do not replay: no step time projected")
        return None
    steps = _spaced(steps_all, PREDICT_STEPS)
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
    return _Source(routed, looked, steps, batch, target.compute_scale * new_batch / batch, ring, buckets, notes)


def _spaced(steps: list[Step], n: int) -> list[Step]:
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


def _links(ctx: Context, target: Target, notes: list[str]) -> TargetLinks:
    intra = target.intra_bw or DEFAULT_INTRA_BW
    if target.intra_bw is None and target.ranks_per_node > 1:
        notes.append(f"within a node: {DEFAULT_INTRA_BW / 1e9:g} GB/s a rank each way assumed (--intra-bw sets it; "
                     "no rate measured where the run was recorded is carried over)")
    latency = DEFAULT_LATENCY_S if target.latency_s is None else target.latency_s
    return TargetLinks(target.nodes, target.ranks_per_node, target.inter_bw * network.WIRE_EFFICIENCY, intra,
                       latency, target.duplex)


# time ------------------------------------------------------------------------------------------

def step_times(src: _Source, links: TargetLinks, case: Case, steps: list[Step] | None = None) -> np.ndarray:
    """Each replayed step's time on `links` under `case` (FAE: its hot and cold steps in their shares)."""
    steps = src.steps if steps is None else steps
    added = _added(src, links, case)
    cold = priced_steps(steps, _price(src, links, case), src.compute_scale, added)
    times = run_steps(cold, priced_links(cold))
    if case.hot_fraction > 0:
        hot = priced_steps(steps, _price(src, links, case), src.compute_scale, added, drop_exchange=True)
        times = (1 - case.hot_fraction) * times + case.hot_fraction * run_steps(hot, priced_links(hot))
    return times


def _price(src: _Source, links: TargetLinks, case: Case):
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


def _added(src: _Source, links: TargetLinks, case: Case) -> tuple[tuple[str, float], ...]:
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


def _free(src: _Source, links: TargetLinks, case: Case, steps: list[Step] | None = None) -> np.ndarray:
    """Each step with free communication (no latency, no wire time): its compute, and its ranks' waits on
    each other. What the links add beyond it is the step's communication."""
    return step_times(src, replace(links, inter=np.inf, intra=np.inf, latency_s=0.0), case, steps)


def _timed(src: _Source, links: TargetLinks, case: Case, steps: list[Step] | None = None,
           free: np.ndarray | None = None) -> tuple[float, float]:
    """The step (median over the steps) and its communication (the median of each step's time beyond its
    time with free communication, `free` where known)."""
    times = step_times(src, links, case, steps)
    free = _free(src, links, case, steps) if free is None else free
    return float(np.median(times)), float(np.median(np.maximum(times - free, 0.0)))


# bytes -----------------------------------------------------------------------------------------

def _row(src: _Source, links: TargetLinks, case: Case, target: Target) -> dict:
    w = links.world
    cold = case.step_exchange()
    share = 1.0 - case.hot_fraction
    a2a = share * cold.bytes_out * _ratio_of(case, cold)
    remote = share * cold.remote * _ratio_of(case, cold, remote=True)
    sync = case.x.syncs[case.sync] if case.sync is not None else None
    ring = 0.0 if case.dp_part is not None else src.ring_bytes
    dp = w * case.dp_part if case.dp_part is not None else 0.0
    step, comm = _timed(src, links, case)
    figures = {A2A_BYTES: a2a, A2A_REMOTE_BYTES: remote, ALLREDUCE_BYTES: ring * w,
               SYNC_BYTES: sync.wire if sync is not None else 0.0, DP_BYTES: dp}
    figures["bytes_per_step"] = a2a + ring * w + (sync.wire if sync is not None else 0.0) + dp
    return {"policy": case.name, "method": "regrouped" if src.routed.on.covered else "regrouped, scaled",
            "topology": target.name, "world": w, "batch_per_device": float(src.routed.on.batch),
            "inter_bw": target.inter_bw, "intra_bw": links.intra, "sync": case.sync,
            HOT_ROWS: 0 if case.hot_keys is None else len(case.hot_keys),
            HOT_SAMPLE_FRACTION: case.hot_fraction, **figures,
            "inter_node_bytes_per_step": _inter_bytes(links, cold, share, ring, sync, dp, case),
            "compute_s": step - comm, "comm_s": comm, STEP_TIME: step, "comm_share": comm / step if step else None,
            "speedup": None}


def _ratio_of(case: Case, x: TargetExchange, remote: bool = False) -> float:
    """DCT-MP's share of the exchange's bytes kept: the output rows at its ratio."""
    if case.output_ratio == 1.0:
        return 1.0
    def size(m: np.ndarray) -> float:
        return float(m.sum() - np.trace(m)) if remote else float(m.sum())
    total = sum(size(m) for m in x.pairs.values())
    kept = sum(size(m) * (case.output_ratio if c in OUTPUTS else 1.0) for c, m in x.pairs.items())
    return kept / total if total else 1.0


def _inter_bytes(links: TargetLinks, x: TargetExchange, share: float, ring: float, sync, dp: float,
                 case: Case) -> float:
    """Bytes a step that cross node boundaries: the exchange's, and each ring's edge leaving every node."""
    n, r = links.nodes, links.ranks_per_node
    if n < 2:
        return 0.0
    node = np.arange(links.world) // r
    cross = node[:, None] != node[None, :]
    moved = sum(float((m * (case.output_ratio if c in OUTPUTS else 1.0))[cross].sum()) for c, m in x.pairs.items())
    w = links.world
    edge = 2 * (w - 1) / w
    rings = edge * ring * n
    if sync is not None:
        rings += edge * sync.allreduce_bytes * n + (float(sync.ids[cross].sum()) if sync.ids is not None else 0.0)
    return share * moved + rings + dp * (w - 1) / w * n


# sections --------------------------------------------------------------------------------------

def _as_written(ctx: Context, src: _Source, policy: Policy, policy_path, notes: list[str]) -> list[Case]:
    """The file's sections that change what is sent, on the target."""
    out = []
    r = src.routed
    for label, section in policy.sections.items():
        if isinstance(section, Replication):
            mask = r.rows_in(_keys(ctx, row_path(policy_path, section.rows)))
            out.append(with_sync(replication(r, mask), section.sync))
        elif isinstance(section, Schedule):
            mask = r.rows_in(_keys(ctx, row_path(policy_path, section.hot_rows)))
            out.append(with_sync(schedule(r, mask), section.sync))
        elif isinstance(section, DctMp):
            out.append(_mp(src, section))
        elif isinstance(section, DctDp):
            out.append(_dp(src, section, ctx.model.world_size))
        elif label == "tiers":
            notes.append("tiers: not projected onto another cluster yet (their node copies are the recorded "
                         "topology's); the other sections are")
        elif label == "lag":
            notes.append("lag: not projected (it applies to inference; its makespan is the lag section's)")
    return out


def _keys(ctx: Context, path: Path) -> np.ndarray:
    frame = pl.read_parquet(path, columns=["table_name", "row"])
    tid = {t.name: i for i, t in enumerate(ctx.model.tables)}
    unknown = set(frame["table_name"].unique().to_list()) - set(tid)
    if unknown:
        raise ValueError(f"{path}: rows of tables the run does not have: {', '.join(sorted(unknown))}")
    tids = frame["table_name"].replace_strict(tid, return_dtype=pl.Int64).to_numpy()
    return tids << 40 | frame["row"].cast(pl.Int64).to_numpy()


def _mp(src: _Source, section: DctMp) -> Case:
    ratio = float(section.prediction.figures.get("ratio") or 1.0)
    return Case("compression.mp", exchange(src.routed), output_ratio=ratio)


def _dp(src: _Source, section: DctDp, recorded_world: int) -> Case:
    """DCT-DP: the bytes a rank sent a step where the run was analysed, gathered by every rank on the target."""
    sent = float(section.prediction.figures.get(DP_BYTES) or 0.0)
    return Case("compression.dp", exchange(src.routed), dp_part=sent / max(recorded_world, 1))


def _combined(src: _Source, cases: list[Case], policy: Policy | None) -> Case | None:
    """The recommended sections together (with a file: its recommended ones), as the trainer applies them:
    the union of replication's and the schedule's rows replicated (synchronised as the larger set says),
    the FAE schedule over that union where it is applied, DCT-MP on the outputs, DCT-DP on the dense
    gradients."""
    chosen = {c.name: c for c in cases[1:] if _recommended(c, policy)}
    if len(chosen) < 2:
        return None
    holding = [c for c in (chosen.get("replication"), chosen.get("schedule")) if c is not None]
    out = replace(cases[0], name="combined", notes=[])
    if holding:
        r = src.routed
        mask = r.rows_in(np.concatenate([c.hot_keys for c in holding]))
        larger = max(holding, key=lambda c: len(c.hot_keys))
        out = replication(r, mask, "combined") if "schedule" not in chosen else schedule(r, mask)
        out = replace(with_sync(out, larger.sync), name="combined")
    if "compression.mp" in chosen:
        out = replace(out, output_ratio=chosen["compression.mp"].output_ratio)
    if "compression.dp" in chosen:
        out = replace(out, dp_part=chosen["compression.dp"].dp_part)
    return out


def _recommended(case: Case, policy: Policy | None) -> bool:
    if policy is not None:
        section = policy.sections.get(case.name)
        return section is not None and section.recommended
    return "recommended" in case.notes


def _derived(ctx: Context, src: _Source, links: TargetLinks, base: Case,
             notes: list[str]) -> tuple[list[Case], Projection]:
    """Replication and the FAE schedule derived for the target, DCT's parts as the run's analysis set them
    (analyses.target_sections), each with the step the replay predicts."""
    r = src.routed
    probe = _spaced(src.steps, DERIVE_STEPS)
    def mean_step(case: Case) -> float:
        return float(np.median(step_times(src, links, case, probe)))
    base_s = mean_step(base)
    budget = _budget(ctx)
    order = ranked_rows(r)
    objective = ctx.options.objective
    tried: dict[int, tuple] = {}  # k -> replication's best merit, FAE's [(merit, sync)]
    best_rep: tuple | None = None  # (merit, case, k): the one case kept (a case holds W' × W' matrices)

    def merit(case: Case) -> float:
        return mean_step(case) if objective == "time" else _bytes_of(case)

    def hot_set(k: int) -> np.ndarray:
        mask = np.zeros(len(r.keys), dtype=bool)
        mask[order[:k]] = True
        return mask

    def at(k: int) -> None:
        nonlocal best_rep
        if k in tried:
            return
        mask = hot_set(k)
        rep = replication(r, mask)
        reps = [(merit(c), c) for c in (with_sync(rep, kind) for kind in sync_kinds(rep))]
        hot = schedule(r, mask, rep.x)
        # a schedule with fewer all-hot samples is replication by another name (tracekit.policy.nothing_to_apply)
        faes = ([(merit(c), c.sync) for c in (with_sync(hot, kind) for kind in sync_kinds(hot))]
                if hot.hot_fraction >= MIN_HOT_SAMPLES else [])
        best = min(reps, key=lambda m: m[0])
        tried[k] = (best[0], faes)
        if best_rep is None or best[0] < best_rep[0]:
            best_rep = (*best, k)

    grid = candidates(r, order, budget)
    for k in grid:  # a coarse grid, then finer between the best point's neighbours
        at(k)
    if grid:
        i = min(range(len(grid)), key=lambda j: tried[grid[j]][0])
        lo, hi = grid[max(i - 1, 0)], grid[min(i + 1, len(grid) - 1)]
        for k in np.unique(np.round(np.geomspace(lo, hi, REFINE_POINTS + 2)).astype(int))[1:-1]:
            at(int(k))
    # without a budget FAE's hot set is held to replication's, as analyze holds it (replica_budget)
    most = max(tried, default=0) if budget is not None or best_rep is None else best_rep[2]
    fae = min(((m, sync, k) for k in tried if k <= most for m, sync in tried[k][1]), key=lambda m: m[0], default=None)
    best_fae = None if fae is None else (fae[0], with_sync(schedule(r, hot_set(fae[2])), fae[1]), fae[2])
    cases = []
    for best in (best_rep, best_fae):
        if best is not None:
            case = best[1]
            gain = base_s / mean_step(case) - 1
            case.notes.append("recommended" if gain >= RECOMMEND_GAIN else
                              f"not recommended: predicted {gain:+.1%} on the step, under {RECOMMEND_GAIN:.0%}")
            cases.append(case)
    if best_rep is None:
        notes.append("replication: no row's lookups cross ranks on the target (or none fits the budget)")
    run_policy = _run_policy(ctx)
    for label, make in (("compression.mp", _mp), ("compression.dp", _dp)):
        section = run_policy.sections.get(label) if run_policy is not None else None
        if section is None:
            continue
        case = make(src, section) if label == "compression.mp" else make(src, section, ctx.model.world_size)
        gain = base_s / mean_step(case) - 1
        if gain < RECOMMEND_GAIN:
            case.notes.append(f"not recommended: predicted {gain:+.1%} on the step, under {RECOMMEND_GAIN:.0%}")
        elif not section.recommended:  # the run's analysis refused it (its quality), which no cluster changes
            case.notes.append(f"not recommended: {section.reason}")
        else:
            case.notes.append("recommended")
        cases.append(case)
    if run_policy is None:
        notes.append("compression: the run has no policy.json (tracekit analyze writes it with DCT's settings "
                     "within the quality its calibration measured): not projected")
    return cases, _policy_for(ctx, src, cases, run_policy)


def _budget(ctx: Context) -> float | None:
    o = ctx.options
    if o.budget_bytes is not None:
        return float(o.budget_bytes)
    if o.budget_fraction is not None:
        return o.budget_fraction * ctx.model.embedding_bytes
    return None


def _bytes_of(case: Case) -> float:
    share = 1.0 - case.hot_fraction
    sync = case.x.syncs[case.sync].wire if case.sync is not None else 0.0
    return share * case.step_exchange().bytes_out + sync


def _run_policy(ctx: Context) -> Policy | None:
    path = RunDir.at(ctx.path).policy
    return read_policy(path) if path.is_file() else None


def _policy_for(ctx: Context, src: _Source, cases: list[Case], run_policy: Policy | None) -> Projection:
    """The derived sections as a policy for the target's world (its predictions filled in by `_mark`)."""
    model = {"tables": ctx.model.policy_model()["tables"], "world_size": src.routed.world}
    sections: dict[str, Section] = {}
    rows: dict[str, pl.DataFrame] = {}
    names = [t.name for t in ctx.model.tables]
    for case in cases:
        recommended = "recommended" in case.notes
        reason = None if recommended else next((n.removeprefix("not recommended: ") for n in case.notes
                                                if n.startswith("not recommended")), None)
        decision = {"recommended": recommended, "reason": reason, "prediction": Prediction({}, "")}
        if case.name in ("replication", "schedule"):
            keys = case.hot_keys
            frame = pl.DataFrame({"table_name": [names[int(k >> 40)] for k in keys],
                                  "row": (keys & ((1 << 40) - 1)).astype(np.int64)})
            replica = int(case.x.syncs[case.sync].replica_bytes) if case.sync else 0
            if case.name == "replication":
                rows["hot_rows"] = frame
                sections["replication"] = Replication(kind="hybrid", rows="policy/hot_rows.parquet",
                                                      sync=case.sync or SPARSE, budget_bytes_per_rank=replica,
                                                      **decision)
            else:
                rows["fae_rows"] = frame
                sections["schedule"] = Schedule(hot_rows="policy/fae_rows.parquet", hot_sample_fraction=case.hot_fraction,
                                                sync=case.sync or SPARSE, budget_bytes_per_rank=replica, **decision)
        elif run_policy is not None and case.name in run_policy.sections:
            sections[case.name] = replace(run_policy.sections[case.name], **decision)
    policy = Policy(source_run=str(ctx.path), model=model, baseline={}, sections=sections)
    return Projection(policy, rows)


def _mark(projection: Projection, rows: list[dict]) -> None:
    """The derived policy's predictions and baseline, from the projection's rows."""
    shown = (A2A_BYTES, A2A_REMOTE_BYTES, ALLREDUCE_BYTES, SYNC_BYTES, DP_BYTES, STEP_TIME, HOT_ROWS,
             HOT_SAMPLE_FRACTION)
    by_name = {row["policy"]: row for row in rows}
    why = "projected by tracekit simulate: bytes of the recorded samples regrouped on the target, time replayed on its links"
    policy = projection.policy
    sections = {label: replace(section, prediction=Prediction({k: by_name[label][k] for k in shown}, why))
                for label, section in policy.sections.items() if label in by_name}
    combined = None
    if "combined" in by_name:
        labels = tuple(label for label, s in sections.items() if s.recommended)
        combined = Combined(labels, Prediction({k: by_name["combined"][k] for k in shown}, why))
    base = {k: by_name["baseline"][k] for k in shown if k not in (HOT_ROWS, HOT_SAMPLE_FRACTION)}
    projection.policy = replace(policy, sections=sections, combined=combined, baseline=base)


# sweep and files -------------------------------------------------------------------------------

def _sweep(src: _Source, links: TargetLinks, cases: list[Case]) -> pl.DataFrame:
    out = []
    probe = _spaced(src.steps, SWEEP_STEPS)
    free = {case.name: _free(src, links, case, probe) for case in cases}
    for rate in SWEEP_RATES:
        at = replace(links, inter=rate / 8 * network.WIRE_EFFICIENCY)
        timed = {case.name: _timed(src, at, case, probe, free[case.name]) for case in cases}
        for name, (step, comm) in timed.items():
            out.append({"policy": name, "inter_bw": rate / 8, "comm_s": comm, STEP_TIME: step,
                        "speedup": timed["baseline"][0] / step if step else None})
    return pl.DataFrame(out)


def write_sections(directory: Path, projection: Projection) -> list[Path]:
    """As `tracekit optimize` writes them: DIR/policy.<section>.json, one a section, and
    DIR/policy.combined.json with the recommended ones, their row lists in DIR/policy/."""
    policy = projection.policy
    written = []
    for label, section in policy.sections.items():
        one = replace(policy, sections={label: replace(section, recommended=True, reason=None,
                                                       extra={**section.extra, **({"not_recommended_because":
                                                              section.reason} if section.reason else {})})},
                      combined=None)
        rows = {name: projection.rows[name] for name in ROW_LISTS.get(label, ())}
        written.append(write_policy(directory / f"policy.{label}.json", one, rows))
    if policy.combined is not None:
        kept = {label: s for label, s in policy.sections.items() if label in policy.combined.sections}
        written.append(write_policy(directory / "policy.combined.json", replace(policy, sections=kept), projection.rows))
    return written


def project(path, target: Target, policy_path=None, *, derive: bool = True, write_dir: Path | None = None,
            curve: bool = False, options: Options | None = None) -> dict:
    """`tracekit simulate`: open the run at `path`, project it onto `target` with the policy file at
    `policy_path` as written (None: the sections derived for the target, or with `derive` False the
    baseline alone), write RUN/analysis/simulate*.parquet and simulate.json (and with `write_dir` the
    derived sections' policy files there), and return the summary with the notes."""
    options = replace(options or Options(), replay_steps=0)
    with open_context(path, options) as ctx:
        policy = None
        if policy_path is not None:
            policy = read_policy(policy_path)
            derived_for = int((policy.model or {}).get("world_size", ctx.model.world_size))
            check_model(policy, tables=ctx.model.policy_model()["tables"], path=policy_path,
                        world_size=target.world if derived_for == target.world else ctx.model.world_size)
        result, projection = simulate(ctx, target, policy, policy_path, derive=derive, curve=curve)
        summary = {"run": str(ctx.path), "policy": None if policy_path is None else str(policy_path),
                   **result.summary, "notes": result.notes, "written": []}
        for name, frame in result.tables.items():
            summary["written"].append(str(ctx.write(name, frame)))
        if "simulate_scale" not in result.tables:  # a curve of an earlier projection is not this one's
            (RunDir.at(ctx.path).analysis / "simulate_scale.parquet").unlink(missing_ok=True)
        if write_dir is not None:
            if projection.policy is None:
                summary["notes"].append(f"--write-policy {write_dir}: nothing derived to write")
            else:
                summary["written"].extend(str(p) for p in write_sections(Path(write_dir), projection))
        ctx.write_json("simulate", summary)
    return summary

"""What-if: a recorded run's training step projected onto another cluster (`tracekit simulate`).

From the run, each training step's communication by class of collective (exchange, ring, gather,
other) and its compute time (analyses.step_traffic's Traffic).

On a target of N nodes × R ranks (global rank r on node r // R; each node's link runs at `inter_bw`
each way, ranks within a node talk at `intra_bw`), per class and step:

    exchange  per tag, max( max_n link_n / inter_bw,  max_r intra_r / intra_bw )
              link_n = max(out_n, in_n): out_n, in_n the bytes node n sends to and receives from
              other nodes, both directions of a link at once (full duplex, the default);
              link_n = out_n + in_n with `duplex=False`, a bound for gloo's worst case: its TCP
              transport tells a peer it may send on the same stream as its own data, so when two
              ranks enter an exchange more than a few ms apart the later one's data crosses first
              and the earlier one's only after it (measured on `tracekit cluster`: the late rank's
              exchange then takes 2.0× its one-way time). The trainer's exchanges are lopsided
              (table-wise: most bytes go one way) and its async all-reduces use the idle direction,
              so full duplex is what its steps measure (bench/RESULTS.md §8).
              intra_r: the same for rank r's traffic within its node. Tags apart: the output
              all-to-all of a table-wise layout is lopsided one way, its backward the other.
    ring      a ring all-reduce: wire = 2(W−1)/W · S per rank to the next rank, one ring edge leaving
              each node: max(wire / inter_bw if N > 1, wire / intra_bw if R > 1); on gloo at W = 2
              the ring's two edges join the same pair, so twice that
    gather    an exchange of g from every rank to every other

    step time = compute · b'/b + Σ class times + α · collectives per step

with α the latency of one collective (`latency_s`, else the run's fitted α: analyses.network) and no
overlap of communication with compute (SCARS's t_iter = t_compute + t_comm). Between nodes the
link carries TCP over IPv4 on Ethernet at MTU 1500: 1448 payload bytes per 1514 bytes sent
(WIRE_EFFICIENCY), which is what a rate-limited link such as `tracekit cluster`'s delivers.

Bytes. At the run's own world size and batch they are exact: the baseline's are the recorded ones
and a policy's are its replayed `predicted` figures (analyses.exchange), and the network does not
change what is sent (method `replay`). At another world size or per-device batch they are scaled per
sample (method `scaled`). What the policy file's sections (replication, tiers, schedule) and DCT's
compression make of the step's bytes, and of their scaling, is analyses.projected_traffic's;
`combined` is every section together, compression applied after the exchange's replicas, as the
trainer applies them.

    result = simulate(ctx, Target(nodes=2, ranks_per_node=1, inter_bw=25e6), policy)
    result.tables["simulate"]         # policy | method | bytes and time per step | speedup
    result.tables["simulate_sweep"]   # policy | inter_bw | step_time_s | speedup
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import polars as pl

from analyses import network, roles
from analyses.context import Context, Result, open_context
from analyses.exchange_timing import sync_calls
from analyses.network import WIRE_EFFICIENCY, exchange_time, ring_time
from analyses.projected_traffic import (TIER2_TAG, replicated_pairs, scaled, section_rows, with_compression,
                                        with_policy)
from analyses.replay.change import Change
from analyses.replay.graph import Call, Step, ring_flows
from analyses.replay.links import Links
from analyses.replay.prediction import replay
from analyses.replay.simulation import run_steps
from analyses.step_traffic import Traffic, recorded
from analyses.traffic import A2A_OPS, GATHER_OPS
from tracekit import tags
from tracekit.figures import STEP_TIME
from tracekit.policy import load_policy, section_part
from tracekit.policy_model import check_model
from tracekit.topology import Topology

SIMULATED = ("replication", "tiers", "schedule")
"""policy.json sections whose predictions say what the exchange becomes."""
COMPRESSED = ("compression.dp", "compression.mp")
"""policy.json's compression parts, projected on top of the exchange."""
SWEEP_RATES = (10e6, 25e6, 50e6, 100e6, 200e6, 500e6, 1e9, 2.5e9, 10e9, 25e9, 100e9)
"""Inter-node link rates of the sweep, bits per second."""


@dataclass(frozen=True)
class Target(Topology):
    """The cluster projected onto: its topology and rates (bytes/s; None: taken from the run)."""

    inter_bw: float
    intra_bw: float | None = None
    batch: int | None = None  # per device
    latency_s: float | None = None
    duplex: bool = True  # both directions of a link at once; False: gloo's worst case (module docstring)



# time on the target ----------------------------------------------------------------------------

def comm_time(t: Traffic, target: Target, intra: float, latency: float) -> float:
    n, r, full = target.nodes, target.ranks_per_node, target.duplex
    inter = target.inter_bw * WIRE_EFFICIENCY
    gather = np.full((t.world, t.world), t.gather) - np.diag(np.full(t.world, t.gather))
    seconds = (sum(exchange_time(m, n, r, inter, intra, full) for m in t.exchange.values())
               + ring_time(t.ring, n, r, inter, intra, full)
               + exchange_time(gather, n, r, inter, intra, full))
    if t.sync_ring:
        seconds += ring_time(t.sync_ring, n, r, inter, intra, full)
    elif t.sync_wire:  # sparse: its wire bytes, evenly from every rank to every other
        per_pair = t.sync_wire / (t.world * (t.world - 1))
        sync = np.full((t.world, t.world), per_pair) - np.diag(np.full(t.world, per_pair))
        seconds += exchange_time(sync, n, r, inter, intra, full)
    if t.node_ring:  # the node copies' dense sync: each node's blocks in a ring of the nodes
        seconds += ring_time(t.node_ring, n, 1, inter, intra, full)
    elif t.node_wire and n > 1:  # sparse: evenly from every node to every other
        per_pair = t.node_wire / (n * (n - 1))
        seconds += exchange_time(np.full((n, n), per_pair) - np.diag(np.full(n, per_pair)), n, 1, inter, intra, full)
    return seconds + latency * t.calls


# the projection --------------------------------------------------------------------------------

def simulate(ctx: Context, target: Target, policy: dict | None = None, policy_path=None) -> Result:
    """Tables `simulate` (baseline and each policy section on `target`) and `simulate_sweep` (the
    same over SWEEP_RATES), and a summary; notes on what was scaled or left out. `policy_path`
    (where `policy` was read from) locates its row lists, for the exact per-pair replay."""
    result = Result()
    if target.world < 1:
        raise ValueError("the target needs at least one rank")
    if not ctx.has("comms"):
        result.notes.append("the run has no comms table: nothing to project")
        return result
    base, run = recorded(ctx)
    if run["compute_s"] is None:
        result.notes.append("the run has no steps table: compute time unknown, step times not projected")
    batch = run["batch"] or 0.0
    new_batch = float(target.batch or batch)
    same = target.world == ctx.model.world_size and abs(new_batch - batch) < 1e-9
    intra = target.intra_bw or _intra_bw(ctx, result.notes)
    latency = run["latency_s"] if target.latency_s is None else target.latency_s
    compute = None if run["compute_s"] is None else run["compute_s"] * (new_batch / batch if batch else 1.0)

    cases = [("baseline", base)]
    policy = policy or {}
    for name in SIMULATED:
        if name in policy:
            rows = section_rows(policy[name], name, policy_path) if ctx.has("lookups") else None
            freed = None if rows is None else replicated_pairs(ctx, rows)
            cases.append((name, with_policy(base, policy[name], freed)))
    exchanged = cases[1:]
    compressed = [(name, part) for name in COMPRESSED if (part := section_part(policy, name)) is not None]
    for name, part in compressed:
        cases.append((name, with_compression(base, name, part)))
    if len(exchanged) + len(compressed) > 1:  # as optimize's combined run: replication (or tiers) first
        combined = next((t for name, t in exchanged if name in ("replication", "tiers")), base)
        for name, part in compressed:
            combined = with_compression(combined, name, part)
        cases.append(("combined", combined))
    if "lag" in policy:
        result.notes.append("lag: not projected (it applies to inference; its makespan is the lag section's)")
    if not same:
        cases = [(name, scaled(t, batch, target, new_batch)) for name, t in cases]
        result.notes.append(f"world {ctx.model.world_size} → {target.world}, batch {batch:g} → {new_batch:g} per "
                            "device: bytes scaled per sample, spread evenly over the rank pairs; syncs dense")
    replayed = (_replayed(ctx, target, intra, dict(cases), base, new_batch / batch if batch else 1.0)
                if compute is not None else None)
    if replayed is not None:
        result.notes.append("step times: the recorded steps replayed on the target's links, each section's collectives "
                            "changed to its bytes (analyses/replay/)")
    rows, sweep = [], []
    base_time = None
    for name, t in cases:
        comm = comm_time(t, target, intra, latency)
        step = None if compute is None else compute + comm
        if replayed is not None and name in replayed:
            step = replayed[name]
            comm = max(step - compute, 0.0)
        base_time = step if name == "baseline" else base_time
        rows.append({"policy": name, "method": "replay" if same else "scaled", "topology": target.name,
                     "world": target.world, "batch_per_device": new_batch, "inter_bw": target.inter_bw,
                     "intra_bw": intra, **t.figures(), "inter_node_bytes_per_step": _inter_bytes(t, target),
                     "collectives_per_step": t.calls, "compute_s": compute, "comm_s": comm, STEP_TIME: step,
                     "comm_share": None if not step else comm / step,
                     "speedup": None if not step or not base_time else base_time / step})
        for rate in SWEEP_RATES:
            c = comm_time(t, replace(target, inter_bw=rate / 8), intra, latency)
            sweep.append({"policy": name, "inter_bw": rate / 8, "comm_s": c,
                          STEP_TIME: None if compute is None else compute + c})
    table = pl.DataFrame(rows)
    sweep_frame = pl.DataFrame(sweep)
    base_sweep = sweep_frame.filter(pl.col("policy") == "baseline").select("inter_bw", base=STEP_TIME)
    sweep_frame = sweep_frame.join(base_sweep, on="inter_bw").with_columns(
        (pl.col("base") / pl.col(STEP_TIME)).alias("speedup")).drop("base")
    result.tables = {"simulate": table, "simulate_sweep": sweep_frame}
    result.summary = {"target": {"topology": target.name, "world": target.world, "inter_bw": target.inter_bw,
                                 "intra_bw": intra, "batch_per_device": new_batch, "latency_s": latency,
                                 "wire_efficiency": WIRE_EFFICIENCY, "full_duplex": target.duplex},
                      "source": {"world": ctx.model.world_size, "batch_per_device": batch, **run},
                      "method": "replay" if same else "scaled", "rows": rows}
    return result


def _replayed(ctx: Context, target: Target, intra: float, cases: dict[str, Traffic], base: Traffic,
              compute_scale: float) -> dict | None:
    """Each case's step on `target` by the replay of the recorded steps on its links: the median over the
    steps. On the recorded world and batch each section's collectives are changed to its bytes (`_change`);
    on another, every rank runs a recorded rank's program (its compute scaled with the batch) and each
    collective carries the case's scaled bytes (`_projected`). None where the run does not replay; a case
    the replay cannot express (tier 2's exchange, a collective of a subgroup on another world) is left out."""
    rp = replay(ctx)
    if not rp.steps:
        return None
    source_one_node = len(set(rp.links.node_of)) == 1
    links = Links(tuple(r // target.ranks_per_node for r in range(target.world)),
                         target.inter_bw * WIRE_EFFICIENCY if target.nodes > 1 else np.inf,
                         target.intra_bw or (rp.links.intra if source_one_node else intra), rp.links.alpha)
    same = target.world == base.world and compute_scale == 1.0
    out = {}
    for name, t in cases.items():
        change = _change(t, base) if same else _sync_change(t)
        steps = rp.steps if same else _projected(rp.steps, t, base, target.world, compute_scale)
        if change is not None and steps:
            out[name] = float(np.median(run_steps(steps, links, change)))
    return out


def _projected(steps: list[Step], t: Traffic, source: Traffic, world: int,
               compute_scale: float) -> list[Step] | None:
    """The recorded steps on `world` ranks: rank r runs recorded rank r mod W's program and starts at its
    offset, its compute times `compute_scale`; each collective keeps its share of its class's recorded bytes
    (an all-to-all of its tag's, an all-reduce of the ring's, a gather of the gathers') of `t`'s bytes."""
    w = source.world
    out = []
    for s in steps:
        if any(len(c.ranks) != w for c in s.calls.values()):
            return None
        calls = {k: replace(c, ranks=tuple(range(world)), flows=_projected_flows(c, t, source, world), time_s=0.0,
                            entries=()) for k, c in s.calls.items()}
        programs = {r: [("compute", arg * compute_scale) if kind == "compute" else (kind, arg)
                        for kind, arg in s.programs[r % w]] for r in range(world)}
        out.append(Step(s.step, {r: s.start[r % w] for r in range(world)}, programs, calls, s.measured_s))
    return out


def _projected_flows(c: Call, t: Traffic, source: Traffic, world: int) -> np.ndarray:
    n = len(c.ranks)
    remote = float(c.flows.sum())
    key = roles.part(c.tag)
    if c.op in A2A_OPS and key in t.exchange:
        recorded = source.exchange.get(key)
        share = remote / (recorded.sum() - np.trace(recorded)) if recorded is not None and recorded.sum() else 0.0
        m = t.exchange[key] * share
        return m - np.diag(np.diag(m))
    if c.op == network.ALL_REDUCE and source.ring:
        return ring_flows(world, c.flows[0].sum() * n / (2 * (n - 1)) * t.ring / source.ring)  # S, scaled
    flows = np.zeros((world, world))
    if c.op in GATHER_OPS and source.gather:
        flows[:] = c.flows[0].max() * t.gather / source.gather
        np.fill_diagonal(flows, 0.0)
    return flows


def _sync_change(t: Traffic) -> Change | None:
    """The sync a case adds, as calls after the backward; None for what the graph has no place for."""
    if TIER2_TAG in t.exchange or t.node_wire:
        return None
    return Change(added=sync_calls(not t.sync_ring, t.sync_wire, t.world) if t.sync_wire else ())


def _change(t: Traffic, base: Traffic) -> Change | None:
    """A case's Traffic as a change of the recorded graph: each exchange collective scaled by its tag's bytes
    between ranks, the sync added as its calls, the dense gradients' bytes (ring, or DCT-DP's gathers)
    scaled; None for what the graph has no place for (tier 2's exchange, the node copies' sync)."""
    if TIER2_TAG in t.exchange or t.node_wire:
        return None
    def remote(m: np.ndarray) -> float:
        return float(m.sum() - np.trace(m))
    scale = {}
    for name in tags.EXCHANGE:
        key = roles.part(name)
        if key in base.exchange and remote(base.exchange[key]):
            scale[name] = remote(t.exchange.get(key, np.zeros_like(base.exchange[key]))) / remote(base.exchange[key])
    dense = ((t.ring + t.gather - base.gather) / base.ring) if base.ring else 1.0
    sync = sync_calls(not t.sync_ring, t.sync_wire, t.world) if t.sync_wire else ()
    return Change(scale, 0.0, sync, 0.0, dense)


UNMEASURED_INTRA_BW = 10e9
"""Bytes/s assumed within a node where the run cannot tell (no one-node run to measure it on)."""


def _intra_bw(ctx: Context, notes: list[str]) -> float:
    """Within a node: the run's fitted link (analyses.network) where its ranks shared one node;
    a run recorded across nodes measured its links instead, so UNMEASURED_INTRA_BW, said in a note."""
    if Topology.of_run(ctx.manifest, ctx.model.world_size).nodes > 1:
        notes.append(f"within a node: {UNMEASURED_INTRA_BW / 1e9:g} GB/s assumed (the run was recorded across nodes, "
                     "so it measured the links between them; --intra-bw sets it)")
        return UNMEASURED_INTRA_BW
    return network.network(ctx).fit.bandwidth or UNMEASURED_INTRA_BW


def _inter_bytes(t: Traffic, target: Target) -> float:
    """Bytes per step that cross node boundaries (exchange, gathers, rings, sync), all nodes."""
    if target.nodes < 2:
        return 0.0
    node = np.arange(t.world) // target.ranks_per_node
    cross = node[:, None] != node[None, :]
    w = t.world
    ring_wire = 2 * (w - 1) / w * (t.ring + t.sync_ring)
    gather = t.gather * float(cross.sum())
    sparse = t.sync_wire / (w * (w - 1)) * float(cross.sum()) if t.sync_wire and not t.sync_ring else 0.0
    return float((t.total_exchange * cross).sum()) + ring_wire * target.nodes + gather + sparse + t.node_wire


def project(path, target: Target, policy_path=None) -> dict:
    """`tracekit simulate`: open the run at `path`, project it onto `target` with the policy file at
    `policy_path` (None: the baseline only), write RUN/analysis/simulate.parquet,
    simulate_sweep.parquet and simulate.json, and return the summary with the notes."""
    with open_context(path) as ctx:
        policy = None
        if policy_path is not None:
            policy = load_policy(policy_path)
            check_model(policy, tables=ctx.model.policy_model()["tables"], world_size=ctx.model.world_size,
                        path=policy_path)
        result = simulate(ctx, target, policy, policy_path)
        summary = {"run": str(ctx.path), "policy": None if policy_path is None else str(policy_path),
                   **result.summary, "notes": result.notes, "written": []}
        for name, frame in result.tables.items():
            summary["written"].append(str(ctx.write(name, frame)))
        ctx.write_json("simulate", summary)
    return summary

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

    result, projection = simulate(ctx, Target(nodes=8, ranks_per_node=8, inter_bw=12.5e9))
    result.tables["simulate"]         # policy | bytes a step | compute, comm, step time | speedup
    result.tables["simulate_sweep"]   # policy | inter_bw | step_time_s | speedup
    projection.policy                 # the sections derived for the target (write_sections writes them)
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import polars as pl

from analyses import network
from analyses.context import Context, Options, Result, open_context
from analyses.replay.target import TargetLinks
from analyses.target_exchange import TargetExchange, exchange
from analyses.target_sections import (Projection, as_written, combined_case, derived, mark, recommended, row_keys,
                                      write_sections)
from analyses.target_time import OUTPUTS, Case, Source, Target, free_times, links_of, source, spaced, timed
from tracekit.figures import (A2A_BYTES, A2A_REMOTE_BYTES, ALLREDUCE_BYTES, DP_BYTES, HOT_ROWS,
                              HOT_SAMPLE_FRACTION, STEP_TIME, SYNC_BYTES)
from tracekit.policy import Policy, read_policy
from tracekit.policy_model import check_model
from tracekit.run_dir import RunDir

SWEEP_RATES = (10e6, 25e6, 50e6, 100e6, 200e6, 500e6, 1e9, 2.5e9, 10e9, 25e9, 100e9, 400e9)
"""Inter-node link rates of the sweep, bits per second."""
SCALE_WORLDS = (4, 8, 16, 32, 64, 128, 256, 512, 1024)
"""World sizes of the scale curve (`curve=True`), the target's ranks per node each."""
SWEEP_STEPS = 6  # recorded steps a point of the sweep replays


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
    src = source(ctx, target, result.notes)
    if src is None:
        return result, projection
    links = links_of(target, result.notes)
    base = Case("baseline", exchange(src.routed))
    cases = [base]
    if policy is not None:
        cases += as_written(ctx, src, policy, policy_path, result.notes)
    elif derive:
        found, projection = derived(ctx, src, links, base, result.notes)
        cases += found
    combined = combined_case(src, cases, policy)
    if combined is not None:
        cases.append(combined)
    rows = [_row(src, links, case, target) for case in cases]
    base_time = rows[0][STEP_TIME]
    for row, case in zip(rows, cases):
        row["speedup"] = base_time / row[STEP_TIME] if row[STEP_TIME] else None
        row["recommended"] = None if case is base else case.name == "combined" or recommended(case, policy)
    if projection.policy is not None:
        mark(projection, rows)
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
    src = source(ctx, target, [])
    if src is None:
        raise ValueError(f"{ctx.path}: no lookups or steps to regroup")
    return exchange(src.routed, None if rows is None else src.routed.rows_in(row_keys(ctx, rows)))


# time ------------------------------------------------------------------------------------------

# bytes -----------------------------------------------------------------------------------------

def _row(src: Source, links: TargetLinks, case: Case, target: Target) -> dict:
    w = links.world
    cold = case.step_exchange()
    share = 1.0 - case.hot_fraction
    a2a = share * cold.bytes_out * _ratio_of(case, cold)
    remote = share * cold.remote * _ratio_of(case, cold, remote=True)
    sync = case.x.syncs[case.sync] if case.sync is not None else None
    ring = 0.0 if case.dp_part is not None else src.ring_bytes
    dp = w * case.dp_part if case.dp_part is not None else 0.0
    step, comm = timed(src, links, case)
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

# the sweep and the command -------------------------------------------------------------------------------

def _sweep(src: Source, links: TargetLinks, cases: list[Case]) -> pl.DataFrame:
    out = []
    probe = spaced(src.steps, SWEEP_STEPS)
    free = {case.name: free_times(src, links, case, probe) for case in cases}
    for rate in SWEEP_RATES:
        at = replace(links, inter=rate / 8 * network.WIRE_EFFICIENCY)
        by_case = {case.name: timed(src, at, case, probe, free[case.name]) for case in cases}
        for name, (step, comm) in by_case.items():
            out.append({"policy": name, "inter_bw": rate / 8, "comm_s": comm, STEP_TIME: step,
                        "speedup": by_case["baseline"][0] / step if step else None})
    return pl.DataFrame(out)


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

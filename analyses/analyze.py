"""`tracekit analyze`: every analysis and policy of DESIGN.md §6 over one run, in order, and what
it writes: `RUN/analysis/*.parquet`, `RUN/analysis/summary.json` (the summary it returns),
`RUN/policy.json` and `RUN/policy/*.parquet`.

    summary = analyze("runs/base", Options(budget_fraction=0.05), progress=print)
    summary["policies"]["replication"]["predicted"]

Each analysis runs only where the run holds what it needs (a run without `lookups` still gets skew,
traffic, timeline and cache); what cannot be computed is listed with the reason, never an error.
Policies come from training rows only; evaluation traffic is reported beside them. Their times
come from one model fitted to the run (analyses.network, in `summary["network"]`); analyses.decision
then marks each section recommended or not (with the reason) and predicts the recommended ones
together (`combined`); the cost model's checks run last, on what the policies derived.
"""

from __future__ import annotations

import importlib
import os
import time
from typing import Any, Protocol

from analyses.context import Background, Context, Options, PolicyResult, Result, open_context
from analyses.decision import decide
from analyses.network import network
from analyses.replay.prediction import replay, together
from analyses.row_totals import kept_file
from analyses.time_left import TimeLeft, expected_seconds
from tracekit.policy import Policy, Section, row_list, write_policy
from tracekit.losses import loss_warning, lost_rows
from tracekit.run_dir import RunDir

ANALYSES: dict[str, tuple[str, tuple[str, ...]]] = {
    # name: (module, trace tables it needs)
    "skew": ("analyses.skew", ("accesses",)),
    "traffic": ("analyses.traffic", ("comms",)),
    "timeline": ("analyses.timeline", ("steps",)),
    "cache": ("analyses.cache", ("accesses",)),
    "planner": ("analyses.planner", ("accesses",)),  # asks analyses.cache for its curves (replayed once)
    "torchrec_plan": ("analyses.torchrec_plans", ("lookups", "comms")),  # a TorchRec run's plan (torchrec_plan.json)
}
COSTMODEL = ("analyses.costmodel", ("lookups", "comms"))


class Progress(Protocol):
    """Told as each phase begins: its name and the seconds expected from there to the end."""

    def __call__(self, phase: str, left_s: float | None = None) -> None: ...
"""After the policies: its checks read what they derived."""
POLICIES: dict[str, str] = {
    "replication": "analyses.policies.replication",
    "tiers": "analyses.policies.tiers",
    "schedule": "analyses.policies.schedule",
    "compression": "analyses.policies.compression",
    "lag": "analyses.policies.lag",
}


def _analysis(ctx: Context, summary: dict, name: str, module: str, needs: tuple[str, ...],
              progress: Progress, clock: TimeLeft, **kwargs: Any) -> None:
    """Run one analysis into `summary` and write its tables; a note where the run lacks its tables."""
    progress(name, clock.start(name))
    missing = [t for t in needs if not ctx.has(t)]
    if missing:
        summary["notes"].append(f"{name}: not computed, the run has no {' or '.join(missing)} table")
        return
    result: Result = importlib.import_module(module).compute(ctx, **kwargs)
    if result.summary:  # an analysis with nothing to compute says why in its notes
        summary["analyses"][name] = result.summary
    summary["notes"].extend(f"{name}: {note}" for note in result.notes)
    for table, frame in result.tables.items():
        summary["written"].append(str(ctx.write(table, frame)))


def planner(path: str | os.PathLike) -> dict[str, Any]:
    """The TorchRec planner inputs of the run at `path` alone (analyses.planner): writes
    analysis/planner.parquet and analysis/torchrec_constraints.json (replaying the caches for
    their curves); returns its summary with the frame's rows and the snippet that loads them."""
    from analyses import planner as inputs

    with open_context(path) as ctx:
        result = inputs.compute(ctx)
        written = [str(ctx.write(table, frame)) for table, frame in result.tables.items()]
    return {"run": str(ctx.path), **result.summary, "notes": result.notes, "written": written,
            "rows": result.tables["planner"].to_dicts() if "planner" in result.tables else [],
            "snippet": inputs.snippet(result.summary["constraints"]) if result.summary else None}


def phases(ctx: Context) -> dict[str, float]:
    """The phases `analyze` goes through on this run after opening it, in order, with the seconds each
    is expected to take (analyses.time_left; 0 where the run lacks the tables it needs)."""
    written = ctx.manifest.written_rows or {}  # the recorder's count: no scan of the trace
    rows = int(written.get("accesses", 0)) + int(written.get("lookups", 0))
    needs = {name: needs for name, (_, needs) in ANALYSES.items()}
    needs.update({f"policy: {name}": () for name in POLICIES if name in ctx.options.policies})
    needs["costmodel"] = COSTMODEL[1]
    return {name: expected_seconds(name, rows) if all(ctx.has(t) for t in tables) else 0.0
            for name, tables in {"open": (), **needs}.items()}


def analyze(path: str | os.PathLike, options: Options | None = None,
            progress: Progress = lambda phase, left_s=None: None, calibration: Background | None = None) -> dict[str, Any]:
    """Run every analysis and policy over the run at `path`, write their tables and policy.json, and
    return the summary (JSON-able): run, warnings, analyses, policies, notes, written files. A
    `calibration` starts once the rows' counts are kept and runs beside the analyses until the time
    model reads its file (analyses.network)."""
    options = options or Options()
    started = time.perf_counter()
    with open_context(path, options, memory_limit=options.memory_limit) as ctx:
        clock = TimeLeft(phases(ctx), started)
        summary: dict[str, Any] = {"run": str(ctx.path), "status": ctx.manifest.status, "warnings": [],
                                   "analyses": {}, "policies": {}, "not_derived": {}, "notes": [], "written": []}
        if ctx.manifest.status != "completed":
            summary["warnings"].append(f"the run is {ctx.manifest.status} (exit code "
                                       f"{ctx.manifest.exit_code}): figures cover what was recorded")
        if ctx.truncated_at is not None:
            summary["warnings"].append(f"the trace is incomplete (manifest `truncated_at`: a write failed, e.g. a full "
                                       f"disk): only steps up to {ctx.truncated_at}, which every rank wrote whole, "
                                       "are analysed")
        lost = lost_rows(ctx.manifest)
        if lost and ctx.truncated_at is None:
            summary["warnings"].append(loss_warning(lost, ctx.manifest.lost_lookups))
        if not ctx.window.everything:
            summary["warnings"].append(f"accesses, lookups and comms were recorded on {ctx.window.describe()} "
                                       "(record --steps/--every): every figure is over those steps")
        if calibration is not None:
            ctx.calibrating = calibration
            calibration.start(kept_file(ctx))
        for name, (module, needs) in ANALYSES.items():
            _analysis(ctx, summary, name, module, needs, progress, clock)
        net = network(ctx)
        summary["network"] = net.summary()
        rp = replay(ctx)
        if rp.steps:
            summary["replay"] = rp.summary()
        baseline = {}
        if ctx.has("comms"):
            from analyses import traffic

            baseline = {k: v for k, v in traffic.baseline(ctx).items() if v is not None}
        sections: dict[str, Section] = {}
        rows: dict[str, Any] = {}
        results: dict[str, PolicyResult] = {}
        for name, module in POLICIES.items():
            if name not in ctx.options.policies:
                continue
            progress(f"policy: {name}", clock.start(f"policy: {name}"))
            derived: PolicyResult = importlib.import_module(module).derive(ctx)
            results[name] = derived
            for table, frame in derived.tables.items():
                summary["written"].append(str(ctx.write(table, frame)))
            if not derived.sections():
                summary["not_derived"][name] = derived.reason
                continue
            sections.update(derived.sections())
            rows.update(derived.rows)
        policy = decide(Policy(str(ctx.path), ctx.model.policy_model(), baseline, sections), net,
                        ctx.options.quality_budget, together(ctx))
        as_json = policy.to_json()
        for name, derived in results.items():
            if derived.sections():
                summary["policies"][name] = {**as_json[name], "evidence": derived.evidence}
        if policy.combined is not None:
            summary["combined"] = as_json["combined"]
        _analysis(ctx, summary, "costmodel", *COSTMODEL, progress, clock, policies=results)
        if ctx.model.tables:
            target = write_policy(RunDir.at(ctx.path).policy, policy, rows)
            summary["written"].append(str(target))
            summary["written"].extend(str(row_list(target, name)) for name in rows)
        else:
            summary["notes"].append("policy.json: not written, the manifest lists no embedding tables")
        summary["baseline"] = baseline
        if calibration is not None and (note := calibration.wait()):
            summary["notes"].append(note)
        ctx.write_json("summary", summary)  # the report reads what could not be derived, and why, from here
    return summary

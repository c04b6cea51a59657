"""`tracekit optimize`: the whole loop in one library call (DESIGN.md §1).

    DIR/base            the command recorded as given (lookups on every step, so predictions are exact)
    DIR/quality-*       a lossy section (DCT compression, the FAE schedule) alone at a setting and a seed,
                        where analyze would recommend it on time but its model-quality cost is not measured: the
                        calibration runs of tracekit/app/quality_runs.py, after which the baseline is
                        analysed again with what they measured (BASE/analysis/quality.json)
    DIR/base/policy.json and one file per recommended training section: policy.<section>.json
    DIR/<section>       the command re-run with `--policy DIR/base/policy.<section>.json`
    DIR/combined        ... with the recommended sections together, where there are several: what the policy
                        file applies (policy.combined.json, which keeps policy.json's `combined` prediction for
                        `compare` to check); the sections --check-all re-runs unrecommended run alone only
    DIR/replication     where tiers across nodes are re-run, replication alone beside them (what
                        FlexShard's tiers are measured against), recommended or not

then the comparison of DIR/base with DIR/<section> ... DIR/combined and its report, DIR/report.html.
The command must take `--policy PATH` as its last option (the reference trainer's train.py does),
unless it is a TorchRec job: then analyze's derived plan (DIR/base/torchrec_plan.json) is what is
re-run, DIR/torchrec_plan (and with --check-all its quantized-comms variant, DIR/torchrec_plan_qcomms),
the command unchanged and the plan injected (`record --plan`).
Each run's output goes to DIR/<name>.log; `progress` hears which step is going. With a `cluster`
topology every run is recorded on that emulated cluster (`tracekit cluster`) of the plain command.

    result = optimize(["torchrun", ..., "train.py", "--steps", "300"], Path("runs/opt"), Options())
    result.summary     # compare's summary, with the notes on the sections left out and why
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

from tracekit.app import cluster as emulated
from tracekit import manifest
from tracekit.app import quality_runs, recording
from tracekit.app.console_record import describe_record
from tracekit.errors import TracekitError
from tracekit.app.loop import analyze_run, compare_runs, write_report
from tracekit.policy import TRAINING, Policy, Section, Tiers, nothing_to_apply, read_policy, write_policy
from tracekit.torchrec_plan import PLAN_FILE, QCOMMS_PLAN_FILE, from_manifest, read_plan
from tracekit.run_dir import RunDir


class OptimizeError(TracekitError):
    """The loop could not go on: the baseline failed, or no policy run completed."""

    exit_code = 1


@dataclass
class Optimized:
    """What `optimize` did: the baseline, the policy runs that completed, the notes on what was left
    out and why, and compare's summary (None where nothing was re-run)."""

    base: Path
    runs: list[Path] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    summary: dict[str, Any] | None = None


def optimize(command: list[str], out_dir: Path, options: Any, *, lookup_every: int = 1,
             cluster: emulated.Cluster | None = None, check_all: bool = False, dct_replay: bool = False,
             progress: Callable[[str], None] = lambda what: None) -> Optimized:
    """Record `command` into OUT/base, analyse it (`options`: analyses.context.Options), re-run it
    with each section worth a run (`check_all`: the sections analyze did not recommend too) and
    their combination, and compare them with the baseline."""
    out_dir.mkdir(parents=True, exist_ok=True)
    base = out_dir / "base"
    progress(f"recording the baseline into {base} (log {out_dir / 'base.log'})")
    code = record(base, command, out_dir / "base.log", lookup_every=lookup_every, cluster=cluster, dct_replay=dct_replay)
    if code != 0:
        raise OptimizeError(f"the baseline run failed (exit code {code}); its output is in {out_dir / 'base.log'}")
    analyze_run(base, options, report=False, progress=lambda step, left_s=None: progress(f"analysing the baseline: {step}", left_s))
    if cluster is not None:  # the report's speedup against the link rate
        from analyses.simulate import Target, project

        progress("analysing the baseline: simulate")
        policy = RunDir.at(base).policy
        project(base, Target(cluster.nodes, cluster.ranks_per_node, cluster.link_bytes_per_s),
                policy if policy.is_file() else None, derive=False)
    calibrated = []
    if not (base / PLAN_FILE).exists():
        calibrated = quality_runs.calibrate(
            command, base, out_dir, options.quality_budget, progress=progress,
            record=lambda run_dir, run_command, log: record(run_dir, run_command, log, lookup_every=lookup_every,
                                                            cluster=cluster, dct_replay=dct_replay))
        if calibrated:
            analyze_run(base, options, report=False,
                        progress=lambda step, left_s=None: progress(f"analysing the baseline again: {step}", left_s))
    progress("analysing the baseline: done")
    if (base / PLAN_FILE).exists():
        plans, notes = torchrec_reruns(base, from_manifest(manifest.read(base)), checked=check_all)
    else:
        plans, notes = reruns(RunDir.at(base).policy, checked=check_all)
    notes = [*calibrated, *notes]
    result = Optimized(base, notes=notes)
    for i, rerun in enumerate(plans, 1):
        log = out_dir / f"{rerun.name}.log"
        progress(f"re-running with {rerun.name} ({i}/{len(plans)}; log {log})")
        code = record(out_dir / rerun.name, command if rerun.plan else [*command, "--policy", str(rerun.policy)], log,
                      lookup_every=lookup_every, cluster=cluster, dct_replay=dct_replay,  # same tracing: times compare
                      plan=rerun.policy if rerun.plan else None)
        if code == 0:
            result.runs.append(out_dir / rerun.name)
        else:
            notes.append(f"{rerun.name}: the run failed (exit code {code}); see {log}")
    if not plans:
        return result
    if not result.runs:
        raise OptimizeError("no policy run completed: " + "; ".join(notes))
    progress("comparing")
    summary = compare_runs(base, result.runs)
    summary["notes"] = [*notes, *summary.get("notes", [])]
    try:
        summary["report"] = str(write_report([base, *result.runs], RunDir.at(out_dir).report))
    except Exception as err:  # the runs and the comparison are done; a report bug must not hide them
        summary["report"] = f"not written ({type(err).__name__}: {err})"
    result.summary = summary
    return result


@dataclass(frozen=True)
class Rerun:
    name: str  # a section, "combined", or "torchrec_plan"
    policy: Path  # the policy file the command is given (--policy), or the TorchRec plan (record --plan)
    plan: bool = False  # a TorchRec plan: the command runs unchanged, the plan injected


def torchrec_reruns(base: Path, own: dict, *, checked: bool = False) -> tuple[list[Rerun], list[str]]:
    """The re-runs of a TorchRec job: analyze's derived plan (torchrec_plan.json) where it differs
    from the job's `own` plan and is recommended, and with `checked` where it is not, and then its
    quantized-comms variant too (torchrec_plan.qcomms.json, never recommended: its loss is measured
    so); a note on each left out and why."""
    plans, notes = [], ["a TorchRec job: tracekit's policy sections apply to its reference trainer; its derived "
                        "plan is re-run instead"]
    for name, path in (("torchrec_plan", base / PLAN_FILE), ("torchrec_plan_qcomms", base / QCOMMS_PLAN_FILE)):
        if not path.exists():
            continue
        plan = read_plan(path)
        if plan["tables"] == own["tables"] and not plan.get("qcomms"):
            notes.append(f"{name} not re-run: the job's own plan ({plan.get('why')})")
        elif plan.get("recommended") or checked:
            plans.append(Rerun(name, path, plan=True))
            if not plan.get("recommended"):
                notes.append(f"{name} re-run although not recommended, to check the decision ({plan.get('why')})")
        else:
            notes.append(f"{name} not re-run: {plan.get('why')}")
    return plans, notes


def reruns(policy_path: Path, *, checked: bool = False) -> tuple[list[Rerun], list[str]]:
    """One policy file per recommended training section worth a run (beside policy.json, so row paths
    hold), and one for their combination: exactly the recommended sections, what `train.py --policy
    policy.json` applies; with notes on the sections left out and why. `checked`: re-run the sections
    analyze did not recommend as well, each alone (marked recommended in its own file), so that the
    measurement checks the decision."""
    policy = read_policy(policy_path)
    chosen, notes, rerun = [], [], dict(policy.sections)
    recommended = [label for label in TRAINING if label in policy.sections and not _why_not(policy.sections[label])]
    for label in TRAINING:
        section = policy.sections.get(label)
        if section is None:
            continue
        reason = _why_not(section)
        if reason and checked and not section.recommended and not _why_not(replace(section, recommended=True)):
            notes.append(f"{label} re-run although not recommended, to check the decision ({section.reason})")
            rerun[label] = replace(section, recommended=True, reason=None,
                                   extra={**section.extra, "not_recommended_because": section.reason})
            reason = None
        if reason:
            notes.append(f"{label} not re-run: {reason}")
            continue
        chosen.append(label)
    if "lag" in policy.sections:
        notes.append("lag not re-run: it applies to inference (train.py --inference --policy FILE), optimize re-runs training")
    beside = _replication_beside_tiers(policy, chosen)
    if beside is not None:  # FlexShard's claim is against replication alone: measure both
        notes = [n for n in notes if not n.startswith("replication not re-run")]
        notes.append(f"replication re-run beside tiers, to compare with them (not recommended: {beside.reason})")
        rerun["replication"] = replace(beside, recommended=True, reason=None,
                                       extra={**beside.extra, "not_recommended_because": beside.reason})
    policy = replace(policy, sections=rerun)
    plans = [Rerun(label, _write_sections(policy_path, policy, [label]))
             for label in chosen + (["replication"] if beside is not None else [])]
    if len(recommended) > 1:
        plans.append(Rerun("combined", _write_sections(policy_path, policy, recommended, "combined")))
    return plans, notes


def _replication_beside_tiers(policy: Policy, chosen: list[str]) -> Section | None:
    """The replication section, where tiers across nodes are re-run and it is not: what the tiers
    are measured against."""
    tiers, replication = policy.sections.get("tiers"), policy.sections.get("replication")
    if ("tiers" not in chosen or "replication" in chosen or replication is None
            or not isinstance(tiers, Tiers) or int(tiers.topology.get("nodes", 1)) < 2):
        return None
    return replication if nothing_to_apply(replication) is None else None


def _why_not(section: Section) -> str | None:
    if not section.recommended:
        return f"not recommended ({section.reason})"
    if isinstance(section, Tiers) and section.topology.get("nodes", 1) == 1:
        return "one node: the tiers are the replication section"
    return nothing_to_apply(section)


def _write_sections(policy_path: Path, policy: Policy, labels: list[str], name: str | None = None) -> Path:
    """policy.<name>.json: the sections `labels` of `policy`; its `combined` only in the combined file."""
    kept = replace(policy, sections={label: policy.sections[label] for label in labels},
                   combined=policy.combined if name == "combined" else None)
    target = policy_path.with_name(f"policy.{name or labels[0]}.json")
    write_policy(target, kept.to_json())
    return target


def record(run_dir: Path, command: list[str], log: Path, *, lookup_every: int,
           cluster: emulated.Cluster | None = None, dct_replay: bool = False, plan: Path | None = None) -> int:
    """`command` recorded into `run_dir` (replacing what is there) with its output, and the
    recording's closing lines, in `log`; the exit code. With `cluster`, `command` (plain
    `python train.py ...`) runs on every rank of that emulated cluster; with `plan`, a TorchRec
    job's plan is injected (record --plan)."""
    recording.check_command(command)
    recording.prepare_run_dir(run_dir, force=True)
    with open(log, "w") as out:
        if cluster is None:
            code = recording.record(command, run_dir, lookup_every=lookup_every, dct_replay=dct_replay, output=out,
                                    plan=plan)
        else:
            code = emulated.record(command, cluster, run_dir, lookup_every=lookup_every, dct_replay=dct_replay,
                                   plan=plan, output=out,
                                   say=lambda line: print(f"tracekit cluster: {line}", file=out, flush=True))
        print(describe_record(recording.summary(run_dir, manifest.read(run_dir))), file=out)
    return code

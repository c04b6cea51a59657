"""Each compared run's predictions against what it measured (analyses.compare): the sections of the
policy it applied, their combination and the policy's baseline, or the TorchRec plan it was recorded
with, as rows of `compare_policy`.

    policy, info, warnings = applied_policy(m)
    rows = policy_rows(m, policy, base, notes) + plan_rows(m, base)

Policies. A run that applied one names it in manifest `policy` ({"path", "sha256", "applied",
"skipped"}; runs recorded before the trainer named its sections applied every section present). The
file is loaded with tracekit.policy.load_policy; a missing file, another sha256, an invalid file or
one for another model is a warning, and what can be compared still is. Each section the run applied
(replication, tiers, schedule, compression.dp/.mp, lag) gives rows of predicted against measured for
the figures it predicts (a note names each section skipped, with why): a2a_bytes_per_step,
a2a_remote_bytes_per_step, sync_bytes_per_step, dp_bytes_per_step, total_bytes_per_step
(predicted: a2a + sync, sync 0 where the section predicts none), total_remote_bytes_per_step,
step_time_s, makespan_s (lag: the recurrence's over the steps after the warm-up, against the run's
`timed_makespan_s`, the slowest rank's time over the same steps from its `steps` rows),
eval_auc_change and eval_logloss_rel_change (a lossy section's, against the run's manifest
`metrics` less BASE's), and the savings against BASE's measured figures (the baseline used
throughout):

    saving         predicted 1 − predicted total / BASE total,  measured 1 − run total / BASE total
    remote_saving  the same with total_remote_bytes_per_step

diff = measured − predicted; diff_pct = diff / predicted (0 where both are 0, null where only the
prediction is). kind is `estimated` where the figure rests on a figure the section gives an interval
for (`intervals`), with predicted_low/predicted_high the same formulas at the intervals' ends; else
`exact`, with no interval. A run that applied several sections measures all of them at once against
each section's own prediction (a note says so), and against the policy's `combined` prediction, in
rows of section "combined", where that names exactly the sections applied. The policy's
`baseline` is shown as section "baseline" against BASE's measured figures: a check that the policy
was derived from a run like BASE. A predicted step time is the source run's median over every step
plus the change in communication time; the measured one skips the warm-up steps.
"""

from __future__ import annotations

import hashlib
import math
from pathlib import Path
from typing import Any

import polars as pl

from analyses import quality
from analyses.measure import EMBEDDING, Measured
from tracekit.errors import PolicyMismatch
from tracekit.figures import (A2A_BYTES, A2A_REMOTE_BYTES, ALLREDUCE_BYTES, AUC_CHANGE, DP_BYTES, HOT_STEP_FRACTION,
                              INTER_BYTES, INTRA_BYTES, LOGLOSS_CHANGE, STEP_TIME, SYNC_BYTES)
from tracekit.policy import PolicyError, load_policy, sections
from tracekit.policy_model import check_model


def applied_policy(m: Measured) -> tuple[dict | None, dict | None, list[str]]:
    """(the policy file the run applied, or None; what the manifest says of it with a status;
    warnings). A changed file is still used; a missing, invalid or foreign one gives no predictions."""
    ref = m.manifest.policy
    if not ref:
        return None, None, []
    path = Path(ref.get("path") or "")
    if not path.is_absolute():
        path = Path(m.manifest.cwd or ".") / path
    info = {"path": str(path), "sha256": ref.get("sha256"), "status": "verified"}
    if not path.is_file():
        info["status"] = "missing"
        return None, info, [f"{m.name} applied the policy {path}, which is missing: no predictions to compare"]
    warnings = []
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if digest != ref.get("sha256"):
        info["status"] = "changed"
        warnings.append(f"{m.name} applied {path} with sha256 {str(ref.get('sha256'))[:12]}…, the file now has "
                        f"{digest[:12]}…: it was rewritten after the run; its predictions now are shown")
    try:
        policy = load_policy(path)
        check_model(policy, tables=[t.to_json() for t in m.manifest.tables or ()],
                    world_size=int(m.manifest.world_size or 1), path=path)
    except PolicyMismatch as err:
        info["status"] = "another model"
        return None, info, [*warnings, f"{m.name}: {err}"]
    except PolicyError as err:
        info["status"] = "invalid"
        return None, info, [*warnings, f"{m.name}: {err}"]
    applied = ref.get("applied")  # None: recorded before the trainer named them, when it applied every one
    info["sections"] = list(applied) if applied is not None else [label for label, _ in sections(policy)]
    info["skipped"] = ref.get("skipped") or {}
    return policy, info, warnings


def policy_rows(m: Measured, policy: dict, base: Measured, notes: list[str]) -> list[dict]:
    """Predicted against measured for each section the run applied, their combination and the
    policy's baseline (module docstring)."""
    measured = {**{k: m.figures.get(k) for k in (*EMBEDDING, DP_BYTES, STEP_TIME, INTRA_BYTES, INTER_BYTES)},
                "makespan_s": m.figures["timed_makespan_s"],  # inference runs: the lag section's figure
                **savings(m.figures, base.figures),
                **quality.changes(m.figures["metrics"], base.figures["metrics"]),
                HOT_STEP_FRACTION: hot_step_fraction(m.steps)}
    bodies, applied = dict(sections(policy)), m.figures["policy"]["sections"]
    checked = [(label, bodies[label]) for label in applied if label in bodies]
    notes += [f"{m.name} skipped {label}: {why}" for label, why in m.figures["policy"]["skipped"].items()]
    if len(checked) > 1:
        combined = policy.get("combined")
        if combined is not None and sorted(combined["sections"]) == sorted(applied):
            checked.append(("combined", combined))
            joint = "; section combined is the policy's prediction for them together"
        else:
            joint = ("; the policy has no prediction for them together" if combined is None else
                     f"; the policy's combined prediction is for {', '.join(combined['sections'])}, not compared")
        notes.append(f"{m.name} applied {', '.join(applied)} together: each section's rows are its own prediction "
                     f"against the measurement of all of them{joint}")
    rows = []
    for label, body in checked:
        intervals = predicted_intervals(body, base.figures)
        rows += [row(m.name, label, figure, value, measured.get(figure), intervals.get(figure))
                 for figure, value in predicted_figures(body.get("predicted") or {}, base.figures).items()]
    baseline = {A2A_BYTES: A2A_BYTES, ALLREDUCE_BYTES: ALLREDUCE_BYTES,
                STEP_TIME: STEP_TIME}
    rows += [row(m.name, "baseline", key, policy["baseline"][key], base.figures.get(ours))
             for key, ours in baseline.items() if _number(policy.get("baseline", {}).get(key))]
    return rows


PLAN_FIGURES = (A2A_BYTES, A2A_REMOTE_BYTES, ALLREDUCE_BYTES, STEP_TIME)


def plan_rows(m: Measured, base: Measured) -> list[dict]:
    """Predicted against measured for a TorchRec plan the run was recorded with (`record --plan`; the
    manifest keeps the plan as it was read, analyses/torchrec_plans.py's predictions in it)."""
    plan = (m.manifest.torchrec_plan or {}).get("plan") or {}
    predicted = plan.get("predicted") or {}
    intervals = plan.get("intervals") or {}
    section = "torchrec_plan.qcomms" if plan.get("qcomms") else "torchrec_plan"
    rows = [row(m.name, section, figure, float(predicted[figure]), m.figures.get(figure),
                tuple(intervals[figure]) if figure in intervals else None)
            for figure in PLAN_FIGURES if _number(predicted.get(figure))]
    rows += [row(m.name, section, f"{figure}_saving", 1 - float(predicted[figure]) / base.figures[figure],
                 1 - m.figures[figure] / base.figures[figure])
             for figure in (A2A_REMOTE_BYTES, STEP_TIME)
             if _number(predicted.get(figure)) and base.figures.get(figure) and m.figures.get(figure) is not None]
    return rows


def hot_step_fraction(steps: pl.DataFrame) -> float | None:
    """The share of a scheduled run's steps that were hot (FAE; None without a schedule column)."""
    kinds = steps["schedule"].drop_nulls()
    return float((kinds == "hot").mean()) if len(kinds) else None


def predicted_figures(predicted: dict, base: dict) -> dict[str, float]:
    """The figures a section predicts, with totals and savings derived as the module docstring says."""
    out = {k: float(predicted[k]) for k in (*EMBEDDING[:3], INTRA_BYTES, INTER_BYTES, DP_BYTES, STEP_TIME,
                                            "makespan_s", HOT_STEP_FRACTION, AUC_CHANGE, LOGLOSS_CHANGE)
           if _number(predicted.get(k))}
    sync = out.get(SYNC_BYTES, 0.0)
    if A2A_BYTES in out:
        out["total_bytes_per_step"] = out[A2A_BYTES] + sync
    if A2A_REMOTE_BYTES in out:
        out["total_remote_bytes_per_step"] = out[A2A_REMOTE_BYTES] + sync
    out.update(savings(out, base))
    return out


def predicted_intervals(body: dict, base: dict) -> dict[str, tuple[float, float]]:
    """(low, high) of each figure predicted_figures derives from `body` that rests on an estimate (a
    figure of its `intervals`): the same formulas at the intervals' low ends and at their high ends,
    ordered (every derived figure moves one way with all the estimates it sums). Figures left out are
    exact."""
    intervals = body.get("intervals") or {}
    predicted = body.get("predicted") or {}  # a hand-written section may predict nothing
    ends = [predicted_figures(predicted | {k: pair[i] for k, pair in intervals.items()}, base) for i in (0, 1)]
    unknown = predicted_figures(predicted | {k: math.nan for k in intervals}, base)
    return {k: (min(ends[0][k], ends[1][k]), max(ends[0][k], ends[1][k])) for k, v in unknown.items() if math.isnan(v)}


def savings(figures: dict, base: dict) -> dict[str, float]:
    """saving and remote_saving of `figures` against BASE's measured totals, where both exist."""
    out = {}
    for name, key in (("saving", "total_bytes_per_step"), ("remote_saving", "total_remote_bytes_per_step")):
        if _number(figures.get(key)) and base.get(key):
            out[name] = 1 - figures[key] / base[key]
    return out


def row(run: str, section: str, figure: str, predicted: float, measured: float | None,
        interval: tuple[float, float] | None = None) -> dict:
    unit = ("bytes" if figure.endswith("bytes_per_step") else "s" if figure.endswith("_s")
            else "auc" if figure == AUC_CHANGE else "relative" if figure == LOGLOSS_CHANGE else "fraction")
    diff = None if measured is None else measured - predicted
    diff_pct = None if diff is None else diff / predicted if predicted else 0.0 if diff == 0 else None
    low, high = interval or (None, None)
    return {"run": run, "section": section, "figure": figure, "unit": unit,
            "kind": "exact" if interval is None else "estimated", "predicted": predicted, "predicted_low": low,
            "predicted_high": high, "measured": measured, "diff": diff, "diff_pct": diff_pct}


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


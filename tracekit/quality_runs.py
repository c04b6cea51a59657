"""Calibration runs of the lossy sections' model-quality cost, which `tracekit optimize` makes
(analyses.quality says how `analyze` uses them).

For each lossy section that analyze would recommend on time but whose cost is not measured, the
recorded command is re-run with that section alone, at settings from the most compressive up,
until one keeps the quality budget. compression.mp tries K = ⌈5% · D⌉, then twice that, and so on
below D (at most MP_POINTS runs), as a fraction of the rows' D values; compression.dp, the keep
ratio analyze derived from the DCT-DP replay (a larger one is not derived from the trace); the
schedule, its hot set as derived. Each run is recorded like optimize's re-runs
(OUT/quality-<label>-<setting>); what its eval AUC and log loss did against the baseline's goes to
BASE/analysis/quality.json. The runs are as long as the recorded
one, so a point is the cost of that command at that setting, measured, not extrapolated.

    notes = calibrate(command, base, out_dir, budget, record=..., progress=print)
"""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path
from typing import Callable

from analyses import quality
from tracekit import recording
from tracekit.policy import DctMp, Policy, read_policy, write_policy

MP_POINTS = 4
"""compression.mp's calibration runs at most (K, 2K, 4K, 8K values a row)."""


def pending(policy: Policy) -> list[str]:
    """The lossy sections whose only bar to a recommendation is their unmeasured quality cost."""
    return [label for label in quality.LOSSY if (section := policy.sections.get(label)) is not None
            and not section.recommended and (section.reason or "").startswith(quality.NOT_MEASURED)]


def ladder(label: str, policy: Policy) -> list[float]:
    """The settings (analyses.quality.SETTING) to try for `label`, most compressive first."""
    section = policy.sections[label]
    if not isinstance(section, DctMp):
        return [float(getattr(section, quality.SETTING[label]))]
    dims = {int(t["dim"]) for t in (policy.model or {}).get("tables", [])}
    if len(dims) != 1:
        return [float(section.keep_ratio)]
    dim = dims.pop()
    k = max(1, math.ceil(0.05 * dim - 1e-9))
    keeps = []
    while k < dim and len(keeps) < MP_POINTS:
        keeps.append(k / dim)
        k *= 2
    return keeps or [1.0]


def calibrate(command: list[str], base: Path, out_dir: Path, budget: quality.Budget,
              record: Callable[[Path, list[str], Path], int],
              progress: Callable[[str], None] = lambda what: None, labels: list[str] | None = None) -> list[str]:
    """Run the calibration (module docstring) for BASE's lossy sections `labels` (default: those
    `pending`) and write BASE/analysis/quality.json; the notes on what ran and what was found.
    `record(run_dir, command, log)` records one run and gives its exit code."""
    policy = read_policy(base / "policy.json")
    labels = pending(policy) if labels is None else labels
    if not labels:
        return []
    baseline = recording.read_manifest(base).get("metrics") or {}
    if not any(isinstance(baseline.get(k), (int, float)) for k in ("eval_auc", "eval_logloss")):
        return [f"{', '.join(labels)}: model quality not calibrated, the run reports no eval_auc or eval_logloss "
                "(tracekit.metrics); not recommended"]
    points, notes = [], []
    for label in labels:
        settings = ladder(label, policy)
        for i, setting in enumerate(settings, 1):
            name = f"quality-{label.replace('.', '-')}-{setting:.4g}"
            section = replace(policy.sections[label], recommended=True, reason=None)
            if isinstance(section, DctMp):
                section = replace(section, keep_ratio=setting)
            path = base / f"policy.{name}.json"
            write_policy(path, replace(policy, sections={label: section}, combined=None).to_json())
            log = out_dir / f"{name}.log"
            at = f"{quality.SETTING[label].replace('_', ' ')} {setting:.2%}"
            progress(f"measuring the model-quality cost of {label} at {at} ({i}/{len(settings)}; log {log})")
            code = record(out_dir / name, [*command, "--policy", str(path)], log)
            if code != 0:
                notes.append(f"{label}: the calibration run at {at} failed (exit code {code}); see {log}")
                break
            metrics = recording.read_manifest(out_dir / name).get("metrics") or {}
            point = quality.point_of(label, setting, str(out_dir / name), _steps(out_dir / name), metrics, baseline)
            points.append(point)
            over = budget.exceeded_by(point)
            notes.append(f"{label} at {at}: {quality.describe_change(point)} measured"
                         f" ({'within' if over is None else 'over'} the quality budget, {budget.describe()})")
            if over is None:
                break
    quality.write(base, points)
    return notes


def _steps(run: Path) -> int | None:
    """The steps the run's ranks recorded (the manifest's `steps`, by rank), the most of them."""
    steps = recording.read_manifest(run).get("steps") or {}
    counts = [n for n in steps.values() if isinstance(n, int)] if isinstance(steps, dict) else []
    return max(counts) if counts else None

"""Calibration runs of the lossy sections' model-quality cost, which `tracekit optimize` makes
(analyses.quality says how `analyze` uses them).

For each lossy section that analyze would recommend on time but whose cost is not measured, the
recorded command is re-run with that section alone, at settings from the most compressive up,
until one keeps the quality budget. compression.mp tries K = ⌈5% · D⌉, then twice that, and so on
below D (at most MP_POINTS runs), as a fraction of the rows' D values; compression.dp, the keep
ratios of the trace's gradient statistics and replay (tracekit.schema.KEEP_RATIOS) from the one
analyze derived, at the derived refresh period; the schedule, its hot set as derived. Each setting runs at SEEDS seeds: the command as given (against
the recorded baseline) and with `--seed N` appended (against the baseline re-run at that seed,
OUT/quality-baseline-seedN); a command that takes no `--seed` is calibrated at one seed, and says so.
Each run is recorded like optimize's re-runs (OUT/quality-<label>-<setting>[-seedN]); what its eval
AUC and log loss did against its baseline's goes to BASE/analysis/quality.json. The runs are as
long as the recorded one: a point is the cost of that command at that setting over those seeds.

    notes = calibrate(command, base, out_dir, budget, record=..., progress=print)
"""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path
from typing import Callable

from analyses import quality
from tracekit import manifest
from tracekit.policy import DctDp, DctMp, Policy, Prediction, read_policy, write_policy
from tracekit.schema import KEEP_RATIOS
from tracekit.run_dir import RunDir

MP_POINTS = 4
"""compression.mp's settings at most (K, 2K, 4K, 8K values a row)."""
SEEDS = 3
"""Seeds each setting runs at (the command as given, then with --seed 1 and --seed 2), and the
baseline too: one seed's AUC change is not the cost (analyses.quality)."""


def pending(policy: Policy) -> list[str]:
    """The lossy sections whose only bar to a recommendation is their unmeasured quality cost."""
    return [label for label in quality.LOSSY if (section := policy.sections.get(label)) is not None
            and not section.recommended and (section.reason or "").startswith(quality.NOT_MEASURED)]


def ladder(label: str, policy: Policy) -> list[float]:
    """The settings (analyses.quality.SETTING) to try for `label`, most compressive first."""
    section = policy.sections[label]
    if isinstance(section, DctDp):  # the keep ratios the trace's statistics and replay hold, from the derived one
        return [keep for keep in sorted(KEEP_RATIOS.values()) if keep >= section.keep_ratio - 1e-12] or [
            section.keep_ratio]
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
              progress: Callable[[str], None] = lambda what: None, labels: list[str] | None = None,
              seeds: int = SEEDS) -> list[str]:
    """Run the calibration (module docstring) for BASE's lossy sections `labels` (default: those
    `pending`) at `seeds` seeds and write BASE/analysis/quality.json; the notes on what ran and what
    was found. `record(run_dir, command, log)` records one run and gives its exit code."""
    policy = read_policy(RunDir.at(base).policy)
    labels = pending(policy) if labels is None else labels
    if not labels:
        return []
    baselines = {0: manifest.read(base).metrics or {}}
    if not any(isinstance(baselines[0].get(k), (int, float)) for k in ("eval_auc", "eval_logloss")):
        return [f"{', '.join(labels)}: model quality not calibrated, the run reports no eval_auc or eval_logloss "
                "(tracekit.metrics); not recommended"]
    notes: list[str] = []

    def seeded(seed: int) -> list[str]:
        return command if seed == 0 else [*command, "--seed", str(seed)]

    def run(name: str, run_command: list[str], what: str) -> dict | None:
        """Record one run; its manifest metrics, or None (with a note) where it failed."""
        log = out_dir / f"{name}.log"
        progress(f"{what} (log {log})")
        code = record(out_dir / name, run_command, log)
        if code != 0:
            notes.append(f"{what}: the run failed (exit code {code}); see {log}")
            return None
        return manifest.read(out_dir / name).metrics or {}

    for seed in range(1, seeds):  # the baseline at each further seed, the recorded run being seed 0
        metrics = run(f"quality-baseline-seed{seed}", seeded(seed), f"the baseline at seed {seed}")
        if metrics is None:
            notes.append(f"model quality calibrated at {len(baselines)} seed(s): the command at --seed {seed} failed")
            break
        baselines[seed] = metrics
    points = []
    for label in labels:
        settings = ladder(label, policy)
        for i, setting in enumerate(settings, 1):
            name = f"quality-{label.replace('.', '-')}-{setting:.4g}"
            section = replace(policy.sections[label], recommended=True, reason=None)
            if isinstance(section, (DctDp, DctMp)) and setting != section.keep_ratio:
                # analyze's prediction is for its own keep ratio: the section at another is as if hand-written
                section = replace(section, keep_ratio=setting, prediction=Prediction({}, ""))
            path = base / f"policy.{name}.json"
            write_policy(path, replace(policy, sections={label: section}, combined=None).to_json())
            at = f"{quality.SETTING[label].replace('_', ' ')} {setting:.2%}"
            done = []
            for seed, baseline in baselines.items():
                run_name = name if seed == 0 else f"{name}-seed{seed}"
                what = f"measuring the model-quality cost of {label} at {at} ({i}/{len(settings)}), seed {seed}"
                metrics = run(run_name, [*seeded(seed), "--policy", str(path)], what)
                if metrics is not None:
                    done.append(quality.seed_of(seed, str(out_dir / run_name), metrics, baseline))
            if not done:
                break
            point = quality.point_of(label, setting, _steps(Path(done[0]["run"])), done)
            points.append(point)
            parsed = quality.load_point(point)
            over = budget.exceeded_by(parsed.figures(), parsed.intervals())
            verdict = ("within the quality budget at every seed" if over is None
                       else "over the quality budget at its worst seed")
            notes.append(f"{label} at {at}: {quality.describe_change(parsed.figures(), parsed.intervals())} over "
                         f"{len(done)} seed(s), {verdict} ({budget.describe()})")
            if over is None:
                break
    quality.write(base, points)
    return notes


def _steps(run: Path) -> int | None:
    """The steps the run's ranks recorded (the manifest's `steps`, by rank), the most of them."""
    steps = manifest.read(run).steps or {}
    counts = [n for n in steps.values() if isinstance(n, int)] if isinstance(steps, dict) else []
    return max(counts) if counts else None

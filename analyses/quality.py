"""The model-quality cost of the lossy sections (DCT's compression.dp and compression.mp, FAE's
schedule), and the budget a recommended one must keep.

A trace holds bytes and times, not what sparsifying gradients or embedding outputs, or batching hot
samples apart, does to the model, so the cost is measured: `tracekit optimize`
(tracekit/app/quality_runs.py) re-runs the recorded command with each lossy section alone (DCT's at keep
ratios from the most compressive up) and writes what the runs' eval AUC and log loss did against the
baseline's to RUN/analysis/quality.json. A point's `setting` is the value of the section's SETTING
field it ran with (DCT's keep ratio; the schedule's share of all-hot samples, which names its hot set):

    {"schema": "tracekit.quality/1",
     "points": [{"section": "compression.mp", "setting": 0.0625, "steps": 400,
                 "seeds": [{"seed": 0, "run": ..., "eval_auc", "eval_logloss", "baseline_eval_auc",
                            "baseline_eval_logloss", "eval_auc_change", "eval_logloss_rel_change"}, ...]}, ...]}

Each seed's change is against the baseline at the same seed (the recorded run is seed 0, the
command as given; the others are the command re-run with `--seed N`); `eval_logloss_rel_change` is
relative to the baseline's log loss. One seed's change is not the cost: on the Criteo Kaggle layout
the same section moved AUC by −0.0003 at one seed and −0.0038 at another (bench/RESULTS.md §32). So a
point's prediction is the mean over its seeds, its interval their range, and the budget must hold at
the interval's worst end. `analyze` reads the file: a DCT section takes the most compressive measured
keep ratio within the budget, and each lossy section predicts the change measured at its setting.
Without a measurement a lossy section states that its cost is not known and is not recommended;
one whose measured cost exceeds the budget is not recommended either (analyses.decision).

The budget (`analyze --quality-budget`): by default an eval AUC loss of at most 0.002 and a relative
rise of eval log loss of at most 1%, each where the runs measured it ("0.001,2%" changes both; a bound
not given keeps its default).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TypeVar

from tracekit.errors import TracekitError
from tracekit.figures import AUC_CHANGE, LOGLOSS_CHANGE
from tracekit.files import write_text
from tracekit.policy import Prediction, Section
from tracekit.run_dir import RunDir

SCHEMA = "tracekit.quality/1"
FILE = "quality.json"  # in RUN/analysis/
SETTING = {"compression.dp": "keep_ratio", "compression.mp": "keep_ratio", "schedule": "hot_sample_fraction"}
"""The lossy sections (they change what the model computes, so their cost is measured here), each with
the field that sets how much: a point measured at another value of it is another section."""
LOSSY = tuple(SETTING)
S = TypeVar("S", bound=Section)
NOT_MEASURED = "its model-quality cost is not measured"
UNSTABLE = "the calibration seeds spread wider than twice the budget, so another seed's cost is not known to within it"
AUC_BUDGET = 0.002
LOSS_BUDGET = 0.01


class QualityError(TracekitError):
    """A quality budget or a quality.json that cannot be read."""


@dataclass(frozen=True)
class Budget:
    """The most a lossy section may cost: an eval AUC loss of at most `auc` and a relative rise of eval
    log loss of at most `loss`, each where the runs measured its metric (None: no such bound). A user who
    serves click probabilities pays for a worse log loss even where the ranking, and so the AUC, holds:
    one section moved AUC by +0.0006 and log loss by +24% (bench/RESULTS.md §38)."""

    auc: float | None = AUC_BUDGET
    loss: float | None = LOSS_BUDGET

    @staticmethod
    def parse(text: str) -> Budget:
        """Comma-separated bounds: a number the AUC loss ('0.002'), a percentage the log loss's relative rise
        ('1%'); a bound not given keeps its default. ValueError saying what was expected."""
        bounds: dict[str, float] = {}
        for part in (p.strip() for p in text.split(",")):
            try:
                value = float(part.rstrip("%"))
            except ValueError:
                value = math.nan
            key = "loss" if part.endswith("%") else "auc"
            if not math.isfinite(value) or value < 0 or key in bounds:
                raise ValueError(f"expected an eval AUC loss such as 0.002 and/or a relative log-loss rise such as "
                                 f"1%, comma-separated, got {text!r}")
            bounds[key] = value / 100 if key == "loss" else value
        return Budget(**bounds)

    def describe(self) -> str:
        parts = ([] if self.auc is None else [f"an eval AUC loss of at most {self.auc:g}"]) + \
            ([] if self.loss is None else [f"an eval log-loss rise of at most {self.loss:.2%}"])
        return " and ".join(parts) or "no bound"

    def exceeded_by(self, figures: dict[str, Any], intervals: dict[str, Any] | None = None) -> str | None:
        """Why a predicted change (AUC_CHANGE; LOGLOSS_CHANGE, relative) is beyond the budget, naming the
        bound it breaks; None within every bound its runs measured. Where `intervals` give the change's
        range over the calibration seeds, its worst end must keep each bound (every seed measured did),
        and the range must be at most twice the bound wide: on 60-step runs one section's AUC change ran
        from +0.008 to +0.055 over three seeds and +0.015 at a fourth (bench/RESULTS.md §32b), a cost the
        mean does not predict to within the budget, whichever way it goes."""
        spans = intervals or {}
        measured = False
        for figure, bound, name, fmt in ((AUC_CHANGE, self.auc, "eval AUC", "+.4f"),
                                         (LOGLOSS_CHANGE, self.loss, "eval log loss", "+.2%")):
            value = figures.get(figure)
            if bound is None or value is None:
                continue
            measured = True
            auc = figure == AUC_CHANGE
            span = spans.get(figure, [value, value])
            shown = f"{name} {_with_range(value, spans.get(figure), fmt)}"
            worst = -min(value, *span) if auc else max(value, *span)  # the worst end, as a cost
            if worst > bound:
                return f"{shown}, beyond the quality budget's {f'-{bound:g}' if auc else f'+{bound:.2%}'}"
            if span[1] - span[0] > 2 * bound:
                return f"{shown}: {UNSTABLE} ({f'{2 * bound:g}' if auc else f'{2 * bound:.2%}'})"
        return None if measured else f"{NOT_MEASURED} (`tracekit optimize` measures it with calibration runs)"


def _with_range(value: float, span: Any, fmt: str) -> str:
    return f"{value:{fmt}}" if not span else f"{value:{fmt}} [{span[0]:{fmt}}, {span[1]:{fmt}}]"


@dataclass(frozen=True)
class Point:
    """A lossy section alone at `setting` (SETTING), run at one or more seeds: what the eval metrics did
    against the baseline's at the same seed, each seed's change (`auc_changes`, `logloss_changes`,
    the latter relative), their mean the prediction and their range its interval."""

    section: str
    setting: float
    runs: tuple[str, ...]
    steps: int | None
    auc_changes: tuple[float, ...]
    logloss_changes: tuple[float, ...]

    def figures(self) -> dict[str, float | None]:
        return {AUC_CHANGE: _mean(self.auc_changes), LOGLOSS_CHANGE: _mean(self.logloss_changes)}

    def intervals(self) -> dict[str, list[float]]:
        """The range over the seeds, where more than one ran."""
        return {figure: [min(values), max(values)] for figure, values in
                ((AUC_CHANGE, self.auc_changes), (LOGLOSS_CHANGE, self.logloss_changes)) if len(values) > 1}

    def describe(self) -> str:
        steps = f"{self.steps} steps" if self.steps else "the run's steps"
        at = f"{SETTING[self.section].replace('_', ' ')} {self.setting:.2%}"
        seeds = max(len(self.auc_changes), len(self.logloss_changes))
        spread = f", over {seeds} seeds" if seeds > 1 else ", one seed"
        return f"{describe_change(self.figures(), self.intervals())} measured at {at} ({steps}{spread}; {self.runs[0]})"


def _mean(values: tuple[float, ...]) -> float | None:
    return sum(values) / len(values) if values else None


@dataclass(frozen=True)
class Calibration:
    """What RUN/analysis/quality.json holds: the points measured, by section."""

    points: tuple[Point, ...]

    def of(self, section: str) -> list[Point]:
        """The section's points, most compressive first."""
        return sorted((p for p in self.points if p.section == section), key=lambda p: p.setting)

    def choose(self, section: str, budget: Budget) -> Point | None:
        """The most compressive point within `budget`; else the least compressive measured (which the
        decision then refuses, saying by how much it is over); None where nothing was measured."""
        points = self.of(section)
        within = [p for p in points if budget.exceeded_by(p.figures(), p.intervals()) is None]
        return within[0] if within else (points[-1] if points else None)

    def at(self, section: str, setting: float) -> Point | None:
        return next((p for p in self.of(section) if math.isclose(p.setting, setting, rel_tol=1e-9)), None)


def source(chosen: Point, budget: Budget) -> str:
    """Where a setting Calibration.choose gave came from, for a section's `why`."""
    if budget.exceeded_by(chosen.figures(), chosen.intervals()) is None:
        return f"the most compressive measured within {budget.describe()} (analysis/quality.json)"
    return "the least compressive measured (analysis/quality.json); none kept the quality budget"


def describe_change(figures: dict[str, Any], intervals: dict[str, Any] | None = None) -> str:
    """'eval AUC -0.0012 [-0.0020, -0.0003], eval log loss +0.31%' of a point's or a prediction's figures."""
    auc, loss = figures.get(AUC_CHANGE), figures.get(LOGLOSS_CHANGE)
    spans = intervals or {}
    parts = ([] if auc is None else [f"eval AUC {_with_range(auc, spans.get(AUC_CHANGE), '+.4f')}"]) + \
        ([] if loss is None else [f"eval log loss {_with_range(loss, spans.get(LOGLOSS_CHANGE), '+.2%')}"])
    return ", ".join(parts) or "no eval metrics"


def attach(section: S, label: str, calibration: Calibration | None, evidence: dict) -> S:
    """`section` with its predicted model-quality change from the calibration run at its setting (null
    where none ran), saying where it came from in its `why` and in `evidence["quality"]`."""
    point = None if calibration is None else calibration.at(label, float(getattr(section, SETTING[label])))
    p = section.prediction
    figures = {**p.figures, **(point.figures() if point else {AUC_CHANGE: None, LOGLOSS_CHANGE: None})}
    intervals = {**p.intervals, **{k: tuple(v) for k, v in (point.intervals() if point else {}).items()}}
    why = p.why + (f"; model quality: {point.describe()}" if point else
                   "; model quality: not measured (the trace cannot say; `tracekit optimize` measures it with "
                   "calibration runs)")
    measured = [] if calibration is None else calibration.of(label)
    evidence["quality"] = {
        "source": "analysis/quality.json (calibration runs of the recorded command)" if measured else "not measured",
        "points": [{SETTING[label]: p.setting, **p.figures(), "intervals": p.intervals(), "runs": list(p.runs),
                    "steps": p.steps} for p in measured]}
    return replace(section, prediction=Prediction(figures, why, intervals))


def load(run: str | Path) -> Calibration | None:
    """RUN/analysis/quality.json, or None where no calibration was run."""
    path = RunDir.at(run).analysis / FILE
    if not path.is_file():
        return None
    try:
        body = json.loads(path.read_text())
        if body.get("schema") != SCHEMA:
            raise ValueError(f"schema {body.get('schema')!r}, expected {SCHEMA!r}")
        return Calibration(tuple(load_point(p) for p in body["points"]))
    except (ValueError, KeyError, TypeError) as err:
        raise QualityError(f"{path}: not a quality calibration ({err}); delete it, or re-run `tracekit optimize`") from None


def load_point(body: dict) -> Point:
    """A quality.json point (point_of) as a Point."""
    seeds = body["seeds"]
    return Point(str(body["section"]), float(body["setting"]), tuple(str(s["run"]) for s in seeds), body.get("steps"),
                 tuple(float(s[AUC_CHANGE]) for s in seeds if s.get(AUC_CHANGE) is not None),
                 tuple(float(s[LOGLOSS_CHANGE]) for s in seeds if s.get(LOGLOSS_CHANGE) is not None))


def changes(metrics: dict, baseline: dict) -> dict[str, float | None]:
    """What a run's manifest `metrics` did against the baseline's: AUC_CHANGE (eval AUC, difference),
    LOGLOSS_CHANGE (eval log loss, relative); None where either lacks the metric."""
    auc, base_auc = metrics.get("eval_auc"), baseline.get("eval_auc")
    loss, base_loss = metrics.get("eval_logloss"), baseline.get("eval_logloss")
    return {AUC_CHANGE: auc - base_auc if _finite(auc) and _finite(base_auc) else None,
            LOGLOSS_CHANGE: loss / base_loss - 1 if _finite(loss) and _finite(base_loss) and base_loss else None}


def seed_of(seed: int, run: str, metrics: dict, baseline: dict) -> dict:
    """One seed of a quality.json point: a calibration run's manifest `metrics` against the baseline's
    at the same seed."""
    return {"seed": seed, "run": run, "eval_auc": metrics.get("eval_auc"), "eval_logloss": metrics.get("eval_logloss"),
            "baseline_eval_auc": baseline.get("eval_auc"), "baseline_eval_logloss": baseline.get("eval_logloss"),
            **changes(metrics, baseline)}


def point_of(section: str, setting: float, steps: int | None, seeds: list[dict]) -> dict:
    """A quality.json point: the section at `setting`, its seeds (seed_of)."""
    return {"section": section, "setting": setting, "steps": steps, "seeds": seeds}


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def write(run: str | Path, points: list[dict]) -> Path:
    path = RunDir.at(run).analysis / FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    return write_text(path, json.dumps({"schema": SCHEMA, "points": points}, indent=2) + "\n")

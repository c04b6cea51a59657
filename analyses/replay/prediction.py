"""The run's replay (analyses.replay): its recorded steps as graphs on the fitted links, checked against
the measured steps, and a policy's step predicted by replaying them with its change.

Every step is replayed with and without a change; the prediction is the measured baseline's median step
times the median of the per-step ratios, its interval their 10th to 90th percentile widened by the
baseline's own drift. The ratio keeps a prediction on the measured baseline where the replay misses it (a
link rate given that the run contradicts); the median replayed step itself scored the same on the
prediction bench (RESULTS §36).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import numpy as np

from analyses import network
from analyses.context import Context
from analyses.replay.change import Change, compose
from analyses.replay.fit import Fit, fit_links
from analyses.replay.graph import Step, mark_alone, recorded_steps
from analyses.replay.links import Links
from analyses.replay.simulation import Stalled, run_steps

PREDICT_STEPS = 48


def changes(ctx: Context) -> dict[str, Change]:
    """The change each policy section predicted its step with, by section label (set by the policies,
    read by the combined prediction), once per context."""
    return ctx.memo(changes, dict)


def together(ctx: Context):
    """A function from section labels to the replay's prediction of them applied together (their changes
    composed), or None where the run does not replay or a section set no change."""
    def predict(labels: list[str]) -> Prediction | None:
        rp, known = replay(ctx), changes(ctx)
        if not rp.steps or rp.measured_median_s is None or any(label not in known for label in labels):
            return None
        return rp.predict(compose([known[label] for label in labels]))
    return predict


@dataclass(frozen=True)
class Prediction:
    step_s: float
    low_s: float
    high_s: float
    ratio: float  # replayed with the change / replayed without it, median over the steps


@dataclass
class Replay:
    steps: list[Step]
    links: Links
    fit: Fit
    measured_median_s: float | None
    spread_s: float = 0.0  # the measured steps' own drift (analyses.network.StepTime)
    notes: list[str] = field(default_factory=list)
    _base: np.ndarray | None = None
    _sample_base: np.ndarray | None = None
    _predicted: dict = field(default_factory=dict)

    def replayed(self, change: Change | None = None) -> np.ndarray:
        """Each step's replayed time (seconds), with `change` applied."""
        if change is None:
            if self._base is None:
                self._base = run_steps(self.steps, self.links)
            return self._base
        return run_steps(self.steps, self.links, change)

    @property
    def sample(self) -> list[Step]:
        """The steps a prediction replays: at most PREDICT_STEPS, evenly spaced over the run, one after
        another (each of a curve's analyses.exchange_timing.CURVE_POINTS points replays them once or twice)."""
        if len(self.steps) <= PREDICT_STEPS:
            return self.steps
        return [self.steps[int(i)] for i in np.linspace(0, len(self.steps) - 1, PREDICT_STEPS)]

    @property
    def compute_s(self) -> float:
        """The steps' compute: per step the most any rank computed, the median over the steps."""
        per_step = [max(sum(arg for kind, arg in p if kind == "compute") for p in s.programs.values())
                    for s in self.steps]
        return float(np.median(per_step)) if per_step else 0.0

    def check(self) -> dict:
        """The unchanged replay against the measured steps: median, p50 and p90, and their errors."""
        measured = np.array([s.measured_s for s in self.steps])
        replayed = self.replayed()
        if not len(measured):
            return {"steps": 0}
        out = {"steps": len(measured)}
        for name, q in (("p50", 50), ("p90", 90)):
            m, r = float(np.percentile(measured, q)), float(np.percentile(replayed, q))
            out[name] = {"measured_s": m, "replayed_s": r, "error": r / m - 1 if m else None}
        out["per_step_error_median"] = float(np.median(np.abs(replayed / measured - 1)))
        return out

    def predict(self, change: Change) -> Prediction | None:
        """The step under `change` (module docstring), once per distinct change; None without timed steps."""
        if not self.steps or self.measured_median_s is None:
            return None
        scale = tuple(sorted((c, np.asarray(f, dtype=np.float64).tobytes()) for c, f in change.scale.items()))
        key = (scale, change.skip, change.added, change.work_s, change.dense)
        if key not in self._predicted:
            self._predicted[key] = self._predict(change)
        return self._predicted[key]

    def _predict(self, change: Change) -> Prediction:
        steps = self.sample
        if self._sample_base is None:
            self._sample_base = run_steps(steps, self.links)
        base = np.maximum(self._sample_base, 1e-12)
        ratios = run_steps(steps, self.links, change) / base
        if change.skip > 0:  # the steps without an exchange, replayed as such, in their share
            ratios = (1 - change.skip) * ratios + change.skip * run_steps(steps, self.links, replace(change, skip=1.0)) / base
        mid = float(np.median(ratios))
        lo, hi = (float(np.percentile(ratios, q)) for q in (10, 90))
        step = self.measured_median_s
        return Prediction(step * mid, step * lo - self.spread_s, step * hi + self.spread_s, mid)

    def summary(self) -> dict:
        f = self.fit
        def rate(x: float) -> float | None:
            return None if math.isinf(x) else float(x)
        return {"steps": len(self.steps), "inter_bytes_per_s": rate(self.links.inter),
                "intra_bytes_per_s": rate(self.links.intra), "burst_bytes": self.links.burst,
                "alpha_s": self.links.alpha, "fit": {"source": f.source, "calls": f.calls, "of": f.total,
                                                    "residual_s": f.residual_s,
                                                    "link_given_bytes_per_s": f.link_given},
                "check": self.check(), "notes": self.notes}


def replay(ctx: Context) -> Replay:
    """The run's steps as graphs with the fitted links, once per context."""
    return ctx.memo(replay, lambda: _build(ctx))


def _build(ctx: Context) -> Replay:
    notes: list[str] = []
    topology = ctx.manifest.topology or {}
    world = ctx.model.world_size
    node_of = tuple(int(n) for n in topology.get("rank_nodes") or [0] * world)
    if len(node_of) != world:
        node_of = tuple(r // max(world // max(int(topology.get("nodes") or 1), 1), 1) for r in range(world))
    steps = recorded_steps(ctx, notes)
    mark_alone(steps)
    links, fit = fit_links(ctx, steps, node_of, topology, notes)
    measured = network.step_time(ctx)
    out = Replay(steps, links, fit, measured.median_s, measured.spread_s, notes)
    try:
        out.replayed()
    except Stalled as e:
        notes.append(f"the recorded steps do not replay ({e}): step times priced per call")
        out.steps = []
    return out

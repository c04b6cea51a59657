"""How long `analyze` has left: each phase's expected time from the trace's size, scaled by how the
phases already done compared with their own expectation (a slower machine, a skewed trace).

    clock = TimeLeft({"open": expected_seconds("open", rows), "skew": ...}, started)
    clock.start("skew")      # seconds expected from here to the end, skew included

A phase's expected time is interpolated (extrapolated beyond) in the trace's accesses + lookups
rows between three measurements, PHASE_SECONDS, taken by `bench/analyze_scale.py --child full` on
this project's CPU box (2 cores, RESULTS §28): the Criteo Kaggle layout run repeated in time to 10M,
100M and 1B accesses rows (16.0M, 153.5M and 1,535M rows with its lookups). Another machine or
another trace's shape runs at another pace, which the phases done measure.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

MEASURED_AT = (16.0e6, 153.5e6, 1535.4e6)  # accesses + lookups rows of the measurements
# seconds of each phase at each of MEASURED_AT, one row a phase
_PHASE_TABLE = """
open                   0.38  2.15  21.91
skew                   0.97  3.62  26.77
traffic                0.04  0.11   0.54
timeline               0.04  0.16   1.13
cache                  4.16  7.95  27.77
planner                0.07  0.48   4.15
torchrec_plan          0.05  0.10   0.88
policy: replication    2.08  7.38  15.92
policy: tiers          0.10  0.48   0.49
policy: schedule       0.39  1.30   1.48
policy: compression    0.08  0.25   1.53
policy: lag            0.03  0.24   2.27
costmodel              0.33  1.03   1.74
"""
PHASE_SECONDS: dict[str, tuple[float, ...]] = {
    name: tuple(float(s) for s in seconds)
    for name, *seconds in (line.rsplit(maxsplit=len(MEASURED_AT)) for line in _PHASE_TABLE.strip().splitlines())}


def expected_seconds(phase: str, rows: float) -> float:
    """The phase's time on the bench machine at `rows` accesses + lookups rows: piecewise linear
    between the measurements, the last segment's line beyond them, never below the smallest
    measurement (0 for a phase not measured)."""
    seconds = PHASE_SECONDS.get(phase)
    if seconds is None:
        return 0.0
    at = np.asarray(MEASURED_AT)
    if rows <= at[-1]:
        return max(min(seconds), float(np.interp(rows, at, seconds)))
    slope = (seconds[-1] - seconds[-2]) / (at[-1] - at[-2])
    return max(min(seconds), seconds[-1] + slope * (rows - at[-1]))


@dataclass
class TimeLeft:
    """The phases to run, in order, with their expected seconds, the first one begun at `started`
    (now where None); `start(name)` as each of the others begins."""

    expected: dict[str, float]
    started: float | None = None
    clock: Callable[[], float] = time.perf_counter
    _done: list[tuple[float, float]] = field(default_factory=list)  # (expected, taken) of each phase ended

    def __post_init__(self) -> None:
        self._current = (next(iter(self.expected), ""), self.clock() if self.started is None else self.started)

    def start(self, name: str) -> float:
        """Seconds expected from now to the end, phase `name` (which begins now) included."""
        now = self.clock()
        previous, began = self._current
        self._done.append((self.expected.get(previous, 0.0), now - began))
        self._current = (name, now)
        names = list(self.expected)
        rest = names[names.index(name):] if name in self.expected else [name]
        return self.pace() * sum(self.expected.get(n, 0.0) for n in rest)

    def pace(self) -> float:
        """Time taken over time expected by the phases done (1 before any, or when they expected none)."""
        expected = sum(e for e, _ in self._done)
        return sum(t for _, t in self._done) / expected if expected > 0.5 else 1.0

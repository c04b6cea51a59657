"""analyze's estimate of the time it has left (analyses.time_left): the phases left, scaled by the
pace of those done, on a clock the test sets; and every phase `analyze` runs reported in order."""

from __future__ import annotations

from pathlib import Path

import pytest

from analyses.analyze import analyze, phases
from analyses.context import open_context
from analyses.time_left import MEASURED_AT, PHASE_SECONDS, TimeLeft, expected_seconds
from tests.test_row_totals import TABLES, steps
from tests.test_skew import write_run


def test_the_time_left_is_the_phases_left_at_the_pace_so_far() -> None:
    now = [0.0]
    clock = TimeLeft({"open": 1.0, "a": 2.0, "b": 3.0, "c": 0.0}, started=0.0, clock=lambda: now[0])
    now[0] = 2.0
    assert clock.start("a") == pytest.approx(2 * (2 + 3))  # open took twice what it should: so will the rest
    now[0] = 4.0
    assert clock.start("b") == pytest.approx(4 / 3 * 3)  # 4 s taken for 3 expected
    now[0] = 4.1
    assert clock.start("c") == 0.0


def test_expected_times_follow_the_measurements_between_and_beyond_them() -> None:
    seconds = PHASE_SECONDS["cache"]
    for rows, measured in zip(MEASURED_AT, seconds):
        assert expected_seconds("cache", rows) == pytest.approx(measured)
    between = (MEASURED_AT[0] + MEASURED_AT[1]) / 2
    assert expected_seconds("cache", between) == pytest.approx((seconds[0] + seconds[1]) / 2)
    beyond = 2 * MEASURED_AT[-1] - MEASURED_AT[-2]  # the last segment's line
    assert expected_seconds("cache", beyond) == pytest.approx(2 * seconds[-1] - seconds[-2])
    assert expected_seconds("cache", 0) == pytest.approx(min(seconds))  # never below the smallest
    assert expected_seconds("no such phase", 1e9) == 0.0


def test_analyze_reports_every_phase_in_order_with_the_time_left(tmp_path: Path) -> None:
    run = write_run(tmp_path / "run", steps(0, 8, seed=1), TABLES, samples_per_step=300)
    told: list[tuple[str, float]] = []
    analyze(run, progress=lambda phase, left_s=None: told.append((phase, left_s)))
    with open_context(run) as ctx:
        assert ["open", *(phase for phase, _ in told)] == list(phases(ctx))
    assert all(left is not None and left >= 0 for _, left in told)
    assert told[-1][1] < told[0][1]

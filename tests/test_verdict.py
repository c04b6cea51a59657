"""The verdict's rows (analyses/verdict.py) from a policy file and compare's summary, by hand."""

from __future__ import annotations

import pytest

from analyses.verdict import TERMINAL_COLUMNS, COLUMNS, cells, verdict

BASE, REPLICATED, COMBINED = "runs/base", "runs/replication", "runs/combined"


def _policy() -> dict:
    def section(step: float, **extra) -> dict:
        return {"predicted": {"step_time_s": step, "a2a_bytes_per_step": 1e6}, "why": "w",
                "intervals": {"step_time_s": [step * 0.9, step * 1.1]}, **extra}
    return {"baseline": {"step_time_s": 0.1, "a2a_bytes_per_step": 4e6, "allreduce_bytes_per_step": 2e6},
            "replication": section(0.06),
            "compression": {"dp": section(0.09, recommended=False,
                                          reason="not recommended: eval log loss +24.15% [+18.60%, +26.90%], beyond "
                                                 "the quality budget's +1.00%"),
                            "mp": section(0.07, recommended=True)},
            "combined": {"sections": ["replication", "compression.mp"], "predicted": {"step_time_s": 0.045},
                         "intervals": {"step_time_s": [0.04, 0.05]}, "why": "together"}}


def _summary() -> dict:
    def run(path: str, step: float, auc: float, loss: float) -> dict:
        return {"run": path, "step_time_s": step, "a2a_bytes_per_step": 1.1e6, "dp_bytes_per_step": 2e6,
                "metrics": {"eval_auc": auc, "eval_logloss": loss}}
    rows = [{"run": REPLICATED, "section": "replication", "figure": "step_time_s", "measured": 0.05},
            {"run": REPLICATED, "section": "baseline", "figure": "step_time_s", "measured": 0.1},
            {"run": COMBINED, "section": "combined", "figure": "step_time_s", "measured": 0.04}]
    return {"base": BASE, "runs": [run(BASE, 0.1, 0.75, 0.5), run(REPLICATED, 0.05, 0.75, 0.5),
                                   run(COMBINED, 0.04, 0.749, 0.505)], "rows": rows}


def test_every_section_has_a_row_the_combination_first_and_the_measured_best_marked() -> None:
    rows = verdict(_policy(), _summary())
    assert [r.label for r in rows] == ["combined: replication + compression.mp", "replication", "compression.dp",
                                       "compression.mp"]  # compression's parts named, each
    combined, replication, dp, mp = rows
    assert combined.best and not any(r.best for r in rows[1:])
    assert combined.measured_speedup == pytest.approx(2.5) and combined.predicted_speedup == pytest.approx(0.1 / 0.045)
    assert combined.speedup_range == pytest.approx((0.1 / 0.05, 0.1 / 0.04))
    assert combined.auc_change == pytest.approx(-0.001) and combined.logloss_change == pytest.approx(0.01)
    assert combined.quality_measured
    assert replication.measured_speedup == pytest.approx(2.0) and replication.recommended
    assert dp.measured_s is None and not dp.recommended
    assert dp.why == "eval log loss +24.15% [+18.60%, +26.90%], beyond the quality budget's +1.00%"
    assert mp.measured_s is None and mp.predicted_speedup == pytest.approx(0.1 / 0.07)


def test_the_cells_say_what_was_measured_and_what_only_predicted() -> None:
    rows = [r.to_json() for r in verdict(_policy(), _summary())]
    shown = cells(rows[0])
    assert len(shown) == len(COLUMNS) and len(TERMINAL_COLUMNS) == len(COLUMNS) - 1
    assert shown[:6] == ["combined: replication + compression.mp ★", "yes", "45 [40–50] ms", "2.22× [2.00–2.50]",
                         "40 ms", "2.50×"]
    assert shown[8] == "-0.0010, +1.00%"
    assert cells(rows[2])[4:6] == ["not run", "–"]
    assert cells(rows[0], compact=True)[3] == "2.22×"


def test_without_runs_the_rows_are_the_predictions_over_the_recorded_baseline() -> None:
    rows = verdict(_policy())
    assert all(r.measured_s is None and not r.best for r in rows)
    assert rows[1].predicted_speedup == pytest.approx(0.1 / 0.06)
    assert verdict(None) == []

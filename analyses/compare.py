"""Compare: recorded runs against a base run, and each against the policy it applied (DESIGN.md §6).

    result = compare("runs/base", ["runs/hybrid"])   # skip_steps: analyses.network's warm-up rule
    result.summary["runs"][1]["ratios"]["step_time_s"]   # hybrid's median step time / base's
    result.tables["compare_policy"]   # run | section | figure | unit | kind | predicted | predicted_low | ...

Each run is measured (analyses.measure: its figures, from training rows), set against BASE
(analyses.run_diff: ratios, the loss difference, and the runs refused or warned of), and its
policy's or TorchRec plan's predictions against what it measured (analyses.prediction_check).

Tables (`compare(...).tables`): compare_runs (one row per run, analyses.measure's figures),
compare_bytes (run, op, tag, kind, calls, bytes_out_per_step, wire_bytes_per_step), compare_schedule
(run, schedule, steps, bytes_per_step, embedding_bytes_per_step), compare_policy (run, section,
figure, unit, kind, predicted, predicted_low, predicted_high, measured, diff, diff_pct). The summary
(JSON-able): base, skip_steps, runs (each with its figures, ratios, by_op_tag, schedule, metrics,
policy: path, sha256, status, sections applied, skipped), rows, warnings, notes.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence

import duckdb
import polars as pl

from analyses.context import Result, open_context
from analyses.measure import Measured, by_op_tag, measure, schedule_split
from analyses.prediction_check import applied_policy, plan_rows, policy_rows
from analyses.run_diff import RATIOS, check_same_model, difference_warnings, loss_diff, ratios, status_warnings
from analyses.verdict import verdict
from tracekit.errors import TracekitError
from tracekit.policy import PolicyError, load_policy
from tracekit.run_dir import RunDir


def compare(base: str | os.PathLike, runs: Sequence[str | os.PathLike], *, skip_steps: int | None = None) -> Result:
    """BASE and each of `runs` measured (module docstring), with ratios to BASE and each run's policy
    predictions against its measurements. TracekitError for a path that is not a run, RunMismatch
    for runs of another model."""
    measured: list[Measured] = []
    for path in (base, *runs):
        with open_context(path) as ctx:
            try:
                if measured:
                    check_same_model(measured[0], ctx)
                measured.append(measure(ctx, skip_steps))
            except duckdb.Error as err:
                raise TracekitError(f"{ctx.path}: cannot read the trace ({str(err).splitlines()[0]})") from None
    first = measured[0]
    result = Result()
    warnings: list[str] = []
    rows: list[dict] = []
    for m in measured:
        warnings += status_warnings(m)
        result.notes += m.notes
        if m is not first:
            warnings += difference_warnings(first, m)
            m.figures["ratios"] = ratios(first, m)
            m.figures["loss_max_abs_diff"] = loss_diff(first, m)
        policy, m.figures["policy"], problems = applied_policy(m)
        warnings += problems
        if policy is not None:
            rows += policy_rows(m, policy, first, result.notes)
        rows += plan_rows(m, first)
    result.tables = tables(measured, rows)
    result.summary = {"base": first.name, "skip_steps": max(m.figures["skip_steps"] for m in measured), "runs": [m.figures for m in measured],
                      "rows": rows, "warnings": warnings, "notes": result.notes}
    result.summary["verdict"] = [row.to_json() for row in verdict(_base_policy(Path(first.name)), result.summary)]
    return result


def _base_policy(run_dir: Path) -> dict | None:
    """BASE's policy.json, where analyze wrote a readable one: the verdict's sections."""
    try:
        policy = RunDir.at(run_dir).policy
        return load_policy(policy) if policy.is_file() else None
    except PolicyError:
        return None


def tables(measured: list[Measured], rows: list[dict]) -> dict[str, pl.DataFrame]:
    flat = [{k: v for k, v in m.figures.items() if not isinstance(v, (dict, list))}
            | {f"{k}_ratio": (m.figures["ratios"] or {}).get(k) for k in RATIOS}
            | {f"metric_{k}": v for k, v in m.figures["metrics"].items()}
            for m in measured]
    by_op = [by_op_tag(m.calls, m.figures["steps"]).with_columns(pl.lit(m.name).alias("run")) for m in measured]
    split = [schedule_split(m.steps, m.calls).with_columns(pl.lit(m.name).alias("run")) for m in measured]
    policy_schema = {"run": pl.String, "section": pl.String, "figure": pl.String, "unit": pl.String,
                     "kind": pl.String, "predicted": pl.Float64, "predicted_low": pl.Float64,
                     "predicted_high": pl.Float64, "measured": pl.Float64, "diff": pl.Float64, "diff_pct": pl.Float64}
    return {"compare_runs": pl.DataFrame(flat, infer_schema_length=None),
            "compare_bytes": pl.concat(by_op).select("run", pl.exclude("run")),
            "compare_schedule": pl.concat(split).select("run", pl.exclude("run")),
            "compare_policy": pl.DataFrame(rows, schema=policy_schema)}

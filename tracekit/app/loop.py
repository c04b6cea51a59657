"""The steps of the loop a user runs, one library function each: the CLI parses its options, calls
one of these and prints what it returns; `tracekit.app.optimize` chains them.

    summary = analyze_run("runs/base", Options(budget_fraction=0.05))   # calibrates first, writes the report
    summary = compare_runs("runs/base", ["runs/hybrid"])                  # with BASE/compare.html
    summary = simulate_run("runs/base", Target(8, 8, 25e9))               # sections derived for 8x8
    frame = query("runs/base", "SELECT op, sum(bytes_out) FROM train_comms GROUP BY op")

Each raises TracekitError (one line naming the run or file) for input it cannot use.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from tracekit.errors import TracekitError
from tracekit.run_dir import RunDir

if TYPE_CHECKING:
    import polars as pl

    from analyses.analyze import Progress
    from analyses.context import Options
    from analyses.simulate import Target


def _silent(phase: str, left_s: float | None = None) -> None:
    return None


class QueryError(TracekitError):
    """A `tracekit sql` query DuckDB refused: its first line."""

    exit_code = 1


def write_report(runs: Sequence[str | os.PathLike], output: str | os.PathLike, plotly_js: str = "inline") -> Path:
    """The HTML report of `runs` (the first is the base, and must have been analysed) at `output`."""
    from reports import write_report as render

    return render(runs, output, plotly_js)


def _report_if_analysed(runs: Sequence[str | os.PathLike], output: str | os.PathLike) -> str:
    """The report's path, or why it was not written where the base was never analysed (the work that
    asked for it is done and is not lost for it)."""
    from reports.inputs import NotAnalysed

    try:
        return str(write_report(runs, output))
    except NotAnalysed as err:
        return f"not written ({err})"


def analyze_run(run_dir: str | os.PathLike, options: Options, *, calibrate: bool = True, report: bool = True,
                progress: Progress = _silent) -> dict[str, Any]:
    """`tracekit analyze`: calibrate the rank-side costs where they are missing (`calibrate`), derive
    every analysis and policy, write RUN/report.html (`report`); the analysis summary, with the
    report's path under "report"."""
    from analyses.analyze import analyze
    from tracekit.app.calibration import Calibration, pending

    run_dir = Path(run_dir)
    job = pending(run_dir) if calibrate else None
    background = job if isinstance(job, Calibration) else None
    try:
        summary = analyze(run_dir, options, progress=progress, calibration=background)
    finally:
        if background is not None:
            background.stop()
    if isinstance(job, str):
        summary["notes"].append(job)
    if report:
        progress("report")
        summary["report"] = str(write_report([run_dir], RunDir.at(run_dir).report))
    return summary


def compare_runs(base: str | os.PathLike, runs: Sequence[str | os.PathLike], *, skip_steps: int | None = None,
                 report: str | os.PathLike | None = None) -> dict[str, Any]:
    """`tracekit compare`: BASE and `runs` measured side by side and each policy's prediction against
    its measurement; with `report`, the HTML report written there (its path under "report")."""
    from analyses.compare import compare

    summary = compare(base, list(runs), skip_steps=skip_steps).summary
    if report is not None:
        summary["report"] = _report_if_analysed([base, *runs], report)
    return summary


def simulate_run(run_dir: str | os.PathLike, target: Target, policy: str = "derive", *, report: bool = True,
                 write_dir: str | os.PathLike | None = None, curve: bool = False, options: Options | None = None
                 ) -> dict[str, Any]:
    """`tracekit simulate`: the run projected onto `target` with `policy`: "derive" (each section derived
    for the target; `write_dir` gets their files), "none" (the baseline alone) or a policy file's path (its
    sections as written)."""
    from analyses.simulate import project

    run_dir = Path(run_dir)
    policy_path = None if policy in ("derive", "none") else Path(policy)
    if policy_path is not None and not policy_path.is_file():
        raise TracekitError(f"--policy {policy_path}: no such file")
    summary = project(run_dir, target, policy_path, derive=policy == "derive", curve=curve, options=options,
                      write_dir=None if write_dir is None else Path(write_dir))
    if report:
        summary["report"] = _report_if_analysed([run_dir], RunDir.at(run_dir).report)
    return summary


def query(run_dir: str | os.PathLike, sql: str) -> pl.DataFrame:
    """`tracekit sql`: `sql` over the run, every trace table and every analysis table a view."""
    import duckdb

    from analyses.context import open_context

    with open_context(run_dir) as ctx:
        for part in sorted(RunDir.at(ctx.path).analysis.glob("*.parquet")):
            ctx.con.sql(f"CREATE VIEW \"{part.stem}\" AS SELECT * FROM read_parquet('{part}')")
        try:
            return ctx.frame(sql)
        except duckdb.Error as err:
            raise QueryError(f"query failed: {str(err).splitlines()[0]}") from None

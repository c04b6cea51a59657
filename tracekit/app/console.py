"""The console the commands print on (rich): the terminal, the progress lines, a command's result as
JSON or for a person, and query results as tables or files, so the library returns data and the
CLI only prints it. What each command prints: tracekit/app/console_analysis.py (analyze, simulate,
calibrate, planner), console_compare.py (compare and the verdict) and console_record.py (record).

    with analysis_progress(enabled=True) as progress:
        summary = analyze_run(run, options, progress=progress)
    show(summary, as_json=False, render=print_analysis)
"""

from __future__ import annotations

import contextlib
import json
import shutil
import sys
from pathlib import Path
from typing import Any, Callable, Iterator

from rich.console import Console
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from tracekit.units import format_cell, format_duration

# 120 columns where no terminal says otherwise (a pipe, a file, the README): the tables stay whole
terminal = Console(width=shutil.get_terminal_size((120, 24)).columns)


@contextlib.contextmanager
def progress_lines(enabled: bool = True, *, keep: bool = True,
                   prefix: str = "") -> Iterator[Callable[..., None]]:
    """A `progress(what, left_s=None)` callback (or a no-op where not `enabled`): each call starts a
    line on stderr with a spinner and its elapsed time (and `left_s`, the seconds expected to the
    end, where given), ending the one before, except that `HEAD: detail` after a line of the same
    HEAD updates that line (one line for the phases of one step); `keep` False: the last line
    vanishes when the block ends (analyze's phases), True: every line stays."""
    if not enabled:
        yield lambda what, left_s=None: None
        return
    with Progress(SpinnerColumn(), TextColumn(prefix + "{task.description}"), TimeElapsedColumn(),
                  console=Console(stderr=True), transient=not keep) as bar:
        tasks: list = []
        heads: list[str] = []

        def show(what: str, left_s: float | None = None) -> None:
            head, detail, _ = what.partition(": ")
            if left_s is not None:
                what += f" [dim](about {format_duration(left_s)} left)[/dim]"
            if tasks and detail and heads[-1] == head:
                return bar.update(tasks[-1], description=what)
            if tasks:
                bar.update(tasks[-1], completed=1, total=1, visible=keep)
            tasks.append(bar.add_task(what, total=None))
            heads.append(head)

        yield show
        if tasks:
            bar.update(tasks[-1], completed=1, total=1)


def analysis_progress(enabled: bool) -> contextlib.AbstractContextManager[Callable[..., None]]:
    """analyze's phase, one line that changes (`analysing skew`, ...), gone at the end."""
    return progress_lines(enabled, keep=False, prefix="analysing ")


def run_progress(enabled: bool) -> contextlib.AbstractContextManager[Callable[..., None]]:
    """One line per run or phase of optimize and calibrate, each with its elapsed time, kept."""
    return progress_lines(enabled, keep=True)


def print_frame(frame: Any) -> None:
    """A Polars DataFrame as a rich table."""
    table = Table(*frame.columns, show_lines=False)
    for row in frame.iter_rows():
        table.add_row(*(format_cell(v) for v in row))
    terminal.print(table)


def show(summary: dict, as_json: bool, render: Callable[[dict], None], report: bool = False) -> None:
    """A command's result: one JSON object on stdout, or `render`ed for a person (with the report's path)."""
    if as_json:
        return print(json.dumps(summary, default=str))
    render(summary)
    if report:
        print(f"report: {summary['report']}")


def write_frame(frame: Any, fmt: str, output: Path | None) -> None:
    """`tracekit sql`'s result: a table on the console, or csv, json or parquet (to `output`, or
    stdout for the text formats)."""
    if fmt == "table":
        return print_frame(frame)
    if fmt == "parquet":
        return frame.write_parquet(output)
    text = _csv(frame) if fmt == "csv" else frame.write_json()
    if output is None:
        sys.stdout.write(text)
    else:
        output.write_text(text)


def _csv(frame: Any) -> str:
    """CSV of a Polars frame, list columns (an all-to-all's splits) written as `[a, b, ...]`, as CSV has no lists."""
    import polars as pl

    lists = [name for name, dtype in frame.schema.items() if isinstance(dtype, (pl.List, pl.Array))]
    return frame.with_columns(
        pl.format("[{}]", pl.col(name).list.eval(pl.element().cast(pl.String)).list.join(", ")).alias(name)
        for name in lists).write_csv()

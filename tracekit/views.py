"""Console rendering of what `tracekit analyze` and `tracekit sql` return (rich), so the library
returns data and the CLI only prints it.

    with analysis_progress(enabled=True) as progress:
        report = analyze(run, options, progress=progress)
    print_analysis(report)
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

from rich.console import Console
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from tracekit.units import format_bytes

console = Console(stderr=False)


@contextlib.contextmanager
def analysis_progress(enabled: bool) -> Iterator[Callable[[str], None]]:
    """A `progress(step)` callback showing the step now running (on stderr), or a no-op."""
    if not enabled:
        yield lambda step: None
        return
    with Progress(SpinnerColumn(), TextColumn("analysing {task.description}"), TimeElapsedColumn(),
                  console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task("", total=None)
        yield lambda step: bar.update(task, description=step)


def print_frame(frame: Any) -> None:
    """A Polars DataFrame as a rich table."""
    table = Table(*frame.columns, show_lines=False)
    for row in frame.iter_rows():
        table.add_row(*(_cell(v) for v in row))
    console.print(table)


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:,.4g}"
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}"
    return "" if value is None else str(value)


def print_analysis(report: dict) -> None:
    """The summary a person reads in a minute: warnings, the figures of each analysis, each policy
    with its predicted saving and why, what could not be derived, and what was written."""
    for warning in report["warnings"]:
        console.print(f"[yellow]warning:[/] {warning}")
    console.print(f"[bold]{report['run']}[/] ({report['status']})")
    for name, summary in report["analyses"].items():
        _print_section(name, summary)
    baseline = report.get("baseline") or {}
    table = Table("policy", "predicted (per training step, all ranks)", "why", title="policies", title_justify="left")
    if baseline:
        table.add_row("baseline (recorded)", _figures(baseline), "what the run did")
    for name, section in report["policies"].items():
        table.add_row(name, _figures(section.get("predicted", {})), section.get("why", ""))
    for name, reason in report["not_derived"].items():
        table.add_row(name, "[dim]not derived[/]", reason)
    console.print(table)
    for note in report["notes"]:
        console.print(f"[dim]note: {note}[/]")
    written = report["written"]
    console.print(f"wrote {len(written)} files under {report['run']} (analysis/, policy.json, policy/)")


def _print_section(name: str, summary: dict) -> None:
    rows = [(k, v) for k, v in summary.items() if not isinstance(v, (dict, list))]
    nested = [(k, v) for k, v in summary.items() if isinstance(v, (dict, list))]
    table = Table("figure", "value", title=name, title_justify="left", show_header=False)
    for key, value in rows:
        table.add_row(key, _value(key, value))
    for key, value in nested:
        table.add_row(key, _compact(key, value))
    console.print(table)


def _value(key: str, value: Any) -> str:
    if isinstance(value, (int, float)) and not isinstance(value, bool) and "bytes" in key:
        return format_bytes(value)
    return _cell(value)


def _compact(key: str, value: Any, limit: int = 8) -> str:
    if isinstance(value, dict):
        items = list(value.items())
        text = ", ".join(f"{k}: {_compact(k, v) if isinstance(v, (dict, list)) else _value(key, v)}"
                         for k, v in items[:limit])
        return text + (f", … ({len(items) - limit} more)" if len(items) > limit else "")
    text = ", ".join(_compact(key, v) if isinstance(v, (dict, list)) else _value(key, v) for v in value[:limit])
    return text + (f", … ({len(value) - limit} more)" if len(value) > limit else "")


def _figures(predicted: dict) -> str:
    return "; ".join(f"{k} {_value(k, v)}" for k, v in predicted.items() if not isinstance(v, (dict, list)))

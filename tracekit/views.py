"""Console rendering of what `tracekit analyze` and `tracekit sql` return (rich), so the library
returns data and the CLI only prints it.

    with analysis_progress(enabled=True) as progress:
        report = analyze(run, options, progress=progress)
    print_analysis(report)
"""

from __future__ import annotations

import contextlib
import shutil
from typing import Any, Callable, Iterator

from rich.console import Console
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from tracekit.units import format_bytes

# 120 columns where no terminal says otherwise (a pipe, a file, the README): the tables stay whole
console = Console(width=shutil.get_terminal_size((120, 24)).columns)


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
    """The summary a person reads in a minute: warnings, skew, traffic, timeline, cache, the cost
    model's check, each policy with its predicted saving and why, what could not be derived."""
    for warning in report["warnings"]:
        console.print(f"[yellow]warning:[/] {warning}")
    analyses = report["analyses"]
    traffic = analyses.get("traffic", {})
    console.print(f"[bold]{report['run']}[/] ({report['status']}): {traffic.get('steps', '?')} training steps, "
                  f"{traffic.get('world_size', '?')} rank(s); every figure is from training rows unless it says eval")
    for name, render in RENDERERS.items():
        if name in analyses:
            render(analyses[name])
    _print_policies(report)
    for note in report["notes"]:
        console.print(f"[dim]note: {note}[/]")
    console.print(f"wrote {len(report['written'])} files: {report['run']}/analysis/*.parquet, policy.json, policy/*.parquet "
                  f"(tracekit sql {report['run']} \"SELECT ...\" reads them all)")


def _skew(summary: dict) -> None:
    table = Table("table", "rows", "touched", "lookups", "top 1%", "top 10%", "gini", "zipf α", "rows for 90%",
                  "hot-set jaccard", title="skew: share of lookups taken by the most-read rows", title_justify="left")
    for name, t in summary["tables"].items():
        table.add_row(name, _cell(t["num_rows"]), _cell(t["rows_touched"]), _cell(t["lookups"]),
                      f"{t['top_1pct_share']:.1%}", f"{t['top_10pct_share']:.1%}", f"{t['gini']:.2f}",
                      f"{t['zipf_alpha']:.2f}", _cell(t["rows_for_90pct"]), _ratio(t.get("hot_set_jaccard")))
    console.print(table)


def _traffic(summary: dict) -> None:
    table = Table("tag", "bytes per training step", title="traffic: bytes_out of every rank, per training step",
                  title_justify="left")
    for tag, value in sorted(summary["train_bytes_per_step_by_tag"].items(), key=lambda kv: -kv[1]):
        table.add_row(tag, format_bytes(value))
    table.add_row("[bold]total[/]", format_bytes(summary["train_bytes_per_step"]))
    console.print(table)
    bandwidth = ", ".join(f"{op} {format_bytes(v)}/s" for op, v in summary["bandwidth"].items() if v)
    console.print(f"  crossing ranks: {format_bytes(summary['cross_rank_bytes_per_step'])} per step; "
                  f"bus bandwidth measured: {bandwidth or 'n/a'}; eval, beside: {format_bytes(summary['eval_bytes'])} in all")


def _timeline(summary: dict) -> None:
    table = Table("rank", "step", "compute", "communication", "waiting", title="timeline: mean per training step",
                  title_justify="left")
    for rank, t in summary["per_rank"].items():
        table.add_row(rank, *(f"{t[k] * 1e3:.1f} ms" for k in ("step_s", "compute_s", "comm_s", "wait_s")))
    console.print(table)
    last = summary["stragglers"]["last"]
    console.print(f"  last to end a step: {', '.join(f'rank {r} {n}x' for r, n in last.items())}; "
                  f"mean spread {summary['stragglers']['mean_end_spread_s'] * 1e3:.2f} ms")


def _cache(summary: dict) -> None:
    factors = [f for f in ("0.1", "0.2") if f in {str(x) for x in summary["load_factors"]}]
    columns = [f"{policy} @{f}" for f in factors for policy in ("lru", "lfu", "oracle")]
    table = Table("table", "distinct rows / step", *columns,
                  title="cache: miss ratio at cache load factors (FBGEMM TBE semantics)", title_justify="left")
    for name, t in summary["tables"].items():
        table.add_row(name, _cell(t["expected_lookups"]),
                      *(f"{t['miss_ratio'][policy][f]:.1%}" for f in factors for policy in ("lru", "lfu", "oracle")))
    console.print(table)


def _costmodel(summary: dict) -> None:
    matches = "equal to" if summary.get("baseline_matches_comms") else "[red]different from[/]"
    console.print(f"cost model: the replayed embedding exchange, {format_bytes(summary['baseline_a2a_bytes_per_step'])} "
                  f"per step ({format_bytes(summary['baseline_a2a_remote_bytes_per_step'])} crossing ranks), is "
                  f"{matches} the bytes in comms; E[U] within {summary['distinct_rows_max_rel_diff']:.1%} of the replay")


RENDERERS = {"skew": _skew, "traffic": _traffic, "timeline": _timeline, "cache": _cache, "costmodel": _costmodel}


def _print_policies(report: dict) -> None:
    baseline = report.get("baseline") or {}
    table = Table("policy", "predicted per training step (all ranks)", "why", title="policies (policy.json)",
                  title_justify="left")
    if baseline:
        table.add_row("baseline (recorded)", _figures(baseline, KEY_FIGURES), "what the run did")
    for name, section in report["policies"].items():
        parts = [(f"{name}.{sub}", section[sub]) for sub in ("dp", "mp") if sub in section] if name == "compression" \
            else [(name, section)]
        for label, body in parts:
            table.add_row(label, _figures(body["predicted"], KEY_FIGURES), body["why"])
    for name, reason in report["not_derived"].items():
        table.add_row(name, "[dim]not derived[/]", reason)
    for sub, reason in report["policies"].get("compression", {}).get("evidence", {}).get("not_derived", {}).items():
        table.add_row(f"compression.{sub}", "[dim]not derived[/]", reason)
    console.print(table)


KEY_FIGURES = ("a2a_bytes_per_step", "allreduce_bytes_per_step", "a2a_remote_bytes_per_step", "sync_bytes_per_step",
               "intra_bytes_per_step", "inter_bytes_per_step", "dp_bytes_per_step", "output_a2a_bytes_per_step",
               "hot_sample_fraction", "gain", "step_time_s")


def _figures(predicted: dict, keys: tuple[str, ...]) -> str:
    shown = [(k, predicted[k]) for k in keys if isinstance(predicted.get(k), (int, float))]
    return "\n".join(f"{k.removesuffix('_per_step').removesuffix('_s').replace('_', ' ')} {_value(k, v)}"
                     for k, v in shown)


def _value(key: str, value: Any) -> str:
    if "bytes" in key:
        return format_bytes(value)
    if key.endswith("_s"):
        return f"{value * 1e3:.1f} ms"
    if "fraction" in key or key == "gain":
        return f"{value:.1%}"
    return _cell(value)


def _ratio(value: float | None) -> str:
    return "" if value is None else f"{value:.2f}"

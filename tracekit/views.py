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


@contextlib.contextmanager
def run_progress(enabled: bool) -> Iterator[Callable[[str], None]]:
    """A `progress(what)` callback showing the run now going and its elapsed time (stderr), or a no-op."""
    if not enabled:
        yield lambda what: None
        return
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(),
                  console=Console(stderr=True), transient=False) as bar:
        task = None

        def show(what: str) -> None:
            nonlocal task
            if task is not None:
                bar.update(task, completed=1, total=1)
            task = bar.add_task(what, total=None)

        yield show
        if task is not None:
            bar.update(task, completed=1, total=1)


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
    if report.get("network"):
        _network(report["network"])
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


def _network(n: dict) -> None:
    """One line on the model every predicted time comes from (analyses.network)."""
    alphas = ", ".join(f"{op} {a * 1e3:.2f} ms" for op, a in sorted(n["alpha_s"].items())) or "none timed"
    rate = f"{format_bytes(n['bandwidth_bytes_per_s'])}/s" if n.get("bandwidth_bytes_per_s") else "bytes free (β ≈ 0)"
    step = n.get("step_time_s")
    console.print(f"network model: α {alphas}; link {rate}; fit residual {n['residual_s'] * 1e3:.2f} ms over "
                  f"{n['calls_fitted']} of {n['calls']} calls; baseline step "
                  + (f"{step * 1e3:.2f} ms ± {n['step_spread_s'] * 1e3:.2f} ms drift" if step else "unknown")
                  + f" ({n['warmup_steps']} warm-up steps left out); rank work {n['rank_work'].split(' (')[0]}")


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
            table.add_row(_decision(label, body), _figures(body["predicted"], KEY_FIGURES, body.get("intervals")),
                          body["why"] if body.get("recommended", True) else f"{body['reason']}\n[dim]{body['why']}[/]")
    if report.get("combined"):
        combined = report["combined"]
        table.add_row("[bold]combined[/]\n" + ", ".join(combined["sections"]),
                      _figures(combined["predicted"], KEY_FIGURES, combined.get("intervals")), combined["why"])
    for name, reason in report["not_derived"].items():
        table.add_row(name, "[dim]not derived[/]", reason)
    for sub, reason in report["policies"].get("compression", {}).get("evidence", {}).get("not_derived", {}).items():
        table.add_row(f"compression.{sub}", "[dim]not derived[/]", reason)
    console.print(table)


KEY_FIGURES = ("a2a_bytes_per_step", "allreduce_bytes_per_step", "a2a_remote_bytes_per_step", "sync_bytes_per_step",
               "intra_bytes_per_step", "inter_bytes_per_step", "dp_bytes_per_step", "output_a2a_bytes_per_step",
               "hot_sample_fraction", "gain", "step_time_s")


def _decision(label: str, body: dict) -> str:
    if "recommended" not in body:
        return label
    return f"{label}\n[green]recommended[/]" if body["recommended"] else f"{label}\n[yellow]not recommended[/]"


def _figures(predicted: dict, keys: tuple[str, ...], intervals: dict | None = None) -> str:
    """One line per figure; an estimated one (with an interval) as `~value [low, high]`."""
    shown = [(k, predicted[k]) for k in keys if isinstance(predicted.get(k), (int, float))]
    lines = []
    for k, v in shown:
        name = k.removesuffix('_per_step').removesuffix('_s').replace('_', ' ')
        span = (intervals or {}).get(k)
        lines.append(f"{name} ~{_value(k, v)} [{_value(k, span[0])}, {_value(k, span[1])}]" if span
                     else f"{name} {_value(k, v)}")
    return "\n".join(lines)


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


def print_compare(summary: dict) -> None:
    """What `tracekit compare` prints: warnings, the runs side by side (each RUN with its ratio to
    BASE), bytes by op and tag, the hot/cold split where there is one, and each policy's
    predicted against measured figures."""
    for warning in summary["warnings"]:
        console.print(f"[yellow]warning:[/] {warning}")
    runs = summary["runs"]
    console.print(f"[bold]compare[/]: {len(runs) - 1} run(s) against BASE {summary['base']}; training rows only, "
                  f"bytes over every training step, times after the first {summary['skip_steps']} steps")
    table = Table("", *(_heading(i, r) for i, r in enumerate(runs)),
                  title="runs (RUN figures with their ratio to BASE)", title_justify="left")
    for label, key, kind in COMPARE_FIGURES:
        table.add_row(label, *(_compared(r, runs[0], key, kind, i == 0) for i, r in enumerate(runs)))
    console.print(table)
    _compare_bytes(runs)
    _compare_schedule(runs)
    _compare_policies(summary["rows"], summary["base"])
    for note in summary["notes"]:
        console.print(f"[dim]note: {note}[/]")


COMPARE_FIGURES = (  # label, figure, how it is shown and compared
    ("device, backend, world, cores", "where", "text"), ("status", "status", "text"),
    ("training steps (timed)", "steps", "steps"),
    ("step time, median", "step_time_s", "time"), ("step time, p90", "step_time_p90_s", "time"),
    ("samples/s", "samples_per_s", "rate"), ("samples per step", "samples_per_step", "count"),
    ("bytes_out per step, all ops", "bytes_per_step", "bytes"),
    ("wire bytes per step, all ops", "wire_bytes_per_step", "bytes"),
    ("embedding all-to-all", "a2a_bytes_per_step", "bytes"), ("  of it remote", "a2a_remote_bytes_per_step", "bytes"),
    ("replica sync (wire)", "sync_bytes_per_step", "bytes"), ("embedding total", "total_bytes_per_step", "bytes"),
    ("eval AUC", "metrics.eval_auc", "metric"), ("eval logloss", "metrics.eval_logloss", "metric"),
    ("train loss", "metrics.train_loss", "metric"), ("samples/s (trainer)", "metrics.samples_per_s", "rate"),
    ("max |Δ loss| per step vs BASE", "loss_max_abs_diff", "loss"),
    ("policy", "policy", "policy"),
)


def _heading(i: int, run: dict) -> str:
    return f"BASE\n{run['run']}" if i == 0 else f"RUN {i}\n{run['run']}"


def _get(run: dict, key: str) -> Any:
    head, _, rest = key.partition(".")
    value = run.get(head)
    return (value or {}).get(rest) if rest else value


def _compared(run: dict, base: dict, key: str, kind: str, is_base: bool) -> str:
    """A run's figure as shown, with its ratio to BASE (× for times and rates, % change for bytes,
    Δ for metrics)."""
    value, base_value = _get(run, key), _get(base, key)
    if kind == "policy":
        return "none" if value is None else f"{value['path']} ({value['status']})"
    if kind == "steps":
        return f"{value} ({run['timed_steps']})"
    if kind == "loss":
        return "" if is_base else "n/a" if value is None else f"{value:.3g}"
    if value is None:
        return "n/a"
    shown = {"text": str, "time": lambda v: f"{v * 1e3:,.2f} ms", "rate": lambda v: f"{v:,.0f}",
             "count": lambda v: f"{v:,.6g}", "bytes": format_bytes, "metric": lambda v: f"{v:.4f}"}[kind](value)
    if is_base or kind in ("text", "count") or base_value is None:
        return shown
    if kind == "metric":
        return f"{shown} Δ{value - base_value:+.4f}"
    if not base_value:
        return shown
    if kind == "bytes":
        return f"{shown} {value / base_value - 1:+.0%}"
    return f"{shown} ×{value / base_value:.2f}"


def _compare_bytes(runs: list[dict]) -> None:
    keys = list(dict.fromkeys((r["op"], r["tag"], r["kind"]) for run in runs for r in run["by_op_tag"]))
    table = Table("op", "tag", "kind", *("BASE" if i == 0 else f"RUN {i}" for i in range(len(runs))),
                  title="bytes_out per training step by op and tag (wire bytes where they differ)",
                  title_justify="left")
    per_run = [{(r["op"], r["tag"], r["kind"]): r for r in run["by_op_tag"]} for run in runs]
    for key in keys:
        cells = []
        for i, rows in enumerate(per_run):
            r, base = rows.get(key), per_run[0].get(key)
            if r is None:
                cells.append("—")
                continue
            text = format_bytes(r["bytes_out_per_step"])
            if r["wire_bytes_per_step"] != r["bytes_out_per_step"]:
                text += f" (wire {format_bytes(r['wire_bytes_per_step'])})"
            if i and base and base["bytes_out_per_step"]:
                text += f" {r['bytes_out_per_step'] / base['bytes_out_per_step'] - 1:+.0%}"
            cells.append(text)
        table.add_row(*key, *cells)
    console.print(table)


def _compare_schedule(runs: list[dict]) -> None:
    split = [(i, s) for i, run in enumerate(runs) for s in run.get("schedule") or []]
    if not split:
        return
    table = Table("run", "schedule", "steps", "bytes_out per step", "embedding bytes per step",
                  title="hot/cold schedule (steps.schedule)", title_justify="left")
    for i, s in split:
        table.add_row("BASE" if i == 0 else f"RUN {i}", s["schedule"], _cell(s["steps"]),
                      format_bytes(s["bytes_per_step"]), format_bytes(s["embedding_bytes_per_step"]))
    console.print(table)


def _compare_policies(rows: list[dict], base: str) -> None:
    if not rows:
        console.print("[dim]no run names a policy it applied (manifest `policy`): nothing predicted to compare[/]")
        return
    table = Table("run", "section", "figure", "predicted", "measured", "diff",
                  title=f"policies: predicted against measured (savings against BASE's measured totals; "
                        f"section baseline: policy.json's against BASE {base}; an estimate is ~value \\[low, high], "
                        f"a figure without an interval is exact)", title_justify="left")
    for r in rows:
        table.add_row(r["run"], r["section"], r["figure"], _policy_predicted(r), _policy_value(r, r["measured"]),
                      _policy_diff(r))
    console.print(table)


def _policy_value(row: dict, value: float | None) -> str:
    if value is None:
        return "n/a"
    shown = {"bytes": format_bytes, "s": lambda v: f"{v * 1e3:,.2f} ms", "fraction": lambda v: f"{v:.1%}"}
    return shown[row["unit"]](value)


def _policy_predicted(row: dict) -> str:
    """The predicted figure; an estimate as in `analyze`'s table, `~11.34 ms [10.10 ms, 12.40 ms]`."""
    shown = _policy_value(row, row["predicted"])
    if row["kind"] == "estimated":
        return f"~{shown} [{_policy_value(row, row['predicted_low'])}, {_policy_value(row, row['predicted_high'])}]"
    return shown


def _policy_diff(row: dict) -> str:
    if row["unit"] == "fraction":
        return "n/a" if row["diff"] is None else f"{row['diff'] * 100:+.1f} pts"
    return "n/a" if row["diff_pct"] is None else f"{row['diff_pct']:+.1%}"


def print_simulate(summary: dict) -> None:
    """`tracekit simulate`: the target, then one row per policy with its bytes and time per step."""
    from tracekit.units import format_rate

    target, source = summary["target"], summary["source"]
    console.print(f"projected onto {target['topology']} ({target['world']} ranks, batch "
                  f"{target['batch_per_device']:g} per rank): {format_rate(target['inter_bw'])} between nodes, "
                  f"{format_rate(target['intra_bw'])} within; latency {target['latency_s'] * 1e6:,.0f} µs per "
                  f"collective; from {summary['run']} ({source['world']} ranks, compute "
                  f"{_seconds(source['compute_s'])} per step of {_seconds(source['step_time_s'])} measured)")
    table = Table("policy", "bytes / step", "between nodes / step", "compute", "communication", "step time",
                  "comm share", "speedup", title=f"simulate ({summary['method']}: bytes "
                  f"{'as recorded and replayed' if summary['method'] == 'replay' else 'scaled per sample'})",
                  title_justify="left")
    for row in summary["rows"]:
        table.add_row(row["policy"], format_bytes(row["bytes_per_step"]), format_bytes(row["inter_node_bytes_per_step"]),
                      _seconds(row["compute_s"]), _seconds(row["comm_s"]), _seconds(row["step_time_s"]),
                      "" if row["comm_share"] is None else f"{row['comm_share']:.0%}", _ratio(row["speedup"]))
    console.print(table)
    for note in summary.get("notes", []):
        console.print(f"note: {note}")


def _seconds(value: float | None) -> str:
    return "?" if value is None else f"{value * 1e3:,.1f} ms"

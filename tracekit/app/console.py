"""What the commands print (rich): every console table, summary line and progress bar, so the
library returns data and the CLI only prints it.

    with analysis_progress(enabled=True) as progress:
        summary = analyze_run(run, options, progress=progress)
    print_analysis(summary)
"""

from __future__ import annotations

import contextlib
import json
import shutil
import signal
import sys
from pathlib import Path
from typing import Any, Callable, Iterator

from rich.console import Console
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from tracekit.figures import A2A_BYTES, A2A_REMOTE_BYTES, SHOWN, STEP_TIME, SYNC_BYTES
from tracekit.losses import lost_by_table
from tracekit.units import format_bytes

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


def format_duration(seconds: float) -> str:
    """A rough duration for a person: "5 s", "40 s", "3 min"."""
    if seconds < 10:
        return f"{max(1, round(seconds))} s"
    if seconds < 90:
        return f"{round(seconds / 5) * 5} s"
    return f"{round(seconds / 60)} min"


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
        table.add_row(*(_cell(v) for v in row))
    terminal.print(table)


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:,.4g}"
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}"
    return "" if value is None else str(value)


def print_analysis(summary: dict) -> None:
    """The summary a person reads in a minute: warnings, skew, traffic, timeline, cache, the cost
    model's check, each policy with its predicted saving and why, what could not be derived."""
    for warning in summary["warnings"]:
        terminal.print(f"[yellow]warning:[/] {warning}")
    analyses = summary["analyses"]
    traffic = analyses.get("traffic", {})
    terminal.print(f"[bold]{summary['run']}[/] ({summary['status']}): {traffic.get('steps', '?')} training steps, "
                   f"{traffic.get('world_size', '?')} rank(s); every figure is from training rows unless it says eval")
    for name, render in RENDERERS.items():
        if name in analyses:
            render(analyses[name])
    if summary.get("network"):
        _network(summary["network"])
    if summary.get("replay"):
        _replay(summary["replay"])
    _print_policies(summary)
    for note in summary["notes"]:
        terminal.print(f"[dim]note: {note}[/]")
    terminal.print(f"wrote {len(summary['written'])} files: {summary['run']}/analysis/*.parquet, policy.json, policy/*.parquet "
                   f"(tracekit sql {summary['run']} \"SELECT ...\" reads them all)")


def _skew(summary: dict) -> None:
    table = Table("table", "rows", "touched", "lookups", "top 1%", "top 10%", "gini", "zipf α", "rows for 90%",
                  "hot-set jaccard", title="skew: share of lookups taken by the most-read rows", title_justify="left")
    for name, t in summary["tables"].items():
        table.add_row(name, _cell(t["num_rows"]), _cell(t["rows_touched"]), _cell(t["lookups"]),
                      f"{t['top_1pct_share']:.1%}", f"{t['top_10pct_share']:.1%}", f"{t['gini']:.2f}",
                      f"{t['zipf_alpha']:.2f}", _cell(t["rows_for_90pct"]), _ratio(t.get("hot_set_jaccard")))
    terminal.print(table)


def _traffic(summary: dict) -> None:
    table = Table("tag", "bytes per training step", title="traffic: bytes_out of every rank, per training step",
                  title_justify="left")
    for tag, value in sorted(summary["train_bytes_per_step_by_tag"].items(), key=lambda kv: -kv[1]):
        table.add_row(tag, format_bytes(value))
    table.add_row("[bold]total[/]", format_bytes(summary["train_bytes_per_step"]))
    terminal.print(table)
    bandwidth = ", ".join(f"{op} {format_bytes(v)}/s" for op, v in summary["bandwidth"].items() if v)
    terminal.print(f"  crossing ranks: {format_bytes(summary['cross_rank_bytes_per_step'])} per step; "
                  f"bus bandwidth measured: {bandwidth or 'n/a'}; eval, beside: {format_bytes(summary['eval_bytes'])} in all")


def _timeline(summary: dict) -> None:
    table = Table("rank", "step", "compute", "communication", "waiting", title="timeline: mean per training step",
                  title_justify="left")
    for rank, t in summary["per_rank"].items():
        table.add_row(rank, *(f"{t[k] * 1e3:.1f} ms" for k in ("step_s", "compute_s", "comm_s", "wait_s")))
    terminal.print(table)
    stragglers = summary["stragglers"]
    if stragglers["mean_end_spread_s"] is None:  # one rank, or no step every rank ended
        terminal.print("  last to end a step: n/a (no step ended on more than one rank)")
        return
    terminal.print(f"  last to end a step: {', '.join(f'rank {r} {n}x' for r, n in stragglers['last'].items())}; "
                  f"mean spread {stragglers['mean_end_spread_s'] * 1e3:.2f} ms")


def _cache(summary: dict) -> None:
    factors = [f for f in ("0.1", "0.2") if f in {str(x) for x in summary["load_factors"]}]
    columns = [f"{policy} @{f}" for f in factors for policy in ("lru", "lfu", "oracle")]
    table = Table("table", "distinct rows / step", *columns,
                  title="cache: miss ratio at cache load factors (FBGEMM TBE semantics)", title_justify="left")
    for name, t in summary["tables"].items():
        table.add_row(name, _cell(t["expected_lookups"]),
                      *(f"{t['miss_ratio'][policy][f]:.1%}" for f in factors for policy in ("lru", "lfu", "oracle")))
    terminal.print(table)


def _costmodel(summary: dict) -> None:
    if "baseline_a2a_bytes_per_step" not in summary:
        return
    matches = "equal to" if summary.get("baseline_matches_comms") else "[red]different from[/]"
    terminal.print(f"cost model: the replayed embedding exchange, {format_bytes(summary['baseline_a2a_bytes_per_step'])} "
                  f"per step ({format_bytes(summary['baseline_a2a_remote_bytes_per_step'])} crossing ranks), is "
                  f"{matches} the bytes in comms" + ("" if summary.get("distinct_rows_max_rel_diff") is None else
                                                     f"; E[U] within {summary['distinct_rows_max_rel_diff']:.1%} of the replay"))


def _network(n: dict) -> None:
    """One line on the model every predicted time comes from (analyses.network)."""
    alphas = ", ".join(f"{op} {a * 1e3:.2f} ms" for op, a in sorted(n["alpha_s"].items())) or "none timed"
    rate = f"{format_bytes(n['bandwidth_bytes_per_s'])}/s" if n.get("bandwidth_bytes_per_s") else "bytes free (β ≈ 0)"
    step = n.get(STEP_TIME)
    terminal.print(f"network model: α {alphas}; link {rate}; fit residual {n['residual_s'] * 1e3:.2f} ms over "
                  f"{n['calls_fitted']} of {n['calls']} calls; baseline step "
                  + (f"{step * 1e3:.2f} ms ± {n['step_spread_s'] * 1e3:.2f} ms drift" if step else "unknown")
                  + f" ({n['warmup_steps']} warm-up steps left out); rank work {n['rank_work'].split(' (')[0]}")


def _replay(r: dict) -> None:
    """One line on the replay the policies' step times come from (analyses/replay/): how well it fits."""
    check, fit = r["check"], r["fit"]
    link = r["inter_bytes_per_s"] or r["intra_bytes_per_s"]
    rate = f"{format_bytes(link)}/s" if link else "unbounded"
    given = f" (given {format_bytes(fit['link_given_bytes_per_s'])}/s)" if fit.get("link_given_bytes_per_s") else ""
    terminal.print(f"replay: {check['steps']} steps; link {rate}{given}, residual {fit['residual_s'] * 1e3:.2f} ms over "
                   f"{fit['calls']} of {fit['of']} calls; baseline replayed p50 {check['p50']['replayed_s'] * 1e3:.1f} ms "
                   f"against {check['p50']['measured_s'] * 1e3:.1f} ms measured ({check['p50']['error']:+.1%}), "
                   f"p90 {check['p90']['replayed_s'] * 1e3:.1f} against {check['p90']['measured_s'] * 1e3:.1f} ms "
                   f"({check['p90']['error']:+.1%})")


def _torchrec_plan(summary: dict) -> None:
    """One line per table the derived TorchRec plan moves, and its decision (analyses/torchrec_plans.py)."""
    def where(table: dict) -> str:
        return f"{table['sharding_type']} on {','.join(str(r) for r in table['ranks'])}"

    moved = {name: (where(summary["recorded"][name]), where(t)) for name, t in summary["derived"].items()
             if where(t) != where(summary["recorded"][name])}
    step = summary["predicted"].get("step_time_s")
    decision = "[green]recommended:[/] " if summary["recommended"] else ""  # else the why says why not
    terminal.print(f"torchrec plan ({summary['written'][0]}): {len(moved)} of {len(summary['derived'])} tables moved; "
                   f"a2a {format_bytes(summary['baseline']['a2a_bytes_per_step'])} → "
                   f"{format_bytes(summary['predicted']['a2a_bytes_per_step'])} a step, step "
                   + (f"{summary['baseline']['step_time_s'] * 1e3:.2f} → {step * 1e3:.2f} ms" if step else "not predicted")
                   + f"; {decision}{summary['why']}")
    for name, (before, after) in list(moved.items())[:10]:
        terminal.print(f"  {name}: {before} → {after}")


RENDERERS = {"skew": _skew, "traffic": _traffic, "timeline": _timeline, "cache": _cache, "costmodel": _costmodel,
             "torchrec_plan": _torchrec_plan}


def _print_policies(summary: dict) -> None:
    baseline = summary.get("baseline") or {}
    table = Table("policy", "predicted per training step (all ranks)", "why", title="policies (policy.json)",
                  title_justify="left")
    if baseline:
        table.add_row("baseline (recorded)", _figures(baseline, SHOWN), "what the run did")
    for name, section in summary["policies"].items():
        parts = [(f"{name}.{sub}", section[sub]) for sub in ("dp", "mp") if sub in section] if name == "compression" \
            else [(name, section)]
        for label, body in parts:
            table.add_row(_decision(label, body), _figures(body["predicted"], SHOWN, body.get("intervals")),
                          body["why"] if body.get("recommended", True) else f"{body['reason']}\n[dim]{body['why']}[/]")
    if summary.get("combined"):
        combined = summary["combined"]
        table.add_row("[bold]combined[/]\n" + ", ".join(combined["sections"]),
                      _figures(combined["predicted"], SHOWN, combined.get("intervals")), combined["why"])
    for name, reason in summary["not_derived"].items():
        table.add_row(name, "[dim]not derived[/]", reason)
    for sub, reason in summary["policies"].get("compression", {}).get("evidence", {}).get("not_derived", {}).items():
        table.add_row(f"compression.{sub}", "[dim]not derived[/]", reason)
    terminal.print(table)




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
    if key.endswith("rel_change"):
        return f"{value:+.2%}"
    if key.endswith("_change"):
        return f"{value:+.4f}"
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
        terminal.print(f"[yellow]warning:[/] {warning}")
    runs = summary["runs"]
    terminal.print(f"[bold]compare[/]: {len(runs) - 1} run(s) against BASE {summary['base']}; training rows only, "
                  f"bytes over every training step, times after the first {summary['skip_steps']} steps")
    table = Table("", *(_heading(i, r) for i, r in enumerate(runs)),
                  title="runs (RUN figures with their ratio to BASE)", title_justify="left")
    for label, key, kind in COMPARE_FIGURES:
        table.add_row(label, *(_compared(r, runs[0], key, kind, i == 0) for i, r in enumerate(runs)))
    terminal.print(table)
    _compare_bytes(runs)
    _compare_schedule(runs)
    _compare_policies(summary["rows"], summary["base"])
    for note in summary["notes"]:
        terminal.print(f"[dim]note: {note}[/]")
    print_verdict(summary.get("verdict") or [])


def print_verdict(rows: list[dict]) -> None:
    """The verdict table (analyses.verdict): each section's decision, its step predicted and measured with
    their speedups over the measured baseline, its bytes and its model-quality change; why, below it."""
    if not rows:
        return
    from rich import box

    from analyses.verdict import TERMINAL_COLUMNS, cells

    table = Table(title="verdict: speedups over the measured baseline, ★ the fastest measured", title_justify="left",
                  box=box.SIMPLE_HEAD, pad_edge=False)
    for column in TERMINAL_COLUMNS:
        table.add_column(column, no_wrap=True)
    for row in rows:
        table.add_row(*cells(row, compact=True)[:len(TERMINAL_COLUMNS)], style="bold" if row["best"] else None)
    terminal.print(table)
    for row in rows:
        terminal.print(f"  {row['label']}: {'recommended' if row['recommended'] else 'not recommended'}, {row['why']}")


COMPARE_FIGURES = (  # label, figure, how it is shown and compared
    ("device, backend, world, cores", "where", "text"), ("status", "status", "text"),
    ("training steps (timed)", "steps", "steps"),
    ("step time, median", STEP_TIME, "time"), ("step time, p90", "step_time_p90_s", "time"),
    ("samples/s", "samples_per_s", "rate"), ("samples per step", "samples_per_step", "count"),
    ("bytes_out per step, all ops", "bytes_per_step", "bytes"),
    ("wire bytes per step, all ops", "wire_bytes_per_step", "bytes"),
    ("embedding all-to-all", A2A_BYTES, "bytes"), ("  of it remote", A2A_REMOTE_BYTES, "bytes"),
    ("replica sync (wire)", SYNC_BYTES, "bytes"), ("embedding total", "total_bytes_per_step", "bytes"),
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
    terminal.print(table)


def _compare_schedule(runs: list[dict]) -> None:
    split = [(i, s) for i, run in enumerate(runs) for s in run.get("schedule") or []]
    if not split:
        return
    table = Table("run", "schedule", "steps", "bytes_out per step", "embedding bytes per step",
                  title="hot/cold schedule (steps.schedule)", title_justify="left")
    for i, s in split:
        table.add_row("BASE" if i == 0 else f"RUN {i}", s["schedule"], _cell(s["steps"]),
                      format_bytes(s["bytes_per_step"]), format_bytes(s["embedding_bytes_per_step"]))
    terminal.print(table)


def _compare_policies(rows: list[dict], base: str) -> None:
    if not rows:
        terminal.print("[dim]no run names a policy it applied (manifest `policy`): nothing predicted to compare[/]")
        return
    table = Table("run", "section", "figure", "predicted", "measured", "diff",
                  title=f"policies: predicted against measured (savings against BASE's measured totals; "
                        f"section baseline: policy.json's against BASE {base}; an estimate is ~value \\[low, high], "
                        f"a figure without an interval is exact)", title_justify="left")
    for r in rows:
        table.add_row(r["run"], r["section"], r["figure"], _policy_predicted(r), _policy_value(r, r["measured"]),
                      _policy_diff(r))
    terminal.print(table)


def _policy_value(row: dict, value: float | None) -> str:
    if value is None:
        return "n/a"
    shown = {"bytes": format_bytes, "s": lambda v: f"{v * 1e3:,.2f} ms", "fraction": lambda v: f"{v:.1%}",
             "auc": lambda v: f"{v:+.4f}", "relative": lambda v: f"{v:+.2%}"}
    return shown[row["unit"]](value)


def _policy_predicted(row: dict) -> str:
    """The predicted figure; an estimate as in `analyze`'s table, `~11.34 ms [10.10 ms, 12.40 ms]`."""
    shown = _policy_value(row, row["predicted"])
    if row["kind"] == "estimated":
        return f"~{shown} [{_policy_value(row, row['predicted_low'])}, {_policy_value(row, row['predicted_high'])}]"
    return shown


def _policy_diff(row: dict) -> str:
    if row["unit"] == "auc":
        return "n/a" if row["diff"] is None else f"{row['diff']:+.4f}"
    if row["unit"] == "relative":
        return "n/a" if row["diff"] is None else f"{row['diff'] * 100:+.2f} pts"
    if row["unit"] == "fraction":
        return "n/a" if row["diff"] is None else f"{row['diff'] * 100:+.1f} pts"
    return "n/a" if row["diff_pct"] is None else f"{row['diff_pct']:+.1%}"


def print_simulate(summary: dict) -> None:
    """`tracekit simulate`: the target, then one row per policy with its bytes and time per step."""
    from tracekit.units import format_rate

    target, source = summary["target"], summary["source"]
    terminal.print(f"projected onto {target['topology']} ({target['world']} ranks, batch "
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
                      _seconds(row["compute_s"]), _seconds(row["comm_s"]), _seconds(row[STEP_TIME]),
                      "" if row["comm_share"] is None else f"{row['comm_share']:.0%}", _ratio(row["speedup"]))
    terminal.print(table)
    for note in summary.get("notes", []):
        terminal.print(f"note: {note}")


def _seconds(value: float | None) -> str:
    return "?" if value is None else f"{value * 1e3:,.1f} ms"


def show(summary: dict, as_json: bool, render: Callable[[dict], None], report: bool = False) -> None:
    """A command's result: one JSON object on stdout, or `render`ed for a person (with the report's path)."""
    if as_json:
        return print(json.dumps(summary, default=str))
    render(summary)
    if report:
        print(f"report: {summary['report']}")


def describe_record(s: dict) -> str:
    """`tracekit record`'s closing lines (on stderr): how the command ended, steps and rows per rank."""
    elapsed = "?" if s["elapsed_s"] is None else f"{s['elapsed_s']:.1f}"
    code = s["exit_code"]
    ended = f"exited with {code}" if code >= 0 else f"was killed by signal {-code} ({_signal_name(-code)})"
    exits = f"  command {ended}; tracekit record exits with {s['record_exit_code']}"
    if not s["traced"]:
        lines = [f"tracekit: {s['status']} after {elapsed} s; nothing was traced into {s['run_dir']}", exits,
                 f"  why: {s['untraced_reason']}"]
    else:
        steps = ", ".join(f"{rank}: {s['steps'].get(str(rank), 'unknown')}" for rank in s["ranks"])
        rows = ", ".join(f"{table} {n:,}" for table, n in sorted(s["rows"].items())) or "none"
        lines = [f"tracekit: {s['status']} after {elapsed} s: {len(s['ranks'])} rank(s), "
                 f"{s['bytes'] / 1e6:.1f} MB in {s['run_dir']}", exits, f"  steps per rank: {steps}",
                 f"  rows: {rows}", f"  gpu: {s['gpu']}"]
        if s["writer_cpu_s"]:
            cpu = ", ".join(f"{rank}: {seconds:.2f} s" for rank, seconds in sorted(s["writer_cpu_s"].items()))
            lines.append(f"  trace writer CPU per rank (counting, encoding, writing): {cpu}{_scheduling(s)}")
    for rank, last in sorted(s["truncated_at"].items(), key=lambda kv: int(kv[0])):
        why = s["writer_first_errors"].get(rank, "a write failed")
        lines.append(f"  the trace is incomplete: rank {rank} lost rows from step {last + 1} on ({why}); its steps "
                     f"up to {last} are whole (manifest `truncated_at`), the rows lost are counted in `dropped_rows`")
    lines += [f"  manifest incomplete: {error}" for error in s["finalise_errors"]]
    if s["traced"]:
        lines.append(describe_loss(s["lost_rows"], s["lost_lookups"]))
    return "\n".join(lines)


def describe_loss(lost_rows: dict[str, int], lost_lookups: int) -> str:
    """One line: whether the trace holds every row the run made, and if not, what it lost per table."""
    if not lost_rows:
        return "  the trace is whole: no row lost"
    return (f"  the trace is NOT whole: {sum(lost_rows.values()):,} rows lost ({lost_by_table(lost_rows, lost_lookups)}; "
            "manifest `lost_rows`): figures from those tables undercount")


def _scheduling(summary: dict) -> str:
    """How the ranks' writer threads ran, for the summary: '' if the manifest does not say."""
    ranks = summary["writer_scheduling"].values()
    if not ranks:
        return ""
    policies = ", ".join(sorted({r["policy"] for r in ranks}))
    rescues = sum(r["rescues"] for r in ranks)
    lifted = f"; lifted {rescues} time(s) where no core was idle" if rescues else ""
    return f" ({policies}{lifted})"


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return "unknown signal"


def print_calibration(c: dict) -> None:
    """`tracekit calibrate`'s table: each model's coefficients and residual, in µs (ns per element)."""
    def us(seconds: float) -> str:
        return f"{seconds * 1e6:,.1f} µs"

    def ns(seconds: float) -> str:
        return f"{seconds * 1e9:,.1f} ns"

    m, i = c["machine"], c["inputs"]
    say = print  # plain lines, as they are: no wrapping or markup
    say(f"calibration of {i['run']} ({i['world_size']} rank(s), batch {i['batch_per_rank']} per rank, "
        f"{i['optimizer']}) on {m['host']}: {m['cpu']}, {m['cores']} cores, {m['threads']} thread(s), "
        f"torch {m['torch']}, {m['backend']} world {m['world_size']}, {m['clock']} time, "
        f"load {m['load_avg']}; took {c['seconds']:.1f} s")
    say("replication: extra per step = c0 + c_ids·ids + c_hot·hot ids + c_rows·rows synchronised")
    say(f"  {'sync':<18}{'c0':>12}{'c_ids':>12}{'c_hot':>12}{'c_rows':>12}{'residual':>12}  collectives")
    for sync, r in c["replication"].items():
        calls = ", ".join(f"{n} {op}" for op, n in r["collectives"].items())
        say(f"  {sync:<18}{us(r['c0_s']):>12}{ns(r['c_ids_s']):>12}{ns(r['c_hot_s']):>12}"
            f"{ns(r['c_rows_s']):>12}{us(r['residual_s']):>12}  {calls}")
    say("collective call (world 1, no wire): " + ", ".join(f"{op} {us(s)}" for op, s in c["collective_call_s"].items()))
    dp, mp, fae = c["dct_dp"], c["dct_mp"], c["schedule"]
    say(f"DCT-DP hook over the plain one (keep ratio {dp['keep_ratio']}): {us(dp['c_bucket_s'])} per bucket + "
        f"{ns(dp['c_elem_s'])} per element (residual {us(dp['residual_s'])}); a refresh adds "
        f"{ns(dp['c_refresh_elem_s'])} per element (residual {us(dp['refresh_residual_s'])})")
    say(f"DCT-MP codec (dim {mp['dim']}): {us(mp['c0_s'])} per step + {ns(mp['c_value_s'])} per value sent + "
        f"{ns(mp['c_kept_s'])} per value kept (residual {us(mp['residual_s'])})")
    say(f"FAE schedule: {ns(fae['c_sample_s'])} per sample taken by index (in-memory data); hot split "
        f"{ns(fae['setup_s_per_sample'])} per training sample, once")
    for note in c["notes"]:
        say(f"note: {note}")


def print_planner(summary: dict) -> None:
    """`tracekit planner`: per table its TorchRec planner inputs, then the snippet to paste."""
    for name, t in summary["tables"].items():
        caches = ", ".join(f"{float(h):.0%}: {c['load_factor']:.3g} ({c['source']})"
                           for h, c in t["cache_load_factor"].items() if c["load_factor"] is not None)
        pooling = t["pooling_factor"] if t["pooling_factor"] is None else round(t["pooling_factor"], 3)
        print(f"{name}: {t['num_embeddings']:,} rows x {t['embedding_dim']}, {t['n_features']} feature(s), "
              f"pooling factor {pooling}, cache load factor for an LRU hit rate of {caches or 'any: unknown'}")
    print(f"pooling factors: {summary['pooling_source']}; written: {summary['constraints']}")
    print(summary["snippet"])


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

"""What `tracekit compare` (and `optimize`, at its end) prints for a person (rich): the runs side by
side with each RUN's ratio to BASE, bytes by op and tag, the hot/cold split, each policy's predicted
against measured figures, and the verdict table.

    print_compare(compare(base, runs))
"""

from __future__ import annotations

from typing import Any

from rich.table import Table

from tracekit.app.console import terminal
from tracekit.figures import A2A_BYTES, A2A_REMOTE_BYTES, STEP_TIME, SYNC_BYTES
from tracekit.units import (PREDICTION_UNITS, format_bytes, format_cell, format_count, format_decimal, format_diff,
                            format_general, format_ms)


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
    shown = {"text": str, "time": lambda v: format_ms(v, 2), "rate": format_count,
             "count": lambda v: format_general(v, 6), "bytes": format_bytes, "metric": format_decimal}[kind](value)
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
        table.add_row("BASE" if i == 0 else f"RUN {i}", s["schedule"], format_cell(s["steps"]),
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
                      format_diff(r, "n/a"))
    terminal.print(table)


def _policy_value(row: dict, value: float | None) -> str:
    return "n/a" if value is None else PREDICTION_UNITS[row["unit"]](value)


def _policy_predicted(row: dict) -> str:
    """The predicted figure; an estimate as in `analyze`'s table, `~11.34 ms [10.10 ms, 12.40 ms]`."""
    shown = _policy_value(row, row["predicted"])
    if row["kind"] == "estimated":
        return f"~{shown} [{_policy_value(row, row['predicted_low'])}, {_policy_value(row, row['predicted_high'])}]"
    return shown

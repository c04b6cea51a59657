"""The table of bench/prediction_accuracy.py: its results.jsonl rows as a rich table, a markdown table for
bench/RESULTS.md, and one line per target (how many sections met it, which did not).

    rows = [json.loads(line) for line in open("runs/prediction_accuracy/results.jsonl")]  # last row of a key wins
    print(markdown_table(rows, (["ratings-2t", ...], ("default", "every1"))))
"""

from __future__ import annotations

import statistics

from rich.table import Table

from tracekit.policy import TRAINING
from tracekit.units import format_bytes

NOTE_CHARS = 160  # in the table; results.jsonl keeps every word
BYTE_COLUMNS = {"a2a_bytes_per_step": "a2a", "a2a_remote_bytes_per_step": "remote",
                "sync_bytes_per_step": "sync", "dp_bytes_per_step": "dp"}
Order = tuple[list[str], tuple[str, ...]]  # workload names, modes: the order rows are shown in


COLUMNS = ("workload", "lookups", "section", "rec.", *BYTE_COLUMNS.values(), "step ms pred [interval] / meas (err)",
           "speedup meas (pred)", "baseline ms med [min–max]", "bytes", "time", "no harm", "decision", "note")


def cells(row: dict) -> list[str]:
    figures = row.get("figures") or {}
    mode = "every step" if row["mode"] == "every1" else "default"
    rec = "—" if row["recommended"] is None else "yes" if row["recommended"] else "no"
    out = [row["workload"], mode, row["section"], rec]
    for figure in BYTE_COLUMNS:
        f = figures.get(figure)
        out.append("" if not f else f"{_bytes(f['predicted'])} / {_bytes(f['measured'])} ({_pct(f['err'])})")
    step = figures.get("step_time_s") or {}
    measured_s = row.get("step_time_s")
    interval = ("" if step.get("predicted_low") is None else
                f" [{_ms(step['predicted_low'])}–{_ms(step['predicted_high'])}]")
    out.append("" if measured_s is None and not step else
               f"{_ms(step.get('predicted'))}{interval} / {_ms(measured_s)} ({_pct(step.get('err'))})")
    speed = "" if row.get("speedup") is None else f"{row['speedup']:.2f}×"
    if speed and row.get("predicted_speedup"):
        speed += f" ({row['predicted_speedup']:.2f}×)"
    out.append(speed)
    base = row.get("baseline_times_s") or (row.get("step_times_s") if row["section"] == "baseline" else None)
    out.append("" if not base else f"{_ms(statistics.median(base))} [{_ms(min(base))}–{_ms(max(base))}]")
    checked = row.get("checks") or {}
    out += [{True: "✓", False: "✗", None: ""}[checked.get(k)] for k in ("bytes", "time", "no_harm")]
    out.append(row.get("decision") or "")
    note = row.get("skip") or row.get("error") or (f"not recommended: {row['reason']}" if row.get("reason") else "")
    if row.get("trainer_skipped"):
        note = f"trainer skipped {', '.join(row['trainer_skipped'])}; {note}".rstrip("; ")
    if row.get("failed"):
        note = f"{row['failed']} run(s) failed: {note}"
    out.append(note if len(note) <= NOTE_CHARS else note[:NOTE_CHARS - 1] + "…")
    return out


def ordered(rows: list[dict], order: Order) -> list[dict]:
    """Section summaries, skips and failures by workload, mode, then baseline, sections, combined."""
    workloads, modes = order
    labels = ["baseline", *TRAINING, "combined"]
    shown = [r for r in rows if r["kind"] in ("section", "skipped")
             or (r["kind"] in ("record", "analyze", "plan") and r["status"] != "ok")]
    return sorted(shown, key=lambda r: (workloads.index(r["workload"]) if r["workload"] in workloads else 99,
                                        modes.index(r["mode"]),
                                        labels.index(r["section"]) if r.get("section") in labels else -1))


def _failure_cells(row: dict) -> list[str]:
    what = "skipped" if row["kind"] == "skipped" else f"{row['kind']} failed"
    reason = row.get("reason") or row.get("error") or ""
    return [row["workload"], "every step" if row["mode"] == "every1" else "default", what,
            *[""] * (len(COLUMNS) - 4), reason]


def table_cells(rows: list[dict], order: Order) -> list[list[str]]:
    return [cells(r) if r["kind"] == "section" else _failure_cells(r) for r in ordered(rows, order)]


def rich_table(rows: list[dict], order: Order) -> Table:
    table = Table(title="prediction accuracy: predicted / measured (err = predicted / measured − 1)")
    for name in COLUMNS:
        table.add_column(name, overflow="fold")
    for c in table_cells(rows, order):
        table.add_row(*c)
    return table


def markdown_table(rows: list[dict], order: Order) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(c.replace("|", "\\|") for c in r) + " |" for r in table_cells(rows, order)]
    return "\n".join(lines)


def summary_lines(rows: list[dict]) -> list[str]:
    """How many sections met each target, and which did not."""
    summaries = [r for r in rows if r["kind"] == "section" and r.get("checks")]
    out = []
    for check, target in (("bytes", "bytes within 2% (default) / exact (every step)"),
                          ("time", "step time within 10%"),
                          ("no_harm", "no recommended section slower than every baseline re-run")):
        checked = [r for r in summaries if r["checks"].get(check) is not None]
        missed = [f"{r['workload']}/{r['mode']}/{r['section']}" for r in checked if not r["checks"][check]]
        out.append(f"- {target}: {len(checked) - len(missed)} of {len(checked)} met"
                   + (f"; missed: {', '.join(missed)}" if missed else ""))
    decisions = [r["decision"] for r in summaries if r.get("decision")]
    kinds = ("right", "no gain", "slower", "missed")
    out.append("- decisions: " + ", ".join(f"{d} {decisions.count(d)}" for d in kinds))
    estimated = [f for r in summaries for f in r["figures"].values() if f.get("in_interval") is not None]
    out.append(f"- measured inside the stated interval: {sum(f['in_interval'] for f in estimated)} of "
               f"{len(estimated)} estimated figures")
    failed = [r for r in rows if r.get("status") in ("failed", "unmeasured")]
    if failed:
        out.append(f"- {len(failed)} run(s) failed or unmeasured: "
                   + "; ".join(f"{r['key']}: {r.get('error')}" for r in failed[:10]))
    return out


def _bytes(n: float | None) -> str:
    return "?" if n is None else format_bytes(n)


def _ms(s: float | None) -> str:
    return "?" if s is None else f"{s * 1e3:.1f}"


def _pct(err: float | None) -> str:
    if err is None:
        return "n/a"
    return "exact" if abs(err) < 1e-9 else f"{err:+.1%}"

"""What `tracekit record` says when the command ends (on stderr): how the command ended, what was
traced per rank, what the trace lost, and why nothing was traced where nothing was.

    print(describe_record(recording.summary(run_dir, manifest.read(run_dir))), file=sys.stderr)
"""

from __future__ import annotations

import signal

from tracekit.losses import lost_by_table

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

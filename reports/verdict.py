"""The report's head: the verdict (a few sentences and analyses.verdict's table), the overview of the
runs, and the warnings a reader must know before trusting a run's figures. Like the other sections,
each is a function from the runs' inputs (reports.inputs); numbers are shown by tracekit.units.show.
"""

from __future__ import annotations

import shlex

from reports.html import PageSection, esc, table
from reports.inputs import RunInputs
from reports.sections import train_timeline
from tracekit.losses import loss_warning, lost_rows
from tracekit.units import show
from tracekit.window import Window


# verdict ----------------------------------------------------------------------------------------

def verdict(runs: list[RunInputs], compare: dict | None) -> list[str]:
    """The few sentences under the verdict's table (`verdict_table`): where the step goes, how skewed the
    lookups are, and whether the run completed."""
    base = runs[0]
    lines = []
    timeline = train_timeline(base)
    if timeline is not None and timeline["step_s"].sum() > 0:
        share = timeline["comm_s"].sum() / timeline["step_s"].sum()
        lines.append(f"communication is {share:.0%} of step time over {timeline['rank'].n_unique()} rank(s)")
    skew = base.table("skew")
    if skew is not None:
        top = skew.sort("lookups", "num_rows", descending=True).row(0, named=True)
        if top["num_rows"]:
            lines.append(f"in table {top['table_name']} (most lookups), {top['rows_for_90pct'] / top['num_rows']:.1%} "
                         f"of rows take 90% of lookups (Zipf α {show('zipf_alpha', top['zipf_alpha'])})")
    if base.manifest.status != "completed":
        lines.append(f"the run is {base.manifest.status} (exit code {base.manifest.exit_code}): "
                     "figures cover what was recorded")
    return lines or ["no analysis figure to summarise (see the sections for what is missing)"]


def verdict_table(run: RunInputs, compare: dict | None) -> str:
    """The verdict's table (analyses.verdict): a row per training section of the run's policy, the
    recommended combination first, predicted against measured; "" where the run has no policy."""
    from analyses.verdict import COLUMNS, cells, verdict as rows

    found = [row.to_json() for row in rows(run.policy, compare)]
    if not found:
        return ""
    return ('<p class="muted">Each section: whether analyze recommends it and why, its step time predicted and, '
            'where a run applied it, measured, with speedups over the measured baseline (★: the fastest measured), '
            'its bytes per step and its change of eval AUC and log loss.</p>'
            + table(COLUMNS, [cells(r) for r in found], left={0, 1, 9}))


# overview ---------------------------------------------------------------------------------------

def overview(runs: list[RunInputs]) -> PageSection:
    s = PageSection("overview", "Overview")
    rows = []
    for run in runs:
        m = run.manifest
        devices = m.devices or {}
        gpus = (m.gpu or {}).get("devices") or []
        device = ", ".join(str(g.get("name", g)) if isinstance(g, dict) else str(g) for g in gpus) or \
            f"{devices.get('cpu', '?')}, {devices.get('cores', '?')} cores"
        steps = m.steps
        steps = ", ".join(f"{k}: {v}" for k, v in steps.items()) if isinstance(steps, dict) else steps
        metrics = m.metrics or {}
        rows.append([run.name, m.status, m.exit_code, len(m.ranks or []), m.backend,
                     device, len(m.tables or ()), steps, show("samples_per_s", metrics.get("samples_per_s"))])
        s.intro.append(f"<p><code>{esc(run.name)}</code>: <code>{esc(shlex.join(map(str, m.command or [])))}"
                       "</code></p>")
    s.intro.insert(0, table(["run", "status", "exit code", "ranks", "backend", "devices", "tables", "steps per rank",
                             "samples/s"], rows, left={0, 1, 4, 5, 7}))
    said: dict[str, list[str]] = {}
    for run in runs:
        for w in warnings(run):
            said.setdefault(w, []).append(run.name)
    s.intro.extend(f'<p class="warn">{esc(", ".join(names))}: {esc(w)}</p>' for w, names in said.items())
    return s


def warnings(run: RunInputs) -> list[str]:
    """What a reader must know before trusting the figures of `run`."""
    m = run.manifest
    out = []
    if m.status != "completed":
        out.append(f"partial run: status {m.status}, exit code {m.exit_code}; the figures cover the "
                   "steps recorded before it ended")
    lost = lost_rows(m)
    if lost:
        out.append(loss_warning(lost, m.lost_lookups))
    window = Window.of_settings(m.collector_settings)
    if not window.everything:
        out.append(f"accesses, lookups and comms were recorded on {window.describe()} (record --steps/--every): "
                   "every figure is over those steps")
    if m.truncated_at:
        out.append("the trace is incomplete (truncated_at): " + ", ".join(
            f"rank {r} whole up to step {s}" for r, s in sorted(m.truncated_at.items())) + "; figures cover those")
    gpu = m.gpu or {}
    if not gpu.get("samples"):
        out.append(f"no GPU samples: {gpu.get('reason') or 'NVML recorded nothing'}")
    if not m.tables:
        out.append("the manifest lists no embedding tables (a user script without nn.Embedding lookups): "
                   "no skew, cache or policy figures")
    if run.summary:
        out.extend(f"policy {k} not derived: {v}" for k, v in run.summary.get("not_derived", {}).items())
        out.extend(run.summary.get("notes", []))
        out.extend(run.summary.get("warnings", []))
    for error in m.finalise_errors or []:
        out.append(f"manifest incomplete: {error}")
    return list(dict.fromkeys(out))  # analyze's summary repeats what the manifest says (the loss)

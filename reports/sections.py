"""The report's sections, each a function from the runs' inputs (reports.inputs) to a Section; the
figures come from analysis tables as written, only filtered, sorted and thinned for drawing; every number in
a table is shown by reports.numbers.show in the unit its name says.
"""

from __future__ import annotations

import shlex
from typing import Any

import polars as pl

from reports.html import Chart, Section, esc, figure, table, thin
from reports.inputs import RunInputs
from reports.numbers import show
from tracekit.figures import A2A_BYTES, STEP_TIME, SYNC_BYTES
from tracekit.losses import loss_warning, lost_rows
from tracekit.window import Window

TOP_TABLES = 6
"""Tables drawn where one trace per table would crowd a chart (the ones with the most lookups)."""
TOP_ROWS = 20
SKEW_ROWS = 8
"""Tables listed in the skew section's table."""


def _cells(record: dict[str, Any], columns: tuple[str, ...]) -> list[str]:
    """The table row of `record`'s `columns`, each shown in the unit its name says (reports.numbers)."""
    return [show(c, record[c]) for c in columns]


def _busiest(run: RunInputs, limit: int = TOP_TABLES) -> list[str]:
    skew = run.table("skew")
    return [] if skew is None else skew.sort("lookups", descending=True)["table_name"].head(limit).to_list()


def _train_timeline(run: RunInputs) -> pl.DataFrame | None:
    """The timeline table less the warm-up steps that analyses.timeline leaves out of its means."""
    from analyses.network import warmup_steps

    frame = run.table("timeline")
    if frame is None:
        return None
    frame = frame.filter(pl.col("step") >= frame["step"].min() + warmup_steps(frame["step"].n_unique()))
    return frame.sort("rank", "step")


# verdict ----------------------------------------------------------------------------------------

def verdict(runs: list[RunInputs], compare: dict | None) -> list[str]:
    """The few sentences under the verdict's table (`verdict_table`): where the step goes, how skewed the
    lookups are, and whether the run completed."""
    base = runs[0]
    lines = []
    timeline = _train_timeline(base)
    if timeline is not None and timeline["step_s"].sum() > 0:
        share = timeline["comm_s"].sum() / timeline["step_s"].sum()
        lines.append(f"communication is {share:.0%} of step time over {timeline['rank'].n_unique()} rank(s)")
    skew = base.table("skew")
    if skew is not None:
        top = skew.sort("lookups", "num_rows", descending=True).row(0, named=True)
        if top["num_rows"]:
            lines.append(f"in table {top['table_name']} (most lookups), {top['rows_for_90pct'] / top['num_rows']:.1%} "
                         f"of rows take 90% of lookups (Zipf α {show('zipf_alpha', top['zipf_alpha'])})")
    if base.manifest.get("status") != "completed":
        lines.append(f"the run is {base.manifest.get('status')} (exit code {base.manifest.get('exit_code')}): "
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


def _predicted_saving(run: RunInputs, section: dict) -> float | None:
    from analyses.prediction_check import predicted_figures

    base = run.policy.get("baseline", {}) if run.policy else {}
    figures = predicted_figures(section.get("predicted", {}), {"total_bytes_per_step": base.get(A2A_BYTES)})
    return figures.get("saving")


# overview ---------------------------------------------------------------------------------------

def overview(runs: list[RunInputs]) -> Section:
    s = Section("overview", "Overview")
    rows = []
    for run in runs:
        m = run.manifest
        devices = m.get("devices", {})
        gpus = (m.get("gpu") or {}).get("devices") or []
        device = ", ".join(str(g.get("name", g)) if isinstance(g, dict) else str(g) for g in gpus) or \
            f"{devices.get('cpu', '?')}, {devices.get('cores', '?')} cores"
        steps = m.get("steps")
        steps = ", ".join(f"{k}: {v}" for k, v in steps.items()) if isinstance(steps, dict) else steps
        metrics = m.get("metrics") or {}
        rows.append([run.name, m.get("status"), m.get("exit_code"), len(m.get("ranks") or []), m.get("backend"),
                     device, len(m.get("tables") or []), steps, show("samples_per_s", metrics.get("samples_per_s"))])
        s.intro.append(f"<p><code>{esc(run.name)}</code>: <code>{esc(shlex.join(map(str, m.get('command') or [])))}"
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
    if m.get("status") != "completed":
        out.append(f"partial run: status {m.get('status')}, exit code {m.get('exit_code')}; the figures cover the "
                   "steps recorded before it ended")
    lost = lost_rows(m)
    if lost:
        out.append(loss_warning(lost, m.get("lost_lookups")))
    window = Window.of_settings(m.get("collector_settings"))
    if not window.everything:
        out.append(f"accesses, lookups and comms were recorded on {window.describe()} (record --steps/--every): "
                   "every figure is over those steps")
    if m.get("truncated_at"):
        out.append("the trace is incomplete (truncated_at): " + ", ".join(
            f"rank {r} whole up to step {s}" for r, s in sorted(m["truncated_at"].items())) + "; figures cover those")
    gpu = m.get("gpu") or {}
    if not gpu.get("samples"):
        out.append(f"no GPU samples: {gpu.get('reason') or 'NVML recorded nothing'}")
    if not m.get("tables"):
        out.append("the manifest lists no embedding tables (a user script without nn.Embedding lookups): "
                   "no skew, cache or policy figures")
    if run.summary:
        out.extend(f"policy {k} not derived: {v}" for k, v in run.summary.get("not_derived", {}).items())
        out.extend(run.summary.get("notes", []))
        out.extend(run.summary.get("warnings", []))
    for error in m.get("finalise_errors") or []:
        out.append(f"manifest incomplete: {error}")
    return list(dict.fromkeys(out))  # analyze's summary repeats what the manifest says (the loss)


# skew -------------------------------------------------------------------------------------------

def skew(run: RunInputs) -> Section:
    s = Section("skew", "Skew: which rows the lookups hit")
    coverage, stats = run.table("coverage"), run.table("skew")
    if coverage is None or stats is None:
        s.missing.append("the run has no accesses table (no embedding lookups were recorded), so there is no skew")
        return s
    fig = figure(title="Coverage: share of lookups taken by the hottest rows", x="rows, as a fraction of the table "
                 "(log scale)", y="share of lookups (fraction)", xaxis_type="log")
    for name, part in coverage.sort("table_name", "row_fraction").group_by("table_name", maintain_order=True):
        part = thin(part.select("row_fraction", "share").rows())
        fig.add_scatter(x=[p[0] for p in part], y=[p[1] for p in part], mode="lines", name=esc(name[0]))
    s.charts.append(Chart(fig, "A curve that rises early means few rows take most lookups: those rows are worth "
                               "replicating or caching."))
    ordered = stats.sort("lookups", "num_rows", descending=True)
    fig = figure(title="Zipf exponent per table (MLE fit)", x="table", y="Zipf α (unitless)")
    fig.add_bar(x=[esc(t) for t in ordered["table_name"]], y=ordered["zipf_alpha"].to_list(), name="α")
    s.charts.append(Chart(fig, "Tables sorted by lookups; α near or above 1 means a heavy head."))
    columns = ("table_name", "num_rows", "rows_touched", "lookups", "top_1pct_share", "top_10pct_share", "gini",
               "zipf_alpha", "rows_for_90pct")
    s.intro.append(table(["table", "rows", "rows touched", "lookups", "top 1%", "top 10%", "Gini", "Zipf α",
                          "rows for 90%"], [_cells(r, columns) for r in ordered.head(SKEW_ROWS).iter_rows(named=True)]))
    if ordered.height > SKEW_ROWS:
        s.intro.append(f'<p class="muted">The {SKEW_ROWS} of {ordered.height} tables with most lookups (then rows); '
                       f'every table: <code>tracekit sql {esc(run.name)} "select * from skew"</code>.</p>')
    hot = run.table("hot_rows")
    if hot is not None:
        top = hot.sort("count", descending=True).head(TOP_ROWS)
        fig = figure(title=f"The {top.height} most-read of the rows chosen for replication", x="table:row",
                     y="lookups (count)")
        fig.add_bar(x=[esc(f"{t}:{r}") for t, r in top.select("table_name", "row").rows()], y=top["count"].to_list())
        s.charts.append(Chart(fig, "The rows the replication policy picked, most read first."))
    stability = run.table("hot_set_stability")
    if stability is not None:
        fig = figure(title="Hot-set stability between windows", x="window (index)", y="Jaccard of top-k sets (0-1)")
        for name in _busiest(run):
            part = stability.filter(pl.col("table_name") == name).sort("window")
            fig.add_scatter(x=part["window"].to_list(), y=part["jaccard"].to_list(), mode="lines+markers",
                            name=esc(name))
        s.charts.append(Chart(fig, "Near 1: the hot rows stay hot, so a static hot set chosen once keeps paying."))
    return s


# traffic ----------------------------------------------------------------------------------------

def traffic(run: RunInputs) -> Section:
    s = Section("traffic", "Traffic: bytes between ranks")
    matrix, by_op, bw = run.table("traffic_matrix"), run.table("traffic_by_op"), run.table("bandwidth")
    if by_op is None:
        s.missing.append("the run has no comms table (one rank, or no torch.distributed collective)")
        return s
    if matrix is not None:
        ranks = sorted(set(matrix["src"]) | set(matrix["dst"]))
        cells = {(a, b): v for a, b, v in matrix.select("src", "dst", "bytes_per_step").rows()}
        fig = figure(title="All-to-all bytes per step, sender × receiver", x="receiving rank", y="sending rank")
        fig.add_heatmap(z=[[cells.get((a, b), 0) for b in ranks] for a in ranks], x=ranks, y=ranks,
                        colorbar_title="bytes/step", colorscale="Blues")
        fig.update_layout(xaxis_type="category", yaxis_type="category")
        s.charts.append(Chart(fig, "Off-diagonal cells cross the network; an uneven row is a rank that sends more."))
    else:
        s.missing.append("rank×rank matrix: no all-to-all with per-peer splits in the run")
    train = by_op.filter(pl.col("phase") == "train").drop_nulls("bytes_per_step").sort("bytes_per_step",
                                                                                       descending=True)
    fig = figure(title="Bytes per training step by op and tag", x="tag", y="bytes_out per step (bytes, all ranks)",
                 barmode="stack")
    for (op,), part in train.group_by("op", maintain_order=True):
        fig.add_bar(x=[esc(t) for t in part["tag"]], y=part["bytes_per_step"].to_list(), name=esc(op))
    s.charts.append(Chart(fig, "Where the bytes go: the embedding all-to-alls against the dense all-reduce."))
    if bw is not None:
        fig = figure(title="Bus bandwidth by message size", x="median message size (bytes, log scale)",
                     y="bus bandwidth (GB/s)", xaxis_type="log")
        for (op,), part in bw.drop_nulls("busbw_bytes_per_s").group_by("op", maintain_order=True):
            fig.add_scatter(x=part["median_size_bytes"].to_list(), y=(part["busbw_bytes_per_s"] / 1e9).to_list(),
                            mode="lines+markers", name=esc(op))
        s.charts.append(Chart(fig, "nccl-tests bus bandwidth of synchronous calls; small messages pay latency, "
                                   "the plateau is what the link gives."))
    return s


# timeline ---------------------------------------------------------------------------------------

def timeline(run: RunInputs) -> Section:
    from plotly.subplots import make_subplots

    s = Section("timeline", "Timeline: compute, communication and waiting")
    frame = _train_timeline(run)
    if frame is None:
        s.missing.append("the run has no steps table (no optimizer step or tracekit.step() was seen)")
    else:
        ranks = frame["rank"].unique().sort().to_list()[:8]
        fig = make_subplots(rows=len(ranks), cols=1, shared_xaxes=True, subplot_titles=[f"rank {r}" for r in ranks])
        colours = {"compute_s": "#4c78a8", "comm_s": "#f58518", "wait_s": "#e45756"}
        for i, r in enumerate(ranks, 1):
            part = thin(frame.filter(pl.col("rank") == r).select("step", *colours).rows())
            for j, (col, colour) in enumerate(colours.items(), 1):
                fig.add_bar(x=[p[0] for p in part], y=[p[j] for p in part], name=col[:-2], marker_color=colour,
                            legendgroup=col, showlegend=i == 1, row=i, col=1)
            fig.update_yaxes(title_text="time (s)", row=i, col=1)
        fig.update_xaxes(title_text="step", row=len(ranks), col=1)
        fig.update_layout(title="Per-rank step time: compute, communication, waiting", barmode="stack",
                          template="plotly_white", height=220 + 160 * len(ranks), bargap=0)
        s.charts.append(Chart(fig, "A tall orange band is communication-bound; red is waiting for a slower rank."))
        fig = figure(title="Step-time distribution", x="step time (ms)", y="steps (count)", barmode="overlay")
        for r in ranks:
            fig.add_histogram(x=thin((frame.filter(pl.col("rank") == r)["step_s"] * 1e3).to_list()),
                              name=f"rank {r}", opacity=0.6)
        s.charts.append(Chart(fig, "Warm-up steps left out; a long right tail is stragglers or periodic work "
                                   "(evaluation, logging)."))
        late = run.table("stragglers")
        if late is not None and len(ranks) > 1:
            fig = figure(title="Stragglers: the rank that ended each step last", x="rank", y="steps (count)")
            fig.add_histogram(x=thin(late.drop_nulls("last_rank")["last_rank"].to_list()), name="last")
            fig.add_histogram(x=thin(late.drop_nulls("blocking_rank")["blocking_rank"].to_list()),
                              name="others waited for it")
            fig.update_layout(xaxis_type="category")
            s.charts.append(Chart(fig, "One rank far ahead of the others is a straggler: its data, its tables or its "
                                       "device is slower."))
    if run.gpu is not None:
        fig = figure(title="GPU utilisation (NVML)", x="time since start (s)", y="utilisation (%)")
        t0 = run.gpu["t_ns"].min()
        for (device,), part in run.gpu.group_by("device", maintain_order=True):
            part = thin(part.select("t_ns", "util_gpu").rows())
            fig.add_scatter(x=[(p[0] - t0) / 1e9 for p in part], y=[p[1] for p in part], mode="lines",
                            name=esc(f"GPU {device}"))
        s.charts.append(Chart(fig, "Dips in utilisation line up with communication the GPU waits for."))
    else:
        s.missing.append("NVML metrics: the run has no GPU samples (" +
                         str((run.manifest.get("gpu") or {}).get("reason") or "no GPU") + ")")
    return s


# cache ------------------------------------------------------------------------------------------

def cache(run: RunInputs) -> Section:
    s = Section("cache", "Cache: miss ratio against cache size")
    mrc = run.table("cache_mrc")
    if mrc is None:
        s.missing.append("the run has no accesses table, so no cache was simulated")
        return s
    fig = figure(title="Miss-ratio curves (LRU, LFU, static top-K oracle)", x="cache size (fraction of table rows)",
                 y="miss ratio (fraction of lookups)", xaxis_type="log")
    dashes = {"lru": "solid", "lfu": "dash", "static": "dot"}
    for name in _busiest(run, 4):
        for (policy,), part in mrc.filter(pl.col("table_name") == name).sort("load_factor").group_by(
                "policy", maintain_order=True):
            fig.add_scatter(x=part["load_factor"].to_list(), y=part["miss_ratio"].to_list(), mode="lines",
                            name=esc(f"{name} {policy}"), line_dash=dashes.get(str(policy), "dashdot"))
    s.charts.append(Chart(fig, "The four tables with most lookups; where LRU meets the oracle, a small cache is "
                               "as good as a static hot set."))
    return s


# policies ---------------------------------------------------------------------------------------

def policies(run: RunInputs) -> Section:
    s = Section("policies", "Policies: what to change, and what it should save")
    policy = run.policy
    if policy is None:
        s.missing.append("the run has no policy.json (the manifest lists no embedding tables)")
        return s
    baseline = policy.get("baseline", {})
    s.intro.append("<p>Baseline per step: " + esc(", ".join(f"{k} {show(k, v)}" for k, v in baseline.items()))
                   + "</p>")
    for name, body in policy.items():
        if not isinstance(body, dict) or "predicted" not in body and name not in ("compression", "lag"):
            continue
        saving = _predicted_saving(run, body) if "predicted" in body else None
        parts = [(f"{name}.{sub}", part) for sub, part in body.items() if isinstance(part, dict) and "predicted" in part] \
            if name in ("compression", "combined") and "predicted" not in body else [(name, body)]
        for label, part in parts:
            s.intro.append(f"<h3>{esc(label)}</h3><p>{_decision(part)}{esc(part.get('why', ''))}</p>")
            if saving:
                s.intro.append(f"<p>Predicted saving of embedding bytes: {esc(show('saving', saving))}</p>")
            s.intro.append(table(["figure", "value"], [[k, " – ".join(show(k, x) for x in v) if isinstance(v, list)
                                                        else show(k, v)] for k, v in _flatten(part).items()]))
    s.intro.append("<p>A figure with an interval (<code>intervals.*</code>, low – high) is an estimate: from sampled "
                   "steps, or a step time with the model's error; a figure without one is exact.</p>")
    sections = {k for k, v in policy.items() if isinstance(v, dict) and k not in ("model", "baseline")}
    absent = [p for p in ("replication", "tiers", "schedule", "compression", "lag") if p not in sections]
    reasons = (run.summary or {}).get("not_derived", {})
    for name in absent:
        s.missing.append(f"policy {name}: " + (reasons.get(name) or "not in policy.json (`tracekit analyze "
                                                                     f"{run.name}` prints why)"))
    sweep = run.table("replication_sweep")
    if sweep is not None:
        s.charts.append(_sweep_chart(sweep))
    sched = run.table("schedule_sweep")
    if sched is not None:
        fig = figure(title="FAE: samples that touch only hot rows, by hot-set size", x="hot-set budget (bytes per "
                     "rank, log scale)", y="hot-sample fraction", xaxis_type="log")
        fig.add_scatter(x=sched["budget_bytes"].to_list(), y=sched["hot_sample_fraction"].to_list(),
                        mode="lines+markers", name="sweep")
        chosen = sched.filter(pl.col("chosen"))
        fig.add_scatter(x=chosen["budget_bytes"].to_list(), y=chosen["hot_sample_fraction"].to_list(), mode="markers",
                        marker_size=14, marker_symbol="star", name="chosen")
        s.charts.append(Chart(fig, "Only samples whose every lookup is hot can skip the all-to-all."))
    return s


def _sweep_chart(sweep: pl.DataFrame) -> Chart:
    part = sweep.filter(pl.col("point") == "sweep").sort("budget_bytes") if "point" in sweep.columns else sweep
    fig = figure(title="Replication budget: bytes per step against replica memory",
                 x="replica budget (bytes per rank, log scale)", y="bytes per step (bytes, all ranks)",
                 xaxis_type="log")
    for (ordering,), p in part.group_by("ordering", maintain_order=True):
        fig.add_scatter(x=p["budget_bytes"].to_list(), y=p["total_bytes_per_step"].to_list(), mode="lines+markers",
                        name=esc(f"total ({ordering})"))
        fig.add_scatter(x=p["budget_bytes"].to_list(), y=p[SYNC_BYTES].to_list(), mode="lines",
                        line_dash="dot", name=esc(f"sync ({ordering})"))
    chosen = sweep.filter(pl.col("chosen"))
    fig.add_scatter(x=chosen["budget_bytes"].to_list(), y=chosen["total_bytes_per_step"].to_list(), mode="markers",
                    marker_size=14, marker_symbol="star", name="chosen")
    return Chart(fig, "All-to-all bytes fall as rows are replicated while the sync grows; the star is the budget "
                      "chosen.")


def _interval(row: dict) -> str:
    """`exact`, or an estimate's interval, of a compare row (analyses.prediction_check's kind and bounds)."""
    if row.get("kind") != "estimated" or row.get("predicted_low") is None:
        return "exact" if row.get("kind") == "exact" else "–"
    return f"{show(row['figure'], row['predicted_low'])} – {show(row['figure'], row['predicted_high'])}"


def _diff(row: dict) -> str:
    """Measured against predicted as `tracekit compare` prints it: a share's in points, an AUC change's
    as a difference, others in %."""
    if row["unit"] == "auc":
        return "–" if row["diff"] is None else f"{row['diff']:+.4f}"
    if row["unit"] == "relative":
        return "–" if row["diff"] is None else f"{row['diff'] * 100:+.2f} pts"
    if row["unit"] == "fraction":
        return "–" if row["diff"] is None else f"{row['diff'] * 100:+.1f} pts"
    return "–" if row["diff_pct"] is None else f"{row['diff_pct']:+.1%}"


def _decision(body: dict) -> str:
    """The decision of analyses.decision, first in a section's paragraph."""
    if "recommended" not in body:
        return ""
    if body["recommended"]:
        return "<b>Recommended.</b> "
    reason = body.get("reason")
    return f"<b>Not recommended:</b> {esc(reason)}. " if reason else "<b>Not recommended.</b> "


def _flatten(body: dict, prefix: str = "") -> dict[str, Any]:
    out = {}
    for k, v in body.items():
        if k in ("why", "reason", "recommended"):
            continue
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


# torchrec ---------------------------------------------------------------------------------------

def torchrec(run: RunInputs) -> Section | None:
    """A TorchRec run's plan: the recorded one beside the derived one (analyze's torchrec_plan.json,
    analyses/torchrec_plans.py) and its quantized-comms variant, table by table, with their
    predicted figures beside the recorded plan's; None for another run."""
    from tracekit.torchrec_plan import PLAN_FILE, QCOMMS_PLAN_FILE, PlanError, from_manifest, read_plan

    plans = {}
    for label, name in (("derived", PLAN_FILE), ("derived, quantized comms", QCOMMS_PLAN_FILE)):
        try:
            plans[label] = read_plan(run.path / name) if (run.path / name).exists() else None
        except PlanError:
            plans[label] = None
    derived = plans["derived"]
    if derived is None:
        return None
    s = Section("torchrec", "TorchRec: the job's plan and the one derived from its trace")
    own = from_manifest(run.manifest)["tables"]

    def where(placed: dict) -> str:
        return f"{placed['sharding_type']} on {', '.join(str(r) for r in placed['ranks'])}"

    rows = [[name, f"{placed['num_embeddings']} × {placed['embedding_dim']}", where(own[name]),
             where(placed) if where(placed) != where(own[name]) else "(same)"]
            for name, placed in derived["tables"].items()]
    s.intro.append(f"<p>{_decision(derived)}{esc(derived.get('why', ''))}</p>")
    s.intro.append(table(["table", "rows × dim", "recorded plan", "derived plan"], rows, left={0, 2, 3}))
    columns = {"recorded plan": derived.get("baseline") or {}, "derived": derived["predicted"]}
    if plans["derived, quantized comms"] is not None:
        columns["derived, quantized comms"] = plans["derived, quantized comms"]["predicted"]
    figures_shown = ("a2a_bytes_per_step", "a2a_remote_bytes_per_step", "allreduce_bytes_per_step",
                     "dp_allreduce_bytes_per_step", "exchange_s", STEP_TIME)
    s.intro.append(table(["figure", *columns], [[k, *(show(k, c.get(k)) if c.get(k) is not None else "–"
                                                      for c in columns.values())] for k in figures_shown]))
    s.intro.append("<p>Bytes per training step, all ranks' bytes_out, exact for any plan (replayed from the "
                   "recorded lookups); the step time is the measured one less the recorded plan's exchange plus "
                   "the derived plan's. <code>tracekit optimize</code> re-runs the job with the derived plan and "
                   "puts them beside the measured figures (compare, section <code>torchrec_plan</code>).</p>")
    estimate = derived.get("torchrec_estimate") or {}
    if "recorded" in estimate and "derived" in estimate:
        terms = list(estimate["recorded"]["ranks"][0])
        busiest = {label: max(estimate[label]["ranks"], key=lambda r: sum(r.values())) for label in ("recorded",
                                                                                                  "derived")}
        s.intro.append("<p>TorchRec's own planner (its EmbeddingPerfEstimator, with the measured pooling factors and "
                       "the run's link) for the same two plans, its busiest rank term by term, to read beside "
                       "tracekit's prediction above. The measured step of a re-run with the derived plan is in the "
                       "compare section once <code>tracekit optimize</code> has made one.</p>")
        s.intro.append(table(["TorchRec's estimate (ms)", "recorded plan", "derived"],
                             [[term, f"{busiest['recorded'][term]:.2f}", f"{busiest['derived'][term]:.2f}"]
                              for term in terms] + [["busiest rank, all terms",
                                                     f"{estimate['recorded']['max_rank_ms']:.2f}",
                                                     f"{estimate['derived']['max_rank_ms']:.2f}"]]))
    else:
        s.missing.append("TorchRec's own planner estimates: " + estimate.get("error", "not in the plan file (analyze "
                                                                            "computes them in the job's Python)"))
    return s


# compare ----------------------------------------------------------------------------------------

def compare(summary: dict) -> Section:
    s = Section("compare", "Compare: measured against the baseline and the predictions")
    runs = summary["runs"]
    names = [esc(r["run"]) for r in runs]
    fig = figure(title="Step time per run", x="run", y="step time (ms)")
    fig.add_bar(x=names, y=[None if r[STEP_TIME] is None else r[STEP_TIME] * 1e3 for r in runs],
                name="mean")
    fig.add_bar(x=names, y=[None if r["step_time_p90_s"] is None else r["step_time_p90_s"] * 1e3 for r in runs],
                name="p90")
    s.charts.append(Chart(fig, f"Training steps after the first {summary['skip_steps']} (warm-up); lower is better."))
    fig = figure(title="Bytes per training step by op and tag", x="run", y="bytes_out per step (bytes)",
                 barmode="stack")
    keys = sorted({(b["op"], b["tag"]) for r in runs for b in r["by_op_tag"]})
    for op, tag in keys:
        values = [next((b["bytes_out_per_step"] for b in r["by_op_tag"] if (b["op"], b["tag"]) == (op, tag)), 0)
                  for r in runs]
        fig.add_bar(x=names, y=values, name=esc(f"{op} {tag}"))
    s.charts.append(Chart(fig, "What each policy removed from the wire, and what its replica sync added."))
    auc = [(r["metrics"] or {}).get("eval_auc") for r in runs]
    if any(a is not None for a in auc):
        fig = figure(title="Held-out AUC per run", x="run", y="AUC (0-1)")
        fig.add_bar(x=names, y=auc)
        fig.update_yaxes(range=[min(a for a in auc if a is not None) - 0.01, 1 if max(
            a for a in auc if a is not None) > 0.99 else max(a for a in auc if a is not None) + 0.01])
        s.charts.append(Chart(fig, "A policy that saves bytes must leave the model's quality where it was."))
    else:
        s.missing.append("AUC: no run evaluated on held-out data")
    rows = [r for r in summary["rows"] if r["unit"] == "bytes"]
    if rows:
        fig = figure(title="Predicted against measured, per policy", x="run · section · figure",
                     y="bytes per step (bytes)", barmode="group", height=460)
        labels = [esc(f"{r['run'].rsplit('/', 1)[-1]} · {r['section']} · {r['figure']}") for r in rows]
        fig.add_bar(x=labels, y=[r["predicted"] for r in rows], name="predicted")
        fig.add_bar(x=labels, y=[r["measured"] for r in rows], name="measured")
        s.charts.append(Chart(fig, "Each pair should match where the prediction is exact (bytes from lookups "
                                   "recorded on every step); an estimate should hold the measurement within "
                                   "its interval."))
    s.intro.append(table(["run", "section", "figure", "predicted", "interval", "measured", "diff"],
                         [[r["run"], r["section"], r["figure"], show(r["figure"], r["predicted"]), _interval(r),
                           show(r["figure"], r["measured"]), _diff(r)] for r in summary["rows"]], left=3))
    s.intro.extend(f'<p class="warn">{esc(w)}</p>' for w in summary.get("warnings", []))
    s.intro.extend(f'<p class="muted">{esc(n)}</p>' for n in summary.get("notes", []))
    return s


# simulate ---------------------------------------------------------------------------------------

def simulate(run: RunInputs) -> Section | None:
    """`tracekit simulate`'s projection of the run, where one was made: the table and step time and
    speedup against the inter-node link rate."""
    rows, sweep = run.table("simulate"), run.table("simulate_sweep")
    if rows is None:
        return None
    first = rows.row(0, named=True)
    s = Section("simulate", f"What-if: this run on {first['topology']} ({first['world']} ranks)")
    s.intro.append(f"<p>Projected from the run's traffic, its compute time and the cost model (bytes "
                   f"{'as recorded and replayed' if first['method'] == 'replay' else 'scaled per sample'}); "
                   f"{esc(show('inter_bw', first['inter_bw']))} between nodes, "
                   f"{esc(show('intra_bw', first['intra_bw']))} within, "
                   f"batch {first['batch_per_device']:g} per rank.</p>")
    columns = ("policy", "bytes_per_step", "inter_node_bytes_per_step", "compute_s", "comm_s", STEP_TIME,
               "comm_share", "speedup")
    s.intro.append(table(["policy", "bytes / step", "between nodes / step", "compute", "communication", "step time",
                          "comm share", "speedup"], [_cells(r, columns) for r in rows.iter_rows(named=True)]))
    if sweep is not None:
        fig = figure(title="Speedup over the baseline against the link between nodes", x="link rate (bit/s, log "
                     "scale)", y="step-time speedup", xaxis_type="log", xaxis_exponentformat="SI")
        for (name,), part in sweep.sort("inter_bw").group_by("policy", maintain_order=True):
            fig.add_scatter(x=(part["inter_bw"] * 8).to_list(), y=part["speedup"].to_list(), mode="lines+markers",
                            name=esc(name))
        topology = run.manifest.get("topology") or {}
        if topology.get("link_bytes_per_s"):
            fig.add_vline(x=topology["link_bytes_per_s"] * 8, line_dash="dot",
                          annotation_text=esc(f"recorded on {topology.get('link')}"))
        s.charts.append(Chart(fig, "The slower the network, the more of the step is communication and the more "
                                   "a policy that moves fewer bytes saves."))
    return s

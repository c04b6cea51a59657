"""The report's figure sections: skew, traffic, timeline and cache from the base run's analysis
tables, and simulate's what-if, each a function from the run's inputs (reports.inputs) to a
PageSection; the figures come from analysis tables as written, only filtered, sorted and thinned for
drawing; every number in a table is shown by tracekit.units.show in the unit its name says. The
report's head is in reports.verdict, the predictions in reports.predictions.
"""

from __future__ import annotations

from typing import Any

import polars as pl

from reports.html import Chart, PageSection, esc, figure, table, thin
from reports.inputs import RunInputs
from tracekit.figures import STEP_TIME
from tracekit.units import show

TOP_TABLES = 6
"""Tables drawn where one trace per table would crowd a chart (the ones with the most lookups)."""
TOP_ROWS = 20
SKEW_ROWS = 8
"""Tables listed in the skew section's table."""


def _cells(record: dict[str, Any], columns: tuple[str, ...]) -> list[str]:
    """The table row of `record`'s `columns`, each shown in the unit its name says (tracekit.units)."""
    return [show(c, record[c]) for c in columns]


def _busiest(run: RunInputs, limit: int = TOP_TABLES) -> list[str]:
    skew = run.table("skew")
    return [] if skew is None else skew.sort("lookups", descending=True)["table_name"].head(limit).to_list()


def train_timeline(run: RunInputs) -> pl.DataFrame | None:
    """The timeline table less the warm-up steps that analyses.timeline leaves out of its means."""
    from analyses.network import warmup_steps

    frame = run.table("timeline")
    if frame is None:
        return None
    frame = frame.filter(pl.col("step") >= frame["step"].min() + warmup_steps(frame["step"].n_unique()))
    return frame.sort("rank", "step")


# skew -------------------------------------------------------------------------------------------

def skew(run: RunInputs) -> PageSection:
    s = PageSection("skew", "Skew: which rows the lookups hit")
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

def traffic(run: RunInputs) -> PageSection:
    s = PageSection("traffic", "Traffic: bytes between ranks")
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

def timeline(run: RunInputs) -> PageSection:
    from plotly.subplots import make_subplots

    s = PageSection("timeline", "Timeline: compute, communication and waiting")
    frame = train_timeline(run)
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
                         str((run.manifest.gpu or {}).get("reason") or "no GPU") + ")")
    return s


# cache ------------------------------------------------------------------------------------------

def cache(run: RunInputs) -> PageSection:
    s = PageSection("cache", "Cache: miss ratio against cache size")
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


# simulate ---------------------------------------------------------------------------------------

def simulate(run: RunInputs) -> PageSection | None:
    """`tracekit simulate`'s projection of the run, where one was made: the table, the speedup against the
    link rate between nodes and, where projected (`--curve`), against the world size."""
    rows, sweep, scale = run.table("simulate"), run.table("simulate_sweep"), run.table("simulate_scale")
    if rows is None or not rows.height:
        return None
    first = rows.row(0, named=True)
    s = PageSection("simulate", f"What-if: this run on {first['topology']} ({first['world']} ranks)")
    s.intro.append(f"<p>Bytes: the recorded samples regrouped onto the target's ranks as the trainer hands them "
                   f"out, counted on its placement of the tables ({esc(first['method'])}). Time: the recorded steps "
                   f"replayed with every collective priced on the target's links: "
                   f"{esc(show('inter_bw', first['inter_bw']))} between nodes, "
                   f"{esc(show('intra_bw', first['intra_bw']))} within, batch {first['batch_per_device']:g} "
                   f"per rank.</p>")
    columns = ("policy", "bytes_per_step", "inter_node_bytes_per_step", "compute_s", "comm_s", STEP_TIME,
               "comm_share", "speedup")
    s.intro.append(table(["section", "bytes / step", "between nodes / step", "compute", "communication", "step time",
                          "comm share", "speedup"], [_cells(r, columns) for r in rows.iter_rows(named=True)]))
    if scale is not None and scale.height:
        fig = figure(title=f"Speedup over the baseline against the world size, at "
                           f"{esc(show('inter_bw', first['inter_bw']))} between nodes",
                     x="ranks (log scale)", y="step-time speedup", xaxis_type="log")
        for (name,), part in scale.sort("world").group_by("policy", maintain_order=True):
            fig.add_scatter(x=part["world"].to_list(), y=part["speedup"].to_list(), mode="lines+markers",
                            name=esc(name))
        s.charts.append(Chart(fig, "Each section derived for each world size: the more ranks, the more of each "
                                   "lookup crosses the network, and the more replicating its row saves, until the "
                                   "replicas' sync grows with the ranks too."))
    if sweep is not None:
        fig = figure(title="Speedup over the baseline against the link between nodes", x="link rate (bit/s, log "
                     "scale)", y="step-time speedup", xaxis_type="log", xaxis_exponentformat="SI")
        for (name,), part in sweep.sort("inter_bw").group_by("policy", maintain_order=True):
            fig.add_scatter(x=(part["inter_bw"] * 8).to_list(), y=part["speedup"].to_list(), mode="lines+markers",
                            name=esc(name))
        topology = run.manifest.topology or {}
        if topology.get("link_bytes_per_s"):
            fig.add_vline(x=topology["link_bytes_per_s"] * 8, line_dash="dot",
                          annotation_text=esc(f"recorded on {topology.get('link')}"))
        s.charts.append(Chart(fig, "The slower the network, the more of the step is communication and the more "
                                   "a policy that moves fewer bytes saves."))
    return s

"""The report's sections on what tracekit predicts and how it held up: the policies analyze derived
(with the replication and FAE sweeps), a TorchRec run's recorded plan beside the derived one, and
compare's measured figures against the baseline and the predictions. Each is a function from the
run's inputs (reports.inputs) or compare's summary to a PageSection; every number in a table is shown
by tracekit.units.show in the unit its name says.
"""

from __future__ import annotations

from typing import Any

import polars as pl

from reports.html import Chart, PageSection, esc, figure, table
from reports.inputs import RunInputs
from tracekit.figures import A2A_BYTES, STEP_TIME, SYNC_BYTES
from tracekit.units import format_diff, show


# policies ---------------------------------------------------------------------------------------

def _predicted_saving(run: RunInputs, section: dict) -> float | None:
    from analyses.prediction_check import predicted_figures

    base = run.policy.get("baseline", {}) if run.policy else {}
    figures = predicted_figures(section.get("predicted", {}), {"total_bytes_per_step": base.get(A2A_BYTES)})
    return figures.get("saving")


def policies(run: RunInputs) -> PageSection:
    s = PageSection("policies", "Policies: what to change, and what it should save")
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

def torchrec(run: RunInputs) -> PageSection | None:
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
    s = PageSection("torchrec", "TorchRec: the job's plan and the one derived from its trace")
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

def compare(summary: dict) -> PageSection:
    s = PageSection("compare", "Compare: measured against the baseline and the predictions")
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
                           show(r["figure"], r["measured"]), format_diff(r, "–")] for r in summary["rows"]], left=3))
    s.intro.extend(f'<p class="warn">{esc(w)}</p>' for w in summary.get("warnings", []))
    s.intro.extend(f'<p class="muted">{esc(n)}</p>' for n in summary.get("notes", []))
    return s

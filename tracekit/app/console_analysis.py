"""What `tracekit analyze`, `simulate`, `calibrate` and `planner` print for a person (rich): the
analysis summary a person reads in a minute (each analysis, the network model and the replay, each
policy with its predicted saving and why), the projection onto another cluster, the calibration's
models and the TorchRec planner's inputs.

    print_analysis(analyze_run(run, options))
"""

from __future__ import annotations

from rich.table import Table

from tracekit.app.console import terminal
from tracekit.figures import SHOWN, STEP_TIME
from tracekit.units import (format_bytes, format_cell, format_decimal, format_ms, format_ns, format_rate, format_us,
                            show)


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
        table.add_row(name, format_cell(t["num_rows"]), format_cell(t["rows_touched"]), format_cell(t["lookups"]),
                      f"{t['top_1pct_share']:.1%}", f"{t['top_10pct_share']:.1%}", f"{t['gini']:.2f}",
                      f"{t['zipf_alpha']:.2f}", format_cell(t["rows_for_90pct"]), _ratio(t.get("hot_set_jaccard")))
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
        table.add_row(name, format_cell(t["expected_lookups"]),
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
        lines.append(f"{name} ~{show(k, v, ms=True)} [{show(k, span[0], ms=True)}, {show(k, span[1], ms=True)}]"
                     if span else f"{name} {show(k, v, ms=True)}")
    return "\n".join(lines)


def _ratio(value: float | None) -> str:
    return "" if value is None else format_decimal(value, 2)


def print_simulate(summary: dict) -> None:
    """`tracekit simulate`: the target, then one row per section with its bytes, time and speedup."""
    if not summary.get("rows"):
        for note in summary.get("notes", []):
            terminal.print(f"note: {note}")
        return
    target, source = summary["target"], summary["source"]
    terminal.print(f"projected onto {target['topology']} ({target['world']} ranks, batch "
                   f"{target['batch_per_device']:g} per rank, {target['sharding']}-wise): "
                   f"{format_rate(target['inter_bw'])} between nodes, {format_rate(target['intra_bw'])} within; "
                   f"latency {format_us(target['latency_s'], 0)} per collective; from {summary['run']} "
                   f"({source['world']} ranks, {source['samples']:,} samples: "
                   f"{source['samples'] / (target['world'] * target['batch_per_device']):.2f} target steps)")
    derived = "sections derived for the target" if summary.get("derived") else "sections as written"
    table = Table("section", "rec.", "rows", "all-to-all / step", "sync / step", "between nodes / step", "compute",
                  "communication", "step time", "speedup",
                  title=f"simulate ({summary['method']} bytes, replayed time; {derived})", title_justify="left")
    for row in summary["rows"]:
        table.add_row(row["policy"], {True: "yes", False: "no"}.get(row.get("recommended"), ""),
                      f"{row['hot_rows']:,}" if row["hot_rows"] else "",
                      format_bytes(row["a2a_bytes_per_step"]), format_bytes(row["sync_bytes_per_step"]),
                      format_bytes(row["inter_node_bytes_per_step"]), _seconds(row["compute_s"]),
                      _seconds(row["comm_s"]), _seconds(row[STEP_TIME]), _ratio(row["speedup"]))
    terminal.print(table)
    for note in summary.get("notes", []):
        terminal.print(f"note: {note}")


def _seconds(value: float | None) -> str:
    return "?" if value is None else format_ms(value)


def print_calibration(c: dict) -> None:
    """`tracekit calibrate`'s table: each model's coefficients and residual, in µs (ns per element)."""
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
        say(f"  {sync:<18}{format_us(r['c0_s']):>12}{format_ns(r['c_ids_s']):>12}{format_ns(r['c_hot_s']):>12}"
            f"{format_ns(r['c_rows_s']):>12}{format_us(r['residual_s']):>12}  {calls}")
    say("collective call (world 1, no wire): "
        + ", ".join(f"{op} {format_us(s)}" for op, s in c["collective_call_s"].items()))
    dp, mp, fae = c["dct_dp"], c["dct_mp"], c["schedule"]
    say(f"DCT-DP hook over the plain one (keep ratio {dp['keep_ratio']}): {format_us(dp['c_bucket_s'])} per bucket + "
        f"{format_ns(dp['c_elem_s'])} per element (residual {format_us(dp['residual_s'])}); a refresh adds "
        f"{format_ns(dp['c_refresh_elem_s'])} per element (residual {format_us(dp['refresh_residual_s'])})")
    say(f"DCT-MP codec (dim {mp['dim']}): {format_us(mp['c0_s'])} per step + {format_ns(mp['c_value_s'])} per value "
        f"sent + {format_ns(mp['c_kept_s'])} per value kept (residual {format_us(mp['residual_s'])})")
    say(f"FAE schedule: {format_ns(fae['c_sample_s'])} per sample taken by index (in-memory data); hot split "
        f"{format_ns(fae['setup_s_per_sample'])} per training sample, once")
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

"""The `tracekit` command line: each command parses its options, calls one library function and
prints what it returns through tracekit.app.console (docs/design.md). A TracekitError out of any
command is printed as its one line, without a traceback.

Heavy modules (torch, duckdb, polars, plotly) are imported inside commands, so
`tracekit --help` stays instant.
"""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path
from typing import Any

import click

from tracekit import __version__, manifest
from tracekit.app.cli_options import (ANALYSIS, DCT_REPLAY, JOB, JSON, RUN_DIR, TRACING, Commands, InputError,
                                  RecordCommand, analysis_options, cluster_topology, job_settings, parsed)
from tracekit.app.cluster import MAX_NODES as CLUSTER_MAX_NODES
from tracekit.app.console import show
from tracekit.run_dir import RunDir


@click.group(cls=Commands, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="tracekit")
def cli() -> None:
    """Trace-driven profiling and analysis of distributed recommendation-model training."""


@cli.command(cls=RecordCommand)
@click.option("-o", "--output", "run_dir", type=click.Path(path_type=Path), default=None,
              help="Run directory (default: runs/<timestamp>-<script>).")
@click.option("--force", is_flag=True, help="Replace a non-empty run directory.")
@TRACING
@DCT_REPLAY
@JOB
@click.option("--gpu-interval", type=click.FloatRange(min=0.01), default=0.1, show_default=True,
              envvar="TRACEKIT_GPU_INTERVAL_S", help="Seconds between NVML samples of each rank's GPU.")
@click.option("--json", "as_json", is_flag=True, help="At the end, print the run's summary as one JSON line on stdout.")
@click.option("--watch", "live", is_flag=True,
              help="Show `tracekit watch`'s live view of the run (on stderr) while COMMAND runs.")
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
def record(run_dir: Path | None, force: bool, lookup_every: int, grad_every: int, flush_interval: float,
           dct_replay: bool, gpu_interval: float, as_json: bool, live: bool, command: tuple[str, ...], **job: Any) -> None:
    """Run COMMAND with the collectors injected; keep a trace of it (docs/recording.md).

    Exits with COMMAND's exit code (130 after Ctrl-C, 128+N if it was killed by signal N, 126 if it
    could not start).

    \b
    Example:
      tracekit record -o runs/base -- torchrun --standalone --nproc-per-node 2 train.py --steps 300
    """
    from tracekit.app import recording
    from tracekit.app.console_record import describe_record
    from tracekit.app.watch import watching

    command, settings = list(command), job_settings(**job)
    run_dir = run_dir or recording.default_run_dir(command)
    recording.prepare(command, run_dir, force=force)
    click.echo(f"tracekit: recording into {run_dir}", err=True)
    with watching(run_dir, enabled=live):  # a thread that only reads the run's files, on stderr
        code = recording.record(command, run_dir, lookup_every=lookup_every, grad_every=grad_every,
                                flush_interval_s=flush_interval, gpu_interval_s=gpu_interval, dct_replay=dct_replay,
                                **settings)
    summary = recording.summary(run_dir, manifest.read(run_dir))
    click.echo(json.dumps(summary) if as_json else describe_record(summary), err=not as_json)
    sys.exit(code)


@cli.command()
@RUN_DIR
@ANALYSIS
@click.option("--report/--no-report", "with_report", default=True, show_default=True,
              help="Write the HTML report, RUN/report.html.")
@click.option("--calibrate/--no-calibrate", "calibrate_first", default=True, show_default=True,
              help="Where RUN/analysis/calibration.json is missing, torch is importable and this host recorded "
                   "RUN, run `tracekit calibrate RUN` first (~5-15 s).")
@JSON
def analyze(run_dir: Path, budget: str | None, topology: str | None, intra_bw: str | None, inter_bw: str | None,
            policies: str | None, objective: str, replay_steps: int, quality_budget: str, memory_limit: str,
            with_report: bool, calibrate_first: bool, as_json: bool) -> None:
    """Derive skew, traffic, timeline, cache and cost figures and the policies of a recorded run.

    Writes RUN/analysis/*.parquet, RUN/policy.json with RUN/policy/*.parquet, and RUN/report.html
    (docs/analysis.md).

    \b
    Example:
      tracekit analyze runs/base --budget 5% --topology 2x1
    """
    from tracekit.app.console import analysis_progress
    from tracekit.app.console_analysis import print_analysis
    from tracekit.app.loop import analyze_run

    options = analysis_options(budget, topology, intra_bw, inter_bw, policies, objective, replay_steps, memory_limit,
                               quality_budget)
    with analysis_progress(enabled=not as_json) as progress:
        summary = analyze_run(run_dir, options, calibrate=calibrate_first, report=with_report, progress=progress)
    show(summary, as_json, print_analysis, report=with_report)


@cli.command()
@RUN_DIR
@click.option("--repeats", type=click.IntRange(min=3), default=7, show_default=True,
              help="Timings per measured point; every figure is their median.")
@JSON
def calibrate(run_dir: Path, repeats: int, as_json: bool) -> None:
    """Measure what each policy's code path adds on a rank per training step, on this machine.

    Times the trainer's own code at RUN's sizes in one process (~5-15 s) and writes
    RUN/analysis/calibration.json, which analyze reads (docs/analysis.md).

    \b
    Example:
      tracekit calibrate runs/base --json
    """
    from tracekit.app.calibration import read_inputs, write
    from tracekit.app.console import run_progress
    from tracekit.app.console_analysis import print_calibration
    from tracekit.dlrm import calibrate as calibration

    inputs = read_inputs(run_dir)
    with run_progress(enabled=not as_json) as progress:
        result = calibration.calibrate(inputs, repeats=repeats, progress=lambda what: progress(f"calibrating {what}"))
    path = write(run_dir, result)
    show(result, as_json, print_calibration)
    if not as_json:
        click.echo(f"wrote {path}")


@cli.command()
@RUN_DIR
@JSON
def planner(run_dir: Path, as_json: bool) -> None:
    """Print TorchRec planner inputs per table: pooling factors and UVM cache load factors.

    Writes RUN/analysis/planner.parquet and RUN/analysis/torchrec_constraints.json, and prints the
    Python that hands them to EmbeddingShardingPlanner.

    \b
    Example:
      tracekit planner runs/torchrec --json
    """
    from analyses.analyze import planner as planner_inputs
    from tracekit.app.console_analysis import print_planner

    summary = planner_inputs(run_dir)
    if not as_json and not summary["rows"]:
        raise InputError(f"{run_dir}: no planner inputs ({'; '.join(summary['notes'])})")
    show(summary, as_json, print_planner)


@cli.command()
@RUN_DIR
@click.argument("query")
@click.option("--format", "fmt", type=click.Choice(["table", "csv", "json", "parquet"]), default="table",
              show_default=True, help="Output format.")
@click.option("-o", "--output", type=click.Path(path_type=Path), default=None, help="Write to FILE (needed for parquet).")
def sql(run_dir: Path, query: str, fmt: str, output: Path | None) -> None:
    """Run a DuckDB query over a run: every trace table (docs/trace-format.md, and train_<table> for
    phase = 'train') and every analysis table is a view.

    \b
    Example:
      tracekit sql runs/base "SELECT op, sum(bytes_out) FROM train_comms GROUP BY op"
    """
    from tracekit.app.console import write_frame
    from tracekit.app.loop import query as run_query

    if fmt == "parquet" and output is None:
        raise click.BadParameter("parquet output needs -o FILE", param_hint="--format")
    write_frame(run_query(run_dir, query), fmt, output)


@cli.command()
@click.argument("base", type=click.Path(path_type=Path))
@click.argument("runs", nargs=-1, required=True, type=click.Path(path_type=Path))
@click.option("--skip-steps", type=click.IntRange(min=0), default=None,
              help="Leave the first N training steps (warm-up) out of step times and samples/s; bytes use every step. "
                   "Default: min(5, max(1, steps // 4)), the rule of every baseline analyze predicts from.")
@click.option("--report", "report_path", type=click.Path(path_type=Path), default=None,
              help="Where to write the HTML report of the comparison (default: BASE/compare.html).")
@click.option("--no-report", is_flag=True, help="Write no HTML report.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document (runs, rows, warnings) instead of tables.")
def compare(base: Path, runs: tuple[Path, ...], skip_steps: int | None, report_path: Path | None, no_report: bool,
            as_json: bool) -> None:
    """Compare runs with BASE: measured figures side by side, and each policy's predicted against measured.

    Training rows only; runs of another model are refused (docs/analysis.md).

    \b
    Example:
      tracekit compare runs/base runs/hybrid --json
    """
    from tracekit.app.console_compare import print_compare
    from tracekit.app.loop import compare_runs

    summary = compare_runs(base, runs, skip_steps=skip_steps,
                           report=None if no_report else report_path or base / "compare.html")
    show(summary, as_json, print_compare, report=not no_report)


@cli.command()
@RUN_DIR
@click.option("--chrome-trace", "trace_path", type=click.Path(path_type=Path, dir_okay=False), default=None,
              help="Write the Chrome / Perfetto trace (Trace Event Format JSON) to FILE. Required.")
def export(run_dir: Path, trace_path: Path | None) -> None:
    """Export a run's steps and collectives as a Chrome / Perfetto trace (ui.perfetto.dev, chrome://tracing).

    \b
    Example:
      tracekit export runs/base --chrome-trace t.json
    """
    from analyses.export import write_chrome_trace

    if trace_path is None:
        raise click.UsageError(f"export needs --chrome-trace FILE (the only format it writes), e.g. "
                               f"tracekit export {shlex.quote(str(run_dir))} --chrome-trace t.json")
    counts = write_chrome_trace(run_dir, trace_path)
    click.echo(f"wrote {trace_path}: {counts['steps']} step and {counts['collectives']} collective events of "
               f"{counts['ranks']} rank(s)")


@cli.command()
@click.argument("runs", nargs=-1, required=True, type=click.Path(path_type=Path))
@click.option("-o", "--output", type=click.Path(path_type=Path), default=None,
              help="HTML file to write (default: FIRST_RUN/report.html).")
@click.option("--plotly-js", type=click.Choice(["inline", "beside"]), default="inline", show_default=True,
              help="plotly.js inlined in the page, or written once beside it as plotly.min.js (smaller pages "
                   "when many reports share a folder); either way nothing is fetched from the network.")
def report(runs: tuple[Path, ...], output: Path | None, plotly_js: str) -> None:
    """Write one self-contained HTML report of RUN (and how the other RUNs compare with it).

    RUN must have been analysed (`tracekit analyze RUN`); the file opens from disk with no network.

    \b
    Example:
      tracekit report runs/base runs/hybrid -o report.html
    """
    from tracekit.app.loop import write_report

    path = write_report(runs, output or RunDir.at(runs[0]).report, plotly_js)
    click.echo(f"{path} ({path.stat().st_size / 1e6:.1f} MB)")


@cli.command(context_settings={"ignore_unknown_options": True})
@click.option("-o", "--output", "out_dir", type=click.Path(path_type=Path), default=Path("runs/optimize"),
              show_default=True, help="Folder of every run: base, one per policy section, combined.")
@click.option("--lookup-every", type=click.IntRange(min=1), default=1, show_default=True,
              help="Lookups recorded every N steps in the baseline (1: the predictions are exact).")
@ANALYSIS
@click.option("--cluster", "cluster_shape", default=None, metavar="NODESxRANKS",
              help="Run every run on an emulated cluster (tracekit cluster), e.g. 2x2; needs --link.")
@click.option("--link", default=None, help="With --cluster: each node's link rate, e.g. 200mbit.")
@click.option("--check-all", is_flag=True,
              help="Re-run the sections analyze did not recommend too, each alone: the measurement checks the decision.")
@DCT_REPLAY
@click.option("--json", "as_json", is_flag=True, help="Print compare's JSON document at the end instead of tables.")
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
def optimize(out_dir: Path, lookup_every: int, budget: str | None, topology: str | None, intra_bw: str | None,
             inter_bw: str | None, policies: str | None, objective: str, replay_steps: int, quality_budget: str,
             memory_limit: str, cluster_shape: str | None, link: str | None, check_all: bool, dct_replay: bool,
             as_json: bool, command: tuple[str, ...]) -> None:
    """Record COMMAND, analyse it, re-run it with each policy and their combination, and compare.

    COMMAND must accept `--policy PATH` at its end (train.py does), or be a TorchRec job, re-run
    unchanged with its derived plan. Every run lands in OUT with its log beside it (OUT/<name>.log).
    With --cluster, COMMAND is the plain `python train.py ...`.

    \b
    Examples:
      tracekit optimize -o runs/opt -- torchrun --standalone --nproc-per-node 2 train.py --steps 300
      tracekit optimize --cluster 2x2 --link 200mbit -o runs/opt -- python train.py --steps 300
    """
    from tracekit.app.console import run_progress
    from tracekit.app.console_compare import print_compare
    from tracekit.app.optimize import optimize as run_loop

    command = list(command)[1:] if command[:1] == ("--",) else list(command)
    options = analysis_options(budget, topology, intra_bw, inter_bw, policies, objective, replay_steps, memory_limit,
                               quality_budget)
    on_cluster = cluster_topology(cluster_shape, link)
    with run_progress(enabled=not as_json) as progress:
        result = run_loop(command, out_dir, options, lookup_every=lookup_every, cluster=on_cluster,
                          check_all=check_all, dct_replay=dct_replay, progress=progress)
    if result.summary is not None:
        return show(result.summary, as_json, print_compare, report=True)
    for note in result.notes:
        click.echo(note, err=as_json)
    click.echo("optimize: analyze recommends no section for this run (each line above says why); nothing to "
               "re-run (--check-all re-runs them anyway)", err=as_json)


@cli.command()
@click.option("--nodes", type=click.IntRange(min=1, max=CLUSTER_MAX_NODES), required=True,
              help="Nodes (network namespaces).")
@click.option("--ranks-per-node", type=click.IntRange(min=1), default=1, show_default=True,
              help="Ranks (torchrun workers) per node; they talk over the node's loopback, unshaped.")
@click.option("--link", required=True, help="Each node's link rate, each way, e.g. 1gbit, 200mbit.")
@click.option("--latency", type=click.FloatRange(min=0), default=None,
              help="One-way latency of each link in ms (needs the netem qdisc).")
@click.option("--record", "run_dir", type=click.Path(path_type=Path), default=None, metavar="DIR",
              help="Record the run into DIR, as `tracekit record -o DIR` does (with record's options below).")
@click.option("--force", is_flag=True, help="With --record: replace a non-empty run directory.")
@TRACING
@JOB
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
def cluster(nodes: int, ranks_per_node: int, link: str, latency: float | None, run_dir: Path | None, force: bool,
            lookup_every: int, grad_every: int, flush_interval: float, command: tuple[str, ...], **job: Any) -> None:
    """Run COMMAND on an emulated cluster: NODES network namespaces whose links run at LINK.

    One torchrun per node runs COMMAND (`python train.py ...`, no torchrun); needs root and iproute2
    (docs/cluster.md). Exits with the first failed node's exit code (130 after Ctrl-C).

    \b
    Example:
      tracekit cluster --nodes 2 --ranks-per-node 2 --link 200mbit --record runs/c -- python train.py --steps 300
    """
    from tracekit.app import cluster as emulated
    from tracekit.app import recording
    from tracekit.app.console_record import describe_record
    from tracekit.units import parse_rate

    parsed(parse_rate, link, "--link")
    settings = job_settings(**job)
    on, command = emulated.Cluster(nodes, ranks_per_node, link, latency), list(command)
    emulated.check_prerequisites(on)

    def say(line: str) -> None:
        click.echo(f"tracekit cluster: {line}", err=True)

    if run_dir is None:
        recording.check_command(command)
        sys.exit(emulated.run_or_report(command, on, say=say)[0])
    recording.prepare(command, run_dir, force=force)
    say(f"recording into {run_dir}")
    code = emulated.record(command, on, run_dir, say=say, lookup_every=lookup_every, grad_every=grad_every,
                           flush_interval_s=flush_interval, **settings)
    click.echo(describe_record(recording.summary(run_dir, manifest.read(run_dir))), err=True)
    sys.exit(code)


@cli.command()
@RUN_DIR
@click.option("--interval", type=click.FloatRange(min=0.05), default=1.0, show_default=True,
              help="Seconds between refreshes.")
@click.option("--window", type=click.IntRange(min=1), default=20, show_default=True,
              help="Recent steps over which step time, comm share and bytes per step are taken.")
@click.option("--once", is_flag=True, help="Print one snapshot and exit.")
def watch(run_dir: Path, interval: float, window: int, once: bool) -> None:
    """Show a run live, being recorded or finished: steps, step time, comm share, bytes, hot tables.

    Ends when the run does, printing the final figures (docs/recording.md).

    \b
    Example:
      tracekit watch runs/base
    """
    from tracekit.app.watch import watch as watch_run

    watch_run(run_dir, interval=interval, window=window, once=once)


@cli.command()
@RUN_DIR
@click.option("--topology", required=True, help="The cluster projected onto: NODESxRANKS, e.g. 8x8.")
@click.option("--inter-bw", required=True, help="Each node's link to the others, each way, e.g. 200mbit, 100gbit.")
@click.option("--intra-bw", default=None, help="Each rank's link to the others of its node, each way "
              "(default: 10GB/s, i.e. 80gbit).")
@click.option("--batch-size", type=click.IntRange(min=1), default=None,
              help="Samples per rank on the target (default: the run's).")
@click.option("--latency", default=None, help="Time one collective costs beyond its bytes on the target, e.g. 50us "
              "(default: 20us).")
@click.option("--sharding", type=click.Choice(["table", "row"]), default=None,
              help="How the target shards the tables (default: as the run did).")
@click.option("--compute-scale", type=click.FloatRange(min=0, min_open=True), default=1.0, show_default=True,
              help="The target device's compute time over the recording's at the same batch (0.1: ten times faster).")
@click.option("--policy", "policy_arg", default="derive", show_default=True,
              help="`derive`: each section derived for the target; a policy file: its sections as written; "
                   "`none`: the baseline alone.")
@click.option("--write-policy", "write_dir", type=click.Path(path_type=Path), default=None,
              help="Write the sections derived for the target to DIR: policy.<section>.json each and "
                   "policy.combined.json, for train.py --policy on the target.")
@click.option("--budget", default=None, help="Replica memory per rank the derivation may use: bytes (64MiB) or a "
              "share of the embedding bytes (5%). Default: no limit.")
@click.option("--objective", type=click.Choice(["time", "bytes"]), default="time", show_default=True,
              help="What a derived section minimises: the replayed step time, or the bytes a step.")
@click.option("--curve/--no-curve", default=False, show_default=True,
              help="Also project onto 4 ... 1,024 ranks (the target's ranks per node), each with its own sections: "
                   "RUN/analysis/simulate_scale.parquet and the report's curve.")
@click.option("--duplex", type=click.Choice(["full", "half"]), default="full", show_default=True,
              help="full: both directions of a link at once; half: a link's two directions one after the other.")
@click.option("--report/--no-report", "with_report", default=True, show_default=True,
              help="Rewrite RUN/report.html with the projection in it.")
@JSON
def simulate(run_dir: Path, topology: str, inter_bw: str, intra_bw: str | None, batch_size: int | None,
             latency: str | None, sharding: str | None, compute_scale: float, policy_arg: str, write_dir: Path | None,
             budget: str | None, objective: str, curve: bool, duplex: str, with_report: bool, as_json: bool) -> None:
    """Project a recorded run onto another cluster: bytes (the recorded samples regrouped onto its ranks) and
    step time (the recorded steps replayed on its links) of the baseline and of each section, derived for
    that cluster by default (docs/cluster.md). Writes RUN/analysis/simulate*.parquet and simulate.json.

    \b
    Example:
      tracekit simulate runs/base --topology 8x8 --inter-bw 100gbit --intra-bw 1600gbit --write-policy runs/8x8
    """
    from analyses.context import Options
    from analyses.simulate import Target
    from tracekit.app.console_analysis import print_simulate
    from tracekit.app.loop import simulate_run
    from tracekit.topology import Topology
    from tracekit.units import parse_budget, parse_duration, parse_rate

    shape = parsed(Topology.parse, topology, "--topology")
    target = Target(shape.nodes, shape.ranks_per_node, parsed(parse_rate, inter_bw, "--inter-bw"),
                    parsed(parse_rate, intra_bw, "--intra-bw"), batch_size,
                    parsed(parse_duration, latency, "--latency"), duplex == "full", sharding, compute_scale)
    options = Options(objective=objective)
    if budget is not None:
        options.budget_bytes, options.budget_fraction = parsed(parse_budget, budget, "--budget")
    show(simulate_run(run_dir, target, policy_arg, report=with_report, write_dir=write_dir, curve=curve,
                      options=options), as_json, print_simulate, report=with_report)


def main() -> None:
    cli()

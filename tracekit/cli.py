"""The `tracekit` command line: a thin click layer over the library (DESIGN.md §1).

Heavy modules (torch, duckdb, polars, plotly) are imported inside commands, so
`tracekit --help` stays instant.
"""

from __future__ import annotations

import json
import shlex
import signal
import sys
from pathlib import Path

import click

from tracekit import __version__


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="tracekit")
def cli() -> None:
    """Trace-driven profiling and analysis of distributed recommendation-model training."""


class _RecordCommand(click.Command):
    """`record`, whose "No such option" says so when the option follows the command without a `--`."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        try:
            return super().parse_args(ctx, list(args))
        except click.NoSuchOption as err:
            start = None if "--" in args else _command_start(self.get_params(ctx), args)
            if start is None:
                raise
            fixed = shlex.join([*args[:start], "--", *args[start:]])
            raise click.UsageError(f"No such option '{err.option_name}': without `--`, the command's options are "
                                   f"read as record's; put `--` before the command: tracekit record {fixed}",
                                   ctx) from None


def _command_start(params: list[click.Parameter], args: list[str]) -> int | None:
    """Where the command begins in `args` (record's own options skipped), or None where an unknown
    option comes first."""
    takes_value = {}
    for p in params:
        if isinstance(p, click.Option):
            for opt in (*p.opts, *p.secondary_opts):
                takes_value[opt] = not (p.is_flag or p.count)
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("-") or arg == "-":
            return i
        name = arg.split("=", 1)[0]
        if name in takes_value:
            i += 2 if takes_value[name] and "=" not in arg else 1
        elif arg[:2] in takes_value and takes_value[arg[:2]]:  # -oDIR
            i += 1
        else:
            return None
    return None


@cli.command(cls=_RecordCommand)
@click.option("-o", "--output", "run_dir", type=click.Path(path_type=Path), default=None,
              help="Run directory (default: runs/<timestamp>-<script>).")
@click.option("--force", is_flag=True, help="Replace a non-empty run directory.")
@click.option("--lookup-every", type=click.IntRange(min=0), default=10, show_default=True,
              envvar="TRACEKIT_LOOKUP_EVERY", help="Write raw per-sample lookups every N steps (0: never).")
@click.option("--grad-every", type=click.IntRange(min=0), default=100, show_default=True,
              envvar="TRACEKIT_GRAD_EVERY",
              help="Write gradient statistics (grads table) of every optimized parameter every N steps (0: never).")
@click.option("--dct-replay", is_flag=True, envvar="TRACEKIT_DCT_REPLAY",
              help="Replay DCT-DP with error feedback on every step's gradients (dct_replay table), from which analyze "
                   "derives compression.dp; costs the step ~15% on the reference trainer, so off by default.")
@click.option("--flush-interval", type=click.FloatRange(min=0.01), default=1.0, show_default=True,
              help="Seconds between flushes of each rank's trace rows to Parquet.")
@click.option("--gpu-interval", type=click.FloatRange(min=0.01), default=0.1, show_default=True,
              envvar="TRACEKIT_GPU_INTERVAL_S", help="Seconds between NVML samples of each rank's GPU.")
@click.option("--json", "as_json", is_flag=True, help="At the end, print the run's summary as one JSON line on stdout.")
@click.option("--watch", "live", is_flag=True,
              help="Show `tracekit watch`'s live view of the run (on stderr) while COMMAND runs.")
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
def record(run_dir: Path | None, force: bool, lookup_every: int, grad_every: int, dct_replay: bool,
           flush_interval: float, gpu_interval: float, as_json: bool, live: bool, command: tuple[str, ...]) -> None:
    """Run COMMAND with the collectors injected; keep a trace of it.

    Every embedding lookup (exact counts per step and row) and every optimizer step of
    every Python process that trains is written to Parquet under the run directory, with
    NVML samples of the GPU each one uses, and a manifest finalised when COMMAND ends. Exits with
    COMMAND's exit code (130 after Ctrl-C, 128+N if it was killed by signal N, 126 if it could not start).

    \b
    Example:
      tracekit record -o runs/base -- torchrun --standalone --nproc-per-node 2 train.py --steps 300
    """
    import datetime

    from tracekit import recording

    command = list(command)
    run_dir = run_dir or recording.default_run_dir(command, datetime.datetime.now())
    try:
        recording.check_command(command)
        recording.prepare_run_dir(run_dir, force=force)
    except recording.RecordError as err:
        raise click.UsageError(str(err)) from None
    click.echo(f"tracekit: recording into {run_dir}", err=True)
    if live:  # a thread that only reads the run's files (on stderr); record itself keeps the main thread
        from tracekit.watch import watch_beside

        view, finished = watch_beside(run_dir)
    code = recording.record(command, run_dir, lookup_every=lookup_every, grad_every=grad_every,
                            flush_interval_s=flush_interval, gpu_interval_s=gpu_interval, dct_replay=dct_replay)
    if live:
        finished.set()
        view.join()
    summary = recording.summary(run_dir, recording.read_manifest(run_dir))
    if as_json:
        click.echo(json.dumps(summary))
    else:
        click.echo(_describe(summary), err=True)
    sys.exit(code)


def _describe(s: dict) -> str:
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
        dropped = sum(n for per_rank in s["dropped_rows"].values() for n in per_rank.values())
        lines = [f"tracekit: {s['status']} after {elapsed} s: {len(s['ranks'])} rank(s), "
                 f"{s['bytes'] / 1e6:.1f} MB in {s['run_dir']}", exits,
                 f"  steps per rank: {steps}", f"  rows: {rows}", f"  dropped rows: {dropped:,}; gpu: {s['gpu']}"]
        if s["writer_cpu_s"]:
            cpu = ", ".join(f"{rank}: {seconds:.2f} s" for rank, seconds in sorted(s["writer_cpu_s"].items()))
            lines.append(f"  trace writer CPU per rank (counting, encoding, writing): {cpu}{_scheduling(s)}")
    lines += [f"  manifest incomplete: {error}" for error in s["finalise_errors"]]
    return "\n".join(lines)


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


class InputError(click.ClickException):
    """A run or file that cannot be read: one line, exit 2."""

    exit_code = 2


def _options(budget: str | None, topology: str | None, intra_bw: str | None, inter_bw: str | None,
             policies: str | None, objective: str = "time"):
    """analyze's options as analyses.context.Options; click.BadParameter naming the option at fault."""
    from analyses.analyze import POLICIES
    from analyses.context import Options
    from tracekit.units import parse_budget, parse_rate

    options = Options(objective=objective)
    try:
        if budget is not None:
            options.budget_bytes, options.budget_fraction = parse_budget(budget)
    except ValueError as err:
        raise click.BadParameter(str(err), param_hint="--budget") from None
    if topology is not None:
        nodes, _, ranks = topology.lower().partition("x")
        if not (nodes.isdigit() and ranks.isdigit() and int(nodes) > 0 and int(ranks) > 0):
            raise click.BadParameter(f"expected NODESxRANKS such as 2x4, got {topology!r}", param_hint="--topology")
        options.topology = (int(nodes), int(ranks))
    for name, text in (("--intra-bw", intra_bw), ("--inter-bw", inter_bw)):
        if text is not None:
            try:
                setattr(options, name[2:].replace("-", "_"), parse_rate(text))
            except ValueError as err:
                raise click.BadParameter(str(err), param_hint=name) from None
    if policies is not None:
        chosen = tuple(p.strip() for p in policies.split(",") if p.strip())
        unknown = [p for p in chosen if p not in POLICIES]
        if unknown:
            raise click.BadParameter(f"unknown policy {', '.join(unknown)}; the policies are {', '.join(POLICIES)}",
                                     param_hint="--policies")
        options.policies = chosen
    return options


@cli.command()
@click.argument("run_dir", type=click.Path(path_type=Path))
@click.option("--budget", default=None, help="Replica/cache memory per rank: bytes (64MiB) or a share of the "
              "embedding bytes (5%). Default: the sweep's optimum.")
@click.option("--topology", default=None, help="NODESxRANKS for the FlexShard tiers, e.g. 2x4 (default: one node).")
@click.option("--intra-bw", default=None, help="Bandwidth within a node, e.g. 100Gbit (default: measured in the run).")
@click.option("--inter-bw", default=None, help="Bandwidth between nodes, e.g. 10Gbit (default: measured in the run).")
@click.option("--policies", default=None, help="Comma-separated policies to derive (default: all).")
@click.option("--objective", type=click.Choice(["time", "bytes"]), default="time", show_default=True,
              help="What the replica budget minimises: predicted step time (measured bandwidths and latency), "
                   "or the bytes that cross the network (what a slower cluster pays for).")
@click.option("--report/--no-report", "with_report", default=True, show_default=True,
              help="Write the HTML report, RUN/report.html.")
@click.option("--calibrate/--no-calibrate", "calibrate_first", default=True, show_default=True,
              help="Where RUN/analysis/calibration.json is missing, torch is importable and this host recorded "
                   "RUN, run `tracekit calibrate RUN` first (~5-20 s).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of the summary.")
def analyze(run_dir: Path, budget: str | None, topology: str | None, intra_bw: str | None, inter_bw: str | None,
            policies: str | None, objective: str, with_report: bool, calibrate_first: bool, as_json: bool) -> None:
    """Derive skew, traffic, timeline, cache and cost figures and the policies of a recorded run.

    Writes RUN/analysis/*.parquet, RUN/policy.json, RUN/policy/*.parquet and RUN/report.html;
    prints what a person reads in a minute (or one JSON object with --json). First, unless
    --no-calibrate, calibrates the work policies add on a rank (see `tracekit calibrate`).

    \b
    Example:
      tracekit analyze runs/base --budget 5% --topology 2x1
    """
    from analyses.analyze import analyze as run_analysis
    from tracekit.calibration import calibrate_if_missing
    from tracekit.errors import TracekitError
    from tracekit.views import analysis_progress, print_analysis

    options = _options(budget, topology, intra_bw, inter_bw, policies, objective)
    try:
        with analysis_progress(enabled=not as_json) as progress:
            calibration_note = None
            if calibrate_first:
                progress("calibration (rank-side costs, in a subprocess)")
                calibration_note = calibrate_if_missing(run_dir)
            report = run_analysis(run_dir, options, progress=progress)
            if calibration_note is not None:
                report["notes"].append(calibration_note)
            if with_report:
                progress("report")
                report["report"] = str(_write_report([run_dir], run_dir / "report.html"))
    except TracekitError as err:
        raise InputError(str(err)) from None
    if as_json:
        click.echo(json.dumps(report, default=str))
    else:
        print_analysis(report)
        if with_report:
            click.echo(f"report: {report['report']}")


@cli.command()
@click.argument("run_dir", type=click.Path(path_type=Path))
@click.option("--repeats", type=click.IntRange(min=3), default=15, show_default=True,
              help="Timings per measured point; every figure is their median.")
@click.option("--json", "as_json", is_flag=True, help="Print the calibration as one JSON object instead of the table.")
def calibrate(run_dir: Path, repeats: int, as_json: bool) -> None:
    """Measure what each policy's code path adds on a rank per training step, on this machine.

    Times the trainer's own code at RUN's sizes (tables, ids per sample, per-rank batch): the replica
    path with either sync, a collective's call, the DCT-DP hook, the DCT-MP codec and FAE's batching,
    in one process with a world-1 gloo group (so the wire costs nothing), ~5-20 s. Writes
    RUN/analysis/calibration.json for the analyses, which never import torch (analyze runs this first where
    the file is missing).

    \b
    Example:
      tracekit calibrate runs/base --json
    """
    from tracekit.dlrm import calibrate as calibration
    from tracekit.errors import TracekitError
    from tracekit.views import run_progress

    try:
        inputs = calibration.read_inputs(run_dir)
        with run_progress(enabled=not as_json) as progress:
            result = calibration.calibrate(inputs, repeats=repeats, progress=lambda what: progress(f"calibrating {what}"))
        path = calibration.write(run_dir, result)
    except TracekitError as err:
        raise InputError(str(err)) from None
    if as_json:
        click.echo(json.dumps(result))
        return
    _print_calibration(result)
    click.echo(f"wrote {path}")


def _print_calibration(c: dict) -> None:
    """calibrate's table: each model's coefficients and residual, in µs (ns for per-element figures)."""
    def us(seconds: float) -> str:
        return f"{seconds * 1e6:,.1f} µs"

    def ns(seconds: float) -> str:
        return f"{seconds * 1e9:,.1f} ns"

    m, i = c["machine"], c["inputs"]
    click.echo(f"calibration of {i['run']} ({i['world_size']} rank(s), batch {i['batch_per_rank']} per rank, "
               f"{i['optimizer']}) on {m['host']}: {m['cpu']}, {m['cores']} cores, {m['threads']} thread(s), "
               f"torch {m['torch']}, {m['backend']} world {m['world_size']}, {m['clock']} time, "
               f"load {m['load_avg']}; took {c['seconds']:.1f} s")
    click.echo("replication: extra per step = c0 + c_ids·ids + c_hot·hot ids + c_rows·rows synchronised")
    click.echo(f"  {'sync':<18}{'c0':>12}{'c_ids':>12}{'c_hot':>12}{'c_rows':>12}{'residual':>12}  collectives")
    for sync, r in c["replication"].items():
        calls = ", ".join(f"{n} {op}" for op, n in r["collectives"].items())
        click.echo(f"  {sync:<18}{us(r['c0_s']):>12}{ns(r['c_ids_s']):>12}{ns(r['c_hot_s']):>12}"
                   f"{ns(r['c_rows_s']):>12}{us(r['residual_s']):>12}  {calls}")
    click.echo("collective call (world 1, no wire): "
               + ", ".join(f"{op} {us(s)}" for op, s in c["collective_call_s"].items()))
    dp, mp, fae = c["dct_dp"], c["dct_mp"], c["schedule"]
    click.echo(f"DCT-DP hook over the plain one (keep ratio {dp['keep_ratio']}): {us(dp['c_bucket_s'])} per bucket + "
               f"{ns(dp['c_elem_s'])} per element (residual {us(dp['residual_s'])}); a refresh adds "
               f"{ns(dp['c_refresh_elem_s'])} per element (residual {us(dp['refresh_residual_s'])})")
    click.echo(f"DCT-MP codec (dim {mp['dim']}): {us(mp['c0_s'])} per step + {ns(mp['c_value_s'])} per value sent + "
               f"{ns(mp['c_kept_s'])} per value kept (residual {us(mp['residual_s'])})")
    click.echo(f"FAE schedule: {ns(fae['c_sample_s'])} per sample taken by index (in-memory data); hot split "
               f"{ns(fae['setup_s_per_sample'])} per training sample, once")
    for note in c["notes"]:
        click.echo(f"note: {note}")


@cli.command()
@click.argument("run_dir", type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of the table and snippet.")
def planner(run_dir: Path, as_json: bool) -> None:
    """Print TorchRec planner inputs per table: pooling factors and UVM cache load factors.

    Writes RUN/analysis/planner.parquet and RUN/analysis/torchrec_constraints.json (per table,
    ParameterConstraints' pooling_factors and CacheParams' load_factor at a 90% LRU hit rate) and
    prints the Python that hands them to EmbeddingShardingPlanner.

    \b
    Example:
      tracekit planner runs/torchrec --json
    """
    from analyses.analyze import planner as planner_inputs
    from tracekit.errors import TracekitError

    try:
        summary = planner_inputs(run_dir)
    except TracekitError as err:
        raise InputError(str(err)) from None
    if as_json:
        click.echo(json.dumps(summary, default=str))
        return
    if not summary["rows"]:
        raise InputError(f"{run_dir}: no planner inputs ({'; '.join(summary['notes'])})")
    for name, t in summary["tables"].items():
        caches = ", ".join(f"{float(h):.0%}: {c['load_factor']:.3g} ({c['source']})"
                           for h, c in t["cache_load_factor"].items() if c["load_factor"] is not None)
        click.echo(f"{name}: {t['num_embeddings']:,} rows x {t['embedding_dim']}, {t['n_features']} feature(s), "
                   f"pooling factor {t['pooling_factor'] if t['pooling_factor'] is None else round(t['pooling_factor'], 3)}, "
                   f"cache load factor for an LRU hit rate of {caches or 'any: unknown'}")
    click.echo(f"pooling factors: {summary['pooling_source']}; written: {summary['constraints']}")
    click.echo(summary["snippet"])


@cli.command()
@click.argument("run_dir", type=click.Path(path_type=Path))
@click.argument("query")
@click.option("--format", "fmt", type=click.Choice(["table", "csv", "json", "parquet"]), default="table",
              show_default=True, help="Output format.")
@click.option("-o", "--output", type=click.Path(path_type=Path), default=None, help="Write to FILE (needed for parquet).")
def sql(run_dir: Path, query: str, fmt: str, output: Path | None) -> None:
    """Run a DuckDB query over a run: every trace table and every analysis table is a view.

    Trace tables: accesses, lookups, comms, steps, grads, gpu (and train_accesses, train_lookups,
    train_comms: phase = 'train'); analysis tables: whatever `tracekit analyze` wrote, by name.

    \b
    Example:
      tracekit sql runs/base "SELECT op, sum(bytes_out) FROM train_comms GROUP BY op"
    """
    import duckdb

    from analyses.context import open_context
    from tracekit.errors import TracekitError
    from tracekit.views import print_frame

    if fmt == "parquet" and output is None:
        raise click.BadParameter("parquet output needs -o FILE", param_hint="--format")
    try:
        ctx = open_context(run_dir)
        for part in sorted((ctx.path / "analysis").glob("*.parquet")):
            ctx.con.sql(f"CREATE VIEW \"{part.stem}\" AS SELECT * FROM read_parquet('{part}')")
        frame = ctx.frame(query)
    except TracekitError as err:
        raise InputError(str(err)) from None
    except duckdb.Error as err:
        raise click.ClickException(f"query failed: {str(err).splitlines()[0]}") from None
    if fmt == "parquet":
        frame.write_parquet(output)
    elif fmt in ("csv", "json"):
        text = _csv(frame) if fmt == "csv" else frame.write_json()
        if output is None:
            click.echo(text, nl=False)
        else:
            output.write_text(text)
    else:
        print_frame(frame)


def _csv(frame) -> str:
    """CSV of `frame`, list columns (an all-to-all's splits) written as `[a, b, ...]`, as CSV has no lists."""
    import polars as pl

    lists = [name for name, dtype in frame.schema.items() if isinstance(dtype, (pl.List, pl.Array))]
    return frame.with_columns(
        pl.format("[{}]", pl.col(name).list.eval(pl.element().cast(pl.String)).list.join(", ")).alias(name)
        for name in lists).write_csv()


@cli.command()
@click.argument("base", type=click.Path(path_type=Path))
@click.argument("runs", nargs=-1, required=True, type=click.Path(path_type=Path))
@click.option("--skip-steps", type=click.IntRange(min=0), default=None,
              help="Leave the first N training steps (warm-up) out of step times and samples/s; bytes use every step. "
                   "Default: min(5, max(1, steps // 4)), the rule of every baseline analyze predicts from.")
@click.option("--report", "report_path", type=click.Path(path_type=Path), default=None,
              help="Where to write the HTML report of the comparison (default: BASE/compare.html).")
@click.option("--no-report", is_flag=True, help="Write no HTML report.")
@click.option("--json", "as_json", is_flag=True,
              help="Print one JSON document (runs, rows, warnings) instead of tables.")
def compare(base: Path, runs: tuple[Path, ...], skip_steps: int | None, report_path: Path | None, no_report: bool,
            as_json: bool) -> None:
    """Compare runs with BASE: measured figures side by side, and each policy's predicted against measured.

    Per run (training rows only): step time, samples/s, bytes per step by op and tag, the
    embedding all-to-all and replica sync bytes, eval AUC/logloss and the loss curve against
    BASE's; where a run applied a policy (manifest `policy`), each section's predicted figures
    against the measured ones, with the saving against BASE. Runs of another model are refused.

    \b
    Example:
      tracekit compare runs/base runs/hybrid --json
    """
    from analyses.compare import compare as compare_runs
    from tracekit.errors import TracekitError
    from tracekit.views import print_compare

    try:
        result = compare_runs(base, list(runs), skip_steps=skip_steps)
        if not no_report:
            result.summary["report"] = str(_write_report([base, *runs], report_path or base / "compare.html"))
    except TracekitError as err:
        raise InputError(str(err)) from None
    if as_json:
        click.echo(json.dumps(result.summary, default=str))
    else:
        print_compare(result.summary)
        if not no_report:
            click.echo(f"report: {result.summary['report']}")


def _write_report(runs: list[Path], output: Path, plotly_js: str = "inline") -> Path:
    from reports import write_report

    return write_report(runs, output, plotly_js)


@cli.command()
@click.argument("run_dir", type=click.Path(path_type=Path))
@click.option("--chrome-trace", "trace_path", type=click.Path(path_type=Path, dir_okay=False), default=None,
              help="Write the Chrome / Perfetto trace (Trace Event Format JSON) to FILE. Required.")
def export(run_dir: Path, trace_path: Path | None) -> None:
    """Export a run's steps and collectives as a Chrome / Perfetto trace.

    One process per rank, one track for its steps and one for its collectives (bytes, peers' splits,
    op, tag and step as args); open FILE in ui.perfetto.dev or chrome://tracing.

    \b
    Example:
      tracekit export runs/base --chrome-trace t.json
    """
    from analyses.export import chrome_trace
    from tracekit.errors import TracekitError

    if trace_path is None:
        raise click.UsageError(f"export needs --chrome-trace FILE (the only format it writes), e.g. "
                               f"tracekit export {shlex.quote(str(run_dir))} --chrome-trace t.json")
    try:
        trace = chrome_trace(run_dir)
    except TracekitError as err:
        raise InputError(str(err)) from None
    try:
        _write_atomically(trace_path, json.dumps(trace))
    except OSError as err:
        raise InputError(f"cannot write --chrome-trace {trace_path}: {err.strerror or err}") from None
    x = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    ranks = sum(e["name"] == "process_name" for e in trace["traceEvents"])
    click.echo(f"wrote {trace_path}: {sum(e['cat'] == 'step' for e in x)} step and "
               f"{sum(e['cat'] == 'comm' for e in x)} collective events of {ranks} rank(s)")


def _write_atomically(path: Path, text: str) -> None:
    """Write `text` to `path` under a temporary name, then rename it: a reader never sees half a file."""
    import os
    import tempfile

    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    finally:
        Path(tmp).unlink(missing_ok=True)


@cli.command()
@click.argument("runs", nargs=-1, required=True, type=click.Path(path_type=Path))
@click.option("-o", "--output", type=click.Path(path_type=Path), default=None,
              help="HTML file to write (default: FIRST_RUN/report.html).")
@click.option("--plotly-js", type=click.Choice(["inline", "beside"]), default="inline", show_default=True,
              help="plotly.js inlined in the page, or written once beside it as plotly.min.js (smaller pages "
                   "when many reports share a folder); either way nothing is fetched from the network.")
def report(runs: tuple[Path, ...], output: Path | None, plotly_js: str) -> None:
    """Write one self-contained HTML report of RUN (and how the other RUNs compare with it).

    The verdict first, then overview, skew, traffic, timeline, cache and policies of the first
    run, and with two or more runs the comparison; plotly is inlined, so the file opens from disk
    with no network. A run without RUN/analysis is analysed first.

    \b
    Example:
      tracekit report runs/base runs/hybrid -o report.html
    """
    from tracekit.errors import TracekitError

    try:
        path = _write_report(list(runs), output or runs[0] / "report.html", plotly_js)
    except TracekitError as err:
        raise InputError(str(err)) from None
    click.echo(f"{path} ({path.stat().st_size / 1e6:.1f} MB)")


@cli.command(context_settings={"ignore_unknown_options": True})
@click.option("-o", "--output", "out_dir", type=click.Path(path_type=Path), default=Path("runs/optimize"),
              show_default=True, help="Folder of every run: base, one per policy section, combined.")
@click.option("--lookup-every", type=click.IntRange(min=1), default=1, show_default=True,
              help="Lookups recorded every N steps in the baseline (1: the predictions are exact).")
@click.option("--budget", default=None, help="As for analyze: replica memory per rank, bytes (64MiB) or a share (5%).")
@click.option("--topology", default=None, help="As for analyze: NODESxRANKS for the tiers.")
@click.option("--intra-bw", default=None, help="As for analyze: bandwidth within a node, e.g. 100gbit.")
@click.option("--inter-bw", default=None, help="As for analyze: bandwidth between nodes, e.g. 10gbit.")
@click.option("--policies", default=None, help="As for analyze: comma-separated policies to derive.")
@click.option("--objective", type=click.Choice(["time", "bytes"]), default="time", show_default=True,
              help="As for analyze: what the replica budget minimises.")
@click.option("--cluster", "cluster_shape", default=None, metavar="NODESxRANKS",
              help="Run every run on an emulated cluster (tracekit cluster), e.g. 2x2; needs --link.")
@click.option("--link", default=None, help="With --cluster: each node's link rate, e.g. 200mbit.")
@click.option("--check-all", is_flag=True,
              help="Re-run the sections analyze did not recommend too, each alone: the measurement checks the decision.")
@click.option("--json", "as_json", is_flag=True, help="Print compare's JSON document at the end instead of tables.")
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
def optimize(out_dir: Path, lookup_every: int, budget: str | None, topology: str | None, intra_bw: str | None,
             inter_bw: str | None, policies: str | None, objective: str, cluster_shape: str | None, link: str | None,
             check_all: bool, as_json: bool, command: tuple[str, ...]) -> None:
    """Record COMMAND, analyse it, re-run it with each policy and their combination, and compare.

    COMMAND must accept `--policy PATH` at its end (the reference trainer's train.py does). Every run
    lands in OUT (base, replication, schedule, ..., combined) with its log beside it (OUT/<name>.log).

    \b
    With --cluster NODESxRANKS --link RATE every run goes through `tracekit cluster --record`, and
    COMMAND is the plain `python train.py ...` that each rank runs.

    \b
    Examples:
      tracekit optimize -o runs/opt -- torchrun --standalone --nproc-per-node 2 train.py --steps 300
      tracekit optimize --cluster 2x2 --link 200mbit -o runs/opt -- python train.py --steps 300
    """
    from analyses.analyze import analyze as run_analysis
    from analyses.compare import compare as compare_runs
    from tracekit import optimize as plan
    from tracekit.calibration import calibrate_if_missing
    from tracekit.errors import TracekitError
    from tracekit.views import analysis_progress, print_compare, run_progress

    command = list(command)
    if command and command[0] == "--":
        command = command[1:]
    options = _options(budget, topology, intra_bw, inter_bw, policies, objective)
    on_cluster = _cluster_of(cluster_shape, link)
    out_dir.mkdir(parents=True, exist_ok=True)
    base = out_dir / "base"
    notes_before: list[str] = []
    with run_progress(enabled=not as_json) as progress:
        progress(f"recording the baseline into {base} (log {out_dir / 'base.log'})")
        code = plan.record(base, command, out_dir / "base.log", lookup_every=lookup_every, cluster=on_cluster)
    if code != 0:
        raise click.ClickException(f"the baseline run failed (exit code {code}); its output is in {out_dir / 'base.log'}")
    try:
        with analysis_progress(enabled=not as_json) as progress:
            progress("calibration (rank-side costs, in a subprocess)")
            calibration_note = calibrate_if_missing(base)
            if calibration_note is not None:
                notes_before.append(calibration_note)
            run_analysis(base, options, progress=progress)
            if on_cluster is not None:  # the report's speedup against the link rate
                from analyses.simulate import Target, project

                progress("simulate")
                project(base, Target(on_cluster.nodes, on_cluster.ranks_per_node, on_cluster.link_bytes_per_s),
                        base / "policy.json")
        reruns, notes = plan.reruns(base / "policy.json", checked=check_all)
        notes = notes_before + notes
    except TracekitError as err:
        raise InputError(str(err)) from None
    done = []
    with run_progress(enabled=not as_json) as progress:
        for i, rerun in enumerate(reruns, 1):
            progress(f"re-running with {rerun.name} ({i}/{len(reruns)}; log {out_dir / (rerun.name + '.log')})")
            code = plan.record(out_dir / rerun.name, [*command, "--policy", str(rerun.policy)],
                               out_dir / f"{rerun.name}.log", lookup_every=lookup_every,  # same tracing: times compare
                               cluster=on_cluster)
            if code == 0:
                done.append(out_dir / rerun.name)
            else:
                notes.append(f"{rerun.name}: the run failed (exit code {code}); see {out_dir / (rerun.name + '.log')}")
    if not reruns:
        for note in notes:
            click.echo(note, err=as_json)
        click.echo("optimize: analyze recommends no section for this run (each line above says why); nothing to "
                   "re-run (--check-all re-runs them anyway)", err=as_json)
        return
    if not done:
        raise click.ClickException("no policy run completed: " + "; ".join(notes))
    try:
        result = compare_runs(base, done)
    except TracekitError as err:
        raise InputError(str(err)) from None
    result.summary["notes"] = [*notes, *result.summary.get("notes", [])]
    result.summary["report"] = _optimize_report(base, done, out_dir / "report.html")
    if as_json:
        click.echo(json.dumps(result.summary, default=str))
    else:
        print_compare(result.summary)
        click.echo(f"report: {result.summary['report']}")


def _cluster_of(shape: str | None, link: str | None):
    """optimize's --cluster/--link as a tracekit.cluster.Topology (None without --cluster)."""
    from tracekit.cluster import Topology, parse_topology

    if shape is None and link is None:
        return None
    if shape is None or link is None:
        raise click.UsageError("--cluster NODESxRANKS and --link RATE go together, e.g. --cluster 2x2 --link 200mbit")
    try:
        nodes, ranks = parse_topology(shape)
    except ValueError as err:
        raise click.BadParameter(str(err), param_hint="--cluster") from None
    _check_rate(link)
    return Topology(nodes, ranks, link)


def _check_rate(link: str) -> None:
    from tracekit.units import parse_rate

    try:
        parse_rate(link)
    except ValueError as err:
        raise click.BadParameter(str(err), param_hint="--link") from None


CLUSTER_MAX_NODES = 155  # tracekit.cluster.MAX_NODES, not imported here: the CLI loads its modules lazily


@cli.command()
@click.option("--nodes", type=click.IntRange(min=1, max=CLUSTER_MAX_NODES), required=True,
              help="Nodes (network namespaces).")
@click.option("--ranks-per-node", type=click.IntRange(min=1), default=1, show_default=True,
              help="Ranks (torchrun workers) per node; they talk over the node's loopback, unshaped.")
@click.option("--link", required=True, help="Each node's link rate, each way, e.g. 1gbit, 200mbit.")
@click.option("--latency", type=click.FloatRange(min=0), default=None,
              help="One-way latency of each link in ms (needs the netem qdisc).")
@click.option("--record", "run_dir", type=click.Path(path_type=Path), default=None, metavar="DIR",
              help="Record the run into DIR, as `tracekit record -o DIR` does.")
@click.option("--force", is_flag=True, help="With --record: replace a non-empty run directory.")
@click.option("--lookup-every", type=click.IntRange(min=0), default=10, show_default=True,
              envvar="TRACEKIT_LOOKUP_EVERY", help="With --record: as for record.")
@click.option("--grad-every", type=click.IntRange(min=0), default=100, show_default=True,
              envvar="TRACEKIT_GRAD_EVERY", help="With --record: as for record.")
@click.option("--flush-interval", type=click.FloatRange(min=0.01), default=1.0, show_default=True,
              help="With --record: as for record.")
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
def cluster(nodes: int, ranks_per_node: int, link: str, latency: float | None, run_dir: Path | None, force: bool,
            lookup_every: int, grad_every: int, flush_interval: float, command: tuple[str, ...]) -> None:
    """Run COMMAND on an emulated cluster: NODES network namespaces whose links run at LINK.

    Each node is a network namespace joined to a bridge by a link shaped to LINK each way; one
    torchrun per node runs COMMAND (`python train.py ...` as it is, no torchrun) on its ranks, so
    traffic between nodes crosses the slow link and traffic within a node does not. Everything it
    creates is removed when COMMAND ends. Needs root and iproute2. Exits with COMMAND's exit code
    (the first node's that failed; 130 after Ctrl-C).

    \b
    Example:
      tracekit cluster --nodes 2 --ranks-per-node 2 --link 200mbit --record runs/c -- python train.py --steps 300
    """
    from tracekit import cluster as emulated
    from tracekit import recording

    _check_rate(link)
    topology = emulated.Topology(nodes, ranks_per_node, link, latency)
    command = list(command)
    try:
        emulated.check_prerequisites(topology)
        recording.check_command(command)
        if run_dir is not None:
            recording.prepare_run_dir(run_dir, force=force)
    except emulated.ClusterError as err:
        raise InputError(str(err)) from None
    except recording.RecordError as err:
        raise click.UsageError(str(err)) from None

    def say(line: str) -> None:
        click.echo(f"tracekit cluster: {line}", err=True)

    def run(env: dict[str, str] | None = None) -> tuple[int, bool]:
        try:
            return emulated.run(command, topology, env=env, say=say)
        except emulated.ClusterError as err:
            say(f"failed: {err}")
            return 2, False

    if run_dir is None:
        sys.exit(run()[0])
    say(f"recording into {run_dir}")
    code = recording.record(command, run_dir, lookup_every=lookup_every, grad_every=grad_every,
                            flush_interval_s=flush_interval, gpu_interval_s=0.1,
                            manifest_extra={"topology": topology.manifest()}, run=run)
    click.echo(_describe(recording.summary(run_dir, recording.read_manifest(run_dir))), err=True)
    sys.exit(code)


@cli.command()
@click.argument("run_dir", type=click.Path(path_type=Path))
@click.option("--interval", type=click.FloatRange(min=0.05), default=1.0, show_default=True,
              help="Seconds between refreshes.")
@click.option("--window", type=click.IntRange(min=1), default=20, show_default=True,
              help="Recent steps over which step time, comm share and bytes per step are taken.")
@click.option("--once", is_flag=True, help="Print one snapshot and exit.")
def watch(run_dir: Path, interval: float, window: int, once: bool) -> None:
    """Show a run live, being recorded or finished: steps, step time, comm share, bytes, hot tables.

    Reads each part file once as it lands, so it is cheap to leave open beside a run; it ends
    when the run does (printing the final figures), and on a finished run prints them at once.
    Comm share: the union of a rank's collective intervals within each step over the step's
    time, over its last WINDOW steps.

    \b
    Example:
      tracekit watch runs/base
    """
    from tracekit.errors import TracekitError
    from tracekit.watch import watch as watch_run

    try:
        watch_run(run_dir, interval=interval, window=window, once=once)
    except TracekitError as err:
        raise InputError(str(err)) from None


@cli.command()
@click.argument("run_dir", type=click.Path(path_type=Path))
@click.option("--topology", required=True, help="The cluster projected onto: NODESxRANKS, e.g. 8x8.")
@click.option("--inter-bw", required=True, help="Each node's link to the others, each way, e.g. 200mbit, 100gbit.")
@click.option("--intra-bw", default=None, help="Between ranks of one node (default: measured in the run).")
@click.option("--batch-size", type=click.IntRange(min=1), default=None,
              help="Samples per rank on the target (default: the run's).")
@click.option("--latency", default=None, help="Time one collective costs beyond its bytes, e.g. 50us "
              "(default: measured in the run).")
@click.option("--policy", "policy_arg", default="all", show_default=True,
              help="A policy file to project, `all` (RUN/policy.json, where analyze wrote one) or `none`.")
@click.option("--duplex", type=click.Choice(["full", "half"]), default="full", show_default=True,
              help="full: both directions of a link at once; half: each pair's two directions one after the "
                   "other (gloo's worst case, where ranks enter an exchange at different times).")
@click.option("--report/--no-report", "with_report", default=True, show_default=True,
              help="Rewrite RUN/report.html with the projection in it.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of the table.")
def simulate(run_dir: Path, topology: str, inter_bw: str, intra_bw: str | None, batch_size: int | None,
             latency: str | None, policy_arg: str, duplex: str, with_report: bool, as_json: bool) -> None:
    """Project a recorded run onto another cluster: bytes and time per step of the baseline and of
    each policy, from the run's traffic, its compute time and the cost model.

    Writes RUN/analysis/simulate.parquet (and simulate_sweep.parquet: step time against the link rate)
    and RUN/analysis/simulate.json.

    \b
    Example:
      tracekit simulate runs/base --topology 2x1 --inter-bw 200mbit
    """
    from analyses.simulate import Target, project
    from tracekit.cluster import parse_topology
    from tracekit.errors import TracekitError
    from tracekit.units import parse_duration, parse_rate
    from tracekit.views import print_simulate

    def parsed(parse, text: str | None, hint: str):
        try:
            return None if text is None else parse(text)
        except ValueError as err:
            raise click.BadParameter(str(err), param_hint=hint) from None

    nodes, per_node = parsed(parse_topology, topology, "--topology")
    target = Target(nodes, per_node, parsed(parse_rate, inter_bw, "--inter-bw"), parsed(parse_rate, intra_bw, "--intra-bw"),
                    batch_size, parsed(parse_duration, latency, "--latency"), duplex == "full")
    policy_path = None if policy_arg == "none" else run_dir / "policy.json" if policy_arg == "all" else Path(policy_arg)
    if policy_arg == "all" and not policy_path.is_file():
        policy_path = None
    elif policy_path is not None and not policy_path.is_file():
        raise click.BadParameter(f"{policy_path}: no such file", param_hint="--policy")
    try:
        summary = project(run_dir, target, policy_path)
        if policy_arg == "all" and policy_path is None:
            summary["notes"].append(f"no {run_dir / 'policy.json'}: the baseline only (tracekit analyze writes it)")
        if with_report:
            summary["report"] = str(_write_report([run_dir], run_dir / "report.html"))
    except TracekitError as err:
        raise InputError(str(err)) from None
    if as_json:
        click.echo(json.dumps(summary, default=str))
    else:
        print_simulate(summary)
        if with_report:
            click.echo(f"report: {summary['report']}")


def _optimize_report(base: Path, runs: list[Path], target: Path) -> str:
    """optimize's last step: the report of the base and the policy runs (a failure is said, not raised)."""
    try:
        return str(_write_report([base, *runs], target))
    except Exception as err:  # the runs and the comparison are done; a report bug must not hide them
        return f"not written ({type(err).__name__}: {err})"


def main() -> None:
    cli()

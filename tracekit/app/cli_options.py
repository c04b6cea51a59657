"""The command line's plumbing (tracekit/app/cli.py holds the commands): the group that prints a
TracekitError as one line, the options several commands share, options turned into the library's
types (click.BadParameter naming the option at fault), and record's hint for options written after
the command without a `--`.
"""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any, Callable

import click


class InputError(click.ClickException):
    """A run or file that cannot be used: one line, exit 2 (or the error's own exit code)."""

    exit_code = 2


class Commands(click.Group):
    """The group: a TracekitError out of any command is printed as its one line, no traceback."""

    def invoke(self, ctx: click.Context) -> Any:
        from tracekit.errors import TracekitError

        try:
            return super().invoke(ctx)
        except TracekitError as err:
            error = InputError(str(err))
            error.exit_code = err.exit_code
            raise error from None


def _options_of(*decorators: Callable) -> Callable:
    """One decorator applying the click options `decorators`, for options commands share."""
    def apply(command: Callable) -> Callable:
        for decorator in reversed(decorators):
            command = decorator(command)
        return command
    return apply


RUN_DIR = click.argument("run_dir", type=click.Path(path_type=Path))
JSON = click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of tables.")
TRACING = _options_of(  # what record and cluster --record trace
    click.option("--lookup-every", type=click.IntRange(min=0), default=10, show_default=True,
                 envvar="TRACEKIT_LOOKUP_EVERY", help="Write raw per-sample lookups every N steps (0: never)."),
    click.option("--grad-every", type=click.IntRange(min=0), default=100, show_default=True, envvar="TRACEKIT_GRAD_EVERY",
                 help="Write gradient statistics (grads table) of every optimized parameter every N steps (0: never)."),
    click.option("--flush-interval", type=click.FloatRange(min=0.01), default=1.0, show_default=True,
                 help="Seconds between flushes of each rank's trace rows to Parquet."))
_HANG_AFTER = click.option("--hang-after", type=click.FloatRange(min=1), default=None, metavar="SECONDS",
                          help="Diagnose a hang when a rank is silent or in one collective this long (hang.json, one "
                               "paragraph on stderr; the job is left running). Default: 100x the slowest rank's step "
                               "time, at least 60 s.")
_WINDOW = _options_of(  # which steps record keeps
    click.option("--steps", "window_steps", default=None, metavar="FIRST:STOP",
                 help="Record accesses, lookups and comms of steps FIRST to STOP-1 only (either may be empty)."),
    click.option("--every", "window_every", default=None, metavar="N:M",
                 help="Record accesses, lookups and comms of the first M steps of every N only, e.g. 100:10."))
_MAX_SIZE = click.option("--max-size", default=None, metavar="BYTES",
                        help="Write at most this much trace (e.g. 20GB), each rank its share; the manifest's "
                             "truncated_at then says where each rank stopped. Default: no limit.")
_PLAN = click.option("--plan", type=click.Path(path_type=Path), default=None, metavar="FILE",
                     help="A TorchRec job: build its DistributedModelParallel with this plan (tracekit's TorchRec plan "
                          "file, as `tracekit optimize` writes it) in place of the one its code builds.")
JOB = _options_of(_HANG_AFTER, _MAX_SIZE, _WINDOW, _PLAN)  # record's options for jobs of days, hangs and plans
DCT_REPLAY = click.option("--dct-replay", is_flag=True, envvar="TRACEKIT_DCT_REPLAY",
                          help="Replay DCT-DP with error feedback on every step's gradients (dct_replay table), from "
                               "which analyze derives compression.dp; costs the step ~15% on the reference trainer, "
                               "so off by default.")
ANALYSIS = _options_of(  # what analyze and optimize derive
    click.option("--budget", default=None, help="Replica/cache memory per rank: bytes (64MiB) or a share of the "
                 "embedding bytes (5%). Default: the sweep's optimum."),
    click.option("--topology", default=None, help="NODESxRANKS for the FlexShard tiers, e.g. 2x4 (default: one node)."),
    click.option("--intra-bw", default=None, help="Bandwidth within a node, e.g. 100Gbit (default: measured in the run)."),
    click.option("--inter-bw", default=None, help="Bandwidth between nodes, e.g. 10Gbit (default: measured in the run)."),
    click.option("--policies", default=None, help="Comma-separated policies to derive (default: all)."),
    click.option("--objective", type=click.Choice(["time", "bytes"]), default="time", show_default=True,
                 help="What the replica budget minimises: predicted step time (measured bandwidths and latency), "
                      "or the bytes that cross the network (what a slower cluster pays for)."),
    click.option("--replay-steps", type=click.IntRange(min=0), default=256, show_default=True,
                 help="Recorded lookup steps the exchange replays use, evenly spaced (0: all); a replay of fewer "
                      "steps than the run's states its error."),
    click.option("--quality-budget", default="0.002,1%", show_default=True,
                 help="The most a lossy section (DCT compression, the FAE schedule) may cost the model: an eval AUC "
                      "loss (0.002) and a relative rise of eval log loss (1%), comma-separated; a bound not given "
                      "keeps its default. One whose measured cost is over either, or not measured, is not "
                      "recommended; `optimize` measures it with calibration runs."),
    click.option("--memory-limit", default="1GB", show_default=True,
                 help="Memory the analysis's DuckDB may hold (it spills to a temporary folder past it), e.g. 4GiB; "
                      "the process holds about 0.5 GiB more."))


def parsed(parse: Callable[[str], Any], text: str | None, hint: str) -> Any:
    """`parse(text)` (None for None); click.BadParameter naming the option `hint` where it fails."""
    try:
        return None if text is None else parse(text)
    except ValueError as err:
        raise click.BadParameter(str(err), param_hint=hint) from None


def job_settings(hang_after: float | None, max_size: str | None, window_steps: str | None,
                 window_every: str | None, plan: Path | None) -> dict[str, Any]:
    """The JOB options as recording.record's keywords: --max-size in bytes, --steps/--every as a
    tracekit.window.Window, --plan read and checked; click.BadParameter naming the option that fails."""
    from tracekit.torchrec_plan import PlanError, read_plan
    from tracekit.units import parse_bytes
    from tracekit.window import Window

    window = parsed(lambda _: Window.parse(steps=window_steps, every=window_every), "", "--steps/--every")
    try:
        None if plan is None else read_plan(plan)
    except PlanError as err:
        raise click.BadParameter(str(err), param_hint="--plan") from None
    return {"hang_after": hang_after, "max_size": parsed(parse_bytes, max_size, "--max-size"), "window": window,
            "plan": plan}


def analysis_options(budget: str | None, topology: str | None, intra_bw: str | None, inter_bw: str | None,
                      policies: str | None, objective: str, replay_steps: int = 256, memory_limit: str = "1GB",
                      quality_budget: str = "0.002,1%"):
    """The ANALYSIS options as analyses.context.Options."""
    from analyses.analyze import POLICIES
    from analyses.context import Options
    from analyses.quality import Budget
    from tracekit.topology import Topology
    from tracekit.units import parse_budget, parse_bytes, parse_rate

    limit = parsed(parse_bytes, memory_limit, "--memory-limit")
    if limit is not None and limit < 64 * 2**20:
        raise click.BadParameter(f"{memory_limit}: at least 64MiB", param_hint="--memory-limit")
    options = Options(objective=objective, replay_steps=replay_steps, memory_limit=f"{limit // 2**20}MiB",
                      topology=parsed(Topology.parse, topology, "--topology"),
                      intra_bw=parsed(parse_rate, intra_bw, "--intra-bw"),
                      inter_bw=parsed(parse_rate, inter_bw, "--inter-bw"),
                      quality_budget=parsed(Budget.parse, quality_budget, "--quality-budget"))
    if budget is not None:
        options.budget_bytes, options.budget_fraction = parsed(parse_budget, budget, "--budget")
    if policies is not None:
        options.policies = tuple(p.strip() for p in policies.split(",") if p.strip())
        if unknown := [p for p in options.policies if p not in POLICIES]:
            raise click.BadParameter(f"unknown policy {', '.join(unknown)}; the policies are {', '.join(POLICIES)}",
                                     param_hint="--policies")
    return options


class RecordCommand(click.Command):
    """`record`, whose "No such option" says so when the option follows the command without a `--`."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        from tracekit.app.recording import command_start

        takes_value = {opt: not (p.is_flag or p.count) for p in self.get_params(ctx)
                       if isinstance(p, click.Option) for opt in (*p.opts, *p.secondary_opts)}
        start = None if "--" in args else command_start(args, takes_value)
        fixed = None if start is None else shlex.join([*args[:start], "--", *args[start:]])
        # an option of record's own after the command (a trainer's --steps) would silently be record's
        mine = next((a for a in args[start:] if a.split("=", 1)[0] in takes_value), None) if fixed else None
        if mine is not None:
            raise click.UsageError(f"'{mine.split('=', 1)[0]}' after the command is read as record's own option; "
                                   f"put `--` before the command: tracekit record {fixed}", ctx)
        try:
            return super().parse_args(ctx, list(args))
        except click.NoSuchOption as err:
            if fixed is None:
                raise
            raise click.UsageError(f"No such option '{err.option_name}': without `--`, the command's options are "
                                   f"read as record's; put `--` before the command: tracekit record {fixed}",
                                   ctx) from None


def cluster_topology(shape: str | None, link: str | None):
    """optimize's --cluster NODESxRANKS --link RATE as a tracekit.app.cluster.Cluster (None without them)."""
    from tracekit.app.cluster import Cluster
    from tracekit.topology import Topology
    from tracekit.units import parse_rate

    if (shape is None) != (link is None):
        raise click.UsageError("--cluster NODESxRANKS and --link RATE go together, e.g. --cluster 2x2 --link 200mbit")
    if link is None:
        return None
    topology = parsed(Topology.parse, shape, "--cluster")
    parsed(parse_rate, link, "--link")
    return Cluster(topology.nodes, topology.ranks_per_node, link)

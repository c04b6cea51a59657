"""The one model of time per training step that every prediction uses (policies, `simulate`,
`compare`, the lag model, the report): collectives fitted from the run's own calls, the work a
policy adds on the rank from a calibration, and one baseline step time.

Collectives (an α–β model per process group). A synchronous training call, matched across ranks
(step, op, group, order), takes its transfer time: from the last rank's entry to the last rank's
exit, on the ranks' common clock (analyses.clocks). Before the last entry the others waited, and
data from the early ranks was already on the wire, so no single rank's duration is the transfer:
the least one undercounts it by the early ranks' head start (measured on `tracekit cluster` at
50mbit, a backward exchange whose ranks entered apart showed 60% of its wire time). A call that
misses a rank's row takes its least duration. Its wire size x is what the busiest link carries
one way:

    all_to_all   max over ranks of max(remote bytes out, remote bytes in)   (lopsided exchanges)
    all_reduce   2(n−1)/n · S      (ring, S the buffer)
    all_gather   (n−1)/n · S_in    (S_in the gathered output)
    other        bytes_out

and time = α_op + β · x, fitted by least squares over every call of the group (one β: one link;
one α ≥ 0 per op: each op's fixed cost on the wire and on the rank; an α the fit puts below 0, as a
token bucket's burst does by moving small calls faster than the link, is held at 0 and the rest
refitted), then refitted without the calls
whose residual exceeds RESIDUAL_CLIP robust deviations (waits the rule did not remove).
`residual_s` is the robust spread (1.4826 · MAD) of the residuals. Where the calls' sizes do not
spread enough to tell β (x_max < MIN_SPREAD · x_min), β comes from the options' link rate or
stays 0 and says so. Options `--intra-bw`/`--inter-bw` fix β (1 / rate) and fit α alone.

Rank-side work: a policy also adds work on the rank (the replica path's split, gather and sync
bookkeeping, a compression hook's selection). `tracekit calibrate` (tracekit/dlrm/calibrate.py)
measures it on the run's machine into analysis/calibration.json; `Network.work` reads its linear
models, in CPU seconds, times ranks per host / cores where a host runs more ranks than cores. Without that file the added work is unknown: predictions say so and count one α per added
collective only.

Baseline step time: per training step the slowest rank's t_end − t_start, the first
`warmup_steps(n)` = min(5, max(1, n // 4)) steps left out (the same rule in `compare`, `simulate`,
the timeline and the lag model), median. `spread_s` is the run's own step-time drift: half the
range of the medians of WINDOWS contiguous windows of the kept steps, the part of run-to-run
variation one run can show.

    net = network(ctx)
    net.call("all_to_all_single", 64e3)          # seconds of one call moving 64 kB on its busiest link
    net.sync("sparse_allreduce", 120e3)          # a replica sync of 120 kB per step (Σ ranks)
    net.step.median_s, net.step.spread_s
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

import numpy as np
import polars as pl

from analyses.clocks import clock_offsets, offset_sql
from analyses.context import Context
from tracekit.figures import STEP_TIME
from tracekit.schema import CALIBRATION_PATH

A2A = "all_to_all_single"
ALL_REDUCE = "all_reduce"
ALL_GATHER = "all_gather"
SPARSE_SYNC_OPS = (ALL_GATHER, A2A, ALL_REDUCE)  # the count, the ids, the union rows
MIN_SPREAD = 1.5
RESIDUAL_CLIP = 4.0
WINDOWS = 4
MAX_WARMUP = 5
WIRE_ERROR = {"link": 0.1, "one host": 0.5}
"""The share of a change in transfer time the model may be off by: between hosts the fit recovers
a link's rate within ~15% (tests/test_network.py); on one host the "link" is memory copies and
gloo's threads on the cores the ranks compute on, and bench/prediction_accuracy.py measured byte
savings there worth half what β said, or nothing."""
WIRE_EFFICIENCY = 1448 / 1514
"""TCP payload per byte on an Ethernet link at MTU 1500 (with TCP timestamps): what a rate-limited
link such as `tracekit cluster`'s delivers."""


def warmup_steps(n: int) -> int:
    """Steps left out at the start of a run of n timed steps: min(5, max(1, n // 4)), none of one
    step. The first step's window opens when the collectors start, so it holds start-up."""
    return min(MAX_WARMUP, max(1, n // 4)) if n > 1 else 0


@dataclass(frozen=True)
class StepTime:
    median_s: float | None
    spread_s: float
    steps: int  # kept
    warmup: int


@dataclass(frozen=True)
class Fit:
    """time = alpha_s[op] + beta_s_per_byte · x, over one process-group size."""

    group_size: int
    alpha_s: dict[str, float]
    beta_s_per_byte: float
    residual_s: float
    calls: int
    kept: int
    source: str

    @property
    def bandwidth(self) -> float | None:
        return 1 / self.beta_s_per_byte if self.beta_s_per_byte > 0 else None


@dataclass
class Network:
    world: int
    fit: Fit
    step: StepTime
    calibration: dict | None
    notes: list[str] = field(default_factory=list)
    ranks_per_host: float = 1.0
    cores: int = 1
    hosts: int = 1

    def alpha(self, op: str) -> float:
        a = self.fit.alpha_s
        return a.get(op, a.get(A2A, a.get(ALL_REDUCE, 0.0)))

    def call(self, op: str, wire_bytes: float) -> float:
        """Seconds of one call of `op` whose busiest link carries `wire_bytes` one way."""
        return self.alpha(op) + self.fit.beta_s_per_byte * max(wire_bytes, 0.0)

    def sync(self, kind: str, total_bytes: float) -> float:
        """A replica sync moving `total_bytes` per step (Σ ranks' wire bytes, analyses.exchange's
        formulas): its collectives' α and its per-rank wire bytes at β; 0 for nothing to sync."""
        if total_bytes <= 0:
            return 0.0
        return self.sync_alpha(kind) + self.fit.beta_s_per_byte * total_bytes / max(self.world, 1)

    def sync_alpha(self, kind: str) -> float:
        """The fixed cost of one replica sync's collectives (α each)."""
        ops = SPARSE_SYNC_OPS if kind == "sparse_allreduce" else (ALL_REDUCE,)
        return sum(self.alpha(op) for op in ops)

    def sync_calls(self, kind: str) -> int:
        return len(SPARSE_SYNC_OPS) if kind == "sparse_allreduce" else 1

    def work(self, kind: str, **sizes):
        """Seconds per step a policy path adds on the rank, from the calibration's linear model for
        `kind` ("replication.sparse_allreduce", "dct_dp", ...) at `sizes` (its variables without
        the c_ prefix and _s suffix: ids=, hot=, rows=, elements= ...); None: not calibrated."""
        model = self._model(kind)
        if model is None:
            return None
        total = float(model.get("c0_s", 0.0))
        for name, value in sizes.items():
            total = total + float(model.get(f"c_{name}_s", 0.0)) * np.asarray(value, dtype=np.float64)
        return np.maximum(total, 0.0) * self.oversubscribed

    @property
    def wire_error(self) -> float:
        return WIRE_ERROR["one host" if self.hosts <= 1 else "link"]

    @property
    def oversubscribed(self) -> float:
        """Wall seconds per CPU second of a rank's work: the calibration times CPU on one process;
        where a host runs more ranks than it has cores, each gets that share of one."""
        return max(1.0, self.ranks_per_host / max(self.cores, 1))

    def work_residual(self, kind: str) -> float:
        model = self._model(kind)
        return float(model.get("residual_s", 0.0)) if model else 0.0

    def _model(self, kind: str) -> dict | None:
        node = self.calibration
        for part in kind.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        return node if isinstance(node, dict) else None

    def error(self, changed_calls: float, wire_change_s: float, work_kind: str | None = None) -> float:
        """The model's error on a predicted step time: each added or removed call's residual
        (independent), `wire_error` of the transfer time it changes, the calibration's residual,
        and the baseline's own drift."""
        return (math.sqrt(max(changed_calls, 0.0) * self.fit.residual_s ** 2 + (self.wire_error * wire_change_s) ** 2
                          + (self.work_residual(work_kind) if work_kind else 0.0) ** 2)
                + self.step.spread_s)

    def summary(self) -> dict:
        return {"group_size": self.fit.group_size, "alpha_s": self.fit.alpha_s,
                "beta_s_per_byte": self.fit.beta_s_per_byte, "bandwidth_bytes_per_s": self.fit.bandwidth,
                "residual_s": self.fit.residual_s, "calls": self.fit.calls, "calls_fitted": self.fit.kept,
                "source": self.fit.source, STEP_TIME: self.step.median_s, "step_spread_s": self.step.spread_s,
                "timed_steps": self.step.steps, "warmup_steps": self.step.warmup,
                "rank_work": "calibrated" if self.calibration else "not calibrated (tracekit calibrate RUN)",
                "rank_work_per_cpu_second": self.oversubscribed,
                "notes": self.notes}


def network(ctx: Context) -> Network:
    """The run's network model, fitted once per context (ctx.memo)."""
    return ctx.memo(network, lambda: _network(ctx))


def _network(ctx: Context) -> Network:
    notes: list[str] = []
    calibration = _calibration(ctx, notes)
    # nodes: hosts, or the emulated nodes of `tracekit cluster` (one host, a shaped link between them)
    hosts = max(len(ctx.manifest.hosts or ()), int((ctx.manifest.topology or {}).get("nodes") or 1))
    cores = int((ctx.manifest.devices or {}).get("cores") or (calibration or {}).get("machine", {}).get("cores")
                or 1)
    return Network(ctx.model.world_size, fit_calls(ctx, notes), step_time(ctx), calibration, notes,
                   ctx.model.world_size / hosts, cores, hosts)


# the baseline step time -------------------------------------------------------------------------

def step_frame(ctx: Context) -> pl.DataFrame:
    """Per training step: step, step_time_s (the slowest rank's), in step order."""
    if not ctx.has("steps"):
        return pl.DataFrame(schema={"step": pl.Int64, STEP_TIME: pl.Float64})
    return ctx.frame("""SELECT step, max(t_end_ns - t_start_ns) / 1e9 AS step_time_s FROM steps
                        WHERE t_end_ns >= t_start_ns GROUP BY step ORDER BY step""")


def step_time(ctx: Context) -> StepTime:
    return timed(step_frame(ctx)[STEP_TIME].to_numpy())


def timed(times: np.ndarray) -> StepTime:
    """The baseline rule over step times in step order (module docstring)."""
    n = len(times)
    if not n:
        return StepTime(None, 0.0, 0, 0)
    skip = warmup_steps(n)
    kept = np.asarray(times[skip:], dtype=np.float64)
    windows = [w for w in np.array_split(kept, WINDOWS) if len(w)] if len(kept) >= 2 * WINDOWS else [kept]
    medians = [float(np.median(w)) for w in windows]
    return StepTime(float(np.median(kept)), (max(medians) - min(medians)) / 2, len(kept), skip)


# what a collective costs the step -------------------------------------------------------------

def exposed(ctx: Context, where: str = "true") -> dict[tuple[str, str], float]:
    """Seconds per step each (op, tag) of synchronous training calls holds the ranks, waits included:
    per step the mean over ranks of their calls' total duration, the median over the steps after
    warm-up. A policy that shrinks a collective's bytes shrinks this in proportion (its waits come
    from the same link: a late rank is late from the previous exchange), down to the call's α."""
    if not ctx.has("comms"):
        return {}
    n = ctx.train_steps()
    rows = ctx.sql(f"""
        WITH per AS (SELECT op, coalesce(tag, '') AS tag, step, rank, sum(t_end_ns - t_start_ns) / 1e9 AS d
                     FROM train_comms WHERE NOT "async" AND t_end_ns > t_start_ns AND group_size >= 2 AND ({where})
                     GROUP BY ALL),
             steps AS (SELECT op, tag, step, avg(d) AS d FROM per GROUP BY ALL)
        SELECT op, tag, median(d) FROM steps WHERE step >= (SELECT min(step) FROM per) + {warmup_steps(n)}
        GROUP BY ALL""").fetchall()
    return {(op, tag): float(d) for op, tag, d in rows}


def shrunk(ctx: Context, where: str, ratio: float) -> float:
    """Seconds per step saved when the synchronous calls matching `where` keep `ratio` of their
    bytes: their transfer (β · busiest-link bytes) shrinks in proportion, and what they held the
    ranks beyond α and transfer (waits for a rank late from the link) shrinks with the step's whole
    transfer time, as in analyses.exchange_timing.timing; on a link whose bytes cost nothing (β ≈ 0)
    nothing is saved."""
    net = network(ctx)
    steps = max(ctx.train_steps(), 1)
    beta = net.fit.beta_s_per_byte
    part = calls_frame(ctx, where)
    if not part.height or beta <= 0:
        return 0.0
    transfer = beta * float(part["x"].sum()) / steps
    every = beta * float(calls_frame(ctx)["x"].sum()) / steps
    calls = part.height / steps
    waits = max(sum(exposed(ctx, where).values()) - calls * net.alpha(A2A) - transfer, 0.0)
    saved = transfer * (1 - ratio)
    return saved + waits * (saved / every if every > 0 else 0.0)


def exposed_async(ctx: Context, where: str) -> float:
    """Seconds per step the asynchronous training calls matching `where` run past a rank's last
    synchronous call (what the step waits for them; before that they overlap its work): per step
    the mean over ranks, the median over the steps after warm-up."""
    if not ctx.has("comms"):
        return 0.0
    rows = ctx.sql(f"""
        WITH last AS (SELECT rank, step, max(t_end_ns) AS t FROM train_comms WHERE NOT "async" GROUP BY ALL),
             per AS (SELECT c.rank, c.step, sum(greatest(c.t_end_ns - greatest(c.t_start_ns, coalesce(l.t, 0)), 0))
                            / 1e9 AS d
                     FROM train_comms c LEFT JOIN last l USING (rank, step)
                     WHERE c."async" AND c.t_end_ns > c.t_start_ns AND ({where}) GROUP BY ALL),
             steps AS (SELECT step, avg(d) AS d FROM per GROUP BY step)
        SELECT median(d) FROM steps WHERE step >= (SELECT min(step) FROM steps) + {warmup_steps(ctx.train_steps())}
        """).fetchall()
    return float(rows[0][0] or 0.0) if rows else 0.0


# the α–β fit ------------------------------------------------------------------------------------

def calls_frame(ctx: Context, where: str = "true") -> pl.DataFrame:
    """One row per synchronous training collective (of those matching the SQL `where`) matched
    across ranks: op, group_size, x (wire bytes on its busiest link, module docstring), time_s
    (the last rank's entry to the last exit, module docstring)."""
    schema = {"op": pl.String, "group_size": pl.Int64, "x": pl.Float64, "time_s": pl.Float64}
    if not ctx.has("comms"):
        return pl.DataFrame(schema=schema)
    offset = offset_sql(clock_offsets(ctx.manifest)[0])
    return ctx.frame(f"""
        WITH c AS (
            SELECT step, op, "group", group_size AS n, rank, bytes_out, bytes_in, splits_out,
                   (t_end_ns - t_start_ns) / 1e9 AS time_s, t_start_ns + {offset} AS t0, t_end_ns + {offset} AS t1,
                   row_number() OVER (PARTITION BY rank, step, op, "group" ORDER BY seq) AS nth
            FROM train_comms
            WHERE t_end_ns > t_start_ns AND group_size >= 2 AND op <> 'barrier' AND NOT "async"
                  AND greatest(bytes_out, bytes_in) > 0 AND ({where})),
        calls AS (
            SELECT step, op, "group", nth, any_value(n) AS n,
                   CASE WHEN count(DISTINCT rank) = any_value(n) THEN (max(t1) - max(t0)) / 1e9
                        ELSE min(time_s) END AS time_s,
                   max(bytes_out)::DOUBLE AS bytes_out, max(bytes_in)::DOUBLE AS bytes_in,
                   -- the splits make the whole matrix: every rank of the group once, each with n splits
                   count(*) = any_value(n) AND count(DISTINCT rank) = any_value(n) AND min(rank) = 0
                       AND max(rank) = any_value(n) - 1 AND bool_and(len(splits_out) = n) AS whole,
                   bool_and(splits_out IS NOT NULL) AS split
            FROM c GROUP BY ALL),
        cells AS (  -- the all-to-alls' bytes from each rank to each other rank
            SELECT step, op, "group", nth, rank AS src, unnest(splits_out) AS b,
                   unnest(generate_series(0, len(splits_out) - 1)) AS dst
            FROM c WHERE op LIKE 'all_to_all%' AND splits_out IS NOT NULL),
        links AS (  -- the busiest link: the most a rank sends to, or receives from, the others
            SELECT step, op, "group", nth, greatest(max(sent), max(received))::DOUBLE AS busiest FROM (
                SELECT step, op, "group", nth, src AS r, sum(b) AS sent, 0 AS received FROM cells
                WHERE src <> dst GROUP BY ALL
                UNION ALL
                SELECT step, op, "group", nth, dst AS r, 0, sum(b) FROM cells WHERE src <> dst GROUP BY ALL)
            GROUP BY ALL)
        SELECT c.op, c.n AS group_size,
               CASE WHEN c.op LIKE 'all_to_all%' AND c.split AND c.whole THEN coalesce(l.busiest, 0.0)
                    WHEN c.op LIKE 'all_to_all%' THEN c.bytes_out * (c.n - 1) / c.n
                    WHEN c.op = '{ALL_REDUCE}' THEN 2 * (c.n - 1) / c.n * c.bytes_out
                    WHEN c.op LIKE 'all_gather%' THEN (c.n - 1) / c.n * c.bytes_in
                    ELSE c.bytes_out END AS x,
               c.time_s
        FROM calls c LEFT JOIN links l USING (step, op, "group", nth)
        ORDER BY c.step, c.op, c."group", c.nth""").cast(schema)


def fit_calls(ctx: Context, notes: list[str]) -> Fit:
    """The α–β fit over the run's calls in its largest group (module docstring)."""
    calls = calls_frame(ctx).with_columns(pl.col("op").str.replace(r"^all_gather.*", ALL_GATHER))
    given = ctx.options.inter_bw or ctx.options.intra_bw
    if not calls.height:
        notes.append("no timed synchronous collective in the run: α = 0, β from the options or 0")
        return Fit(ctx.model.world_size, {}, 1 / given if given else 0.0, 0.0, 0, 0, "none")
    size = int(calls["group_size"].mode().max())
    calls = calls.filter(pl.col("group_size") == size)
    ops = sorted(calls["op"].unique())
    x, t = calls["x"].to_numpy(), calls["time_s"].to_numpy()
    op_index = np.array([ops.index(o) for o in calls["op"]])
    spread = x.max() >= MIN_SPREAD * max(x.min(), 1.0)
    beta_fixed = 1 / given if given else (None if spread else 0.0)
    keep = np.ones(len(t), dtype=bool)
    for _ in range(2):
        alpha, beta = _lstsq(x[keep], t[keep], op_index[keep], len(ops), beta_fixed)
        residual = t - (alpha[op_index] + beta * x)
        scale = _robust(residual[keep])
        keep = np.abs(residual) <= RESIDUAL_CLIP * max(scale, 1e-6)
    source = ("β from --intra-bw/--inter-bw, α fitted" if given else
              "α–β least squares over the run's calls" if spread else
              "α fitted; the calls' sizes do not spread enough to tell β (taken 0)")
    if beta_fixed == 0.0 and not given:
        notes.append(f"network: {source}")
    return Fit(size, {op: float(a) for op, a in zip(ops, alpha)}, float(beta), _robust(residual[keep]),
               len(t), int(keep.sum()), source)


def _lstsq(x: np.ndarray, t: np.ndarray, op: np.ndarray, n_ops: int, beta: float | None) -> tuple[np.ndarray, float]:
    onehot = np.zeros((len(t), n_ops))
    onehot[np.arange(len(t)), op] = 1.0
    if beta is None:
        free = np.ones(n_ops, dtype=bool)
        for _ in range(n_ops + 1):  # an α below 0 is held at 0 and the rest refitted (least squares with α ≥ 0)
            coef, *_ = np.linalg.lstsq(np.column_stack([onehot[:, free], x]), t, rcond=None)
            alpha = np.zeros(n_ops)
            alpha[free], beta = coef[:-1], float(coef[-1])
            if (alpha >= 0).all():
                break
            free &= alpha > 0
        if beta < 0:  # sizes that do not explain time: every call its op's median
            beta = 0.0
            alpha = np.array([np.median(t[op == i]) if (op == i).any() else 0.0 for i in range(n_ops)])
    else:
        alpha = np.array([np.median((t - beta * x)[op == i]) if (op == i).any() else 0.0 for i in range(n_ops)])
    return np.maximum(alpha, 0.0), float(beta)


def _robust(residual: np.ndarray) -> float:
    if not len(residual):
        return 0.0
    return float(1.4826 * np.median(np.abs(residual - np.median(residual))))


# the rank-side work -----------------------------------------------------------------------------

def _calibration(ctx: Context, notes: list[str]) -> dict | None:
    if ctx.calibrating is not None:  # running beside the analysis: its file is read once it is written
        ctx.calibrating.wait()
    path = ctx.path / CALIBRATION_PATH
    if not path.is_file():
        notes.append("rank-side work not calibrated (no analysis/calibration.json; `tracekit calibrate RUN` on the "
                      "run's machine): a policy's added work counts one α per added collective only")
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        notes.append(f"{path}: unreadable ({err}); rank-side work not calibrated")
        return None

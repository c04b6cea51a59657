"""The replay: a recorded training step rebuilt as a graph and run again on a model of the links, so that a
policy's step time is the same graph with its collectives changed (dPRO, Daydream: papers.md, anchors.md).

The graph, per training step (after warm-up; at most REPLAY_STEPS of them, evenly spaced over the run) and
rank, from `steps` and `train_comms` on the common clock:
- compute: the measured time between the rank's communication events;
- a synchronous collective: the rank enters it and waits there until its data has arrived;
- an asynchronous one (DDP's bucket all-reduces): issued where it was, it runs beside compute, and the rank
  waits for the step's issued ones at its wait point: where its backward's last gradient was computed
  (`steps.t_grads_ns`), else the step's end.

The ranks run the steps one after another from the first step's recorded offsets, and a replayed step
lasts, as a measured one does, the slowest rank's start to end. Collectives are their flows, bytes from
rank to rank: an all-to-all's splits, a ring all-reduce's 2(n−1)/n · S to the next rank, an all-gather's
copies. A flow between nodes crosses its source node's link out and the destination node's link in, each
`inter` bytes/s each way (a token bucket where the run's cluster shaped one); within a node it takes its
ranks' `intra`. Flows that share a link share it max-min fairly (progressive filling). How an all-to-all's
flows start, and when a rank leaves a call, is `_Simulation`'s.

The links are fitted from the same run (`Fit` says how well): α per op and the link's rate, by replaying the
synchronous calls, alone or (on a token-bucket link) in their steps, against the time each took from its
last entry to its last exit (analyses.network's rule).

A policy is a `Change` of the graph: the exchange's collectives scaled to its replayed bytes, skipped on
the steps that no longer make them, the collectives it adds (a replica sync) after the backward where the
trainer issues them, the dense gradients' bytes scaled, and the rank-side work it adds. Every step is
replayed with and without it; the prediction is the measured baseline's median step times the median of
the per-step ratios, its interval their 10th to 90th percentile widened by the baseline's own drift. The
ratio keeps a prediction on the measured baseline where the replay misses it (a link rate given that the
run contradicts); the median replayed step itself scored the same on the prediction bench (RESULTS §36).

    rp = replay(ctx)                  # the recorded steps as graphs, and the fitted links
    rp.check()                        # the unchanged replay against the measured steps: p50, p90
    rp.predict(Change(scale={"output_fwd": 0.5}))   # Prediction(step_s, low_s, high_s, ratio)
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field, replace

import numpy as np
import polars as pl

from analyses import network
from analyses.clocks import clock_offsets, offset_sql
from analyses.context import Context
from tracekit import tags
from tracekit.topology import tbf_params
from tracekit.torchrec_plan import PlanError, from_manifest

EXCHANGE_TAGS = {tags.OUTPUT_FWD: "output_fwd", tags.OUTPUT_BWD: "output_bwd"}
INPUT_ORDER = ("input_lengths", "input_ids")  # the input dist's two calls, in their order
TORCHREC_ORDER = (*INPUT_ORDER, "output_fwd", "output_bwd")  # a TorchRec sharding group's all-to-alls, in order
KEYED = ("call", "issue", "waitfor")  # a program's instructions that name a call
EPS_BYTES = 1e-3
REPLAY_STEPS = 240  # the steps a run's graph holds, evenly spaced: its check, its fit, its samples
PREDICT_STEPS = 48
LINE_RATE = 100.0  # a token bucket's line rate, as a multiple of its rate (a veth's, in `tracekit cluster`)


class Stalled(RuntimeError):
    """The replay cannot go on: a rank waits in a collective that another rank never enters."""


@dataclass
class Call:
    """One collective of a step, matched across the ranks of its group (the k-th call of a group on
    every rank): `flows[i, j]` bytes from its i-th rank to its j-th."""

    op: str
    tag: str
    collective: str | None  # the exchange's collective (analyses.exchange.COLLECTIVES), else None
    ranks: tuple[int, ...]
    flows: np.ndarray
    is_async: bool
    time_s: float  # measured: the last entry to the last exit (synchronous calls)
    entry_s: float  # the last entry, from the step's first start
    entries: tuple[float, ...]  # each rank's entry, seconds from the step's first start
    alone: bool = True  # no other collective's transfer overlapped it


@dataclass
class Step:
    """A step's graph: per rank its start (seconds after the first rank's) and its program, a list of
    ("compute", seconds) | ("call", key) | ("issue", key) | ("waitfor", key) | ("wait", None)."""

    step: int
    start: dict[int, float]
    programs: dict[int, list[tuple[str, object]]]
    calls: dict[int, Call]
    measured_s: float


@dataclass(frozen=True)
class Links:
    node_of: tuple[int, ...]  # by rank
    inter: float  # bytes/s of a node's link, each way
    intra: float  # bytes/s of a rank within its node, each way
    alpha: dict[str, float]
    burst: float = 0.0  # bytes a node's link sends at line rate after it idled (a token bucket's; 0: none)
    per_call: bool = False  # a recorded call takes the time it took (one host: bytes are not what costs)

    def alpha_of(self, op: str) -> float:
        return self.alpha.get(op, self.alpha.get(network.A2A, 0.0))


@dataclass(frozen=True)
class Fit:
    """How the links were fitted: on `calls` calls (of the `total` it considered: the synchronous ones, or a
    run's async ones where it has none), with the robust spread of their residuals (seconds)."""

    source: str
    calls: int
    total: int
    residual_s: float
    link_given: float | None  # the link's rate where the run names it (tracekit cluster), bytes/s


@dataclass(frozen=True)
class Added:
    """A collective a policy adds on every rank once a step, after the backward (the replica sync): an
    all-reduce of `bytes_per_rank` on a ring, or `op` sending `bytes_per_rank` spread over the others."""

    op: str
    bytes_per_rank: float
    tag: str = "added"


@dataclass(frozen=True)
class Change:
    """A policy as a transformation of the graph: `scale[c]` the factor on exchange collective c's bytes
    between ranks (a number, or an array of factors per (sender, receiver) in the call's group); `skip` the share of steps that make no exchange (FAE's all-hot ones); `added` the
    collectives it adds; `work_s` rank-side seconds a step it adds (after the backward); `dense` the factor
    on the dense gradients' all-reduce bytes (DDP's buckets, the trainer's hook: tracekit.tags.DP_TAGS)."""

    scale: dict[str, float] = field(default_factory=dict)
    skip: float = 0.0
    added: tuple[Added, ...] = ()
    work_s: float = 0.0
    dense: float = 1.0


def compose(changes: list[Change]) -> Change:
    """Changes applied together: their scales multiplied, the largest skip, every added call and all work."""
    scale: dict[str, float] = {}
    for c in changes:
        for name, factor in c.scale.items():
            scale[name] = scale.get(name, 1.0) * factor
    return Change(scale, max((c.skip for c in changes), default=0.0), tuple(a for c in changes for a in c.added),
                  sum(c.work_s for c in changes), math.prod(c.dense for c in changes))


def changes(ctx: Context) -> dict[str, Change]:
    """The change each policy section predicted its step with, by section label (set by the policies,
    read by the combined prediction), once per context."""
    return ctx.memo(changes, dict)


def together(ctx: Context):
    """A function from section labels to the replay's prediction of them applied together (their changes
    composed), or None where the run does not replay or a section set no change."""
    def predict(labels: list[str]) -> Prediction | None:
        rp, known = replay(ctx), changes(ctx)
        if not rp.steps or rp.measured_median_s is None or any(label not in known for label in labels):
            return None
        return rp.predict(compose([known[label] for label in labels]))
    return predict


@dataclass(frozen=True)
class Prediction:
    step_s: float
    low_s: float
    high_s: float
    ratio: float  # replayed with the change / replayed without it, median over the steps


@dataclass
class Replay:
    steps: list[Step]
    links: Links
    fit: Fit
    measured_median_s: float | None
    spread_s: float = 0.0  # the measured steps' own drift (analyses.network.StepTime)
    notes: list[str] = field(default_factory=list)
    _base: np.ndarray | None = None
    _sample_base: np.ndarray | None = None
    _predicted: dict = field(default_factory=dict)

    def replayed(self, change: Change | None = None) -> np.ndarray:
        """Each step's replayed time (seconds), with `change` applied."""
        if change is None:
            if self._base is None:
                self._base = run_steps(self.steps, self.links)
            return self._base
        return run_steps(self.steps, self.links, change)

    @property
    def sample(self) -> list[Step]:
        """The steps a prediction replays: at most PREDICT_STEPS, evenly spaced over the run, one after
        another (each of a curve's analyses.exchange.CURVE_POINTS points replays them once or twice)."""
        if len(self.steps) <= PREDICT_STEPS:
            return self.steps
        return [self.steps[int(i)] for i in np.linspace(0, len(self.steps) - 1, PREDICT_STEPS)]

    @property
    def compute_s(self) -> float:
        """The steps' compute: per step the most any rank computed, the median over the steps."""
        per_step = [max(sum(arg for kind, arg in p if kind == "compute") for p in s.programs.values())
                    for s in self.steps]
        return float(np.median(per_step)) if per_step else 0.0

    def check(self) -> dict:
        """The unchanged replay against the measured steps: median, p50 and p90, and their errors."""
        measured = np.array([s.measured_s for s in self.steps])
        replayed = self.replayed()
        if not len(measured):
            return {"steps": 0}
        out = {"steps": len(measured)}
        for name, q in (("p50", 50), ("p90", 90)):
            m, r = float(np.percentile(measured, q)), float(np.percentile(replayed, q))
            out[name] = {"measured_s": m, "replayed_s": r, "error": r / m - 1 if m else None}
        out["per_step_error_median"] = float(np.median(np.abs(replayed / measured - 1)))
        return out

    def predict(self, change: Change) -> Prediction | None:
        """The step under `change` (module docstring), once per distinct change; None without timed steps."""
        if not self.steps or self.measured_median_s is None:
            return None
        scale = tuple(sorted((c, np.asarray(f, dtype=np.float64).tobytes()) for c, f in change.scale.items()))
        key = (scale, change.skip, change.added, change.work_s, change.dense)
        if key not in self._predicted:
            self._predicted[key] = self._predict(change)
        return self._predicted[key]

    def _predict(self, change: Change) -> Prediction:
        steps = self.sample
        if self._sample_base is None:
            self._sample_base = run_steps(steps, self.links)
        base = np.maximum(self._sample_base, 1e-12)
        ratios = run_steps(steps, self.links, change) / base
        if change.skip > 0:  # the steps without an exchange, replayed as such, in their share
            ratios = (1 - change.skip) * ratios + change.skip * run_steps(steps, self.links, replace(change, skip=1.0)) / base
        mid = float(np.median(ratios))
        lo, hi = (float(np.percentile(ratios, q)) for q in (10, 90))
        step = self.measured_median_s
        return Prediction(step * mid, step * lo - self.spread_s, step * hi + self.spread_s, mid)

    def summary(self) -> dict:
        f = self.fit
        def rate(x: float) -> float | None:
            return None if math.isinf(x) else float(x)
        return {"steps": len(self.steps), "inter_bytes_per_s": rate(self.links.inter),
                "intra_bytes_per_s": rate(self.links.intra), "burst_bytes": self.links.burst,
                "alpha_s": self.links.alpha, "fit": {"source": f.source, "calls": f.calls, "of": f.total,
                                                    "residual_s": f.residual_s,
                                                    "link_given_bytes_per_s": f.link_given},
                "check": self.check(), "notes": self.notes}


# the graph from the trace ----------------------------------------------------------------------------

def replay(ctx: Context) -> Replay:
    """The run's steps as graphs with the fitted links, once per context."""
    return ctx.memo(replay, lambda: _build(ctx))


def _build(ctx: Context) -> Replay:
    notes: list[str] = []
    topology = ctx.manifest.get("topology") or {}
    world = ctx.model.world_size
    node_of = tuple(int(n) for n in topology.get("rank_nodes") or [0] * world)
    if len(node_of) != world:
        node_of = tuple(r // max(world // max(int(topology.get("nodes") or 1), 1), 1) for r in range(world))
    steps = _steps(ctx, notes)
    _mark_alone(steps)
    links, fit = _fit(ctx, steps, node_of, topology, notes)
    measured = network.step_time(ctx)
    out = Replay(steps, links, fit, measured.median_s, measured.spread_s, notes)
    try:
        out.replayed()
    except Stalled as e:
        notes.append(f"the recorded steps do not replay ({e}): step times priced per call")
        out.steps = []
    return out


def _steps(ctx: Context, notes: list[str]) -> list[Step]:
    """The graphs of at most REPLAY_STEPS steps that every rank completed after warm-up, evenly spaced."""
    if not (ctx.has("comms") and ctx.has("steps")):
        return []
    world = ctx.model.world_size
    complete = ctx.frame(f"""SELECT step, count(*) = {world} AS whole FROM steps WHERE t_end_ns >= t_start_ns
                             GROUP BY step ORDER BY step""")
    skip = network.warmup_steps(complete.height)
    kept = complete.filter(pl.col("whole") & (pl.col("step") >= skip))["step"].to_list()
    if len(kept) > REPLAY_STEPS:
        kept = [kept[int(i)] for i in np.linspace(0, len(kept) - 1, REPLAY_STEPS)]
    if not kept:
        notes.append("no step that every rank completed: nothing to replay")
        return []
    chosen = f"step IN ({', '.join(map(str, kept))})"
    offset = offset_sql(clock_offsets(ctx.manifest)[0])
    steps = ctx.frame(f"""
        SELECT step, rank, t_start_ns + {offset} AS t0, t_end_ns + {offset} AS t1,
               t_grads_ns + {offset} AS tg
        FROM steps WHERE t_end_ns >= t_start_ns AND {chosen} ORDER BY step, rank""")
    calls = ctx.frame(f"""
        SELECT step, rank, seq, op, "group", group_size, tag, "async", bytes_out, splits_out,
               t_start_ns + {offset} AS c0, CASE WHEN t_end_ns >= t_start_ns THEN t_end_ns + {offset} END AS c1,
               t_wait_ns + {offset} AS cw,
               row_number() OVER (PARTITION BY rank, step, "group" ORDER BY seq) AS nth
        FROM train_comms WHERE group_size >= 2 AND op NOT IN ('send', 'recv', 'isend', 'irecv') AND {chosen}
        ORDER BY step, rank, seq""")
    by_step = {k[0]: f for k, f in calls.partition_by("step", as_dict=True).items()}
    try:
        torchrec = bool(from_manifest(ctx.manifest))
    except PlanError:
        torchrec = False
    out = []
    for (step,), frame in steps.partition_by("step", as_dict=True).items():
        graph = _step(step, frame, by_step.get(step), world, torchrec)
        if graph is not None:
            out.append(graph)
    if not out:
        notes.append("no step whose collectives every rank recorded: nothing to replay")
    return sorted(out, key=lambda s: s.step)


def _step(step: int, ranks: pl.DataFrame, calls: pl.DataFrame | None, world: int, torchrec: bool) -> Step | None:
    t0 = dict(zip(ranks["rank"], ranks["t0"]))
    t1 = dict(zip(ranks["rank"], ranks["t1"]))
    tg = dict(zip(ranks["rank"], ranks["tg"]))
    first = min(t0.values())
    measured = max(t1[r] - t0[r] for r in t0) / 1e9
    graph_calls: dict[int, Call] = {}
    per_rank: dict[int, list[tuple]] = {r: [] for r in t0}
    if calls is not None:
        keys: dict[tuple, int] = {}
        rows = calls.to_dicts()
        groups: dict[tuple, list[dict]] = {}
        for row in rows:
            groups.setdefault((row["group"], row["nth"]), []).append(row)
        for gk, members in groups.items():
            members.sort(key=lambda r: r["rank"])
            if len({m["op"] for m in members}) > 1 or len(members) != members[0]["group_size"]:
                return None  # a lost row: the ranks disagree on the call, or one has none
            key = keys[gk] = len(keys)
            graph_calls[key] = _call(members, first)
            for m in members:
                per_rank[m["rank"]].append((m["c0"], m["c1"], key, m["async"], m["cw"] if m["async"] else None))
        _name_exchange(graph_calls, torchrec)
    programs = {r: _program(per_rank[r], t0[r], t1[r], tg[r]) for r in t0}
    return Step(step, {r: (t0[r] - first) / 1e9 for r in t0}, programs, graph_calls, measured)


def ring_flows(n: int, size: float) -> np.ndarray:
    """A ring all-reduce of `size` bytes a rank on `n` ranks: 2(n−1)/n · size from each rank to the next."""
    flows = np.zeros((n, n))
    if n > 1:
        for i in range(n):
            flows[i, (i + 1) % n] = 2 * (n - 1) / n * size
    return flows


def _call(members: list[dict], first: int) -> Call:
    """The call its members (one row a rank) make, its times in seconds from the step's `first` start."""
    n = len(members)
    op = members[0]["op"]
    if op == network.ALL_REDUCE:
        flows = ring_flows(n, float(members[0]["bytes_out"]))
    else:
        flows = np.zeros((n, n))
        for i, m in enumerate(members):
            splits = m["splits_out"]
            if splits is not None and len(splits) == n:
                flows[i] = splits
        np.fill_diagonal(flows, 0.0)
    entries = [m["c0"] for m in members]
    exits = [m["c1"] for m in members if m["c1"] is not None]
    last_exit = max(exits) if exits else max(entries)
    return Call(op, members[0]["tag"] or "", None, tuple(m["rank"] for m in members), flows, bool(members[0]["async"]),
                max(last_exit - max(entries), 0) / 1e9, (max(entries) - first) / 1e9,
                tuple((e - first) / 1e9 for e in entries))


def _name_exchange(calls: dict[int, Call], torchrec: bool) -> None:
    """The trainer's exchange collectives by tag, the input dist's two calls by their order. A TorchRec job's
    of one sharding group by their order: its four all-to-alls (the splits' aside) are the input dist's
    lengths and ids, the output dist forward and backward (analyses.torchrec_plan_bytes' COLLECTIVES); a step
    with more (several sharding groups) is left unnamed."""
    if torchrec:
        a2a = sorted((k for k, c in calls.items() if c.op == network.A2A and not c.tag.startswith(tags.TORCHREC_SPLITS)),
                     key=lambda k: calls[k].entry_s)
        if len(a2a) == len(TORCHREC_ORDER):
            for name, k in zip(TORCHREC_ORDER, a2a):
                calls[k].collective = name
        return
    inputs = sorted((k for k, c in calls.items() if c.tag == tags.INPUT_DIST), key=lambda k: calls[k].entry_s)
    for name, k in zip(INPUT_ORDER, inputs):
        calls[k].collective = name
    for c in calls.values():
        if c.tag in EXCHANGE_TAGS:
            c.collective = EXCHANGE_TAGS[c.tag]


def _program(events: list[tuple], t0: int, t1: int, tg: int | None) -> list[tuple]:
    """A rank's step as compute between its events (module docstring). An async call the rank waited on
    itself (`comms.t_wait_ns`: a TorchRec awaitable) is waited for there; the others at the wait point."""
    timeline = []  # (time, kind, key, completion)
    for c0, c1, key, is_async, cw in events:
        timeline.append((c0, "issue" if is_async else "call", key, c1))
        if cw is not None:
            timeline.append((max(cw, c0), "waitfor", key, c1))
    timeline.sort(key=lambda e: (e[0], e[1] == "waitfor"))
    own_wait = {key for _, kind, key, _ in timeline if kind == "waitfor"}
    program: list[tuple] = []
    cursor = t0
    pending: list[int] = []  # async calls issued and not waited for
    waited = tg is None or not any(is_async and cw is None for _, _, _, is_async, cw in events)
    for t, kind, key, c1 in timeline:
        if not waited and t >= tg:
            cursor = _wait(program, cursor, tg, pending, events)
            waited = True
        program.append(("compute", max(t - cursor, 0) / 1e9))
        program.append((kind, key))
        if kind == "issue":
            if key not in own_wait:
                pending.append(key)
            cursor = max(cursor, t)
        else:  # a call, or the wait on an issued one: the rank goes on once it completed
            cursor = max(cursor, t, c1 if c1 is not None else t)
    if not waited:
        cursor = _wait(program, cursor, tg, pending, events)
    program.append(("compute", max(t1 - cursor, 0) / 1e9))
    if pending and tg is None:
        program.append(("wait", None))
    return program


def _wait(program: list[tuple], cursor: int, tg: int, pending: list[int], events: list[tuple]) -> int:
    """The wait point: compute up to it, then blocked until the pending async calls completed."""
    tg = max(tg, cursor)
    program.append(("compute", (tg - cursor) / 1e9))
    program.append(("wait", None))
    done = [c1 for c0, c1, key, *_ in events if key in pending and c1 is not None]
    pending.clear()
    return max([tg, *done])


def _mark_alone(steps: list[Step]) -> None:
    """A synchronous call ran alone if no async call's transfer (its last issue to its completion, taken
    as the call's `entry_s` + `time_s`) overlapped its own."""
    for s in steps:
        spans = [(c.entry_s, c.entry_s + c.time_s) for c in s.calls.values() if c.is_async]
        for c in s.calls.values():
            a, b = c.entry_s, c.entry_s + c.time_s
            c.alone = not c.is_async and not any(x < b and a < y for x, y in spans)


# the links, fitted from the run ----------------------------------------------------------------------

def _fit(ctx: Context, steps: list[Step], node_of: tuple[int, ...], topology: dict,
         notes: list[str]) -> tuple[Links, Fit]:
    given = topology.get("link_bytes_per_s")
    nodes = len(set(node_of))
    alone = [c for s in steps for c in s.calls.values() if not c.is_async and c.alone and c.time_s > 0
             and c.flows.sum() > 0]
    total = sum(1 for s in steps for c in s.calls.values() if not c.is_async)
    fixed = (ctx.options.inter_bw or ctx.options.intra_bw) if nodes > 1 else (ctx.options.intra_bw or ctx.options.inter_bw)
    intra = ctx.options.intra_bw or np.inf
    if nodes == 1 and not fixed:  # one host: a call costs what it took, its bytes changed at the fitted rate
        net = network.network(ctx).fit
        rate = 1 / net.beta_s_per_byte if net.beta_s_per_byte > 0 else np.inf
        return (Links(node_of, np.inf, rate, dict(net.alpha_s), per_call=True),
                Fit(f"one host: each recorded call the time it took, its bytes changed at the rate of analyses.network's "
                    f"fit ({net.source})", net.kept, total, net.residual_s, given))
    burst = float(topology.get("burst_bytes") or tbf_params(given)["burst"]) if nodes > 1 and given else 0.0
    if burst and not fixed and any(c.time_s > 0 and c.flows.sum() > 0 for s in steps for c in s.calls.values()):
        return _fit_bucket(steps, node_of, given, burst, intra)
    if not alone:
        notes.append("replay: no synchronous call ran alone to fit the links on; α = 0, links from the options")
        return Links(node_of, ctx.options.inter_bw or given or np.inf, intra, {}), Fit("none", 0, total, 0.0, given)
    ops = sorted({c.op for c in alone})
    t = np.array([c.time_s for c in alone])
    op_index = np.array([ops.index(c.op) for c in alone])
    unit = Links(node_of, 1.0 if nodes > 1 else np.inf, 1.0 if nodes == 1 else np.inf, {})
    x = np.array([_alone_time(c, unit) for c in alone])
    spread = x.max() >= network.MIN_SPREAD * max(x.min(), 1.0)
    beta_fixed = 1 / fixed if fixed else (None if spread else (1 / given if given else 0.0))
    keep = np.ones(len(t), dtype=bool)
    for _ in range(2):
        alpha, beta = network._lstsq(x[keep], t[keep], op_index[keep], len(ops), beta_fixed)
        residual = t - (alpha[op_index] + beta * x)
        scale = network._robust(residual[keep])
        keep = np.abs(residual) <= network.RESIDUAL_CLIP * max(scale, 1e-6)
    rate = 1 / beta if beta > 0 else np.inf
    source = ("α fitted, the link's rate from the options" if fixed else
              "α and the link's rate by least squares over the calls that ran alone" if spread else
              "α fitted; the calls' sizes do not spread enough to tell the rate"
              + (" (the cluster's link rate taken)" if given else " (taken as unbounded)"))
    alphas = dict(zip(ops, map(float, alpha)))
    links = (Links(node_of, rate, intra, alphas) if nodes > 1 else
             Links(node_of, ctx.options.inter_bw or np.inf, rate, alphas))
    return links, Fit(source, int(keep.sum()), total, network._robust(residual[keep]), given)


def _fit_bucket(steps: list[Step], node_of: tuple[int, ...], given: float, burst: float,
                intra: float) -> tuple[Links, Fit]:
    """The rate of a token-bucket link (`tracekit cluster`'s, whose burst is known): the recorded steps
    replayed at rates around the link's payload rate, the one whose synchronous calls' (a run without any:
    its async calls') replayed times
    (their last entry to last exit, the bucket as the steps before left it) are nearest the measured ones,
    with each op's α the median of what its calls took beyond their replayed time."""
    timed = [(i, k, c) for i, s in enumerate(steps) for k, c in s.calls.items() if c.time_s > 0 and c.flows.sum() > 0]
    synchronous = any(not c.is_async for *_, c in timed)  # else (a TorchRec job) its async calls, issue to completion
    measured = {(i, k): (c.op, c.time_s) for i, k, c in timed if c.is_async != synchronous}
    ops = sorted({op for op, _ in measured.values()})
    best = None
    for factor in np.linspace(0.6, 1.4, 17):
        rate = given * network.WIRE_EFFICIENCY * factor
        replayed = call_times(steps, Links(node_of, rate, intra, {}, burst))
        keys = [k for k in measured if k in replayed]
        op_index = np.array([ops.index(measured[k][0]) for k in keys])
        extra = np.array([measured[k][1] - replayed[k] for k in keys])
        alpha = np.array([max(float(np.median(extra[op_index == i])), 0.0) if (op_index == i).any() else 0.0
                          for i in range(len(ops))])
        residual = extra - alpha[op_index]
        score = float(np.median(np.abs(residual)))
        if best is None or score < best[0]:
            best = (score, rate, alpha, residual)
    _, rate, alpha, residual = best
    keep = np.abs(residual) <= network.RESIDUAL_CLIP * max(network._robust(residual), 1e-6)
    if not synchronous:  # async calls overlap others: what one op's calls take beyond the replay is their wait
        alpha = np.full_like(alpha, alpha.min())  # behind the others, not a fixed cost; the least is the op's α
    links = Links(node_of, rate, intra, dict(zip(ops, map(float, alpha))), burst)
    against = "synchronous call's time" if synchronous else "async call's issue to completion (no synchronous one)"
    return links, Fit(f"the link's rate fitted by replaying the steps with its {burst / 1e3:.0f} kB token bucket "
                      f"against each {against}; α per op their median excess", int(keep.sum()), len(measured),
                      network._robust(residual[keep]), given)


def _alone_time(c: Call, links: Links) -> float:
    """The call's last entry to last exit, replayed alone from its recorded entries on `links` with no α
    (on links of one byte a second, its time is α + this / the link's rate)."""
    first = min(c.entries)
    programs = {r: [("compute", e - first), ("call", 0), ("end", 0)] for r, e in zip(c.ranks, c.entries)}
    ends = _Simulation(links, {0: c}).run(programs, dict.fromkeys(c.ranks, 0.0))
    return max(e[0] for e in ends.values()) - (max(c.entries) - first)


# the replay ---------------------------------------------------------------------------------------------

def run_steps(steps: list[Step], links: Links, change: Change | None = None) -> np.ndarray:
    """Each step's replayed time (the slowest rank's start to end) with `change` applied. The ranks run
    the steps one after another from the first step's recorded offsets, so a rank that leaves a step
    early waits at the next one's first collective, as it did."""
    if not steps:
        return np.zeros(0)
    ends = _replay(steps, links, change).ends
    starts = {r: [steps[0].start[r], *(ends[r][:-1])] for r in ends}
    return np.array([max(ends[r][i] - starts[r][i] for r in ends) for i in range(len(steps))])


def call_times(steps: list[Step], links: Links) -> dict[tuple[int, int], float]:
    """Each call's replayed time, its last entry to its last exit (an async call's: to its completion), by
    (step position, call)."""
    sim = _replay(steps, links, None)
    out = {}
    for key, c in sim.calls.items():
        exits = [sim.left.get((key, r)) for r in c.ranks]
        if None not in exits and len(sim.entries.get(key, ())) == len(c.ranks):
            out[key] = max(exits) - max(sim.entries[key].values())
    return out


def _replay(steps: list[Step], links: Links, change: Change | None) -> _Simulation:
    programs: dict[int, list[tuple]] = {r: [] for r in steps[0].programs}
    calls: dict[tuple, Call] = {}
    for i, s in enumerate(steps):
        step_programs, step_calls = _changed(s, change, links) if change is not None else (s.programs, s.calls)
        calls.update({(i, k): c for k, c in step_calls.items()})
        for r, program in step_programs.items():
            programs[r].extend((kind, (i, arg)) if kind in KEYED else (kind, arg) for kind, arg in program)
            programs[r].append(("end", i))
    sim = _Simulation(links, calls)
    sim.ends = sim.run(programs, steps[0].start)
    return sim


def _changed(step: Step, change: Change, links: Links) -> tuple[dict[int, list[tuple]], dict[int, Call]]:
    calls = dict(step.calls)
    dropped: set[int] = set()
    for k, c in step.calls.items():
        if c.collective is None:
            if change.dense != 1.0 and c.tag.startswith(tags.DP_TAGS):
                calls[k] = _scaled(c, float(change.dense), links)
            continue
        if change.skip >= 1.0:
            dropped.add(k)
        elif c.collective in change.scale:
            calls[k] = _scaled(c, change.scale[c.collective], links)
    ranks = tuple(sorted(step.programs))
    added = []
    for a in change.added:
        key = max(calls, default=-1) + 1
        calls[key] = Call(a.op, a.tag, None, ranks, _added_flows(a, len(ranks)), False, 0.0, 0.0, ())
        added.append(key)
    programs = {}
    for r, program in step.programs.items():
        out = [ins for ins in program if not (ins[0] in KEYED and ins[1] in dropped)]
        if added or change.work_s:
            i = _after_backward(out)
            inserted = [("call", k) for k in added] + ([("compute", float(change.work_s))] if change.work_s else [])
            out = out[:i] + inserted + out[i:]
        programs[r] = out
    return programs, calls


def _scaled(c: Call, factor, links: Links) -> Call:
    """`c` with its bytes times `factor` (a number, or one per pair); where a call takes the time it took
    (`Links.per_call`), that time changed by the bytes it gains or loses on its busiest link at the lesser
    of two costs per byte: the link's fitted one, and the call's own (its time beyond the op's α over its
    bytes). On one host a fit over calls whose times follow the cores' scheduling can price a byte far
    above what any recorded call took."""
    flows = c.flows * factor
    took = c.time_s
    before = _one_way(c.flows)
    if links.per_call and before > 0:
        own = max(took - links.alpha_of(c.op), 0.0) / before
        per_byte = min(own, 1.0 / links.intra)
        took = max(took + (_one_way(flows) - before) * per_byte, 0.0)
    return replace(c, flows=flows, time_s=took)


def _one_way(flows: np.ndarray) -> float:
    """The most bytes any rank of a call sends or receives."""
    return float(max(flows.sum(axis=1).max(), flows.sum(axis=0).max())) if flows.size else 0.0


def _added_flows(a: Added, n: int) -> np.ndarray:
    if a.op == network.ALL_REDUCE:
        return ring_flows(n, a.bytes_per_rank)
    flows = np.zeros((n, n))  # an exchange or a gather: the rank's bytes spread over the others
    if n > 1:
        flows[:] = a.bytes_per_rank / (n - 1)
        np.fill_diagonal(flows, 0.0)
    return flows


def _after_backward(program: list[tuple]) -> int:
    """Where the trainer issues what follows the backward: after the wait point, else before the
    step's last compute."""
    for i, ins in enumerate(program):
        if ins[0] == "wait":
            return i + 1
    return max(len(program) - 1, 0)


class _Simulation:
    """The discrete-event replay of the ranks' programs on the links.

    An all-reduce's or a gather's flows start once every rank has entered. An all-to-all's data moves as
    gloo's pairs move it (measured on `tracekit cluster`, bench/RESULTS.md §36): a rank entering it tells
    each peer it may send, on the stream that carries its own data to that peer. So between a rank that
    entered early and one that entered later, the later one's
    data crosses first (the early one's notice was waiting), and the early one's only once it has, behind
    which the later one's notice came; ranks that enter together send at once. A rank leaves the call
    when all its data has arrived and all its own has started (handed to the socket), plus the op's α.
    Flows that share a link share it max-min fairly."""

    def __init__(self, links: Links, calls: dict) -> None:
        self.links = links
        self.calls = calls
        self.entries: dict = {}  # call -> {rank: time}
        self.pending: dict = {}  # (call, rank) -> [in-flows not arrived, out-flows not started]
        self.flows: dict = {}  # (call, i, j) -> bytes left, for the flows moving now
        self.after: dict = {}  # (call, i, j) -> the flow that starts once it has arrived
        self.left: dict = {}  # (call, rank) -> when the rank left the call
        self.timers: list = []  # (time, call, rank): the rank leaves the call then
        self.tokens: dict = {}  # a node link's bucket: bytes it may still send at line rate

    def run(self, programs: dict[int, list[tuple]], start: dict[int, float]) -> dict[int, list[float]]:
        pc = dict.fromkeys(programs, 0)
        ready: dict[int, float | None] = dict(start)
        blocked: dict[int, tuple] = {}  # rank -> ("call", key) or ("wait", keys): what it waits for
        issued: dict[int, list] = {r: [] for r in programs}
        ends: dict[int, list[float]] = {r: [] for r in programs}
        finished: set[int] = set()
        now = min(start.values())
        while len(finished) < len(programs):
            moved = True
            while moved:  # run every rank that can run now
                moved = False
                for r in programs:
                    t = ready[r]
                    if r in finished or t is None or t > now:
                        continue
                    if pc[r] >= len(programs[r]):
                        finished.add(r)
                        continue
                    kind, arg = programs[r][pc[r]]
                    pc[r] += 1
                    moved = True
                    if kind == "compute":
                        ready[r] = t + arg
                    elif kind == "end":
                        ends[r].append(t)
                    elif kind in ("call", "issue"):
                        self._enter(arg, r, t)
                        if kind == "issue":
                            issued[r].append(arg)
                        elif (arg, r) in self.left:
                            ready[r] = max(t, self.left[arg, r])
                        else:
                            ready[r], blocked[r] = None, ("call", arg)
                    else:  # wait for one async call, or for those issued so far
                        if kind == "waitfor":
                            keys = [arg]
                            issued[r] = [k for k in issued[r] if k != arg]
                        else:
                            keys, issued[r] = issued[r], []
                        if all((k, r) in self.left for k in keys):
                            ready[r] = max([t, *(self.left[k, r] for k in keys)])
                        else:
                            ready[r], blocked[r] = None, ("wait", keys)
            for r, (kind, arg) in list(blocked.items()):  # ranks whose calls are done
                keys = [arg] if kind == "call" else arg
                if all((k, r) in self.left for k in keys):
                    ready[r] = max([now, *(self.left[k, r] for k in keys)])
                    del blocked[r]
            if len(finished) == len(programs):
                break
            rates = self._rates()
            flowing = self._throughput(rates)
            candidates = [t for r, t in ready.items() if t is not None and r not in finished and t > now]
            candidates += [now + self.tokens[k] / (v - self.links.inter) for k, v in flowing.items()
                           if self.tokens.get(k, 0.0) > 0 and v > self.links.inter]
            candidates += [t for t, *_ in self.timers[:1]]
            candidates += [now + (0.0 if math.isinf(rate) else left / rate)
                           for f, left in self.flows.items() if (rate := rates[f]) > 0]
            if not candidates:
                if any(t is not None and t <= now for r, t in ready.items() if r not in finished):
                    continue
                raise Stalled("a collective some rank never enters")
            t = max(min(candidates), now)
            if self.links.burst:
                for k in self.tokens:
                    left = self.tokens[k] + (self.links.inter - flowing.get(k, 0.0)) * (t - now)
                    self.tokens[k] = min(left, self.links.burst) if left > 1.0 else 0.0  # under a byte: empty
            for f in list(self.flows):  # a flow on links without a rate (unbounded) arrives at once
                self.flows[f] = 0.0 if math.isinf(rates[f]) else self.flows[f] - rates[f] * (t - now)
            now = t
            for f in [f for f, left in self.flows.items() if left <= EPS_BYTES]:
                del self.flows[f]
                self._arrived(f, now)
            while self.timers and self.timers[0][0] <= now:
                when, key, r = heapq.heappop(self.timers)
                self.left[key, r] = when
        return ends

    def _enter(self, key: tuple, r: int, t: float) -> None:
        c = self.calls[key]
        me = c.ranks.index(r)
        entered = self.entries.setdefault(key, {})
        entered[me] = t
        self.pending[key, me] = [int((c.flows[:, me] > EPS_BYTES).sum()), int((c.flows[me] > EPS_BYTES).sum())]
        if not c.op.startswith("all_to_all"):  # a ring or a gather: every flow once all have entered
            if len(entered) == len(c.ranks):
                for i, j in zip(*np.nonzero(c.flows > EPS_BYTES)):
                    self._start((key, int(i), int(j)), t)
                for i in range(len(c.ranks)):
                    self._check(key, i, t)
            return
        for peer, t_peer in entered.items():
            if peer == me:
                continue
            mine, theirs = c.flows[me, peer] > EPS_BYTES, c.flows[peer, me] > EPS_BYTES
            if mine:
                self._start((key, me, peer), t)
            if theirs:
                if t_peer == t or not mine:
                    self._start((key, peer, me), t)
                else:
                    self.after[key, me, peer] = (key, peer, me)
        self._check(key, me, t)

    def _start(self, f: tuple, t: float) -> None:
        key, i, j = f
        self.flows[f] = float(self.calls[key].flows[i, j])
        self.pending[key, i][1] -= 1
        self._check(key, i, t)

    def _arrived(self, f: tuple, t: float) -> None:
        key, i, j = f
        self.pending[key, j][0] -= 1
        self._check(key, j, t)
        then = self.after.pop(f, None)
        if then is not None:
            self._start(then, t)

    def _check(self, key: tuple, me: int, t: float) -> None:
        if self.pending[key, me] == [0, 0]:
            self.pending[key, me] = [-1, -1]
            c = self.calls[key]
            took = self.links.alpha_of(c.op)
            if self.links.per_call:  # the recorded call's own time; an added one's α and bytes at the rate
                took = c.time_s if c.entries else took + _one_way(c.flows) / self.links.intra
            heapq.heappush(self.timers, (t + took, key, c.ranks[me]))

    def _path(self, f: tuple) -> tuple[tuple, tuple]:
        """The links flow `f` crosses: its nodes' links out and in, or within a node its ranks'."""
        key, i, j = f
        c = self.calls[key]
        a, b = c.ranks[i], c.ranks[j]
        na, nb = self.links.node_of[a], self.links.node_of[b]
        return (("up", na), ("down", nb)) if na != nb else (("lo_up", a), ("lo_down", b))

    def _throughput(self, rates: dict) -> dict:
        """Bytes/s each node link carries now."""
        out: dict = {}
        for f, rate in rates.items():
            for link in self._path(f):
                if link[0] in ("up", "down"):
                    out[link] = out.get(link, 0.0) + rate
        return out

    def _rates(self) -> dict:
        """Max-min fair rates of the flows moving now (progressive filling): the link whose fair share is
        least fixes its flows at that share, until every flow is fixed."""
        if self.links.per_call:  # the calls' times hold their bytes: flows arrive at once
            return dict.fromkeys(self.flows, np.inf)
        paths = {}
        capacity = {}
        for f in self.flows:
            paths[f] = self._path(f)
            for link in paths[f]:
                if link[0] in ("up", "down"):
                    if self.links.burst and link not in self.tokens:
                        self.tokens[link] = self.links.burst
                    line = self.tokens.get(link, 0.0) > 0
                    capacity[link] = self.links.inter * (LINE_RATE if line else 1.0)
                else:
                    capacity[link] = self.links.intra
        rates = {}
        free = set(paths)
        while free:
            users: dict[tuple, list] = {}  # an unbounded link (inf) shares inf: its flows move at once
            for f in free:
                for link in paths[f]:
                    users.setdefault(link, []).append(f)
            link, share = min(((k, capacity[k] / len(v)) for k, v in users.items()), key=lambda kv: kv[1])
            for f in users[link]:
                rates[f] = share
                free.discard(f)
                for other in paths[f]:
                    if not math.isinf(share):
                        capacity[other] -= share
        return rates

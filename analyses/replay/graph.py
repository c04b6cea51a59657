"""The replay's graph of a recorded step (analyses.replay), built from the trace.

The graph, per training step (after warm-up; at most REPLAY_STEPS of them, evenly spaced over the run) and
rank, from `steps` and `train_comms` on the common clock:
- compute: the measured time between the rank's communication events;
- a synchronous collective: the rank enters it and waits there until its data has arrived;
- an asynchronous one (DDP's bucket all-reduces): issued where it was, it runs beside compute, and the rank
  waits for the step's issued ones at its wait point: where its backward's last gradient was computed
  (`steps.t_grads_ns`), else the step's end.

Collectives are their flows, bytes from rank to rank: an all-to-all's splits, a ring all-reduce's
2(n−1)/n · S to the next rank, an all-gather's copies.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import polars as pl

from analyses import network
from analyses.clocks import clock_offsets, offset_sql
from analyses.context import Context
KEYED = ("call", "issue", "waitfor")  # a program's instructions that name a call
REPLAY_STEPS = 240  # the steps a run's graph holds, evenly spaced: its check, its fit, its samples


@dataclass
class Call:
    """One collective of a step, matched across the ranks of its group (the k-th call of a group on
    every rank): `flows[i, j]` bytes from its i-th rank to its j-th."""

    op: str
    tag: str
    collective: str | None  # the exchange's collective (comms.role, analyses.roles), else None
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


def recorded_steps(ctx: Context, notes: list[str]) -> list[Step]:
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
        SELECT step, rank, seq, op, "group", group_size, tag, role, "async", bytes_out, splits_out,
               t_start_ns + {offset} AS c0, CASE WHEN t_end_ns >= t_start_ns THEN t_end_ns + {offset} END AS c1,
               t_wait_ns + {offset} AS cw,
               row_number() OVER (PARTITION BY rank, step, "group" ORDER BY seq) AS nth
        FROM train_comms WHERE group_size >= 2 AND op NOT IN ('send', 'recv', 'isend', 'irecv') AND {chosen}
        ORDER BY step, rank, seq""")
    by_step = {k[0]: f for k, f in calls.partition_by("step", as_dict=True).items()}
    out = []
    for (step,), frame in steps.partition_by("step", as_dict=True).items():
        graph = _step(step, frame, by_step.get(step), world)
        if graph is not None:
            out.append(graph)
    if not out:
        notes.append("no step whose collectives every rank recorded: nothing to replay")
    return sorted(out, key=lambda s: s.step)


def _step(step: int, ranks: pl.DataFrame, calls: pl.DataFrame | None, world: int) -> Step | None:
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
    programs = {r: _program(per_rank[r], t0[r], t1[r], tg[r]) for r in t0}
    return Step(step, {r: (t0[r] - first) / 1e9 for r in t0}, programs, graph_calls, measured)


def ring_flows(n: int, size: float) -> np.ndarray:
    """A ring all-reduce of `size` bytes a rank on `n` ranks: 2(n−1)/n · size from each rank to the next."""
    flows = np.zeros((n, n))
    if n > 1:
        for i in range(n):
            flows[i, (i + 1) % n] = 2 * (n - 1) / n * size
    return flows


def one_way(flows: np.ndarray) -> float:
    """The most bytes any rank of a call sends or receives."""
    return float(max(flows.sum(axis=1).max(), flows.sum(axis=0).max())) if flows.size else 0.0


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
    return Call(op, members[0]["tag"] or "", members[0]["role"], tuple(m["rank"] for m in members), flows,
                bool(members[0]["async"]),
                max(last_exit - max(entries), 0) / 1e9, (max(entries) - first) / 1e9,
                tuple((e - first) / 1e9 for e in entries))


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



def mark_alone(steps: list[Step]) -> None:
    """A synchronous call ran alone if no async call's transfer (its last issue to its completion, taken
    as the call's `entry_s` + `time_s`) overlapped its own."""
    for s in steps:
        spans = [(c.entry_s, c.entry_s + c.time_s) for c in s.calls.values() if c.is_async]
        for c in s.calls.values():
            a, b = c.entry_s, c.entry_s + c.time_s
            c.alone = not c.is_async and not any(x < b and a < y for x, y in spans)

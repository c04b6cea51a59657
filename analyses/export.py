"""Export: a run's steps and collectives as a Chrome / Perfetto trace (the Trace Event Format), so a
run opens in the timeline viewer people already use (ui.perfetto.dev, chrome://tracing).

    counts = write_chrome_trace("runs/base", "t.json")   # {"steps", "collectives", "ranks"}
    trace = chrome_trace("runs/base")
    trace["traceEvents"]    # metadata ("M") and complete ("X") events, one per steps/comms row
    trace["otherData"]      # run, origin_ns, clock: how to get back to the recorded nanoseconds

Layout: one process per rank (pid = rank, named "rank R"); in it one thread for steps (tid 0,
"steps") and one for collectives (tid 1, "collectives"). A viewer draws the events of one thread
as a stack, so they must nest; an async collective (a DDP bucket all-reduce) overlaps the calls
after it without nesting, and goes to the first extra lane where it fits (tid 2, 3, ...,
"collectives (overlapping)").

Each steps or comms row is one complete event ("ph": "X"):
- ts = (t_start_ns + offset_ns(rank) − origin_ns) / 1000 and dur = (t_end_ns − t_start_ns) / 1000,
  in microseconds. offset_ns aligns the ranks' monotonic clocks: 0 on one host (they share the
  clock), the manifest's clock anchors on several (analyses.clocks.clock_offsets); origin_ns is
  the earliest aligned start, so the trace begins at 0 and keeps nanosecond precision in a float.
- a step: name "step N", cat "step", args step, samples, loss, schedule;
- a collective: name "op tag", cat "comm", args op, tag, phase, bytes_out, bytes_in, splits_out,
  splits_in (bytes to and from each peer, in group-rank order), group, group_size, dtype, async,
  step, seq. A call whose completion is unknown (t_end_ns = −1) gets dur 0 and args
  "completion": "unknown".

Example, two ranks with one step and one all-to-all each (times in ns, one host):

    steps  rank step t_start_ns t_end_ns      comms  rank op                t_start_ns t_end_ns
           0    0    1000       9000                 0    all_to_all_single 2000       3500
           1    0    1200       9100                 1    all_to_all_single 2100       -1

    X events  pid tid name                       ts   dur
              0   0   step 0                     0.0  8.0
              0   1   all_to_all_single emb_fwd  1.0  1.5
              1   0   step 0                     0.2  7.9
              1   1   all_to_all_single emb_fwd  1.1  0.0   (args completion: unknown)
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

from analyses.clocks import clock_offsets
from tracekit.errors import TracekitError
from tracekit.files import write_text
from tracekit.run import open_run

STEPS_TID = 0
COMMS_TID = 1
STEP_ARGS = ("step", "samples", "loss", "schedule")
COMM_ARGS = ("op", "tag", "phase", "bytes_out", "bytes_in", "splits_out", "splits_in", "group", "group_size",
             "dtype", "async", "step", "seq")


def chrome_trace(run_dir: str | os.PathLike) -> dict:
    """The steps and comms of the run at `run_dir` as a Trace Event Format object (see the module
    docstring); RunNotFound if it is not a run, TracekitError if it has neither table."""
    run = open_run(run_dir)
    present = run.tables()
    frames = {table: run.scan(table).sort("rank", "t_start_ns").collect().to_dicts()
              for table in ("steps", "comms") if table in present}
    if not frames:
        raise TracekitError(f"{Path(run_dir)} has no steps or comms rows to export; "
                            f"it has: {', '.join(present) or 'none'}")
    offsets, clock = clock_offsets(run.manifest)
    rows = [r for table in frames.values() for r in table]
    origin = min(r["t_start_ns"] + offsets.get(r["rank"], 0) for r in rows)

    def ts(rank: int, t_ns: int) -> float:
        return (t_ns + offsets.get(rank, 0) - origin) / 1000

    events = []
    for r in frames.get("steps", []):
        events.append({"name": f"step {r['step']}", "cat": "step", "ph": "X", "pid": r["rank"], "tid": STEPS_TID,
                       "ts": ts(r["rank"], r["t_start_ns"]), "dur": (r["t_end_ns"] - r["t_start_ns"]) / 1000,
                       "args": {k: _json_value(r[k]) for k in STEP_ARGS}})
    lanes = _lanes(frames.get("comms", []))
    for r, tid in zip(frames.get("comms", []), lanes):
        known = r["t_end_ns"] >= 0
        args = {k: r[k] for k in COMM_ARGS}
        if not known:
            args["completion"] = "unknown"
        events.append({"name": f"{r['op']} {r['tag']}".strip(), "cat": "comm", "ph": "X", "pid": r["rank"],
                       "tid": tid, "ts": ts(r["rank"], r["t_start_ns"]),
                       "dur": (r["t_end_ns"] - r["t_start_ns"]) / 1000 if known else 0.0, "args": args})
    ranks = sorted({*map(int, run.manifest.ranks or []), *(r["rank"] for r in rows)})
    threads = {(r["rank"], tid) for r, tid in zip(frames.get("comms", []), lanes)}
    return {"traceEvents": _metadata(ranks, threads) + events, "displayTimeUnit": "ms",
            "otherData": {"run": str(run_dir), "run_id": run.manifest.run_id, "origin_ns": origin,
                          "clock": clock, "time_unit": "ts and dur in microseconds from origin_ns"}}


def write_chrome_trace(run_dir: str | os.PathLike, target: str | os.PathLike) -> dict[str, int]:
    """Write the run's trace (chrome_trace) to `target` atomically; how many step and collective
    events of how many ranks it holds."""
    trace = chrome_trace(run_dir)
    try:
        write_text(target, json.dumps(trace))
    except OSError as err:
        raise TracekitError(f"cannot write --chrome-trace {target}: {err.strerror or err}") from None
    x = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    return {"steps": sum(e["cat"] == "step" for e in x), "collectives": sum(e["cat"] == "comm" for e in x),
            "ranks": sum(e["name"] == "process_name" for e in trace["traceEvents"])}


def _lanes(comms: list[dict]) -> list[int]:
    """The tid of each comms row (sorted by rank, t_start_ns): COMMS_TID where it fits after the
    lane's last call, else the first extra lane where it does (greedy interval partitioning)."""
    tids, ends = [], {}  # ends: (rank, tid) -> end of the lane's last call
    for r in comms:
        start = r["t_start_ns"]
        end = max(start, r["t_end_ns"])
        tid = COMMS_TID
        while ends.get((r["rank"], tid), start) > start:
            tid += 1
        ends[(r["rank"], tid)] = end
        tids.append(tid)
    return tids


def _metadata(ranks: list[int], threads: set[tuple[int, int]]) -> list[dict]:
    """Process and thread names ("rank R"; "steps", "collectives", "collectives (overlapping)")
    and their order in the viewer."""
    def meta(name: str, pid: int, args: dict, tid: int = 0) -> dict:
        return {"name": name, "ph": "M", "pid": pid, "tid": tid, "args": args}

    events = []
    for rank in ranks:
        events += [meta("process_name", rank, {"name": f"rank {rank}"}),
                   meta("process_sort_index", rank, {"sort_index": rank})]
        for tid in sorted({STEPS_TID, COMMS_TID} | {t for p, t in threads if p == rank}):
            name = {STEPS_TID: "steps", COMMS_TID: "collectives"}.get(tid, "collectives (overlapping)")
            events += [meta("thread_name", rank, {"name": name}, tid), meta("thread_sort_index", rank,
                                                                             {"sort_index": tid}, tid)]
    return events


def _json_value(value):
    """`value`, with a NaN or infinite float (which JSON cannot hold) as None."""
    return None if isinstance(value, float) and not math.isfinite(value) else value

"""Diagnosing a hung distributed job from its ranks' heartbeats (collectors/heartbeat.py), as
PyTorch's Flight Recorder does for NCCL, for any backend.

`tracekit record` polls `HangWatch.check()` every second while the command runs. A hang is a rank
whose heartbeat is older than `hang_after` seconds (stopped, or stuck in native code holding the
GIL), or a collective open longer than that. Then, once per hang, it writes `RUN/hang.json`, prints
one paragraph to stderr and asks the live ranks for their Python stacks (SIGUSR2: `ranks/stacks-
rank=R.txt`); it never stops the job. When every rank beats again and no call is open that long, it
says the hang cleared (and after how long) and watches for the next.

Beside a silent rank, every live rank in a collective counts as waiting (most likely for it). The
diagnosis, per process group the waiting ranks are in (the call numbers count each rank's calls
in that group, so equal numbers are the same collective):

    waiting    the ranks in call #N of the group, with op, tag and since when
    silent     ranks whose heartbeat is stale, with the call and step they were last at
    missing    members of the group that are not in call #N: at an earlier or later call (they
               disagree on the order of collectives: a skipped or extra call), or in none

`hang_after` None: HANG_FLOOR_S, or 100× the slowest rank's recent step time where that is longer.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

from tracekit.files import write_text
from tracekit.run_dir import RunDir

HANG_FLOOR_S = 60.0
STEPS_PER_HANG = 100
STACKS_SIGNAL = signal.SIGUSR2  # collectors/heartbeat.py's


def read_heartbeats(run_dir: Path) -> dict[int, dict]:
    """Every rank's last heartbeat, by rank (unreadable ones left out)."""
    beats = {}
    for path in RunDir.at(run_dir).ranks.glob("heartbeat-rank=*.json"):
        try:
            beat = json.loads(path.read_text())
            beats[int(beat["rank"])] = beat
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return beats


def threshold(beats: dict[int, dict], hang_after: float | None) -> float:
    if hang_after is not None:
        return hang_after
    steps = [b["step_s"] for b in beats.values() if b.get("step_s")]
    return max(HANG_FLOOR_S, STEPS_PER_HANG * max(steps)) if steps else HANG_FLOOR_S


def diagnose(beats: dict[int, dict], now: float, hang_after: float) -> dict | None:
    """The hang the heartbeats show at `now` (module docstring), or None."""
    silent = {r: b for r, b in beats.items() if now - b["wall_time"] > hang_after}
    # in a collective that long; or, beside a silent rank, in any collective (most likely waiting for it)
    stuck = {r: b for r, b in beats.items() if b.get("open") and r not in silent
             and (silent or now - b["open"]["since"] > hang_after)}
    if not silent and not stuck:
        return None
    groups = []
    for group in sorted({b["open"]["group"] for b in stuck.values()}):
        waiting = {r: b["open"] for r, b in stuck.items() if b["open"]["group"] == group}
        call = min(o["call"] for o in waiting.values())
        first = next(o for r, o in sorted(waiting.items()) if o["call"] == call)
        groups.append({"group": group, "group_size": first["group_size"], "call": call, "op": first["op"],
                       "tag": first["tag"],
                       "waiting": {str(r): {"since_s": round(now - o["since"], 1), "call": o["call"], "op": o["op"],
                                            "tag": o["tag"]} for r, o in sorted(waiting.items())},
                       "not_there": {str(r): why for r, why in _not_there(beats, group, call, first).items()}})
    return {"detected_at": now, "hang_after_s": hang_after, "groups": groups,
            "silent": {str(r): {"since_s": round(now - b["wall_time"], 1), "step": b["step"],
                                "last_open": b.get("open"), "pid": b.get("pid"), "host": b.get("host")}
                       for r, b in sorted(silent.items())},
            "ranks": {str(r): {"step": b["step"], "pid": b.get("pid"), "host": b.get("host")}
                      for r, b in sorted(beats.items())}}


def _not_there(beats: dict[int, dict], group: str, call: int, first: dict) -> dict[int, str]:
    """Why each member of `group` (a rank that has called in it) is not waiting in its call #`call`
    as `first` does: in another call of it, in the same call with another op (they disagree on the
    order of collectives), past it, or never entered it."""
    out = {}
    for r, b in sorted(beats.items()):
        mine = b["open"] if b.get("open") and b["open"]["group"] == group else None
        done = b.get("calls", {}).get(group)
        if mine is None and done is None:
            continue  # not a member, as far as its calls tell
        if mine is not None and mine["call"] == call and (mine["op"], mine["tag"]) == (first["op"], first["tag"]):
            continue
        if mine is not None and mine["call"] == call:
            out[r] = (f"disagrees: its call #{call} of this group is {mine['op']} ({mine['tag']}), not {first['op']} "
                      f"({first['tag']}): a collective skipped or added on one side")
        elif mine is not None:
            out[r] = f"in call #{mine['call']} ({mine['op']}, {mine['tag']}) of this group instead"
        elif done >= call:
            out[r] = f"past it: {done} calls of this group done"
        else:
            where = (f"in {b['open']['op']} ({b['open']['tag']}) of group {b['open']['group']}" if b.get("open")
                     else "in no collective")
            out[r] = (f"never entered it: {done} calls of this group done at its last heartbeat, then {where} "
                      f"at step {b['step']}")
    return out


def describe(hang: dict) -> str:
    """The one paragraph `record` prints."""
    parts = []
    for r, s in hang["silent"].items():
        last = s["last_open"]
        at = f"in {last['op']} ({last['tag']}, call #{last['call']} of group {last['group']})" if last else \
            "in no collective"
        parts.append(f"rank {r} has sent no heartbeat for {s['since_s']:.0f} s (stopped, or stuck in native code "
                     f"holding the GIL; its last at step {s['step']}, {at})")
    for g in hang["groups"]:
        waiting = ", ".join(f"rank {r} for {w['since_s']:.0f} s" for r, w in g["waiting"].items()
                            if (w["call"], w["op"], w["tag"]) == (g["call"], g["op"], g["tag"]))
        parts.append(f"waiting in {g['op']} ({g['tag']}), call #{g['call']} of group {g['group']} "
                     f"({g['group_size']} ranks): {waiting}")
        parts += [f"rank {r} is not there: {why}" for r, why in g["not_there"].items()]
    return f"tracekit: the job looks hung (nothing for {hang['hang_after_s']:.0f} s): " + "; ".join(parts) + \
        ". The job is left running; stacks of the live ranks are in ranks/stacks-rank=R.txt, this in hang.json."


class HangWatch:
    """Polled by `record` while the command runs (module docstring)."""

    def __init__(self, run_dir: Path, hang_after: float | None, *, out=None) -> None:
        self.run_dir, self.hang_after, self.out = run_dir, hang_after, out or sys.stderr
        self.current: dict | None = None
        self.hangs = 0

    def check(self, now: float | None = None) -> dict | None:
        """Look once; returns the hang found now, if it is a new one."""
        now = time.time() if now is None else now
        beats = read_heartbeats(self.run_dir)
        if not beats:
            return None
        hang = diagnose(beats, now, threshold(beats, self.hang_after))
        if hang is None:
            if self.current is not None:
                print(f"tracekit: the hang cleared after {now - self.current['detected_at']:.0f} s", file=self.out,
                      flush=True)
                self._write({**self.current, "cleared_after_s": round(now - self.current["detected_at"], 1)})
                self.current = None
            return None
        if self.current is not None:
            return None
        self.current, self.hangs = hang, self.hangs + 1
        self._write(hang)
        self._ask_for_stacks(hang)
        print(describe(hang), file=self.out, flush=True)
        return hang

    def _write(self, hang: dict) -> None:
        try:
            write_text(self.run_dir / "hang.json", json.dumps(hang, indent=2) + "\n")
        except OSError:
            pass

    def _ask_for_stacks(self, hang: dict) -> None:
        """SIGUSR2 to every rank on this host that still beats (a stopped one would take it only later)."""
        here = os.uname().nodename
        for r, rank in hang["ranks"].items():
            if r in hang["silent"] or not rank.get("pid") or rank.get("host") not in (here, None):
                continue
            try:
                os.kill(int(rank["pid"]), STACKS_SIGNAL)
            except (OSError, ValueError):
                pass

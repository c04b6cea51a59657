"""What a rank is doing now, for hang diagnosis: a heartbeat file a thread of its own rewrites every
second, and the rank's Python stacks on request.

`RUN/ranks/heartbeat-rank=R.json` (written atomically):

    {"rank", "pid", "host", "wall_time": when written (time.time()), "step": the step now running,
     "step_started": its wall time, "step_s": recent seconds per step (null before two steps ended),
     "rss_bytes": the process's resident memory,
     "open": the collective the training thread is in (null: none) — {"op", "tag", "group",
             "group_size", "call": its number among this rank's calls in that group (1 = the first),
             "since": wall time it was entered},
     "calls": {group: calls completed in it}}

The training thread only notes the call it enters (collectors/comm.py keeps a reference to it); this
thread reads it, so a rank blocked in a collective still beats. A stopped process (SIGSTOP) or one
whose native code holds the GIL stops beating: its file goes stale. SIGUSR2 makes the process write
every thread's Python stack to `RUN/ranks/stacks-rank=R.txt` (faulthandler), which `tracekit record`
asks for when it diagnoses a hang (tracekit/app/hang.py).
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import socket
import threading
import time
from pathlib import Path
from typing import Any

from collectors.steps import StepClock
from tracekit.run_dir import RunDir

INTERVAL_S = 1.0
STACKS_SIGNAL = signal.SIGUSR2


def path_of(run_dir: Path, rank: int) -> Path:
    return RunDir.at(run_dir).ranks / f"heartbeat-rank={rank}.json"


def stacks_path(run_dir: Path, rank: int) -> Path:
    return RunDir.at(run_dir).ranks / f"stacks-rank={rank}.txt"


class Heartbeat:
    """The thread that rewrites this rank's heartbeat; `stop()` ends it and removes the file."""

    def __init__(self, run_dir: Path, rank: int, clock: StepClock, comms: Any) -> None:
        self.path, self.rank, self.clock, self.comms = path_of(run_dir, rank), rank, clock, comms
        self._tmp = self.path.with_name(f".{self.path.name}.tmp")
        self._stop = threading.Event()
        self._seen_step, self._seen_at, self.step_s = clock.step, time.time(), None
        self._stacks = None
        try:  # a program's own SIGUSR2 handler is kept: then no stacks on request
            if signal.getsignal(STACKS_SIGNAL) in (signal.SIG_DFL, None):
                self._stacks = open(stacks_path(run_dir, rank), "w")
                faulthandler.register(STACKS_SIGNAL, file=self._stacks, all_threads=True)
        except (OSError, ValueError, RuntimeError):  # not the main thread, or no room: no stacks
            self._stacks = None
        self._thread = threading.Thread(target=self._run, name=f"tracekit-heartbeat-rank{rank}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(INTERVAL_S):
            try:
                self.beat()
            except Exception:  # a heartbeat must never take the training process down
                pass

    def beat(self) -> dict:
        now, step = time.time(), self.clock.step
        if step > self._seen_step:
            per = (now - self._seen_at) / (step - self._seen_step)
            self.step_s = per if self.step_s is None else 0.5 * self.step_s + 0.5 * per
            self._seen_step, self._seen_at = step, now
        started = now - (time.monotonic_ns() - self.clock._t_start_ns) / 1e9
        state = {"rank": self.rank, "pid": os.getpid(), "host": socket.gethostname(), "wall_time": now,
                 "step": step, "step_started": started, "step_s": self.step_s, "rss_bytes": _rss_bytes(),
                 **self.comms.now()}
        try:
            self._tmp.write_text(json.dumps(state))
            os.replace(self._tmp, self.path)
        finally:  # a full disk leaves no half-written temporary behind
            self._tmp.unlink(missing_ok=True)
        return state

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2 * INTERVAL_S)
        if self._stacks is not None:
            try:
                faulthandler.unregister(STACKS_SIGNAL)
                self._stacks.close()
                if not os.path.getsize(self._stacks.name):
                    os.unlink(self._stacks.name)
            except (OSError, ValueError):
                pass
        self.path.unlink(missing_ok=True)
        self._tmp.unlink(missing_ok=True)


def _rss_bytes() -> int | None:
    """The process's resident memory now (Linux), for bench/soak.py's flat-memory check."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None

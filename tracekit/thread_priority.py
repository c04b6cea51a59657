"""How a traced rank's trace writer thread shares the rank's core: its niceness and scheduling policy.

Linux schedules threads, not processes, so each call here acts on one thread by its native id.
Two ways to keep the writer out of the training thread's way:

- *nicer*: the thread weighs less (nice +10: 110 against 1024), yet the scheduler still lets a
  picked writer finish its time slice before a training thread woken by a collective gets the core;
- *idle* (`SCHED_IDLE`): the thread runs only on a core nothing else wants, and any other thread
  waking on that core preempts it at once. It also gets next to nothing of a core that never idles,
  so the writer is put there only where the process may move it back (`may_leave_idle`): Linux
  lets a thread leave `SCHED_IDLE` only with CAP_SYS_NICE or an RLIMIT_NICE that allows its nice
  value, which most unprivileged users lack.
"""

from __future__ import annotations

import os
import resource

CAP_SYS_NICE = 23  # its bit in /proc/<pid>/status's CapEff


def renice(tid: int, nice: int) -> None:
    """Make thread `tid` `nice` nicer than it is (capped at 19); a no-op where that is not allowed."""
    if nice <= 0 or not hasattr(os, "setpriority"):
        return
    try:
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + nice))
    except OSError:  # not allowed here: the thread keeps its priority
        pass


def may_leave_idle(tid: int) -> bool:
    """Whether this process may move thread `tid` into `SCHED_IDLE` and later back to `SCHED_OTHER`
    at its present nice value."""
    if not hasattr(os, "SCHED_IDLE"):
        return False
    soft, _ = resource.getrlimit(resource.RLIMIT_NICE)
    if soft == resource.RLIM_INFINITY or soft >= 20 - os.getpriority(os.PRIO_PROCESS, tid):
        return True
    try:
        with open("/proc/self/status") as status:
            caps = next(line.split()[1] for line in status if line.startswith("CapEff:"))
    except (OSError, StopIteration):
        return False
    return bool(int(caps, 16) >> CAP_SYS_NICE & 1)


def set_idle(tid: int, idle: bool) -> bool:
    """Put thread `tid` under `SCHED_IDLE` (idle=True) or back under `SCHED_OTHER`, its nice value
    kept; False if the kernel refused."""
    try:
        os.sched_setscheduler(tid, os.SCHED_IDLE if idle else os.SCHED_OTHER, os.sched_param(0))
    except OSError:
        return False
    return True


def is_idle(tid: int) -> bool:
    """Whether thread `tid` is under `SCHED_IDLE` now."""
    return hasattr(os, "SCHED_IDLE") and os.sched_getscheduler(tid) == os.SCHED_IDLE

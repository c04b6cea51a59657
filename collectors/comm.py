"""The comm collector: every torch.distributed collective and point-to-point call of a rank.

`install(writer, clock)` wraps the public functions of `torch.distributed` (and the same
functions in `torch.distributed.distributed_c10d`, which torch's own modules call). Each call
becomes one `comms` row: op, group, dtype, bytes out and in, bytes per peer, start time,
completion time, a tag and the phase (`train` | `eval`, collectors/phase.py). A wrapped function
called by another (`send` calls `isend`, `all_gather_into_tensor` calls `all_gather_single`) is
the outer call's row, not one of its own. Completion of an async call is taken from its Work
future, not from the call's return; a Work without a future (gloo's `isend`/`irecv`, which
complete only inside `wait()`) gives t_end_ns -1. The training thread only describes the call
(sizes, not data) and keeps it; the writer thread drains the kept calls, in call order, at every
flush, holding back those of the step now running once the clock has moved (so that calls after
the last step are written as `eval` at close). An async call not complete when it had to be
written (at exit, or with too many calls behind it) has t_end_ns -1 too.

DDP's gradient all-reduce is seen when it is issued from Python (a comm hook, such as the
reference trainer's); DDP's built-in C++ all-reduce is not (a dispatch-level hook would be).

The tag is the innermost `tracekit.label(name)` around the call, else `ddp_bucket_<i>` for DDP's
gradient buckets, else the calling function's qualified name (e.g. `_sum_allreduce_hook`).
A DDP model that registers no comm hook of its own gets, at its first forward, a Python hook that
does what DDP's built-in one does (average each bucket with one all-reduce), so its traffic is seen.

bytes_out and bytes_in are the sizes of the call's send and receive buffers (for broadcast, reduce
and all_reduce, the one tensor: both). splits_out[j] is the bytes of this rank's data the op
delivers to group rank j, splits_in[i] the bytes of group rank i's data this rank's result is
made of, self included, in group-rank order; so for any two ranks, splits_out of i at j equals
splits_in of j at i. This is the op's logical exchange, not what the algorithm puts on the wire:
- all_to_all(_single): the splits given (even ones when none are);
- all_gather(_into_tensor, _single): my tensor to every rank, every rank's tensor to me;
- reduce_scatter(_tensor, _single): my input's chunk j to rank j, and from every rank its chunk
  of my output (the output's size);
- broadcast: the root's tensor to every rank (the root's splits_out is the tensor size for all,
  every rank's splits_in the tensor size at the root); reduce: every rank's tensor to the root;
- send/isend: the tensor to the peer, nothing back; recv/irecv the reverse (splits_in [] for a
  receive from any source: the sender is known only at completion);
- [] for all_reduce, whose per-peer traffic depends on the algorithm (every rank's data reaches
  every rank, so the logical split says nothing bytes_out does not), and for barrier (no data).

Splits of an all-to-all, two ranks, rank 0 sending 3 rows of 8 bytes to itself and 1 to rank 1
(input_split_sizes [3, 1]) and receiving 2 from rank 1: splits_out [24, 8], splits_in [24, 16].
"""

from __future__ import annotations

import collections
import functools
import inspect
import sys
import threading
import time
import weakref
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch.nn.parallel import DistributedDataParallel

from collectors import phase
from collectors.guard import Guard
from collectors.steps import StepClock
from tracekit.labels import current_label, label
from tracekit.store import RunWriter
from tracekit.tags import DDP_BUCKET
from tracekit.window import Window

OPS = ("all_to_all_single", "all_to_all", "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single",
       "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single", "broadcast", "reduce", "barrier",
       "send", "recv", "isend", "irecv")


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _split_bytes(t: torch.Tensor, sizes: list[int] | None, world: int) -> list[int]:
    row = _nbytes(t) // t.shape[0] if t.dim() and t.shape[0] else 0
    if sizes is None or len(sizes) == 0:
        return [_nbytes(t) // world] * world
    return [int(s) * row for s in sizes]


def _group_rank(a: dict[str, Any], global_key: str, group_key: str) -> int | None:
    """The group rank a call names as its root or peer: `group_src`/`group_dst` if given, else its
    global `src`/`dst` translated to the call's group (None: a receive from any source)."""
    if a.get(group_key) is not None:
        return int(a[group_key])
    rank, group = a.get(global_key), a.get("group")
    return rank if rank is None or group is None else dist.get_group_rank(group, rank)


def describe(op: str, a: dict[str, Any], group_size: int) -> tuple[str, int, int, list[int], list[int]]:
    """(dtype, bytes_out, bytes_in, splits_out, splits_in) of one call, from its arguments by name
    (splits: see the module docstring)."""
    peers = range(group_size)
    if op == "all_to_all_single":
        out = _split_bytes(a["input"], a.get("input_split_sizes"), group_size)
        inn = _split_bytes(a["output"], a.get("output_split_sizes"), group_size)
        return (str(a["input"].dtype), sum(out), sum(inn), out, inn)
    if op == "all_to_all":
        out = [_nbytes(t) for t in a["input_tensor_list"]]
        inn = [_nbytes(t) for t in a["output_tensor_list"]]
        return (str(a["input_tensor_list"][0].dtype), sum(out), sum(inn), out, inn)
    if op in ("send", "isend", "recv", "irecv"):
        n, sending = _nbytes(a["tensor"]), op in ("send", "isend")
        peer = _group_rank(a, "dst", "group_dst") if sending else _group_rank(a, "src", "group_src")
        one = [n if j == peer else 0 for j in peers] if peer is not None else []  # any source: unknown
        none = [0] * group_size
        return (str(a["tensor"].dtype), n if sending else 0, 0 if sending else n, one if sending else none,
                none if sending else one)
    if op == "barrier":
        return ("", 0, 0, [], [])
    if op == "all_gather":
        n, inn = _nbytes(a["tensor"]), [_nbytes(x) for x in a["tensor_list"]]
        return (str(a["tensor"].dtype), n, sum(inn), [n] * group_size, inn)
    if op in ("all_gather_into_tensor", "all_gather_single"):
        n, total = _nbytes(a["input_tensor"]), _nbytes(a["output_tensor"])
        return (str(a["input_tensor"].dtype), n, total, [n] * group_size, [total // group_size] * group_size)
    if op == "reduce_scatter":
        out, n = [_nbytes(t) for t in a["input_list"]], _nbytes(a["output"])
        return (str(a["output"].dtype), sum(out), n, out, [n] * group_size)
    if op in ("reduce_scatter_tensor", "reduce_scatter_single"):
        total, n = _nbytes(a["input"]), _nbytes(a["output"])
        return (str(a["input"].dtype), total, n, [total // group_size] * group_size, [n] * group_size)
    t = a["tensor"]  # all_reduce, broadcast, reduce: the logical buffer, whatever the algorithm
    n = _nbytes(t)
    if op == "all_reduce":
        return (str(t.dtype), n, n, [], [])
    root = _group_rank(a, "src", "group_src") if op == "broadcast" else _group_rank(a, "dst", "group_dst")
    everyone = [n] * group_size if dist.get_rank(a.get("group")) == root else [0] * group_size
    to_root = [n if j == root else 0 for j in peers]
    return (str(t.dtype), n, n, everyone if op == "broadcast" else to_root, to_root if op == "broadcast" else everyone)


class CommHandle:
    def __init__(self, writer: RunWriter, clock: StepClock, window: Window = Window()) -> None:
        self.writer, self.clock, self.window = writer, clock, window
        self.guard = Guard("comm")
        self.seq = 0  # calls drained so far: the next row's seq
        self.backend: str | None = None  # of the first group a call used
        self._groups: weakref.WeakKeyDictionary[Any, tuple[int, str]] = weakref.WeakKeyDictionary()
        self.open: tuple | None = None  # the call the training thread is in now (collectors/heartbeat.py)
        self.group_calls: collections.Counter[str] = collections.Counter()  # calls completed, per group
        self.calls: collections.deque[list] = collections.deque()  # appended here, popped by the writer
        self.originals: dict[tuple[Any, str], Callable] = {}
        for module in (dist, c10d):
            for op in OPS:
                fn = getattr(module, op, None)
                if fn is not None:
                    self.originals[(module, op)] = fn
                    setattr(module, op, self._wrap(op, fn))
        self.ddp_forward = DistributedDataParallel.forward
        DistributedDataParallel.forward = _hooking_forward(self.ddp_forward)
        self.work_wait = dist.Work.wait
        self._waits: weakref.WeakKeyDictionary[Any, list] = weakref.WeakKeyDictionary()  # a recorded Work's call
        dist.Work.wait = self._waiting(self.work_wait)
        self._in_flight = 0  # calls the last drain took: lost if the writer fails to take them
        writer.add_source(self.drain, in_flight=lambda: {"comms": self._in_flight})

    def _wrap(self, op: str, fn: Callable) -> Callable:
        names = list(inspect.signature(fn).parameters)
        group_at = names.index("group") if "group" in names else len(names)

        @functools.wraps(fn)
        def traced(*args, **kwargs):
            if _inside.call:  # called by another wrapped function (send calls isend): that one's row covers it
                return fn(*args, **kwargs)
            t_start = time.monotonic_ns()
            _inside.call = True
            caller = sys._getframe(1)
            self.open = (op, names, args, kwargs, current_label.get(), caller, time.time())  # for the heartbeat
            try:
                result = fn(*args, **kwargs)
            finally:
                _inside.call = False
                self.open = None
            if self.window.on(self.clock.step):
                self.guard.run(self._record, op, names, args, kwargs, result, t_start, caller)
            else:  # outside the recorded steps only the call's number in its group is kept (for hangs)
                self._count(kwargs["group"] if "group" in kwargs else args[group_at] if len(args) > group_at else None)
            return result

        traced.__wrapped_by_tracekit__ = True
        return traced

    def _waiting(self, wait: Callable) -> Callable:
        """Work.wait, noting when the program first waited on a recorded call's Work (a TorchRec awaitable's
        wait, a user's `work.wait()`; DDP waits for its buckets inside the reducer, not here)."""
        waits = self._waits

        @functools.wraps(wait)
        def traced_wait(work, *args, **kwargs):
            call = waits.pop(work, None)
            if call is not None:
                call[T_WAIT] = time.monotonic_ns()
            return wait(work, *args, **kwargs)

        return traced_wait

    def _count(self, group) -> None:
        try:
            pg = group if group is not None else c10d._get_default_group()
            self.group_calls[(self._groups.get(pg) or self._new_group(pg))[1]] += 1
        except Exception:  # a count must never take the program down
            pass

    def _record(self, op, names, args, kwargs, result, t_start, caller) -> None:
        arguments = dict(zip(names, args))
        if kwargs:
            arguments.update(kwargs)
        group = arguments.get("group")
        pg = group if group is not None else c10d._get_default_group()
        size, group_name = self._groups.get(pg) or self._new_group(pg)
        self.group_calls[group_name] += 1
        is_work = result is not None and hasattr(result, "get_future")
        call = [self.clock.step, op, group_name, size, *describe(op, arguments, size), t_start, 0,
                current_label.get() or caller.f_code.co_qualname, is_work, phase.of_call(), None]
        if is_work:
            self._waits[result] = call
            try:
                future = result.get_future()
            except RuntimeError:  # "Work::getFuture not implemented" (gloo's isend/irecv): completion unknown
                call[T_END] = -1
            else:
                future.add_done_callback(functools.partial(_complete, call))
        else:
            call[T_END] = time.monotonic_ns()
        self.calls.append(call)

    def now(self) -> dict:
        """What the heartbeat reports (collectors/heartbeat.py): the call open now, and the calls
        completed per group. Called on the heartbeat's thread."""
        calls = dict(self.group_calls)
        call = self.open
        if call is None:
            return {"open": None, "calls": calls}
        op, names, args, kwargs, tag, caller, since = call
        pg = ({**dict(zip(names, args)), **kwargs}.get("group")) or c10d._get_default_group()
        size, group = self._groups.get(pg) or (dist.get_world_size(pg), getattr(pg, "group_name", "") or "default")
        return {"open": {"op": op, "tag": tag or caller.f_code.co_qualname, "group": group, "group_size": size,
                         "call": calls.get(group, 0) + 1, "since": since}, "calls": calls}

    def _new_group(self, pg: Any) -> tuple[int, str]:
        """The size and name of a process group first seen now, kept for its later calls."""
        if self.backend is None:
            self.backend = str(dist.get_backend(pg))
        info = self._groups[pg] = (dist.get_world_size(pg), getattr(pg, "group_name", "") or "default")
        return info

    def drain(self, final: bool) -> list[tuple[str, dict]]:
        """The calls kept so far, in call order, up to the first async one still running or, once the
        clock has moved, the first of the step now running; all of them if `final` or if more than
        MAX_HELD_CALLS wait (those still running get t_end_ns -1). Called on the writer thread."""
        calls = []
        everything = final or len(self.calls) > MAX_HELD_CALLS
        current = self.clock.step
        while self.calls and (everything or (self.calls[0][T_END] and (current == 0 or self.calls[0][0] < current))):
            call = self.calls.popleft()
            if not call[T_END]:
                call[T_END] = -1
            if final:
                call[PHASE] = self.clock.phase_after_close(call[0], call[PHASE])
            calls.append(call)
        self._in_flight = len(calls)
        if not calls:
            return []
        columns = dict(zip(FIELDS, zip(*calls)))
        columns["seq"] = range(self.seq, self.seq + len(calls))
        self.seq += len(calls)
        return [("comms", columns)]

    def uninstall(self) -> None:
        global _installed
        for (module, op), fn in self.originals.items():
            setattr(module, op, fn)
        DistributedDataParallel.forward = self.ddp_forward
        dist.Work.wait = self.work_wait
        _installed = None


FIELDS = ("step", "op", "group", "group_size", "dtype", "bytes_out", "bytes_in", "splits_out", "splits_in",
          "t_start_ns", "t_end_ns", "tag", "async", "phase", "t_wait_ns")  # a kept call's items, in order
T_END = FIELDS.index("t_end_ns")
T_WAIT = FIELDS.index("t_wait_ns")
PHASE = FIELDS.index("phase")
MAX_HELD_CALLS = 100_000  # calls held behind an async one never waited for, before they are written anyway


class _Inside(threading.local):
    call = False  # this thread is inside a wrapped call


_inside = _Inside()


def _complete(call: list, future: Any) -> None:
    call[T_END] = time.monotonic_ns()


def _average_bucket_hook(process_group, bucket):
    """DDP's default behaviour as a Python comm hook: average the bucket over the group.

    DDP's reducer scales each gradient by 1 / world size while copying it into the bucket, then
    sums. Where the world size is a power of two, scaling before or after the sum gives the same
    bits (a power of two only moves the exponent; gradients under 2^-126, subnormal, aside), so the
    bucket is summed as it is and scaled in the future's callback, which runs on the communication
    thread: the training thread makes no pass over the bucket. At other sizes it scales before the
    sum, as the reducer does (scaling after it differs by an ulp at 3 ranks)."""
    group = process_group if process_group is not None else dist.group.WORLD
    size = dist.get_world_size(group)
    after = size & (size - 1) == 0  # a power of two: scale after the sum
    with label(f"{DDP_BUCKET}_{bucket.index()}"):
        tensor = bucket.buffer() if after else bucket.buffer().mul_(1.0 / size)
        work = dist.all_reduce(tensor, group=group, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0].mul_(1.0 / size) if after else fut.value()[0])


def _has_comm_hook(ddp: DistributedDataParallel) -> bool:
    """Whether the model registered a comm hook. Reads DDP's private `_comm_hooks` list (checked on
    torch 2.13); if it ever disappears, assume a hook exists, so the model is left untouched."""
    return bool(getattr(ddp, "_comm_hooks", True))


def _hooking_forward(forward: Callable) -> Callable:
    @functools.wraps(forward)
    def traced_forward(self, *args, **kwargs):
        if not getattr(self, "_tracekit_checked", False):
            self._tracekit_checked = True
            if not _has_comm_hook(self):
                self.register_comm_hook(None, _average_bucket_hook)
        return forward(self, *args, **kwargs)

    return traced_forward


_installed: CommHandle | None = None  # the wrapped functions are process-wide, so is their record


def install(writer: RunWriter, clock: StepClock, *, window: Window = Window()) -> CommHandle:
    """Record every collective of this process (on the steps of `window`); a second call returns the
    installed handle."""
    global _installed
    if _installed is None:
        _installed = CommHandle(writer, clock, window)
    return _installed

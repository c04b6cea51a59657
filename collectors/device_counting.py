"""Counting kept lookup calls on their CUDA device without stalling the training stream.

`counting.count_rows` counts a `Kept` whose ids are on an accelerator with `torch.unique` and reads
the result back with `.cpu()`: the writer thread then waits for the device, and the size readback
makes the device wait for it. `DeviceCounter` counts the same rows, equal to `count_rows`'s, in
fixed-size steps that never read a size back while the device works:
- the writer thread `submit`s a `Kept` with the event the training thread recorded at its step's
  end; a low-priority side stream waits on that event, builds `count_rows`'s keys (the per-call key
  offsets computed on the host, uploaded from pinned memory), sorts them, and compacts the runs into
  buffers as long as the ids (`compact_sorted`), with the number of distinct keys `u` beside them;
- phase 1 copies `u` into pinned memory; once `ready()` sees that copy done, phase 2 copies the
  first `u` keys and counts; once `ready()` sees that done, the host decodes them into a `Counted`.
Host memory comes from a ring of `slots` pinned buffers: a submit that finds none free is refused,
so the caller drops its ids (counts them as lost) rather than wait. `copy_to_host` brings other
tensors (sampled raw lookups, the loss) back by the same rules.

Every call is made on one thread (the writer's). On CPU the collector counts with numpy in
`count_rows`; only what the counter runs on its side stream, `build_keys` and `compact_sorted` (plain
torch ops), and the host's `key_layout` and `decode` run on CPU too, which is how they are tested
without a GPU.
"""

from __future__ import annotations

import collections
import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from collectors.counting import Counted, Kept, Keys, Table

ALIGN = 64  # bytes: each view cut from a slot's host buffer starts at a multiple of it
MIN_HOST_BYTES = 1 << 16


def side_stream(device: torch.device) -> torch.cuda.Stream:
    """A new stream of `device` at the lowest priority (a larger number is a lower priority)."""
    return torch.cuda.Stream(device, priority=max(torch.cuda.Stream.priority_range()))


@dataclass
class KeyLayout:
    """`count_rows`'s keys of a `Kept` (`counting.Keys`), and what the device needs of them: `meta`,
    one column per call, rows (call_key, size) and, where a table of the calls has a padding row,
    that row (-1 for the others). Padding ids get the key `sentinel`, above every other key."""

    keys: Keys
    meta: np.ndarray  # int64 [2 or 3, calls]
    ids: int  # padding ids included

    @property
    def has_padding(self) -> bool:
        return len(self.meta) == 3

    @property
    def sentinel(self) -> int:
        return int(self.keys.bases[-1])

    @property
    def dtype(self) -> torch.dtype:
        """int32 where every key (the sentinel included) is below 2**31."""
        top = self.sentinel if self.has_padding else self.sentinel - 1
        return torch.int32 if top < 2**31 else torch.int64


def key_layout(kept: Kept, tables: list[Table]) -> KeyLayout:
    """The layout of `kept`'s keys, as `count_rows` builds them."""
    size = kept.size.astype(np.int64, copy=False)
    keys = Keys.of(kept, tables)
    rows = [keys.call_key, size] + ([keys.padding] if keys.padding is not None else [])
    return KeyLayout(keys, np.stack(rows).astype(np.int64), int(size.sum()))


def build_keys(ids: torch.Tensor, meta: torch.Tensor, layout: KeyLayout) -> torch.Tensor:
    """Each id's key (`layout.meta` on the ids' device as `meta`), padding ids keyed `layout.sentinel`,
    in `layout.dtype`. Fixed-size: no size is read back."""
    n = ids.numel()
    call = torch.repeat_interleave(meta[1], output_size=n)  # output_size given: no sync for the size
    keys = ids.to(layout.dtype) + meta[0].to(layout.dtype).index_select(0, call)
    if layout.has_padding:
        keys.masked_fill_(ids == meta[2].index_select(0, call), layout.sentinel)
    return keys


def compact_sorted(keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(unique, counts, u) of sorted `keys`: the first `u[0]` entries of `unique` are the distinct
    keys, increasing, and of `counts` (int32) how often each occurs; the entries after them are
    unspecified. Both are as long as `keys`, and `u` is a 1-element int64 tensor: nothing is read
    back, so on CUDA it runs without a sync."""
    n, device = keys.numel(), keys.device
    if n == 0:
        return keys.clone(), keys.new_zeros(0, dtype=torch.int32), keys.new_zeros(1, dtype=torch.int64)
    starts = torch.cat([torch.ones(1, dtype=torch.bool, device=device), keys[1:] != keys[:-1]])
    run = torch.cumsum(starts, 0) - 1  # each key's run
    # first[r]: where run r starts, for r < u; first[u] stays n. Non-starts all go to the spare slot n,
    # which is never read for r < u (first[u] is slot n only when u == n, where nothing goes there).
    first = torch.full((n + 1,), n, dtype=torch.int64, device=device)
    first.scatter_(0, torch.where(starts, run, n), torch.arange(n, device=device))
    counts = (first[1:] - first[:-1]).to(torch.int32)
    unique = keys.gather(0, first[:n].clamp_max(n - 1))
    return unique, counts, run[-1:] + 1


def decode(layout: KeyLayout, unique: np.ndarray, counts: np.ndarray) -> Counted:
    """The `Counted` of the distinct keys `unique` (increasing, the sentinel included where padding
    ids were counted) and their counts: what `count_rows` returns for the same calls."""
    if layout.has_padding and len(unique) and unique[-1] == layout.sentinel:
        unique, counts = unique[:-1], counts[:-1]
    return layout.keys.rows(unique, counts)


class HostBuffer:
    """One slot's host memory: a byte buffer (pinned where `pin`), grown to fit and kept, cut into
    aligned typed views. Views cut earlier are invalid once it grows."""

    def __init__(self, pin: bool) -> None:
        self.pin = pin
        self.bytes = torch.empty(0, dtype=torch.uint8)

    def views(self, specs: Sequence[tuple[torch.dtype, tuple[int, ...]]]) -> list[torch.Tensor]:
        offsets, end = [], 0
        for dtype, shape in specs:
            offsets.append(end)
            end += -(-math.prod(shape) * dtype.itemsize // ALIGN) * ALIGN
        if end > self.bytes.numel():
            self.bytes = torch.empty(max(MIN_HOST_BYTES, 1 << (end - 1).bit_length()), dtype=torch.uint8,
                                     pin_memory=self.pin)
        return [self.bytes[o:o + math.prod(shape) * dtype.itemsize].view(dtype).view(shape)
                for o, (dtype, shape) in zip(offsets, specs)]


class Submitted:
    """A submitted `Kept`. `ids_free()`: whether the side stream has read its ids, so that the memory
    holding them (a staging chunk) may be written again."""

    def __init__(self, read: torch.cuda.Event) -> None:
        self._read = read

    def ids_free(self) -> bool:
        return self._read.query()


class HostCopy:
    """Tensors on their way to pinned host memory (`DeviceCounter.copy_to_host`). Poll `done()`;
    once it is True, `arrays()` gives them as numpy arrays (copies, in their shapes) and hands the
    slot back. Each copy holds a slot of the ring until `arrays()` is called."""

    def __init__(self, counter: DeviceCounter, buffer: HostBuffer, views: list[torch.Tensor],
                 sources: list[torch.Tensor], event: torch.cuda.Event) -> None:
        self._counter, self._buffer, self._views = counter, buffer, views
        self._sources = sources  # read by the side stream: held until arrays()
        self._event = event

    def done(self) -> bool:
        return self._event.query()

    def arrays(self) -> list[np.ndarray]:
        if self._views is None:
            raise RuntimeError("arrays() was already called on this copy")
        if not self.done():
            raise RuntimeError("the copy is not done: poll done() first")
        out = [v.numpy().copy() for v in self._views]
        self._views, self._sources = None, []
        self._counter._free.append(self._buffer)
        return out


class _Count:
    """One submitted `Kept` on its way: counted on the device (phase 1 ends with `u` in host memory),
    its `u` keys and counts copied back (phase 2), decoded (done)."""

    def __init__(self, layout: KeyLayout, buffer: HostBuffer | None) -> None:
        self.layout, self.buffer = layout, buffer
        self.event: torch.cuda.Event | None = None  # the running phase's end
        self.device_out: tuple[torch.Tensor, ...] = ()  # what the running phase reads on the device
        self.u_host: torch.Tensor | None = None
        self.host_out: tuple[torch.Tensor, torch.Tensor] | None = None
        self.result: Counted | None = None


class DeviceCounter:
    """Counts kept calls on one CUDA device (module docstring); every method returns without waiting
    for the device, except `close`."""

    def __init__(self, device: torch.device | str | int, slots: int = 4) -> None:
        device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
        if device.type != "cuda":
            raise ValueError(f"DeviceCounter counts on a CUDA device, not {device} (on CPU count_rows counts "
                             "with numpy)")
        if slots < 1:
            raise ValueError(f"slots must be >= 1, got {slots}")
        self.device = torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)
        self.stream = side_stream(self.device)
        self._free: list[HostBuffer] = [HostBuffer(pin=True) for _ in range(slots)]
        self._jobs: collections.deque[_Count] = collections.deque()
        self._closed = False

    def submit(self, kept: Kept, tables: list[Table], after: torch.cuda.Event | None) -> Submitted | None:
        """Start counting `kept` (ids a 1-D int64 tensor on this device, no `weight`) once the device
        has passed `after` (an event recorded after its ids were written; None: all work queued on the
        calling thread's current stream now). Its `Counted` comes out of `ready()` in submission order.
        None where no slot of the ring is free (or the counter is closed): nothing was taken, and the
        caller counts the ids as lost."""
        self._check_ids(kept)
        if self._closed or (kept.size.sum() and not self._free):
            return None
        layout = key_layout(kept, tables)
        read = torch.cuda.Event()  # never recorded where nothing is read: query() is True
        if layout.ids == 0:
            job = _Count(layout, None)
            job.result = decode(layout, np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int32))
        else:
            job = _Count(layout, self._free.pop())
            self._count(job, kept.ids, after, read)
        self._jobs.append(job)
        return Submitted(read)

    def _check_ids(self, kept: Kept) -> None:
        ids = kept.ids
        if not isinstance(ids, torch.Tensor) or ids.device != self.device or ids.dtype != torch.int64 or ids.dim() != 1:
            raise ValueError(f"kept ids must be a 1-D int64 tensor on {self.device}")
        if kept.weight is not None:
            raise ValueError("weighted (carried) calls are on the host: count them with count_rows")

    def _wait(self, after: torch.cuda.Event | None) -> None:
        if after is None:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
        else:
            self.stream.wait_event(after)

    def _count(self, job: _Count, ids: torch.Tensor, after: torch.cuda.Event | None, read: torch.cuda.Event) -> None:
        """Phase 1: keys, sort and compaction on the side stream, `u` copied to the slot's host memory."""
        layout = job.layout
        meta_shape = tuple(int(d) for d in layout.meta.shape)
        meta_host, job.u_host = job.buffer.views([(torch.int64, meta_shape), (torch.int64, (1,))])
        meta_host.numpy()[:] = layout.meta
        self._wait(after)
        ids.record_stream(self.stream)  # made on another stream: not reused before the side stream is past it
        with torch.cuda.stream(self.stream):
            # made here and read here only: freed back to this stream's pool, in stream order
            meta = meta_host.to(self.device, non_blocking=True)
            keys = build_keys(ids, meta, layout)
            read.record(self.stream)
            unique, counts, u = compact_sorted(torch.sort(keys).values)
            job.u_host.copy_(u, non_blocking=True)
            job.event = torch.cuda.Event()
            job.event.record(self.stream)
        job.device_out = (unique, counts, u, ids)

    def _copy_rows(self, job: _Count) -> None:
        """Phase 2: the first `u` keys and counts into the slot's host memory."""
        u = int(job.u_host.numpy()[0])
        unique, counts = job.device_out[:2]
        keys_host, counts_host = job.buffer.views([(unique.dtype, (u,)), (torch.int32, (u,))])
        with torch.cuda.stream(self.stream):
            keys_host.copy_(unique[:u], non_blocking=True)
            counts_host.copy_(counts[:u], non_blocking=True)
            job.event = torch.cuda.Event()
            job.event.record(self.stream)
        job.device_out = (unique, counts)
        job.host_out = (keys_host, counts_host)

    def _finish(self, job: _Count) -> None:
        keys_host, counts_host = job.host_out
        job.result = decode(job.layout, keys_host.numpy(), counts_host.numpy())
        job.device_out, job.host_out, job.u_host = (), None, None
        self._free.append(job.buffer)
        job.buffer = None

    def _advance(self) -> None:
        """Move every job whose running phase has ended on to its next one."""
        for job in self._jobs:
            if job.result is not None or not job.event.query():
                continue
            if job.host_out is None:
                self._copy_rows(job)
            else:
                self._finish(job)

    def ready(self) -> list[Counted]:
        """The counts of the submitted `Kept`s that are done, in submission order, after those returned
        before; moves the others on. Never waits for the device."""
        self._advance()
        out = []
        while self._jobs and self._jobs[0].result is not None:
            out.append(self._jobs.popleft().result)
        return out

    def pending_lookups(self) -> int:
        """The ids of the submitted `Kept`s not yet returned, padding ids included (the host cannot tell
        them from others before the device has counted)."""
        return sum(job.layout.ids for job in self._jobs)

    def copy_to_host(self, tensors: Sequence[torch.Tensor], after: torch.cuda.Event | None) -> HostCopy | None:
        """Copy `tensors` (on this device) to pinned host memory on the side stream once the device has
        passed `after` (None: all work queued on the calling thread's current stream now). None where no
        slot of the ring is free (or the counter is closed)."""
        tensors = list(tensors)
        if any(t.device != self.device for t in tensors):
            raise ValueError(f"copy_to_host copies tensors on {self.device}")
        if self._closed or not self._free:
            return None
        buffer = self._free.pop()
        views = buffer.views([(t.dtype, tuple(t.shape)) for t in tensors])
        self._wait(after)
        for t in tensors:
            t.record_stream(self.stream)
        with torch.cuda.stream(self.stream):
            for view, t in zip(views, tensors):
                view.copy_(t, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        return HostCopy(self, buffer, views, tensors, event)

    def close(self) -> list[Counted]:
        """At process exit: waits for the side stream and returns the counts of every submitted `Kept`
        not yet returned, in submission order. Later submits and copies are refused."""
        self._closed = True
        self.stream.synchronize()
        self._advance()  # phase 1 done everywhere: phase 2 queued
        self.stream.synchronize()
        return self.ready()

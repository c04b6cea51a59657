"""Lookup calls on a CUDA device, kept and counted without stalling the training stream.

On an accelerator the training thread keeps, per lookup call, only a reference to its ids (and on
sampled steps to its offsets) with the ids' version counter, and records one event per step at the
step's end. Nothing is copied, launched or synchronised on the training thread.

The writer thread, at each drain, takes the calls of the steps whose end event exists and hands them
to a `DeviceCounter` (collectors/device_counting.py): on its low-priority side stream, which waits on
the last of those events, the calls' ids are joined, keyed, sorted and compacted, and come back
through a bounded ring of pinned buffers; the writer polls events and never waits. Sampled calls'
ids and offsets come back the same way for the `lookups` rows. What cannot be counted is counted as
lost, never silently dropped:
- the ring is full (the side stream is behind): the calls' ids;
- the program wrote into a call's ids in place before they were counted (its version moved): that
  call's ids, since what the buffer holds now is another step's.
"""

from __future__ import annotations

import collections
from typing import Any, Callable, Iterator

import numpy as np
import torch

from collectors.counting import PHASES, Kept, Table
from collectors.device_counting import DeviceCounter, HostCopy


class DeviceStaging:
    """The calls of one CUDA device: `keep` and `on_step_end` on the training thread, `drain` on the
    writer's. `lost(table, rows)` counts what cannot be written (for `accesses`, ids); `make_call(step, phase, table index,
    ids, offsets, sources)` makes the collector's sampled-call object from host tensors."""

    def __init__(self, device: torch.device, lost: Callable[[int], None], make_call: Callable[..., Any]) -> None:
        self.device = device
        self.counter = DeviceCounter(device)
        self._lost = lost
        self._make_call = make_call
        self._calls: collections.deque[tuple] = collections.deque()  # (step, table, phase, ids, version, layout)
        self._events: collections.deque[tuple[int, torch.cuda.Event]] = collections.deque()  # (step, its end)
        self._last_step_kept = -1
        self._copies: collections.deque[tuple[HostCopy, list[tuple]]] = collections.deque()  # sampled calls coming back

    def keep(self, step: int, table: int, call_phase: str, ids: torch.Tensor, layout: tuple | None) -> None:
        """Keep a reference to one call's ids; `layout` on sampled steps only: (the ids' shape, a reference
        to their bag offsets or None, the offsets' version, the call's `tracekit.sources` or None)."""
        version = None  # a copy's: no one else writes it (inference tensors keep no version)
        if ids.is_inference():
            ids = ids.clone()
        else:
            version = ids._version
        self._calls.append((step, table, call_phase, ids, version, layout))
        self._last_step_kept = step

    def on_step_end(self, step: int) -> None:
        if self._last_step_kept == step:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))
            self._events.append((step, event))

    def drain(self, final: bool, tables: list[Table], phase_after_close: Callable[[int, str], str]
              ) -> Iterator[tuple[str, Any]]:
        """("taken", ids) for the ids handed to the side stream now, ("counted", Counted) for counts that
        are back, ("sampled", [calls]) for sampled calls whose ids are back. The calls of steps whose
        end event is recorded (all of them if `final`, their phase after `phase_after_close`) are
        handed over; at `final` it waits for the side stream, the program being done."""
        calls = self._calls
        if final and calls:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))
            self._events.append((calls[-1][0], event))
        last, taken = None, []
        while self._events:
            step, last = self._events.popleft()
            while calls and calls[0][0] <= step:
                taken.append(calls.popleft())
        if final:
            taken = [(s, t, phase_after_close(s, p), *rest) for s, t, p, *rest in taken]
        if taken:
            yield "taken", sum(c[3].numel() for c in taken)
            self._submit(taken, last, tables)
        for counted in (self.counter.close() if final else self.counter.ready()):
            yield "counted", counted
        while self._copies and (final or self._copies[0][0].done()):
            copy, sampled = self._copies.popleft()
            yield "sampled", self._sampled_calls(copy, sampled)

    def _submit(self, calls: list[tuple], after: torch.cuda.Event, tables: list[Table]) -> None:
        whole = [c for c in calls if c[4] is None or c[3]._version == c[4]]
        overwritten = sum(c[3].numel() for c in calls if c[4] is not None and c[3]._version != c[4])
        if overwritten:
            self._lost("accesses", overwritten)
        if not whole:
            return
        stream = self.counter.stream
        stream.wait_event(after)
        for c in whole:
            c[3].record_stream(stream)  # made on the training stream: not reused before the side stream is past it
        with torch.cuda.stream(stream):
            ids = torch.cat([c[3].reshape(-1).to(torch.int64) for c in whole])
            kept = Kept(ids, *(np.array(column, dtype=np.int64) for column in (
                [c[0] for c in whole], [c[1] for c in whole], [PHASES.index(c[2]) for c in whole],
                [c[3].numel() for c in whole])))
            if self.counter.submit(kept, tables, after=None) is None:
                self._lost("accesses", ids.numel())
                return
            sampled = [c for c in whole if c[5] is not None]
            if sampled:
                tensors = [t for c in sampled for t in (c[3], c[5][1]) if t is not None]
                copy = self.counter.copy_to_host(tensors, after=None)
                if copy is None:
                    self._lost("lookups", sum(c[3].numel() for c in sampled))
                else:
                    self._copies.append((copy, sampled))

    def _sampled_calls(self, copy: HostCopy, calls: list[tuple]) -> list:
        arrays = iter(copy.arrays())
        out = []
        for step, table, call_phase, _, _, (shape, offsets, _, sources) in calls:
            ids = torch.from_numpy(next(arrays)).reshape(shape)
            bags = None
            if offsets is not None:
                bags = torch.from_numpy(next(arrays)).to(torch.int64)
                bags = bags - bags[:1]
            out.append(self._make_call(step, call_phase, table, ids, bags, sources))
        return out

    def pending_lookups(self) -> int:
        """Ids kept or counting and not yet back (padding ids included)."""
        return sum(c[3].numel() for c in self._calls) + self.counter.pending_lookups()

"""Lookup calls on the host, kept for the writer at the cost of a few list appends a call.

Per lookup call the training thread notes the call (its table, phase, number of ids, the ids' version
counter) and keeps a reference to its ids until the step ends. At the step's end (and mid-step once a
step holds more than `SPILL_IDS` ids) one `torch.cat` copies the step's ids into a chunk of a few
reused int64 tensors, the sampled calls' bag offsets are copied too, and the references are let go.
No Python object of a call outlives its step: the garbage collector's full passes, which a second of
held tensors brought on every few seconds (100–150 ms each over a trainer's heap), and the memory the
trainer could not reuse both stay as they are untraced (bench/RESULTS.md §35). The writer thread takes
the filled chunks' ids as one array and hands the chunks back for reuse.

What cannot be written is counted as lost, never written wrong: a call whose ids the program rewrote
in place before its step ended (its version moved) loses its ids, and its table's later calls are
copied at the call instead; a sampled call whose offsets were rewritten loses its lookups. A program
that refills one id buffer for each batch loses nothing: its ids are copied before the next batch.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch

from collectors.counting import Kept
from tracekit.phases import EVAL, TRAIN

SPILL_IDS = 1 << 18  # ids a step holds by reference before they are copied mid-step
CHUNK_IDS = 1 << 20  # int64 ids a reused chunk holds (8 MB)
FIELDS = 6  # a kept call's values: ids, step, table index, eval, the ids' version, their number


def version_of(tensor: torch.Tensor | None) -> int | None:
    """The version counter of `tensor`, which moves when it is written in place; None for no tensor or
    an inference tensor (which keeps none; reading it raises, which is cheaper than asking is_inference())."""
    if tensor is None:
        return None
    try:
        return tensor._version
    except RuntimeError:
        return None


@dataclass
class Spilled:
    """The calls one spill copied: their ids at `chunk[start:start + sum(size)]`, and per call its step,
    table index, phase (True: eval) and number of ids, as the training thread's lists (the writer makes
    arrays of them); `layouts` for sampled calls: (the call's position, its ids' shape, a reference to
    its bag offsets, copied, or None, its `tracekit.sources` or None)."""

    chunk: torch.Tensor
    start: int
    step: list[int]
    table: list[int]
    eval: list[bool]
    size: list[int]
    layouts: list[tuple]


class HostStaging:
    """The host's lookup calls: `keep`, `spill` (at each step's end) on the training thread, `take` on
    the writer's. `lost(table, rows)` counts what cannot be written."""

    def __init__(self, lost: Callable[[str, int], None]) -> None:
        self._lost = lost
        self.copying: set[int] = set()  # tables whose program rewrites its id buffer in place: copied at the call
        # the calls of the running step end to end, FIELDS values each: one list, one extend a call
        self._calls: list = []
        self._layouts: list[tuple] = []
        self.held = 0  # ids in `_calls`
        self.spilled: collections.deque[Spilled] = collections.deque()  # appended here, popped by the writer
        self._chunk = torch.empty(0, dtype=torch.int64)
        self._used = self._capacity = 0  # ids of the chunk filled, and its length
        self._spare: collections.deque[torch.Tensor] = collections.deque()  # chunks the writer is done with
        self._last_taken: torch.Tensor | None = None  # the chunk of the last spill the writer took

    def keep(self, step: int, table: int, call_phase: str, ids: torch.Tensor, n: int,
             layout: tuple | None, copy: bool) -> None:
        """Keep one call of `n` ids: a reference to them (a copy if `copy`, or for an inference tensor,
        which keeps no version); `layout` on sampled steps: (shape, offsets, the offsets' version, the
        call's `tracekit.sources` or None)."""
        version = None if copy else version_of(ids)
        if version is None:
            ids = ids.clone()
        if layout is not None:
            self._layouts.append((len(self._calls) // FIELDS, *layout))
        self._calls += (ids if ids.dim() == 1 else ids.reshape(-1), step, table, call_phase == EVAL, version, n)
        self.held += n
        if self.held > SPILL_IDS:
            self.spill()

    def spill(self) -> None:
        """Copy the kept calls' ids into a chunk and let go of them (at each step's end)."""
        calls, layouts = self._calls, self._layouts
        if not calls:
            return
        self._calls, self._layouts, self.held = [], [], 0
        ids, step, table, is_eval, version, size = (calls[f::FIELDS] for f in range(FIELDS))
        moved = [i for i, t in enumerate(ids) if version[i] is not None and t._version != version[i]]
        if moved:  # rewritten in place since the call: lost, and the table's later calls copied at the call
            self._lost("accesses", sum(size[i] for i in moved))
            self.copying.update(table[i] for i in moved)
            keep = sorted(set(range(len(ids))) - set(moved))
            position = {old: new for new, old in enumerate(keep)}
            layouts = [(position[lay[0]], *lay[1:]) for lay in layouts if lay[0] in position]
            ids, step, table, is_eval, size = ([column[i] for i in keep] for column in (ids, step, table, is_eval, size))
            if not ids:
                return
        total = sum(size)
        try:
            chunk, start = self._room(total)
            torch.cat(ids, out=chunk[start:start + total])
        except Exception:  # the references are gone: the ids are lost, and said so
            self._lost("accesses", total)
            raise
        if layouts:
            layouts = self._copied_offsets(layouts, size)
        self.spilled.append(Spilled(chunk, start, step, table, is_eval, size, layouts))

    def _copied_offsets(self, layouts: list[tuple], size: list[int]) -> list[tuple]:
        """The sampled calls' layouts with their bag offsets copied; a call whose offsets were rewritten
        in place since loses its lookups."""
        out = []
        for i, shape, offsets, version, sources in layouts:
            if offsets is not None:
                if version is not None and offsets._version != version:
                    self._lost("lookups", size[i])
                    continue
                offsets = offsets.clone()
            out.append((i, shape, offsets, sources))
        return out

    def _room(self, n: int) -> tuple[torch.Tensor, int]:
        """A chunk with `n` ids free from the returned position on: the current one, a spare, or new."""
        if n > CHUNK_IDS:
            return torch.empty(n, dtype=torch.int64), 0
        if self._used + n > self._capacity:
            self._chunk = self._spare.popleft() if self._spare else torch.empty(CHUNK_IDS, dtype=torch.int64)
            self._used, self._capacity = 0, CHUNK_IDS
        start, self._used = self._used, self._used + n
        return self._chunk, start

    def take(self, everything: bool, current: int, make_call: Callable[..., Any]) -> tuple[Kept | None, list]:
        """The spilled calls of the steps before `current` (all if `everything`) as one `Kept` (their ids
        copied out of the chunks, which go back for reuse), and the sampled ones as `make_call(step,
        phase, table index, ids, offsets from 0, sources)`."""
        taken = []
        while self.spilled and (everything or self.spilled[0].step[0] < current):
            taken.append(self.spilled.popleft())
        if not taken:
            return None, []
        ids = [s.chunk.numpy()[s.start:s.start + sum(s.size)] for s in taken]
        joined = np.concatenate(ids) if len(ids) > 1 else ids[0].copy()
        for s in taken:  # a chunk before the last one taken is done: the training thread fills later ones
            if s.chunk is not self._last_taken:
                if self._last_taken is not None and self._last_taken.numel() == CHUNK_IDS:
                    self._spare.append(self._last_taken)
                self._last_taken = s.chunk
        kept = Kept(joined, *(np.array([v for s in taken for v in getattr(s, f)], dtype=np.int64)
                              for f in ("step", "table", "eval", "size")))
        sampled, base = [], 0
        for s, part in zip(taken, ids):
            if s.layouts:
                starts = np.cumsum(s.size) - s.size
                for i, shape, offsets, sources in s.layouts:
                    lo = base + int(starts[i])
                    call_ids = torch.from_numpy(joined[lo:lo + s.size[i]]).reshape(shape)
                    if offsets is not None:
                        bags = offsets.numpy().astype(np.int64)
                        offsets = torch.from_numpy(bags - bags[:1])
                    sampled.append(make_call(s.step[i], EVAL if s.eval[i] else TRAIN, s.table[i], call_ids, offsets,
                                             sources))
            base += len(part)
        return kept, sampled

"""The embedding collector's kept calls, between the training thread that keeps them and the writer
thread that counts them.

On the training thread, `stage` notes a call and keeps its ids: on the host (collectors/host_staging.py:
ids rewritten in place before the step ends are counted as lost, never written wrong) or on a CUDA
device, where they are counted on a side stream (collectors/device_staging.py); `keep_tables` keeps a
call of several tables whole (a `TablesCall`). No more than `max_pending_ids` ids are held for the
writer: a call beyond that is counted as dropped `accesses`. Once more than the writer's `flush_rows`
ids wait, the writer is woken.

On the writer thread, `drain` (a `RunWriter` source) takes the calls of finished steps in bulk at
every flush, counts them in pieces (collectors/counting.py) and turns them into `accesses` rows, one
per (step, phase, table, row), and `lookups` rows of sampled steps (collectors/lookups.py), whose
`src` and `src_sample` come from the `tracekit.sources` a sampled call was made in, read when it is
kept (one ContextVar read per sampled call; none on other steps). A step's
calls are written once the clock has moved past it; calls after the last step (an evaluation pass)
are written at close under the step the clock shows then, as `eval`. A step holding more than the
writer's `flush_rows` ids is counted as it comes and written once it has ended.
"""

from __future__ import annotations

import collections
from typing import Any, Iterator

import numpy as np
import torch

from collectors.counting import PHASES, PIECE_IDS, Kept, Table, carried, columns, count_rows
from collectors.device_staging import DeviceStaging
from collectors.host_staging import HostStaging, version_of
from collectors.lookups import Call, TablesCall, lookup_rows, lookup_sources
from collectors.steps import StepClock
from tracekit.phases import EVAL
from tracekit.sources import Sources, current_sources
from tracekit.store import RunWriter


def _source_columns(groups: list[list[Call]], found: list[tuple[np.ndarray, ...]]) -> dict[str, np.ndarray]:
    """`src` and `src_sample` of the lookups `lookup_rows` found for each table's calls; none where no
    call declared its sources (the store then writes both columns null)."""
    declared = [lookup_sources(calls, rows[1]) for calls, rows in zip(groups, found)]
    if all(d is None for d in declared):
        return {}
    pairs = [d if d is not None else (np.ma.masked_all(len(rows[1]), np.int32),) * 2 for d, rows in zip(declared, found)]
    return {"src": np.ma.concatenate([p[0] for p in pairs]), "src_sample": np.ma.concatenate([p[1] for p in pairs])}


def _by_table(calls: list[Call]) -> dict[tuple[Table, str], list[Call]]:
    """Calls grouped by (table, phase)."""
    groups: dict[tuple[Table, str], list[Call]] = {}
    for call in calls:
        groups.setdefault((call.table, call.phase), []).append(call)
    return groups


class Staging:
    """The calls kept for the writer (module docstring). The writer keeps draining them until it is
    closed, so calls kept before the collector is uninstalled are still written."""

    def __init__(self, writer: RunWriter, clock: StepClock, tables: list[Table], max_pending_ids: int) -> None:
        self.writer = writer
        self.clock = clock
        self.max_pending_ids = max_pending_ids  # held for the writer before a call's ids are shed
        self._table_list = tables  # the collector's tables by Table.index (TableIdentity.table_list, which grows)
        self._host = HostStaging(self.writer.count_dropped)  # the calls on the host (collectors/host_staging.py)
        self._tables_calls: collections.deque[TablesCall] = collections.deque()  # appended here, popped by the writer
        self._woken = False  # the writer was woken for held ids and has not drained since
        self._ids_added = 0  # written by the training thread only
        self._step_ids = 0  # ids kept in the step now running (training thread)
        self._ids_drained = 0  # written by the writer thread only
        self._carry: Kept | None = None  # counts of a step still running when a drain took its calls
        self._taken: list[Kept] = []  # what the running drain has taken and not handed over (in_flight)
        self._sampled_taken: list[Call] = []
        self._devices: dict[torch.device, DeviceStaging] = {}  # calls on CUDA devices, by device

    def stage(self, table: Table, ids: torch.Tensor, offsets: torch.Tensor | None, call_phase: str,
               sampled: bool, copy: bool = False) -> None:
        """Note the call and keep its ids (a copy if `copy`, or where the program rewrote its id buffer
        in place within a step) for the host's or the device's staging."""
        n = ids.numel()
        if self._ids_added - self._ids_drained + n > self.max_pending_ids:
            self.writer.count_dropped("accesses", n)
            return
        if ids.is_cpu or not ids.is_cuda:
            if not ids.is_cpu:
                ids = ids.cpu()
            layout = (ids.shape, offsets.clone() if copy and offsets is not None else offsets,
                      None if copy else version_of(offsets), current_sources.get()) if sampled else None
            self._host.keep(self.clock.step, table.index, call_phase, ids, n, layout,
                            copy or table.index in self._host.copying)
        else:
            layout = (ids.shape, offsets, version_of(offsets), current_sources.get()) if sampled else None
            self._device_staging(ids.device).keep(self.clock.step, table.index, call_phase, ids, layout)
        self._ids_added += n
        self._step_ids += n
        if not self._woken and self._ids_added - self._ids_drained > self.writer.flush_rows:
            self._wake()

    def _device_staging(self, device: torch.device) -> DeviceStaging:
        """The staging of `device`'s calls (collectors/device_staging.py), made at its first call."""
        staging = self._devices.get(device)
        if staging is None:
            staging = self._devices[device] = DeviceStaging(device, self.writer.count_dropped, self._sampled_call)
            self.clock.add_listener(staging)
        return staging

    def _sampled_call(self, step: int, call_phase: str, table: int, ids: torch.Tensor,
                      offsets: torch.Tensor | None, sources: Sources | None) -> Call:
        return Call(step, call_phase, self._table_list[table], ids, offsets, True, sources=sources)

    def end_step(self) -> None:
        """Copy the step's ids out of the program's tensors, and start the next step's count of ids."""
        try:
            self._host.spill()
        finally:
            self._step_ids = 0

    def keep_tables(self, tables: list[Table | None], cuts: list[int], ids: torch.Tensor, offsets: torch.Tensor,
                    bounds: list[int], call_phase: str, sampled: bool) -> None:
        """Keep one call looking up several tables made now (a `TablesCall`; `ids` already a copy of the
        collector's own, `offsets` copied if `sampled`): the per-table work is left to the writer."""
        if self._held_full(ids.numel()):
            return
        self._tables_calls.append(TablesCall(self.clock.step, call_phase, tables, cuts, ids,
                                             offsets.clone() if sampled else None, bounds))
        self._ids_added += ids.numel()
        self._step_ids += ids.numel()
        if not self._woken and self._ids_added - self._ids_drained > self.writer.flush_rows:
            self._wake()

    def _wake(self) -> None:
        """Wake the writer, once more than `flush_rows` ids wait, and not again until it has drained:
        a wake on every call while it has not run yet (under SCHED_IDLE, on a busy core) would hand
        it the GIL and a lock call by call (bench/RESULTS.md §30)."""
        self._woken = True
        self.writer.wake()

    def _held_full(self, n: int) -> bool:
        """Whether keeping `n` more ids would hold more than `max_pending_ids` for the writer: they are
        then counted as dropped `accesses` (inline in `stage`, the hot path)."""
        if self._ids_added - self._ids_drained + n > self.max_pending_ids:
            self.writer.count_dropped("accesses", n)
            return True
        return False

    def drain(self, final: bool) -> Iterator[tuple[str, dict[str, Any]]]:
        """The calls of steps the clock has left (all of them if `final`) as `accesses` and `lookups`
        columns. Where the running step holds more than `flush_rows` ids, its calls are taken too and
        counted, but their counts are carried to the next drain (`counting.carried`): no (step, table,
        row) is written in two rows. While it runs, `in_flight()` says what it has taken and not yet
        handed over, so a drain that fails counts those as lost."""
        everything = final or self._step_ids > self.writer.flush_rows  # a step larger than a flush
        self._woken = False
        current = self.clock.step  # read first: the calls of steps before it are final
        if final:  # the calls since the last step's end (the training thread spills them at each step's end)
            self._host.spill()
        kept, sampled = self._take_calls(everything, current)
        for call in self._take_tables_calls(everything, current):
            kept.append(Kept.of_calls([call]))
            if call.sampled:
                sampled.append(call)
        if self._carry is not None:
            kept.append(self._carry)
            self._carry = None
        self._taken, self._sampled_taken = list(kept), list(sampled)
        for staging in list(self._devices.values()):
            for kind, value in staging.drain(final, self._table_list, self.clock.phase_after_close):
                if kind == "taken":
                    self._ids_drained += value
                elif kind == "counted":
                    yield "accesses", value.columns()
                else:
                    sampled += value
        if final:  # the calls after the last step, which no step end followed, are `eval`
            for k in kept:
                k.phase[(k.step == self.clock.step) & (self.clock.step > 0)] = PHASES.index(EVAL)
            for call in sampled:
                call.phase = self.clock.phase_after_close(call.step, call.phase)
        if kept:
            yield from self._counted(Kept.joined(kept), None if final else current)
        self._taken = []
        groups = _by_table(sampled)
        if groups:
            found = [lookup_rows(group_calls) for group_calls in groups.values()]
            step, sample, pos, row, feature = (np.concatenate(column) for column in zip(*found))
            yield "lookups", columns(list(groups), [len(f[0]) for f in found], step=step,
                                     sample=sample.astype(np.int32), pos=pos.astype(np.int32), row=row,
                                     feature=feature, **_source_columns(list(groups.values()), found))
        self._sampled_taken = []

    def _counted(self, whole: Kept, running: int | None) -> Iterator[tuple[str, dict[str, Any]]]:
        """`accesses` columns of `whole`'s calls in pieces; those of step `running` and later (None:
        none) counted and carried to the next drain instead."""
        self._taken = [whole]
        if running is not None:
            whole, later = whole.split_at(running)
            self._taken = [whole, later]
            if len(later.size):
                self._carry = carried(count_rows(later, self._table_list))
        pieces = list(whole.pieces(PIECE_IDS))
        for i, piece in enumerate(pieces):
            self._taken = pieces[i:]
            yield "accesses", count_rows(piece, self._table_list).columns()

    def in_flight(self) -> dict[str, int]:
        """Lookups (padding ids left out) the drain running now has taken and not handed over, per
        trace table: the writer counts them as lost if the drain fails."""
        padding = np.array([-1 if t.padding_idx is None else t.padding_idx for t in self._table_list], dtype=np.int64)
        on_devices = sum(staging.pending_lookups() for staging in self._devices.values())
        return {"accesses": on_devices + sum(k.lookups - k.padding_lookups(padding) for k in self._taken),
                "lookups": sum(c.ids.numel() if c.table.padding_idx is None else int((c.ids != c.table.padding_idx).sum())
                               for c in self._sampled_taken)}

    def _take_calls(self, everything: bool, current: int) -> tuple[list[Kept], list[Call]]:
        """The host's calls of the steps before `current` (all if `everything`) as one `Kept`, and the
        sampled ones as `Call`s (collectors/host_staging.py)."""
        kept, sampled = self._host.take(everything, current, self._sampled_call)
        if kept is None:
            return [], []
        self._ids_drained += int(kept.size.sum())
        return [kept], sampled

    def _take_tables_calls(self, everything: bool, current: int) -> list[Call]:
        calls = []
        while self._tables_calls and (everything or self._tables_calls[0].step < current):
            taken = self._tables_calls.popleft()
            self._ids_drained += taken.ids.numel()  # as added: features of no recorded table too
            calls += taken.split()
        return calls

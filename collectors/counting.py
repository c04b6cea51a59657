"""Counting kept lookup calls into `accesses` rows, exactly, however the calls fall into flushes.

The embedding collector (collectors/embedding.py) keeps each lookup call's ids and hands the writer
thread a `Kept`: the ids of many calls end to end, with each call's step, table, phase and size.
`count_rows` turns a `Kept` into `accesses` rows, one per (step, phase, table, row). Two rules keep
those rows whole:
- `Kept.pieces` cuts a flush into pieces of about `PIECE_IDS` ids at call boundaries, and never puts
  two calls of one (step, table, phase) into different pieces, so no count is split between two rows
  (a step larger than a piece is cut between its tables);
- a flush that has to take the running step's calls (a step of more ids than a flush) counts them
  but does not write them: `carried` turns the counts into a `Kept` whose ids stand for `weight`
  lookups each, and the next flush counts it together with the rest of that step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator

import numpy as np
import pyarrow as pa
import torch

from tracekit.phases import EVAL, TRAIN

PHASES = (TRAIN, EVAL)  # a kept call's phase code is its index here
PIECE_IDS = 1 << 18  # ids the writer counts at once (bench/RESULTS.md §30)
CPU = torch.device("cpu")


@dataclass(frozen=True, eq=False)
class Table:
    """What the collector needs of a table module, fixed at its first call."""

    name: str
    num_rows: int  # the module's own rows: ids are below it
    padding_idx: int | None  # a module row
    first_row: int  # the table's row that the module's row 0 holds
    index: int = 0  # its place in the handle's tables (kept calls name their table by it)


@dataclass
class Kept:
    """Calls one drain took, on one device: their ids end to end (a numpy array on CPU, where the
    writer counts with numpy; a tensor on an accelerator), and per call its step, table
    (`Table.index`), phase (index in PHASES) and number of ids. `weight`, where given, is how many
    lookups each id stands for (counts carried from an earlier flush); otherwise each id is one."""

    ids: np.ndarray | torch.Tensor  # 1-D int64
    step: np.ndarray
    table: np.ndarray
    phase: np.ndarray
    size: np.ndarray
    weight: np.ndarray | None = None  # int64, one per id, on CPU

    @property
    def device(self) -> torch.device:
        return self.ids.device if isinstance(self.ids, torch.Tensor) else CPU

    @property
    def lookups(self) -> int:
        """The lookups these calls stand for."""
        return int(self.size.sum()) if self.weight is None else int(self.weight.sum())

    def padding_lookups(self, padding: np.ndarray) -> int:
        """Of `lookups`, those of ids equal to their table's `padding[table]` (-1: none)."""
        if not len(self.size) or (padding[self.table] < 0).all():
            return 0
        ids = self.ids if isinstance(self.ids, np.ndarray) else self.ids.cpu().numpy()
        is_padding = ids == np.repeat(padding[self.table], self.size)
        return int(is_padding.sum() if self.weight is None else self.weight[is_padding].sum())

    @staticmethod
    def of_ids(ids: torch.Tensor, step: np.ndarray, table: np.ndarray, phase: np.ndarray, size: np.ndarray) -> Kept:
        return Kept(ids.numpy() if ids.device.type == "cpu" else ids, step, table, phase, size)

    @staticmethod
    def of_calls(calls: list) -> Kept:
        """Calls (anything with step, phase, table, ids) one after another."""
        return Kept.of_ids(torch.cat([c.ids.reshape(-1).to(torch.int64) for c in calls]),
                           np.array([c.step for c in calls], dtype=np.int64),
                           np.array([c.table.index for c in calls], dtype=np.int64),
                           np.array([PHASES.index(c.phase) for c in calls], dtype=np.int64),
                           np.array([c.ids.numel() for c in calls], dtype=np.int64))

    def calls(self, lo: int, hi: int) -> Kept:
        """Calls lo to hi (exclusive), a view."""
        ends = np.cumsum(self.size)
        first, last = (int(ends[lo - 1]) if lo else 0), (int(ends[hi - 1]) if hi else 0)
        return Kept(self.ids[first:last], self.step[lo:hi], self.table[lo:hi], self.phase[lo:hi], self.size[lo:hi],
                    None if self.weight is None else self.weight[first:last])

    def take(self, calls: np.ndarray) -> Kept:
        """The calls at the (increasing) positions `calls`, their ids gathered end to end."""
        starts = np.cumsum(self.size) - self.size
        size = self.size[calls]
        index = np.repeat(starts[calls] - (np.cumsum(size) - size), size) + np.arange(int(size.sum()))
        ids = self.ids[index] if isinstance(self.ids, np.ndarray) else self.ids[torch.from_numpy(index).to(self.device)]
        return Kept(ids, self.step[calls], self.table[calls], self.phase[calls], size,
                    None if self.weight is None else self.weight[index])

    def split_at(self, step: int) -> tuple[Kept, Kept]:
        """(the calls of steps before `step`, the others), each in call order."""
        later = self.step >= step
        if not later.any():
            return self, self.take(np.zeros(0, dtype=np.int64))
        if later.all():
            return self.take(np.zeros(0, dtype=np.int64)), self
        return self.take(np.flatnonzero(~later)), self.take(np.flatnonzero(later))

    def pieces(self, ids: int) -> Iterator[Kept]:
        """The calls in pieces of about `ids` ids, cut at call boundaries: the calls of one (step,
        table, phase) are always in one piece, so counted apart no (step, table, row) is split
        between two, and each piece's sort and passes stay in cache. A piece is larger than `ids`
        only where one (step, table, phase) alone is."""
        total = int(self.size.sum())
        if len(self.size) < 2 or total <= ids:
            if len(self.size):
                yield self
            return
        groups = (self.step * int(self.table.max() + 1) + self.table) * len(PHASES) + self.phase
        _, group = np.unique(groups, return_inverse=True)  # ordered by step, then table
        group_ids = np.bincount(group, weights=self.size).astype(np.int64)
        opens = (np.cumsum(group_ids) - group_ids) // ids  # the piece each group opens in, non-decreasing
        _, piece_of_group = np.unique(opens, return_inverse=True)
        piece = piece_of_group[group]
        if (np.diff(piece) >= 0).all():  # each piece is a run of calls: views, no copy
            bounds = np.searchsorted(piece, np.arange(piece[-1] + 2))
            for lo, hi in zip(bounds[:-1], bounds[1:]):
                yield self.calls(int(lo), int(hi))
            return
        for p in range(int(piece.max()) + 1):
            yield self.take(np.flatnonzero(piece == p))

    @staticmethod
    def joined(parts: list[Kept]) -> Kept:
        """The parts end to end, on CPU if they are on different devices (one sort per flush, so that
        each (step, phase, table, row) is one row)."""
        if len(parts) == 1:
            return parts[0]
        devices = {k.device for k in parts}
        if len(devices) == 1 and CPU not in devices:
            ids = torch.cat([k.ids for k in parts])
        else:
            ids = np.concatenate([k.ids.cpu().numpy() if isinstance(k.ids, torch.Tensor) else k.ids for k in parts])
        weight = None
        if any(k.weight is not None for k in parts):
            weight = np.concatenate([np.ones(int(k.size.sum()), dtype=np.int64) if k.weight is None else k.weight
                                     for k in parts])
        return Kept(ids, *(np.concatenate([getattr(k, f) for k in parts]) for f in ("step", "table", "phase", "size")),
                    weight=weight)


@dataclass
class Counted:
    """`accesses` rows of several (table, phase) groups, whole: the first sizes[0] rows are groups[0]'s,
    and so on; within a group, unique (step, row), sorted."""

    groups: list[tuple[Table, str]]
    sizes: np.ndarray
    step: np.ndarray
    row: np.ndarray
    count: np.ndarray

    def columns(self) -> dict[str, Any]:
        return columns(self.groups, self.sizes, step=self.step, row=self.row, count=self.count)


def count_rows(kept: Kept, tables: list[Table]) -> Counted:
    """The `accesses` rows of each (table, phase) of the kept calls. One sort on the ids' device for
    all of them: of `base + (step - first step) * num_rows + row`, each group's keys above the bases
    of those before it, int32 keys where they fit (half the time of int64's; bench/RESULTS.md §19),
    so one sort of a flush beats one per table. Every per-call step is a numpy pass over the calls:
    no Python per call."""
    if not len(kept.size):
        return Counted([], np.zeros(0, dtype=np.int64), *(np.zeros(0, dtype=t) for t in (np.int64, np.int64, np.int32)))
    group, inverse = np.unique(kept.table * len(PHASES) + kept.phase, return_inverse=True)
    first = np.full(len(group), np.iinfo(np.int64).max)
    last = np.full(len(group), np.iinfo(np.int64).min)
    np.minimum.at(first, inverse, kept.step)
    np.maximum.at(last, inverse, kept.step)
    which = [tables[g // len(PHASES)] for g in group]
    num_rows = np.array([t.num_rows for t in which], dtype=np.int64)
    bases = np.concatenate([[0], np.cumsum((last - first + 1) * num_rows)])
    call_key = bases[inverse] + (kept.step - first[inverse]) * num_rows[inverse]
    padding = np.array([-1 if t.padding_idx is None else t.padding_idx for t in tables], dtype=np.int64)[kept.table]
    unique, counts = _unique_keys(kept, call_key, padding if (padding >= 0).any() else None, bases[-1] <= 2**31)
    cuts = np.searchsorted(unique, bases)
    # each (group, step) cell's keys start at its calls' key: its rows are one subtraction from there
    cell = np.unique(call_key)
    cell_group = np.searchsorted(bases, cell, side="right") - 1
    cell_step = first[cell_group] + (cell - bases[cell_group]) // num_rows[cell_group]
    first_row = np.array([t.first_row for t in which], dtype=np.int64)[cell_group]
    per_cell = np.diff(np.searchsorted(unique, cell), append=len(unique))
    step = np.repeat(cell_step, per_cell)
    row = np.subtract(unique, np.repeat(cell - first_row, per_cell), dtype=np.int64)
    return Counted([(t, PHASES[g % len(PHASES)]) for t, g in zip(which, group)], np.diff(cuts[:len(group) + 1]),
                   step, row, counts.astype(np.int32, copy=False))


def _unique_keys(kept: Kept, call_key: np.ndarray, padding: np.ndarray | None, small: bool) -> tuple[np.ndarray, np.ndarray]:
    """The distinct keys `id + call_key of its call` (ids equal to their call's `padding` left out) and
    their counts (each id's weight summed, where it has one), sorted; int32 keys where `small`. On CPU
    in numpy: its sort is 2-3x torch's here (AVX-512), and torch's CPU ops would start an OpenMP team
    on the writer thread whose spinning takes the cores from a rank that computes with several
    threads (bench/RESULTS.md §30)."""
    if isinstance(kept.ids, np.ndarray):
        dtype = np.int32 if small else np.int64
        key = np.add(kept.ids, np.repeat(call_key.astype(dtype), kept.size), dtype=dtype, casting="unsafe")
        weight = kept.weight
        if padding is not None:
            keep = kept.ids != np.repeat(padding, kept.size)
            key, weight = key[keep], None if weight is None else weight[keep]
        return _sorted_runs(key, weight)
    if kept.weight is not None:  # carried counts are on CPU: count there
        return _unique_keys(Kept(kept.ids.cpu().numpy(), kept.step, kept.table, kept.phase, kept.size, kept.weight),
                            call_key, padding, small)
    device, n = kept.ids.device, kept.ids.numel()
    sizes = torch.from_numpy(kept.size).to(device)
    key = kept.ids + torch.repeat_interleave(torch.from_numpy(call_key).to(device), sizes, output_size=n)
    if padding is not None:
        key = key[kept.ids != torch.repeat_interleave(torch.from_numpy(padding).to(device), sizes, output_size=n)]
    unique, counts = torch.unique(key.int() if small else key, return_counts=True)
    return unique.cpu().numpy(), counts.cpu().numpy()


def _sorted_runs(key: np.ndarray, weight: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The distinct keys, sorted, and how many times each occurs (or the sum of their `weight`):
    `np.unique(key, return_counts=True)` at a third of its time here. Torch's sort of a 1-D tensor (one
    row: it runs on this thread, no OpenMP team) is twice numpy's on this box's CPUs, and the runs are
    found in one numpy pass (bench/RESULTS.md §34)."""
    if not len(key):
        return key, np.zeros(0, dtype=np.int64)
    if weight is None:
        ordered = torch.sort(torch.from_numpy(key)).values.numpy()
    else:
        ordered, order = (t.numpy() for t in torch.sort(torch.from_numpy(key)))
    opens = np.empty(len(ordered), dtype=bool)
    opens[0] = True
    np.not_equal(ordered[1:], ordered[:-1], out=opens[1:])
    starts = np.flatnonzero(opens)
    counts = np.diff(starts, append=len(ordered)) if weight is None else np.add.reduceat(weight[order], starts)
    return ordered[starts], counts


def carried(counted: Counted) -> Kept:
    """Counted rows as calls to count again with later ones: one call per (table, phase, step), each id
    a module row weighted by its count."""
    n = len(counted.step)
    if not n:
        return Kept(np.zeros(0, dtype=np.int64), *(np.zeros(0, dtype=np.int64) for _ in range(4)),
                    weight=np.zeros(0, dtype=np.int64))
    group = np.repeat(np.arange(len(counted.groups)), counted.sizes)
    table = np.array([t.index for t, _ in counted.groups], dtype=np.int64)[group]
    first_row = np.array([t.first_row for t, _ in counted.groups], dtype=np.int64)[group]
    phase = np.array([PHASES.index(p) for _, p in counted.groups], dtype=np.int64)[group]
    opens = np.flatnonzero(np.r_[True, (np.diff(group) != 0) | (np.diff(counted.step) != 0)])
    return Kept(counted.row - first_row, counted.step[opens], table[opens], phase[opens],
                np.diff(np.r_[opens, n]), weight=counted.count.astype(np.int64))


def _dictionary(values: list[str], sizes: Any, index_type: pa.DataType) -> pa.DictionaryArray:
    """`values[i]` repeated `sizes[i]` times, dictionary-encoded."""
    unique = sorted(set(values))
    which = np.repeat(np.array([unique.index(v) for v in values], dtype=index_type.to_pandas_dtype()), sizes)
    return pa.DictionaryArray.from_arrays(pa.array(which, index_type), pa.array(unique, pa.string()))


def columns(groups: list[tuple[Table, str]], sizes: Any, **values: np.ndarray) -> dict[str, Any]:
    """Columns of several (table, phase) groups' rows, whole: the first sizes[0] rows are groups[0]'s,
    and so on."""
    return {"table_name": _dictionary([t.name for t, _ in groups], sizes, pa.int32()),
            "phase": _dictionary([p for _, p in groups], sizes, pa.int8()), **values}

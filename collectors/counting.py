"""Counting kept lookup calls into `accesses` rows, exactly, however the calls fall into flushes.

The embedding collector's staging (collectors/staging.py) keeps each lookup call's ids and hands the writer
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


@dataclass
class Keys:
    """How the kept calls' ids are keyed for one sort: id `i` of a call is `call_key + i`, where each
    (table, phase) group's keys lie above the bases of those before it: `bases[g] + (step - first[g])
    * num_rows + row`. `padding` is each call's table's padding row (-1: none), or None where no
    table has one."""

    groups: np.ndarray  # table index * len(PHASES) + phase, per group, increasing
    tables: list[Table]  # per group
    first: np.ndarray  # per group: its first step
    bases: np.ndarray  # per group, and the end of the last
    call_key: np.ndarray  # per call
    padding: np.ndarray | None  # per call

    @staticmethod
    def of(kept: Kept, tables: list[Table]) -> Keys:
        group, inverse = np.unique(kept.table * len(PHASES) + kept.phase, return_inverse=True)
        first = np.full(len(group), np.iinfo(np.int64).max)
        last = np.full(len(group), np.iinfo(np.int64).min)
        np.minimum.at(first, inverse, kept.step)
        np.maximum.at(last, inverse, kept.step)
        which = [tables[g // len(PHASES)] for g in group]
        num_rows = np.array([t.num_rows for t in which], dtype=np.int64)
        bases = np.concatenate([[0], np.cumsum((last - first + 1) * num_rows)]).astype(np.int64)
        call_key = bases[inverse] + (kept.step - first[inverse]) * num_rows[inverse]
        padding = np.array([-1 if t.padding_idx is None else t.padding_idx for t in tables], dtype=np.int64)[kept.table]
        return Keys(group, which, first, bases, call_key, padding if (padding >= 0).any() else None)

    @property
    def small(self) -> bool:
        """Whether every key fits in int32 (half the sort time of int64's; bench/RESULTS.md §19)."""
        return int(self.bases[-1]) <= 2**31

    def rows(self, unique: np.ndarray, counts: np.ndarray) -> Counted:
        """The `accesses` rows of the distinct keys `unique` (increasing) counted `counts` times."""
        cuts = np.searchsorted(unique, self.bases)
        # each (group, step) cell's keys start at its calls' key: its rows are one subtraction from there
        cell = np.unique(self.call_key)
        cell_group = np.searchsorted(self.bases, cell, side="right") - 1
        num_rows = np.array([t.num_rows for t in self.tables], dtype=np.int64)[cell_group]
        first_row = np.array([t.first_row for t in self.tables], dtype=np.int64)[cell_group]
        per_cell = np.diff(np.searchsorted(unique, cell), append=len(unique))
        step = np.repeat(self.first[cell_group] + (cell - self.bases[cell_group]) // num_rows, per_cell)
        row = np.subtract(unique, np.repeat(cell - first_row, per_cell), dtype=np.int64)
        return Counted([(t, PHASES[g % len(PHASES)]) for t, g in zip(self.tables, self.groups)],
                       np.diff(cuts[:len(self.groups) + 1]), step, row, counts.astype(np.int32, copy=False))


def count_rows(kept: Kept, tables: list[Table]) -> Counted:
    """The `accesses` rows of each (table, phase) of the kept calls: one sort on the ids' device of
    all their keys (`Keys`), so one sort of a flush beats one per table. Every per-call step is a
    numpy pass over the calls: no Python per call."""
    if not len(kept.size):
        return Counted([], np.zeros(0, dtype=np.int64), *(np.zeros(0, dtype=t) for t in (np.int64, np.int64, np.int32)))
    keys = Keys.of(kept, tables)
    return keys.rows(*_unique_keys(kept, keys.call_key, keys.padding, keys.small))


def _unique_keys(kept: Kept, call_key: np.ndarray, padding: np.ndarray | None, small: bool) -> tuple[np.ndarray, np.ndarray]:
    """The distinct keys `id + call_key of its call` (ids equal to their call's `padding` left out) and
    their counts (each id's weight summed, where it has one), sorted; int32 keys where `small`. On CPU
    in numpy (`_sorted_runs`); on an accelerator with torch, whose result `.cpu()` waits for (the
    collector counts CUDA calls with collectors/device_counting.py instead)."""
    if isinstance(kept.ids, np.ndarray):
        dtype = np.int32 if small else np.int64
        key = np.add(kept.ids, np.repeat(call_key.astype(dtype), kept.size), dtype=dtype, casting="unsafe")
        weight = kept.weight
        if weight is None:
            ordered = _sorted_by_cell(key, kept, call_key, padding)
            if ordered is not None:
                return _runs(ordered)
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


CELL_SORT_MAX = 1 << 16  # ids of the largest (step, table) a flush may sort row by row
CELL_SORT_SPREAD = 4  # ... and how much larger than the mean one it may be


def _sorted_by_cell(key: np.ndarray, kept: Kept, call_key: np.ndarray, padding: np.ndarray | None
                    ) -> np.ndarray | None:
    """`key` sorted (padding ids left out), or None where its cells are too uneven for this: each
    (step, table, phase) cell's keys lie in a range of their own, increasing with the cell's key, so
    the keys are sorted by putting each cell in a row of a 2-D array (padded with the dtype's largest
    value), sorting the rows and reading them in order. numpy sorts rows of a few hundred ids ~9x
    faster than the same ids in one 1-D sort on this box (bench/RESULTS.md §34)."""
    cells, cell_of_call = np.unique(call_key, return_inverse=True)
    per_cell = np.bincount(cell_of_call, weights=kept.size, minlength=len(cells)).astype(np.int64)
    width = int(per_cell.max()) if len(per_cell) else 0
    n = len(key)
    if not n or width > CELL_SORT_MAX or width * len(cells) > CELL_SORT_SPREAD * n:
        return None
    sentinel = np.iinfo(key.dtype).max
    if int(key.max()) >= sentinel:
        return None
    if padding is not None:
        key = np.where(kept.ids == np.repeat(padding, kept.size), sentinel, key)
    # where each call's ids start in its cell's row: after the calls of the same cell before it
    by_cell = np.argsort(cell_of_call, kind="stable")
    size = kept.size[by_cell]
    offset_in_cell = np.empty(len(size), dtype=np.int64)
    offset_in_cell[by_cell] = np.cumsum(size) - size - np.repeat((np.cumsum(per_cell) - per_cell), np.bincount(
        cell_of_call, minlength=len(cells)))
    start = cell_of_call * width + offset_in_cell  # the call's first slot in the flattened grid
    grid = np.full(len(cells) * width, sentinel, dtype=key.dtype)
    grid[np.repeat(start - (np.cumsum(kept.size) - kept.size), kept.size) + np.arange(n)] = key
    grid = grid.reshape(len(cells), width)
    grid.sort(axis=1)
    flat = grid.reshape(-1)
    return flat if len(flat) == n and padding is None else flat[flat != sentinel]


def _runs(ordered: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The distinct values of sorted `ordered` and how many times each occurs, in one pass."""
    if not len(ordered):
        return ordered, np.zeros(0, dtype=np.int64)
    opens = np.empty(len(ordered), dtype=bool)
    opens[0] = True
    np.not_equal(ordered[1:], ordered[:-1], out=opens[1:])
    starts = np.flatnonzero(opens)
    return ordered[starts], np.diff(starts, append=len(ordered))


def _sorted_runs(key: np.ndarray, weight: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The distinct keys, sorted, and how many times each occurs (or the sum of their `weight`): what
    `np.unique(key, return_counts=True)` gives. numpy, not torch: torch sorts a large 1-D tensor on an
    OpenMP team that the writer thread would start and leave spinning on a rank's cores
    (bench/RESULTS.md §30, §34)."""
    if weight is None:
        return _runs(np.sort(key))
    if not len(key):
        return key, np.zeros(0, dtype=np.int64)
    order = np.argsort(key)
    unique, counts = _runs(key[order])
    starts = np.cumsum(counts) - counts
    return unique, np.add.reduceat(weight[order], starts)


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

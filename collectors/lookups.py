"""Lookup calls as the writer thread takes them, and the `lookups` rows of the sampled ones.

A `Call` is one lookup call of one table; a `TablesCall` is one call of several tables at once (a
TorchRec/FBGEMM table-batched embedding's features, collectors/torchrec_tables.py), kept whole on the
training thread and split into `Call`s by the writer. `lookup_rows` turns a table's sampled calls into
the `lookups` columns: each id's `sample` (bag index of an EmbeddingBag, row of a 2-D [B, L] input,
dim-0 index of an N-D input, i for the i-th id of a 1-D nn.Embedding input) and `pos` (position in
the bag or sequence), padding ids left out; `lookup_sources` gives the same lookups their `src` and
`src_sample` where the call was made inside `tracekit.sources` (tracekit/sources.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from collectors.counting import Table
from tracekit.sources import Sources


@dataclass
class Call:
    """One lookup call, as kept for the writer thread."""

    step: int
    phase: str  # "train" | "eval" (collectors/phase.py)
    table: Table
    ids: torch.Tensor
    offsets: torch.Tensor | None  # only on sampled steps, for the lookups' positions
    sampled: bool
    feature: int = 0  # a TBE's feature of a table several look up: its order among them (TablesCall)
    sources: Sources | None = None  # the call's `tracekit.sources` declaration, on sampled steps


@dataclass
class TablesCall:
    """One call looking up several tables at once (a TBE's features), kept whole on the training thread
    and split into one `Call` per table by the writer: feature f looks up `tables[f]` (None: not
    recorded) with ids[cuts[f]:cuts[f + 1]] in the bags offsets[bounds[f]:bounds[f + 1] + 1] (the
    offsets are kept on sampled steps only, so a call with offsets is a sampled one)."""

    step: int
    phase: str
    tables: list[Table | None]
    cuts: list[int]
    ids: torch.Tensor
    offsets: torch.Tensor | None
    bounds: list[int]

    def split(self) -> list[Call]:
        calls = []
        for f, table in enumerate(self.tables):
            start, end = self.cuts[f], self.cuts[f + 1]
            if table is not None and end > start:
                bags = None
                if self.offsets is not None:
                    bags = self.offsets[self.bounds[f]:self.bounds[f + 1] + 1]
                    bags = bags - bags[:1]
                feature = sum(t is table for t in self.tables[:f])
                calls.append(Call(self.step, self.phase, table, self.ids[start:end], bags, bags is not None, feature))
        return calls


def lookup_ids(module: nn.Module, args: tuple, kwargs: dict) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The ids tensor of an Embedding/EmbeddingBag call, and its offsets (None if not given)."""
    ids = args[0] if args else kwargs["input"]
    offsets = None
    if isinstance(module, nn.EmbeddingBag):
        offsets = args[1] if len(args) > 1 else kwargs.get("offsets")
    return ids, offsets  # integer ids: no autograd history to leave behind


def positions(ids: torch.Tensor, offsets: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(sample, pos) of each id of `ids.reshape(-1)`, as int64 tensors on the ids' device."""
    n, device = ids.numel(), ids.device
    if ids.dim() == 1 and offsets is not None:  # bags: ids[offsets[b]:offsets[b + 1]] is bag b
        index = torch.arange(n, device=device)
        offsets = offsets.to(device=device, dtype=torch.int64)
        sample = torch.searchsorted(offsets, index, right=True) - 1
        return sample, index - offsets[sample]
    if ids.dim() <= 1:  # one id per sample
        return torch.arange(n, device=device), torch.zeros(n, dtype=torch.int64, device=device)
    batch = ids.shape[0]
    length = n // batch if batch else 0
    sample = torch.arange(batch, device=device).repeat_interleave(length)
    return sample, torch.arange(length, device=device).repeat(batch)


def lookup_rows(calls: list[Call]) -> tuple[np.ndarray, ...]:
    """(step, sample, pos, row, feature) of every non-padding lookup of one table's sampled calls."""
    if all(c.ids.dim() == 1 and c.offsets is not None and c.ids.device.type == "cpu" for c in calls):
        return _bag_rows(calls)
    parts = []
    for c in calls:
        sample, pos = positions(c.ids, c.offsets)
        rows = c.ids.reshape(-1).to(torch.int64)
        if c.table.padding_idx is not None:
            keep = rows != c.table.padding_idx
            sample, pos, rows = sample[keep], pos[keep], rows[keep]
        parts.append((np.full(rows.numel(), c.step, dtype=np.int64), *(t.cpu().numpy() for t in (sample, pos)),
                      rows.cpu().numpy() + c.table.first_row, np.full(rows.numel(), c.feature, dtype=np.int16)))
    return tuple(np.concatenate(column) for column in zip(*parts))


def _bag_rows(calls: list[Call]) -> tuple[np.ndarray, ...]:
    """`lookup_rows` of CPU bag calls (1-D ids, offsets from 0), in one pass over all of them: the
    writer holds the GIL for a few numpy calls rather than for a few torch calls per call."""
    rows = np.concatenate([c.ids.numpy() for c in calls]).astype(np.int64, copy=False)
    sizes = np.array([c.ids.numel() for c in calls], dtype=np.int64)
    bags = np.array([c.offsets.numel() for c in calls], dtype=np.int64)
    id_base, bag_base = np.cumsum(sizes) - sizes, np.cumsum(bags) - bags
    offsets = np.concatenate([c.offsets.numpy() for c in calls]).astype(np.int64) + np.repeat(id_base, bags)
    index = np.arange(len(rows), dtype=np.int64)
    bag = np.searchsorted(offsets, index, side="right") - 1  # later calls' bags start at or after their first id
    pos = index - offsets[bag]
    sample = bag - np.repeat(bag_base, sizes)
    step = np.repeat(np.array([c.step for c in calls], dtype=np.int64), sizes)
    feature = np.repeat(np.array([c.feature for c in calls], dtype=np.int16), sizes)
    table = calls[0].table
    if table.padding_idx is not None:
        keep = rows != table.padding_idx
        step, sample, pos, rows, feature = step[keep], sample[keep], pos[keep], rows[keep], feature[keep]
    return step, sample, pos, rows + table.first_row, feature


def _items(call: Call) -> int:
    """The items `sample` counts in a call: its bags, the rows of an N-D input, the ids of a 1-D one."""
    if call.ids.dim() == 1:
        return call.ids.numel() if call.offsets is None else call.offsets.numel()
    return call.ids.shape[0]


def lookup_sources(calls: list[Call], sample: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """`src` and `src_sample` (int32, masked arrays: null where unknown) of the lookups `lookup_rows(calls)`
    gave `sample` for, from each call's declared sources; None where no call declared any. A call's
    item `sample` came from the source q with starts[q] <= sample < starts[q + 1] (starts: the running
    sum of its counts), and is item `sample - starts[q]` of those q sent. A call whose items do not
    number the counts' sum, or that declared none, gets nulls; so does `src_sample` of a 1-D
    nn.Embedding input's ids, whose `sample` is an id's index."""
    if all(c.sources is None for c in calls):
        return None
    items = np.array([_items(c) for c in calls], dtype=np.int64)
    kept = np.array([c.ids.numel() if c.table.padding_idx is None else int((c.ids != c.table.padding_idx).sum())
                     for c in calls], dtype=np.int64)  # each call's lookups in `sample`
    base = np.cumsum(items) - items  # each call's first item, calls end to end
    declared = [i for i, c in enumerate(calls) if c.sources is not None and sum(c.sources.counts) == items[i]]
    if not declared:
        null = np.ma.masked_all(len(sample), dtype=np.int32)
        return null, null.copy()
    counts = [np.array(calls[i].sources.counts, dtype=np.int64) for i in declared]
    starts = np.concatenate([base[i] + np.cumsum(n) - n for i, n in zip(declared, counts)])
    ranks = np.concatenate([np.array(calls[i].sources.ranks, dtype=np.int64) for i in declared])
    call = np.repeat(np.arange(len(calls)), kept)
    item = sample.astype(np.int64) + base[call]
    source = np.searchsorted(starts, item, side="right") - 1  # later calls' sources start after this item
    known = np.zeros(len(calls), dtype=bool)
    known[declared] = True
    by_item = np.array([c.ids.dim() != 1 or c.offsets is not None for c in calls])
    unknown = ~known[call]
    src = np.ma.array(ranks[source].astype(np.int32), mask=unknown)
    src_sample = np.ma.array((item - starts[source]).astype(np.int32), mask=unknown | ~by_item[call])
    return src, src_sample

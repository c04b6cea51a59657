"""The embedding collector: which rows of which table each step reads.

`install(writer, clock)` registers two global torch hooks:

- a module forward hook that sees every `nn.Embedding` / `nn.EmbeddingBag` call (other modules
  return at one isinstance check). Each call's ids are counted with `torch.unique` on their own
  device; ids equal to the module's `padding_idx` are not lookups and are left out, weighted
  lookups (`per_sample_weights`) count like any other. When the clock's step ends, the step's
  exact counts are written as `accesses` rows (step, table_name, row, count). On sampled steps
  (`step % lookup_every == 0`) every lookup is also written to `lookups` with its `sample` (bag
  index of an EmbeddingBag, row of a 2-D [B, L] input, dim-0 index of an N-D input, i for the
  i-th id of a 1-D nn.Embedding input) and `pos` (position in the bag or sequence; padding ids
  keep their position slot but write no row);
- a module registration hook feeding `collectors.names.ModuleNames`, so a table is named by its
  dotted path from the outermost module seen, e.g. `tables.a` for
  `model.tables = nn.ModuleDict({"a": ...})`, fixed at the table's first call. A table registered
  before install, or in no module, is named `f"{type(m).__name__}_{k}"`, k counting from 0 in
  first-call order.

A module tagged with `tracekit.shard(m, table=..., first_row=...)` is named by its `table`, and
`first_row` is added to each of its ids, so `row` is the table's global row in both trace tables.
At each module's first call, `handle.tables` gets an entry with what the manifest lists of it:
`table`, `first_row`, `num_rows` (this module's rows), `table_rows` (the whole table's), `dim`,
`dtype`, `kind` ("pooled" for an EmbeddingBag, "sequence" for an Embedding) and `padding_idx`
(a global row, or None).

Rows are buffered per step (on the ids' device, unique rows only) and written at the step's end;
a step not ended by the clock before `uninstall()` writes nothing.

    clock = StepClock()
    steps_handle = steps.install(writer, clock)
    handle = embedding.install(writer, clock, lookup_every=10)
    ...
    handle.uninstall(); steps_handle.uninstall()
"""

from __future__ import annotations

import weakref
from typing import Any

import pyarrow as pa
import torch
from torch import nn
from torch.nn.modules import module as torch_module

from collectors.guard import Guard
from collectors.names import ModuleNames
from collectors.steps import StepClock
from tracekit.shards import Shard, shard_of
from tracekit.store import RunWriter

EMBEDDINGS = (nn.Embedding, nn.EmbeddingBag)


def lookup_ids(module: nn.Module, args: tuple, kwargs: dict) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The ids tensor of an Embedding/EmbeddingBag call, and its offsets (None if not given)."""
    ids = args[0] if args else kwargs["input"]
    offsets = None
    if isinstance(module, nn.EmbeddingBag):
        offsets = args[1] if len(args) > 1 else kwargs.get("offsets")
    return ids.detach(), offsets


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


def table_entry(module: nn.Module, shard: Shard) -> dict:
    """What the manifest lists of a table module, described in the module docstring."""
    padding = module.padding_idx
    return {"table": shard.table, "first_row": shard.first_row, "num_rows": module.num_embeddings,
            "table_rows": shard.num_rows, "dim": module.embedding_dim,
            "dtype": str(module.weight.dtype).removeprefix("torch."),
            "kind": "pooled" if isinstance(module, nn.EmbeddingBag) else "sequence",
            "padding_idx": None if padding is None else shard.first_row + padding}


def merge_counts(parts: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum per-call (rows, counts) pairs into one (rows, counts) pair with unique rows."""
    rows = torch.cat([r for r, _ in parts])
    counts = torch.cat([c for _, c in parts])
    if len(parts) == 1:
        return rows, counts
    rows, inverse = torch.unique(rows, return_inverse=True)
    return rows, torch.zeros(rows.numel(), dtype=counts.dtype, device=counts.device).index_add_(0, inverse, counts)


class EmbeddingHandle:
    """The installed embedding collector; `uninstall()` removes every hook it registered."""

    def __init__(self, writer: RunWriter, clock: StepClock, lookup_every: int) -> None:
        self.writer = writer
        self.clock = clock
        self.lookup_every = lookup_every
        self.guard = Guard("embedding")
        self.names = ModuleNames()
        self.tables: list[dict] = []  # one entry per module seen, in first-call order (module docstring)
        self._shards: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # module -> its Shard
        self._counts: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self._lookups: dict[str, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = {}
        self._hooks = [
            torch_module.register_module_module_registration_hook(self._on_register),
            torch_module.register_module_forward_hook(self._on_forward, with_kwargs=True),
        ]
        clock.add_listener(self)

    def uninstall(self) -> None:
        global _installed
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        self.clock.remove_listener(self)
        self._counts, self._lookups = {}, {}
        if _installed is self:
            _installed = None

    def on_step_end(self, step: int) -> None:
        counts, lookups = self._counts, self._lookups
        self._counts, self._lookups = {}, {}
        self.guard.run(self._write, step, counts, lookups)

    def _on_register(self, parent: nn.Module, attr: str, child: nn.Module | None) -> None:
        self.guard.run(self.names.on_module, parent, attr, child)  # returns None: child unchanged

    def _on_forward(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        if isinstance(module, EMBEDDINGS):
            self.guard.run(self._record, module, args, kwargs)  # returns None: output unchanged

    def _sampled(self) -> bool:
        return self.lookup_every > 0 and self.clock.step % self.lookup_every == 0

    def _shard(self, module: nn.Module) -> Shard:
        """The module's table and first row (its whole table at 0 if untagged); on its first call,
        its entry in `tables`."""
        shard = self._shards.get(module)
        if shard is None:
            shard = shard_of(module) or Shard(self.names.module_name(module), 0, module.num_embeddings)
            self._shards[module] = shard
            self.tables.append(table_entry(module, shard))
        return shard

    def _record(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        ids, offsets = lookup_ids(module, args, kwargs)
        shard = self._shard(module)
        rows = ids.reshape(-1).to(torch.int64)
        keep = None if module.padding_idx is None else rows != module.padding_idx
        rows_kept = rows if keep is None else rows[keep]
        if shard.first_row:
            rows_kept = rows_kept + shard.first_row
        self._counts.setdefault(shard.table, []).append(torch.unique(rows_kept, return_counts=True))
        if self._sampled():
            sample, pos = positions(ids, offsets)
            if keep is not None:
                sample, pos = sample[keep], pos[keep]
            self._lookups.setdefault(shard.table, []).append((sample, pos, rows_kept.clone()))  # ids may be reused

    def _write(self, step: int, counts: dict, lookups: dict) -> None:
        """One append per trace table per step, every table's rows together."""
        if counts:
            merged = {table: merge_counts(parts) for table, parts in counts.items()}
            self._append("accesses", step, list(merged), {
                "row": [rows for rows, _ in merged.values()],
                "count": [n.to(torch.int32) for _, n in merged.values()]})
        if lookups:
            joined = {table: [torch.cat(column) for column in zip(*parts)] for table, parts in lookups.items()}
            self._append("lookups", step, list(joined), {
                "sample": [c[0].to(torch.int32) for c in joined.values()],
                "pos": [c[1].to(torch.int32) for c in joined.values()],
                "row": [c[2] for c in joined.values()]})

    def _append(self, trace_table: str, step: int, names: list[str], columns: dict[str, list[torch.Tensor]]) -> None:
        """Rows of several tables at once: `columns[key][i]` holds table `names[i]`'s values."""
        sizes = torch.tensor([part.numel() for part in next(iter(columns.values()))])
        n = int(sizes.sum())
        which = torch.repeat_interleave(torch.arange(len(names), dtype=torch.int32), sizes)
        table_name = pa.DictionaryArray.from_arrays(pa.array(which.numpy()), pa.array(names))
        arrays = {key: pa.array(torch.cat(parts).cpu().numpy()) for key, parts in columns.items()}
        steps = pa.array(torch.full((n,), step, dtype=torch.int64).numpy())
        self.writer.append(trace_table, {"step": steps, "table_name": table_name, **arrays})


# The module hooks are process-wide, so the record of them is too: one slot, set by install and
# cleared by uninstall, makes a second install a no-op.
_installed: EmbeddingHandle | None = None


def install(writer: RunWriter, clock: StepClock, *, lookup_every: int = 10) -> EmbeddingHandle:
    """Count every embedding lookup per (step, table, row) into `accesses`, and write the raw
    lookups of every `lookup_every`-th step (0: never) into `lookups`. A second call while
    installed returns the installed handle unchanged."""
    global _installed
    if lookup_every < 0:
        raise ValueError(f"lookup_every must be >= 0 (0 writes no lookups), got {lookup_every}")
    if _installed is None:
        _installed = EmbeddingHandle(writer, clock, lookup_every)
    return _installed

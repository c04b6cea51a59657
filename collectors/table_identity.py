"""Which table of the trace an embedding module is, and what the manifest lists of it.

A table is named by its dotted path from the outermost module seen (`collectors.names`), e.g.
`tables.a` for `model.tables = nn.ModuleDict({"a": ...})`, fixed at the table's first call. A table
registered before install, or in no module, is named `f"{type(m).__name__}_{k}"`, k counting from 0
in first-call order.

Identity across ranks, from what the process sees at the table's first call: a module tagged with
`tracekit.shard` is a shard of the table it names (`placement` "sharded"); an untagged module
inside a DistributedDataParallel or FSDP model is a data-parallel replica, the same table on every
rank ("replicated"); any other untagged module is the process's own table ("local"), named
`<path>@rank<R>` in a world of more than one rank: model-parallel tables kept in a rank-local
`ModuleList` share paths (`emb_l.0`) but not contents, so they never merge.

A module tagged with `tracekit.shard(m, table=..., first_row=...)` is named by its `table`, and
`first_row` is added to each of its ids, so `row` is the table's global row in both trace tables.
At each module's first call, `tables` gets an entry with what the manifest lists of it: `table`,
`first_row`, `num_rows` (this module's rows), `table_rows` (the whole table's), `dim`, `dtype`,
`kind` ("pooled" for an EmbeddingBag, "sequence" for an Embedding), `padding_idx` (a global row,
or None) and `placement` (above).
"""

from __future__ import annotations

import os
import weakref

import torch.distributed as dist
from torch import nn

from collectors.counting import Table
from collectors.names import ModuleNames
from tracekit.shards import Shard, shard_of


def _rank_and_world() -> tuple[int, int]:
    """This process's rank and world size: the default process group's, else torchrun's variables."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def table_entry(module: nn.Module, shard: Shard) -> dict:
    """What the manifest lists of a table module, described in the module docstring."""
    padding = module.padding_idx
    return {"table": shard.table, "first_row": int(shard.first_row), "num_rows": int(module.num_embeddings),
            "table_rows": int(shard.table_rows), "dim": int(module.embedding_dim),
            "dtype": str(module.weight.dtype).removeprefix("torch."),
            "kind": "pooled" if isinstance(module, nn.EmbeddingBag) else "sequence",
            "padding_idx": None if padding is None else int(shard.first_row + padding)}


class TableIdentity:
    """The tables the embedding collector has seen: their manifest entries (`tables`, in first-call
    order) and their `Table`s (`table_list`, by `Table.index`, which kept calls name them by)."""

    def __init__(self, names: ModuleNames) -> None:
        self.names = names  # the modules' paths, kept by the collector's module-registration hook
        self.tables: list[dict] = []  # one entry per module seen, in first-call order (module docstring)
        self.table_list: list[Table] = []  # by Table.index
        self._names: weakref.WeakKeyDictionary[nn.Module, str] = weakref.WeakKeyDictionary()  # name_table()

    def add_table(self, entry: dict, *, num_rows: int, first_row: int, padding_idx: int | None = None) -> Table:
        """List `entry` (the keys of `table_entry`, `placement`, and any more) in `tables`, and return
        the `Table` whose calls `record_call` keeps: `num_rows` module rows holding the table's rows
        from `first_row` on."""
        self.tables.append(entry)
        table = Table(entry["table"], num_rows, padding_idx, first_row, len(self.table_list))
        self.table_list.append(table)
        return table

    def name_table(self, module: nn.Module, name: str) -> None:
        """Name `module`'s table `name` instead of its module path (a TorchRec table config's name);
        called before its first lookup. Placement and the `@rank<R>` suffix still apply."""
        self._names[module] = name

    def first_call(self, module: nn.Module) -> Table:
        """The table of `module`, at its first call: named, placed and listed as the module docstring says."""
        rows = int(module.num_embeddings)
        shard, placement = shard_of(module), "sharded"
        if shard is None:
            name = self._names.get(module) or self.names.module_name(module)
            placement = "replicated" if self.names.is_replicated(module) else "local"
            rank, world_size = _rank_and_world()
            if placement == "local" and world_size > 1:
                name = f"{name}@rank{rank}"
            shard = Shard(name, 0, table_rows=rows)
        entry = {**table_entry(module, shard), "placement": placement}
        return self.add_table(entry, num_rows=rows, first_row=shard.first_row, padding_idx=module.padding_idx)

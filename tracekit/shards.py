"""`tracekit.shard(module, table=..., first_row=...)`: which rows of which table an embedding holds.

A model-parallel trainer cuts a table into shards and looks each shard up with shard-local ids
(0 is the shard's first row). Tagged, a shard's module is named by its logical table in the trace,
its rows are written as global rows (`first_row` + local id) in `accesses` and `lookups`, and the
manifest's `tables` says which rank holds which rows. The tag is one attribute on the module: it
costs nothing per lookup and changes nothing when no collector reads it.

    shard = nn.EmbeddingBag.from_pretrained(weight[start:stop])
    tracekit.shard(shard, table="t0", first_row=start, num_rows=total_rows)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeVar

ATTR = "tracekit_shard"
"""The module attribute holding its `Shard`."""


@dataclass(frozen=True)
class Shard:
    table: str  # the logical table's name, as the trace names it
    first_row: int  # the table's row that the module's row 0 holds
    table_rows: int  # rows of the whole table, every shard together (`shard()`'s `num_rows`)


M = TypeVar("M")


def shard(module: M, *, table: str, first_row: int = 0, num_rows: int | None = None) -> M:
    """Tag an `nn.Embedding`/`nn.EmbeddingBag` as rows [first_row, first_row + its rows) of `table`,
    which has `num_rows` rows in all (default: up to this shard's last row). Returns the module."""
    local = getattr(module, "num_embeddings", None)
    if local is None:
        raise TypeError(f"tracekit.shard takes an nn.Embedding or nn.EmbeddingBag, got {type(module).__name__}")
    total = first_row + local if num_rows is None else num_rows
    if not table:
        raise ValueError("tracekit.shard: `table` must be a non-empty name")
    if first_row < 0 or first_row + local > total:
        raise ValueError(f"tracekit.shard({table!r}): rows [{first_row}, {first_row + local}) of this shard do "
                         f"not fit in a table of `num_rows`={total} rows")
    setattr(module, ATTR, Shard(table, first_row, total))
    return module


def shard_of(module: object) -> Shard | None:
    """The module's tag from `shard()`, or None."""
    return getattr(module, ATTR, None)

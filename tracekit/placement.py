"""Where the reference trainer places its embedding tables on W ranks: its specs and its planner.

The trainer (tracekit/dlrm/sharding.py) builds its plan with `ShardingPlan.build`, and `tracekit
simulate` (analyses.target_exchange) places the recorded tables on a target's world size with the same
call, with no process group: one planner, run online and offline.

    plan = ShardingPlan.build([TableSpec("t0", 1000, 16), TableSpec("t1", 10, 16)], 2, "table")
    plan.owners == (0, 1)                 # table-wise: largest first, each to the least loaded rank
    ShardingPlan.build(specs, 4, "row").row_range(0, 1) == (250, 500)   # row-wise: blocks of ceil(rows / W)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

SHARDINGS = ("table", "row")


@dataclass(frozen=True)
class TableSpec:
    """An embedding table: its name, rows and dim, and whether its bags are pooled (else a sequence)."""

    name: str
    rows: int
    dim: int
    pooled: bool = True


@dataclass(frozen=True)
class ShardingPlan:
    """Where every table (table-wise) or row block (row-wise) lives; identical on all ranks."""

    tables: tuple[TableSpec, ...]
    world_size: int
    kind: str  # "table" | "row"
    owners: tuple[int, ...]  # table-wise: owner rank of each table

    @staticmethod
    def build(tables: list[TableSpec], world_size: int, kind: str) -> ShardingPlan:
        """Table-wise: largest tables first, each to the rank holding the fewest rows so far."""
        if kind not in SHARDINGS:
            raise ValueError(f"sharding must be one of {', '.join(SHARDINGS)}, got {kind!r}")
        owners = [0] * len(tables)
        if kind == "table":
            load = [0] * world_size
            for t in sorted(range(len(tables)), key=lambda t: (-tables[t].rows * tables[t].dim, t)):
                rank = min(range(world_size), key=lambda r: (load[r], r))
                owners[t] = rank
                load[rank] += tables[t].rows * tables[t].dim
        return ShardingPlan(tuple(tables), world_size, kind, tuple(owners))

    def tables_on(self, rank: int) -> list[int]:
        """Tables with a shard on `rank`, in table order."""
        if self.kind == "row":
            return list(range(len(self.tables)))
        return [t for t, owner in enumerate(self.owners) if owner == rank]

    def block_rows(self, t: int) -> int:
        """Row-wise: the rows of table t's block on each rank (the last rank's may hold fewer)."""
        return math.ceil(self.tables[t].rows / self.world_size)

    def row_range(self, t: int, rank: int) -> tuple[int, int]:
        """Rows [start, stop) of table t held by `rank`."""
        table_rows = self.tables[t].rows
        if self.kind == "table":
            return (0, table_rows) if self.owners[t] == rank else (0, 0)
        block = self.block_rows(t)
        return min(table_rows, rank * block), min(table_rows, (rank + 1) * block)

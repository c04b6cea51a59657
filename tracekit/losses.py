"""What a recorded run lost: the manifest's `lost_rows` (rows per trace table, all ranks together) and
`lost_lookups` (the lookups of the `accesses` rows among them), read the same way by `record`,
`analyze` and the report, and said in the same words. Standard library only: the CLI imports it."""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tracekit.manifest import Manifest


def lost_rows(manifest: Manifest) -> dict[str, int]:
    """Rows lost per trace table, all ranks together: the manifest's `lost_rows`, or for a run recorded
    before it, the sum of `dropped_rows` over ranks. For `accesses`, ids never counted are counted as
    rows (at most one row each); `lost_lookups` has the lookups."""
    if manifest.lost_rows is not None:
        return dict(manifest.lost_rows)
    total: Counter[str] = Counter()
    for per_table in (manifest.dropped_rows or {}).values():
        total.update(per_table)
    return {table: n for table, n in sorted(total.items()) if n}


def lost_by_table(lost: dict[str, int], lost_lookups: int | None) -> str:
    """`lost_rows`' figures in words: `accesses 1,234 (1,234 lookups), steps 2`."""
    return ", ".join(f"{table} {n:,}" + (f" ({lost_lookups:,} lookups)" if table == "accesses" and lost_lookups else "")
                     for table, n in sorted(lost.items()))


def loss_warning(lost: dict[str, int], lost_lookups: int | None) -> str:
    """What `analyze` and the report say of a run that lost rows."""
    return (f"the trace lost rows (manifest `lost_rows`: {lost_by_table(lost, lost_lookups)}): a trace writer fell "
            "behind or failed, so figures from those tables undercount")

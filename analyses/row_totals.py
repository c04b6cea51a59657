"""Per (table, row) of the training accesses: its lookups (ids, `count` summed), its accesses rows
(the (step, rank) batches it appears in) and the lowest and highest rank that read it. One pass over
`accesses`, temp table `tk_row_totals`, that skew's histogram and the replication sweep both read.

    ctx.sql(f"SELECT table_name, count(*) FROM {row_totals(ctx)} GROUP BY ALL")

Incremental: the totals are kept in RUN/analysis/increments/ with the part files they cover (path,
size, modification time) and the steps analysed. `analyze` of a run that grew (a recording still
going, a rank's parts added) reads only the parts added since and adds their totals in. A covered
part that changed or vanished, other steps analysed (`record --steps`, a truncated trace) or another
tracekit's state file: the totals are computed again from every part.
"""

from __future__ import annotations

import json
from pathlib import Path

from analyses.context import Context
from tracekit.files import replacing, write_text
from tracekit.run_dir import ANALYSIS

TABLE = "tk_row_totals"
STATE_DIR = Path(ANALYSIS) / "increments"
VERSION = 1  # of the kept totals' format: another one is recomputed, never read


def row_totals(ctx: Context) -> str:
    """The name of the temp table (table_name, row, lookups, accesses, min_rank, max_rank) of the
    run's training accesses, computed once per context, reusing what an earlier analyze kept."""
    return ctx.memo(row_totals, lambda: _row_totals(ctx))


def kept_file(ctx: Context) -> Path | None:
    """The Parquet file (table_name, row, lookups, ...) the run's totals are kept in, computed first where
    they are not; None where the run has no accesses."""
    if not ctx.has("accesses"):
        return None
    row_totals(ctx)
    path = ctx.path / STATE_DIR / "row_totals.parquet"
    return path if path.is_file() else None


def shared_tables(ctx: Context) -> str:
    """SQL for the names of the tables some row of which several ranks read (data-parallel or
    column-wise): there a row's totals are not one rank's."""
    return f"SELECT DISTINCT table_name FROM {row_totals(ctx)} WHERE min_rank <> max_rank"


def _row_totals(ctx: Context) -> str:
    parts = ctx.run.parts("accesses")
    stamps = {str(p.relative_to(ctx.path)): _stamp(p) for p in parts}
    key = {"version": VERSION, "steps": ctx.steps_kept(["step"])}
    state = ctx.path / STATE_DIR
    covered = _covered(state, key, stamps)
    new = [p for p in parts if str(p.relative_to(ctx.path)) not in covered]
    sources = []
    if new:
        relation = ctx.run.relation("accesses", ctx.con, new)
        ctx.con.register("tk_new_accesses", relation)
        kept = ctx.steps_kept(relation.columns)
        sources.append(f"""SELECT table_name, "row", sum("count"::DOUBLE) AS lookups, count(*)::BIGINT AS accesses,
                                  min(rank) AS min_rank, max(rank) AS max_rank
                           FROM tk_new_accesses {kept or 'WHERE true'} AND phase = 'train' GROUP BY ALL""")
    if covered:
        sources.append(f"SELECT * FROM read_parquet('{state / 'row_totals.parquet'}')")
    if len(sources) == 1:
        query = sources[0]
    else:
        query = f"""SELECT table_name, "row", sum(lookups) AS lookups, sum(accesses)::BIGINT AS accesses,
                           min(min_rank) AS min_rank, max(max_rank) AS max_rank
                    FROM ({' UNION ALL '.join(sources)}) GROUP BY ALL"""
    ctx.sql(f"CREATE OR REPLACE TEMP TABLE {TABLE} AS {query}")
    if new:
        ctx.con.unregister("tk_new_accesses")
        _keep(ctx, state, key, stamps)
    return TABLE


def _stamp(part: Path) -> list[int]:
    status = part.stat()
    return [status.st_size, status.st_mtime_ns]


def _covered(state: Path, key: dict, stamps: dict[str, list[int]]) -> set[str]:
    """The parts whose totals `state` holds, if every one of them is unchanged and they were taken
    over the same steps; else none."""
    try:
        kept = json.loads((state / "row_totals.json").read_text())
    except (OSError, ValueError):
        return set()
    if not isinstance(kept, dict) or kept.get("key") != key or not (state / "row_totals.parquet").is_file():
        return set()
    parts = kept.get("parts") or {}
    if any(stamps.get(path) != stamp for path, stamp in parts.items()):
        return set()
    return set(parts)


def _keep(ctx: Context, state: Path, key: dict, stamps: dict[str, list[int]]) -> None:
    """Write the totals and the parts they cover: the old list goes first, so that a kill in
    between leaves no list, and the next analyze recomputes rather than count a part twice."""
    (state / "row_totals.json").unlink(missing_ok=True)
    with replacing(state / "row_totals.parquet") as tmp:
        ctx.sql(f"COPY {TABLE} TO '{tmp}' (FORMAT parquet, COMPRESSION zstd)")
    write_text(state / "row_totals.json", json.dumps({"key": key, "parts": stamps}) + "\n")

"""The sizes of a recorded run that the rank-side calibration (tracekit/dlrm/calibrate.py) reproduces:
its tables, the samples each rank trained on per step, each row's training lookups, its world size,
the trainer's optimizer and the intra-op threads its ranks ran with. Read with the run store's reader
(tracekit.run), training rows only; torch-free, so the trainer's side turns them into tensors.

    sizes = run_sizes("runs/base")                        # the rows' lookups summed from the accesses
    sizes = run_sizes("runs/base", kept_file(ctx))        # or read from analyze's kept totals
    sizes.tables[0].num_rows, sizes.row_counts.num_rows
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq

from tracekit.errors import TracekitError
from tracekit.phases import TRAIN
from tracekit.run import Run, open_run
from tracekit.schema import PHASED
from tracekit.manifest import Table


@dataclass
class RunSizes:
    """What the calibration takes from a run."""

    run: str
    tables: tuple[Table, ...]  # the manifest's tables
    samples: list[int]  # samples of each training step, per rank
    row_counts: pa.Table | None  # (table_name, row, count): each row's training lookups; None: no accesses
    world_size: int
    optimizer: str  # the trainer's --optimizer
    omp_threads: int  # the run's OMP_NUM_THREADS; 0 where it set none


def run_sizes(run_dir: str | os.PathLike, row_totals: str | os.PathLike | None = None) -> RunSizes:
    """The calibration's inputs from the run at `run_dir`: its manifest, steps and accesses; the rows'
    counts from `row_totals` where given (the Parquet file of (table_name, row, lookups) that analyze
    keeps, analyses.row_totals), else summed from the accesses."""
    run_dir = Path(run_dir)
    run = open_run(run_dir)
    manifest = run.manifest
    entries = manifest.tables or ()
    if not entries:
        raise TracekitError(f"{run_dir}: the manifest names no embedding tables; nothing to calibrate")
    present = run.tables()
    con = duckdb.connect()
    try:
        samples = [] if "steps" not in present else [
            int(n) for (n,) in _train(run, "steps", con).project("samples").fetchall()]
        if not samples:
            raise TracekitError(f"{run_dir} has no training steps (steps table); record a run that trains")
        counts = _row_counts(run, con, row_totals) if row_totals is not None or "accesses" in present else None
    finally:
        con.close()
    return RunSizes(str(run_dir), entries, samples, counts, int(manifest.world_size or 1),
                    _optimizer(manifest.command or []), int((manifest.environment or {}).get("OMP_NUM_THREADS", 0)))


def _train(run: Run, table: str, con: duckdb.DuckDBPyConnection) -> duckdb.DuckDBPyRelation:
    """The training rows of a trace table, every rank's (a table without phases holds only those)."""
    relation = run.relation(table, con)
    return relation.filter(f"phase = '{TRAIN}'") if table in PHASED else relation


def _row_counts(run: Run, con: duckdb.DuckDBPyConnection, row_totals: str | os.PathLike | None) -> pa.Table:
    """(table_name, row, count): each row's training lookups, from `row_totals` or the accesses."""
    if row_totals is not None:
        totals = pq.read_table(row_totals, columns=["table_name", "row", "lookups"])
        return pa.table({"table_name": totals.column("table_name").cast(pa.string()), "row": totals.column("row"),
                         "count": totals.column("lookups")})
    return _train(run, "accesses", con).aggregate(
        'table_name, "row", sum("count")::BIGINT AS "count"', 'table_name, "row"').to_arrow_table()


def _optimizer(command: list[str]) -> str:
    """The trainer's --optimizer where the recorded command names it; sgd (its default) otherwise."""
    for i, arg in enumerate(command):
        if arg == "--optimizer" and i + 1 < len(command):
            return command[i + 1]
        if arg.startswith("--optimizer="):
            return arg.split("=", 1)[1]
    return "sgd"

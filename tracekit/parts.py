"""Parquet part files, the unit the run store writes: one per trace table per rank per flush, at
`<run>/<table>/rank=<R>/part-NNNNN.parquet`, zstd, with the encodings of `PARQUET_OPTIONS`.
`write_part` writes one under a hidden temporary name and renames it into place when complete, so a
reader globbing `*.parquet` never sees half a file.

Test hook: with TRACEKIT_FAULT_KILL_BEFORE_RENAME=<table>:<n> in its environment, a process about
to rename part n of `table` into place (`part-<n, 5 digits>.parquet`, of any rank) kills itself
with SIGKILL instead, its bytes written to the temporary file: a real kill in the middle of writing
a part, whose aftermath tests/test_crash_safety.py checks. With TRACEKIT_FAULT_SLOW_WRITE_S=S, every
part takes S seconds more to write: a slow disk, for bench/soak.py's writer that falls behind.

    write_part(data, Path("runs/base/accesses/rank=0"), 0, **PARQUET_OPTIONS["accesses"])
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq


# Encodings per trace table, for size and for the writer's CPU time (bench/RESULTS.md): row ids
# sorted within a (step, table) delta-encode to about a byte, low-cardinality columns take a
# dictionary, the rest is zstd, and only `step` gets min/max statistics (a third of the encoding
# time otherwise). The default dictionary-encodes every column and keeps every statistic. `phase`,
# already a dictionary in Arrow, must be listed too, or its strings are decoded and re-encoded (1.3
# of a 4.7 ms accesses flush, bench/RESULTS.md §16).
PARQUET_OPTIONS: dict[str, dict[str, Any]] = {
    "accesses": dict(use_dictionary=["step", "table_name", "count", "phase"],
                     column_encoding={"row": "DELTA_BINARY_PACKED"}, write_statistics=["step"]),
    "lookups": dict(use_dictionary=["step", "table_name", "pos", "phase", "feature", "src"],
                    column_encoding={"sample": "DELTA_BINARY_PACKED"}, write_statistics=["step"]),
}


FAULT_KILL_BEFORE_RENAME = "TRACEKIT_FAULT_KILL_BEFORE_RENAME"  # the test hook of the module docstring
FAULT_SLOW_WRITE_S = "TRACEKIT_FAULT_SLOW_WRITE_S"  # ... and a slow disk: each part takes this long more


def write_part(data: pa.Table, directory: Path, index: int, **options: Any) -> Path:
    """Write `data` as `directory/part-<index>.parquet` (zstd; `options` go to pq.write_table) via a
    hidden temporary file in the same directory, renamed into place once complete."""
    final = directory / f"part-{index:05d}.parquet"
    tmp = directory / f".{final.name}.tmp"
    directory.mkdir(parents=True, exist_ok=True)
    try:
        if os.environ.get(FAULT_SLOW_WRITE_S):
            time.sleep(float(os.environ[FAULT_SLOW_WRITE_S]))
        pq.write_table(data, tmp, compression="zstd", **options)
        if os.environ.get(FAULT_KILL_BEFORE_RENAME) == f"{directory.parent.name}:{index}":
            os.kill(os.getpid(), signal.SIGKILL)
        os.replace(tmp, final)
    finally:
        tmp.unlink(missing_ok=True)
    return final


def prime() -> None:
    """Pay now, as the writer starts and before the traced program's loop, what its first flush would
    pay once (pyarrow's lazy import of numpy.ma, zstd's set-up: ~14 ms of CPU here)."""
    try:
        pq.write_table(pa.table({"x": pa.array(np.zeros(1, dtype=np.int64))}), pa.BufferOutputStream(),
                       compression="zstd")
    except Exception:  # the flushes will say what is wrong, counted like any failed write
        pass

"""What the trace writer spends per embedding id, itemised: counting a piece of whole steps into
`accesses` rows (`count_rows`), then encoding those rows as the recorder writes them (Parquet,
zstd, the `accesses` encodings of tracekit/parts.py), each column apart, and the formats one might
swap in (no compression, lz4, Arrow IPC on one thread).

The piece is the one-rank proxy of bench/record_overhead.py at `--batch 1536` (8 tables x 100k
rows, pooling 4, 5 steps: one PIECE_IDS run), with uniform ids (the proxy's) and with Zipf ids.
CPU time of this thread (`time.thread_time`), median of `--repeats`. From the repo root:

    .venv/bin/python bench/writer_costs.py
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from collectors.counting import Kept, Table, count_rows  # noqa: E402
from tracekit.parts import PARQUET_OPTIONS  # noqa: E402


def cpu_s(work: Callable[[], object], repeats: int) -> float:
    """Median thread CPU seconds of `work()`."""
    times = []
    for _ in range(repeats):
        start = time.thread_time()
        work()
        times.append(time.thread_time() - start)
    return statistics.median(times)


def piece(tables: int, batch: int, pooling: int, steps: int, rows: int, zipf: float, seed: int = 0) -> Kept:
    """`steps` steps of one call per table of `batch * pooling` ids, end to end."""
    rng = np.random.default_rng(seed)
    n = tables * batch * pooling * steps
    ids = (rng.zipf(zipf, n) - 1) % rows if zipf else rng.integers(0, rows, n)
    calls = steps * tables
    return Kept(ids.astype(np.int64), np.repeat(np.arange(steps), tables), np.tile(np.arange(tables), steps),
                np.zeros(calls, dtype=np.int64), np.full(calls, batch * pooling, dtype=np.int64))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tables", type=int, default=8)
    p.add_argument("--batch", type=int, default=1536)
    p.add_argument("--pooling", type=int, default=4)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--rows", type=int, default=100_000)
    p.add_argument("--repeats", type=int, default=20)
    args = p.parse_args()

    tables = [Table(f"t{i}", args.rows, None, 0, i) for i in range(args.tables)]
    out = Path(tempfile.mkdtemp(prefix="writer-costs-"))
    print(f"# {platform.processor() or platform.machine()}, {platform.system()}; "
          f"{args.tables} tables x {args.rows} rows, {args.batch} x {args.pooling} ids a call, {args.steps} steps")
    for zipf in (0.0, 1.2):
        kept = piece(args.tables, args.batch, args.pooling, args.steps, args.rows, zipf)
        ids = int(kept.size.sum())
        count_s = cpu_s(lambda: count_rows(kept, tables), args.repeats)
        data = pa.table(count_rows(kept, tables).columns())
        print(f"\n## ids {'uniform' if not zipf else f'Zipf {zipf}'}: {ids} ids, {data.num_rows} accesses rows")
        print("| work | ms | ns per id | ns per row | kB |\n|---|---:|---:|---:|---:|")

        def line(name: str, seconds: float, size: int | None = None) -> None:
            kb = f"{size / 1e3:.0f}" if size is not None else ""
            print(f"| {name} | {seconds * 1e3:.2f} | {seconds / ids * 1e9:.1f} | {seconds / data.num_rows * 1e9:.1f} | {kb} |")

        line("count_rows", count_s)
        path = out / "part.parquet"
        options = PARQUET_OPTIONS["accesses"]
        for compression in ("zstd", "lz4", "none"):
            seconds = cpu_s(lambda: pq.write_table(data, path, compression=compression, **options), args.repeats)
            line(f"Parquet, {compression}{' (as recorded)' if compression == 'zstd' else ''}", seconds, path.stat().st_size)
        for column in data.column_names:
            column_options = dict(use_dictionary=[column] if column in options["use_dictionary"] else False,
                                  column_encoding={column: options["column_encoding"][column]}
                                  if column in options["column_encoding"] else None,
                                  write_statistics=[column] if column in options["write_statistics"] else False)
            one = data.select([column])
            seconds = cpu_s(lambda: pq.write_table(one, path, compression="zstd", **column_options), args.repeats)
            line(f"  of it: `{column}` alone", seconds, path.stat().st_size)
        for compression in (None, "lz4", "zstd"):
            def write_ipc() -> None:
                with ipc.new_file(str(path), data.schema,
                                  options=ipc.IpcWriteOptions(compression=compression, use_threads=False)) as f:
                    f.write_table(data)
            line(f"Arrow IPC, {compression or 'uncompressed'}", cpu_s(write_ipc, args.repeats), path.stat().st_size)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

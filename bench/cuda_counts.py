"""Are the ids counted on a GPU exact? Recomputes the `accesses` table of a run recorded from
train.py's synthetic data (world 1, as bench/gpu_check.sh records the Criteo Kaggle layout on
CUDA) from the very samples the trainer consumed, counted here on the CPU with numpy, and compares
them row by row. From the repo root, on a run directory fetched from the GPU machine:

    .venv/bin/python bench/cuda_counts.py /tmp/gpurun/kr
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import polars as pl

from tracekit.dlrm.config import TrainConfig, from_args
from tracekit.dlrm.data import open_dataset
from tracekit.run import open_run


def expected(config: TrainConfig, steps: int) -> pl.DataFrame:
    """(step, table_name, row, count) of every id the trainer's first `steps` batches look up."""
    dataset = open_dataset("synthetic", tables=config.tables, rows=config.rows, num_dense=config.dense,
                           pooling=config.pooling, samples=config.samples, seed=config.seed, zipf=config.zipf,
                           drift=config.drift, preset=config.preset, scale=config.scale)
    names = dataset.table_names or [f"t{t}" for t in range(len(dataset.table_rows))]
    frames = []
    for step in range(steps):
        batch = dataset.batch(step * config.batch_size, (step + 1) * config.batch_size)
        ids = batch.values.numpy()
        bounds = np.concatenate([[0], np.cumsum(batch.lengths.sum(dim=1).numpy())])
        for t, name in enumerate(names):
            rows, counts = np.unique(ids[bounds[t]:bounds[t + 1]], return_counts=True)
            frames.append(pl.DataFrame({"step": step, "table_name": name, "row": rows, "count": counts}))
    return pl.concat(frames)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run_dir", type=Path)
    args = p.parse_args()
    manifest = json.loads((args.run_dir / "manifest.json").read_text())
    command = manifest["command"]
    config = from_args(command[command.index("train.py") + 1:])
    if manifest["world_size"] != 1:
        raise SystemExit(f"{args.run_dir}: world size {manifest['world_size']}; this check reads world-1 runs")
    recorded = (open_run(args.run_dir).scan("accesses").group_by("step", "table_name", "row")
                .agg(pl.col("count").sum()).collect())
    steps = int(recorded["step"].max()) + 1
    want = expected(config, steps)
    keys = ["step", "table_name", "row"]
    joined = want.join(recorded.cast({"row": pl.Int64, "count": pl.Int64}), on=keys, how="full", coalesce=True,
                       suffix="_recorded")
    differ = joined.filter(pl.col("count").fill_null(0) != pl.col("count_recorded").fill_null(0))
    print(f"{args.run_dir}: {', '.join(manifest['gpu']['devices']) or 'CPU'}, {steps} steps, "
          f"{want['count'].sum():,} ids in {want.height:,} (step, table, row) counts from the data; "
          f"{recorded['count'].sum():,} in {recorded.height:,} recorded; {differ.height} differ")
    if differ.height:
        print(differ.head(10))
    return 1 if differ.height else 0


if __name__ == "__main__":
    sys.exit(main())

"""The main job of the README (`make demo`): record the reference trainer on built-in synthetic data.

Runs `tracekit record -o runs/demo -- torchrun --nproc-per-node 2 train.py ...` (about three
minutes on 2 cores), then reads the run back and prints what its training steps hold (the
evaluation passes, phase `eval`, only as a total): the collectives by op and tag, and how
skewed each table's lookups are. The analyze -> re-run -> compare -> report steps of the
loop join this job as those commands land.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RUN_DIR = Path("runs") / "demo"  # under REPO, where the job runs
DEMO_ARGS = ["--steps", "3000", "--eval-every", "1000", "--log-every", "250", "--zipf", "1.05", "--samples", "3500000"]


def main() -> int:
    train = ["torchrun", "--standalone", "--nproc-per-node", "2", "train.py", *DEMO_ARGS, *sys.argv[1:]]
    print("$ tracekit record -o runs/demo --force -- " + " ".join(train), flush=True)
    code = subprocess.call([sys.executable, "-m", "tracekit", "record", "-o", str(RUN_DIR), "--force", "--",
                            sys.executable, "-m", "torch.distributed.run", *train[1:]], cwd=REPO)
    if code == 0:
        show(REPO / RUN_DIR)
    return code


def show(run_dir: Path) -> None:
    """What a first look at a run shows: traffic by op and tag, and how skewed the lookups are."""
    import polars as pl

    from tracekit.run import open_run

    pl.Config.set_tbl_hide_column_data_types(True)
    pl.Config.set_tbl_hide_dataframe_shape(True)
    run = open_run(run_dir)
    train = pl.col("phase") == "train"
    print("\ncollectives of the training steps, all ranks:")
    print(run.scan("comms").filter(train).group_by("op", "tag")
          .agg(pl.len().alias("calls"), pl.col("bytes_out").sum()).sort("bytes_out", descending=True).collect())
    per_row = run.scan("accesses").filter(train).group_by("table_name", "row").agg(pl.col("count").sum())
    share = (per_row.with_columns(pl.col("count").rank("ordinal", descending=True).over("table_name").alias("rank"))
             .group_by("table_name")
             .agg(pl.col("count").sum().alias("lookups"), pl.len().alias("rows_touched"),
                  (pl.col("count").filter(pl.col("rank") <= pl.col("rank").max() // 100).sum()
                   / pl.col("count").sum()).round(3).alias("top_1pct_share"))
             .sort("table_name"))
    print("\ntraining lookups per table (top_1pct_share: share of lookups that hit the 1% most-read rows touched):")
    print(share.collect())
    lookups = dict(run.scan("accesses").group_by("phase").agg(pl.col("count").sum()).collect().rows())
    sent = dict(run.scan("comms").group_by("phase").agg(pl.col("bytes_out").sum()).collect().rows())
    print(f"\nleft out above, the evaluation passes (phase eval): {lookups.get('eval', 0):,} lookups and "
          f"{sent.get('eval', 0):,} bytes of collectives, beside {lookups.get('train', 0):,} lookups and "
          f"{sent.get('train', 0):,} bytes in the training steps")


if __name__ == "__main__":
    sys.exit(main())

"""Replication on the Criteo Kaggle layout (issue 9's targets): `tracekit optimize --policies replication`
at 2 and 4 gloo ranks, then the figures the targets name, from the runs it leaves.

    .venv/bin/python bench/replication_kaggle.py [--scale 0.01] [--steps 300] [--worlds 2,4]

Per world size: replica rows as a share of all rows, embedding all-to-all and total embedding bytes
per step (all-to-all + replica sync) against the baseline, measured and predicted, the step time
measured and predicted, and the same two savings at HugeCTR's frequent set (from the replayed sweep,
whose bytes the trainer reproduces exactly).
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
from pathlib import Path

import polars as pl

REPO = Path(__file__).resolve().parents[1]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--scale", type=float, default=0.01)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--worlds", default="2,4")
    p.add_argument("--out", type=Path, default=Path("/tmp/tracekit-bench-replication"))
    args = p.parse_args()
    print(f"machine: {platform.processor() or platform.machine()}, gloo on CPU; preset criteo-kaggle × {args.scale}")
    for world in map(int, args.worlds.split(",")):
        out = args.out / f"w{world}"
        train = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
                 "train.py", "--preset", "criteo-kaggle", "--scale", str(args.scale), "--dim", "16",
                 "--samples", "1000000", "--steps", str(args.steps), "--log-every", "1000"]
        text = subprocess.run([sys.executable, "-m", "tracekit", "optimize", "-o", str(out), "--policies",
                               "replication", "--json", "--", *train], cwd=REPO, capture_output=True, text=True,
                              check=True).stdout
        report(world, out, json.loads(text.strip().splitlines()[-1]))


def report(world: int, out: Path, summary: dict) -> None:
    base, run = summary["runs"][0], summary["runs"][1]
    policy = json.loads((out / "base" / "policy.json").read_text())
    rows = sum(t["num_rows"] for t in policy["model"]["tables"])
    predicted = policy["replication"]["predicted"]
    sweep = pl.read_parquet(out / "base" / "analysis" / "replication_sweep.parquet")
    hugectr = sweep.filter(pl.col("point") == "hugectr").row(0, named=True)
    a2a0, total0 = base["a2a_bytes_per_step"], base["total_bytes_per_step"]
    print(f"\nworld {world}: {int(predicted['hot_rows'])} replica rows = {predicted['hot_rows'] / rows:.3%} of {rows:,}")
    print(f"  all-to-all bytes/step  {a2a0:,.0f} -> {run['a2a_bytes_per_step']:,.0f} measured "
          f"({1 - run['a2a_bytes_per_step'] / a2a0:.1%} saved), predicted {predicted['a2a_bytes_per_step']:,.0f}")
    print(f"  total embedding bytes  {total0:,.0f} -> {run['total_bytes_per_step']:,.0f} measured "
          f"({1 - run['total_bytes_per_step'] / total0:.1%} saved), predicted "
          f"{predicted['a2a_bytes_per_step'] + predicted['sync_bytes_per_step']:,.0f}")
    print(f"  step time              {base['step_time_s'] * 1e3:.2f} ms -> {run['step_time_s'] * 1e3:.2f} ms measured, "
          f"{predicted['step_time_s'] * 1e3:.2f} ms predicted ({run['step_time_s'] / predicted['step_time_s'] - 1:+.1%})")
    print(f"  HugeCTR frequent set   {hugectr['hot_rows']:,} rows = {hugectr['hot_rows'] / rows:.3%}: all-to-all "
          f"{1 - hugectr['a2a_bytes_per_step'] / a2a0:.1%} saved, total {1 - hugectr['total_bytes_per_step'] / total0:.1%}")


if __name__ == "__main__":
    main()

"""What recording costs a step, measured inside one process: `tracekit record --every N:N/2` records
blocks of steps and leaves the blocks between unrecorded, so one run holds both, under the same
machine state (this box's untraced runs move ±15% from run to run; the steps of one run do not).

The `steps` table keeps every step's time. A block's first `--settle` steps are left out (the writer
still works on the block before for up to a flush interval), and each recorded block's median step time is set
against the unrecorded block after it (which cancels the machine's slow drift); a run's figure is
the median of those pairs. What the unrecorded steps still pay (the step
and comm collectors, the phase wrapper) is not in this ratio; `record_overhead.py` measures the
whole against untraced runs. From the repo root:

    .venv/bin/python bench/record_blocks.py --runs 3                  # the host-bound proxy, ~1 min a run
    .venv/bin/python bench/record_blocks.py --runs 3 -- --batch-size 1536   # more arguments for train.py
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import polars as pl

ROOT = Path(__file__).resolve().parent.parent
PROXY = ["--tables", "26", "--rows", "100000", "--dim", "16", "--bottom-mlp", "32,16", "--top-mlp", "32,1",
         "--batch-size", "512", "--eval-fraction", "0", "--log-every", "100000", "--epochs", "1000"]
# --epochs: the synthetic set holds 2,048 steps of 512; --steps ends the run


def one_run(run_dir: Path, steps: int, block: int, settle: int, extra: list[str], python: str) -> dict:
    """The recorded and unrecorded blocks' median step times of one traced run."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [python, "-m", "tracekit", "record", "--force", "-o", str(run_dir), "--every", f"{2 * block}:{block}",
               "--", python, "train.py", *PROXY, "--steps", str(steps), *extra]
    r = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{r.stderr[-3000:]}")
    frame = pl.read_parquet(run_dir / "steps" / "**" / "*.parquet").sort("step").with_columns(
        ms=(pl.col("t_end_ns") - pl.col("t_start_ns")) / 1e6, in_block=pl.col("step") % (2 * block))
    kept = frame.filter((pl.col("in_block") % block >= settle) & (pl.col("step") >= 2 * block)).with_columns(
        pair=pl.col("step") // (2 * block), recorded=pl.col("in_block") < block)
    medians = kept.group_by("pair", "recorded").agg(pl.col("ms").median()).sort("pair")
    by_pair = medians.pivot(on="recorded", index="pair", values="ms").drop_nulls()
    ratios = (by_pair["false"] / by_pair["true"]).to_list()
    recorded, unrecorded = kept.filter(pl.col("recorded"))["ms"].median(), kept.filter(~pl.col("recorded"))["ms"].median()
    manifest = json.loads((run_dir / "manifest.json").read_text())
    return {"recorded_ms": recorded, "unrecorded_ms": unrecorded, "ratio": statistics.median(ratios),
            "writer_cpu_s": sum(manifest["writer_cpu_s"].values()), "lost_rows": manifest["lost_rows"]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--steps", type=int, default=6000)
    p.add_argument("--block", type=int, default=500, help="steps a block (recorded, then unrecorded)")
    p.add_argument("--settle", type=int, default=150, help="steps left out at the start of each block")
    p.add_argument("--python", default=str(ROOT / ".venv" / "bin" / "python"))
    p.add_argument("extra", nargs="*", help="more train.py arguments, after --")
    args = p.parse_args()
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.runs):
            result = one_run(Path(tmp) / "run", args.steps, args.block, args.settle, args.extra, args.python)
            results.append(result)
            print(f"run {i + 1}/{args.runs}: recorded {result['recorded_ms']:.3f} ms, unrecorded "
                  f"{result['unrecorded_ms']:.3f} ms a step: samples/s ratio {result['ratio']:.3f}; writer "
                  f"{result['writer_cpu_s']:.2f} s; lost {result['lost_rows'] or 'none'}", file=sys.stderr, flush=True)
    ratios = [r["ratio"] for r in results]
    print(f"machine: {cpu}, {os.cpu_count()} cores; train.py {' '.join(PROXY + args.extra)} --steps {args.steps}, "
          f"one rank, OMP_NUM_THREADS=1, record --every {2 * args.block}:{args.block}")
    print(f"recorded blocks' samples/s against unrecorded ones', run by run: "
          f"{', '.join(f'{r:.3f}' for r in ratios)}; median {statistics.median(ratios):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

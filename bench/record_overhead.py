"""What tracing costs: samples/s of the reference trainer untraced vs under `tracekit record`,
and bytes of trace per embedding lookup.

Runs alternate (untraced, traced, traced with raw lookups every step, ...), each a fresh 2-rank
torchrun on gloo/CPU; medians and ratios are printed with the machine. Then one traced run on
the criteo-kaggle preset gives the trace's bytes per lookup. From the repo root:

    .venv/bin/python bench/record_overhead.py --runs 3
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

ROOT = Path(__file__).resolve().parent.parent
BIN = ROOT / ".venv" / "bin"
TRAIN = ["--pooling", "1", "--zipf", "0", "--eval-fraction", "0", "--json"]
TORCHRUN = [str(BIN / "torchrun"), "--standalone", "--nproc-per-node", "2", "train.py"]


def samples_per_s(command: list[str]) -> float:
    out = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])["samples_per_s"]


def traced(run_dir: Path, *extra: str) -> list[str]:
    return [str(BIN / "tracekit"), "record", "--force", "-o", str(run_dir), *extra, "--", *TORCHRUN]


def trace_bytes(run_dir: Path) -> int:
    return sum(p.stat().st_size for p in run_dir.rglob("*.parquet"))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--steps", type=int, default=200)
    args = p.parse_args()
    steps = ["--steps", str(args.steps)]
    results: dict[str, list[float]] = {"untraced": [], "traced": [], "traced, lookups every step": []}
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        for i in range(args.runs):
            results["untraced"].append(samples_per_s([*TORCHRUN, *TRAIN, *steps]))
            results["traced"].append(samples_per_s([*traced(run_dir), *TRAIN, *steps]))
            results["traced, lookups every step"].append(
                samples_per_s([*traced(run_dir, "--lookup-every", "1"), *TRAIN, *steps]))
            print(f"run {i + 1}/{args.runs}: " + ", ".join(f"{k} {v[-1]:,.0f}" for k, v in results.items()),
                  file=sys.stderr)
        base = statistics.median(results["untraced"])
        cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")
        print(f"machine: {cpu}, {os.cpu_count()} cores; gloo, world size 2, 1 thread per rank; "
              f"{args.steps} steps, pooling 1, 8 tables x 100k x 64, batch 512 per rank; {args.runs} runs each")
        print("| variant | median samples/s | runs | vs untraced |\n|---|---:|---|---:|")
        for name, values in results.items():
            med = statistics.median(values)
            print(f"| {name} | {med:,.0f} | {', '.join(f'{v:,.0f}' for v in values)} | {med / base - 1:+.1%} |")

        # bytes per lookup on the criteo-kaggle preset (26 tables, one id each)
        preset = ["--preset", "criteo-kaggle", "--scale", "0.02", "--batch-size", "512", "--steps", "100",
                  "--eval-fraction", "0", "--json"]
        subprocess.run([*traced(run_dir), *preset], cwd=ROOT, capture_output=True, text=True, check=True)
        lookups = 100 * 2 * 512 * 26
        size = trace_bytes(run_dir)
        print(f"\ncriteo-kaggle preset (scale 0.02), 100 steps x 1024 samples x 26 tables = {lookups:,} lookups: "
              f"{size:,} bytes of Parquet = {size / lookups:.2f} B per lookup (lookups table every 10th step)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

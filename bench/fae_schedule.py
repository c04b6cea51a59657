"""FAE hot/cold scheduling, measured (bench/RESULTS.md §6): hot-sample fraction, samples/s and the AUC change.

    .venv/bin/python bench/fae_schedule.py [--pairs 3] [--steps 600]

A layout where samples can be all-hot (FAE's premise: few one-hot features with skewed ids): 6 tables
of 2,000 rows, Zipf 1.3, 2 gloo ranks. `tracekit optimize --policies schedule --budget 20%` records
the baseline, derives the hot set and re-runs with the schedule; then more baseline / FAE pairs,
alternating, untraced (train.py --json), for samples/s and eval AUC/logloss (medians).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--pairs", type=int, default=3)
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--out", type=Path, default=Path("/tmp/tracekit-bench-fae"))
    args = p.parse_args()
    train = ["train.py", "--tables", "6", "--rows", "2000", "--dim", "16", "--bottom-mlp", "64,16",
             "--top-mlp", "64,1", "--batch-size", "256", "--samples", "400000", "--pooling", "1", "--zipf", "1.3",
             "--eval-fraction", "0.1", "--steps", str(args.steps), "--log-every", "1000"]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    summary = json.loads(subprocess.run(
        [sys.executable, "-m", "tracekit", "optimize", "-o", str(args.out), "--policies", "schedule", "--budget", "20%",
         "--json", "--", *torchrun, *train], cwd=REPO, capture_output=True, text=True, check=True).stdout.splitlines()[-1])
    policy = json.loads((args.out / "base" / "policy.json").read_text())["schedule"]
    fae = next(r for r in summary["runs"] if r["run"].endswith("schedule"))
    base = summary["runs"][0]
    print(f"machine: {platform.processor() or platform.machine()}, 2 cores, gloo on CPU, 2 ranks")
    print(f"hot rows {policy['predicted']['hot_rows']:,}, hot samples {policy['hot_sample_fraction']:.1%} "
          f"(predicted hot steps {policy['predicted']['hot_step_fraction']:.1%}); recorded steps: "
          + ", ".join(f"{s['schedule']} {s['steps']}" for s in fae["schedule"] or []))
    print(f"embedding bytes/step (traced runs): baseline {base['total_bytes_per_step']:,.0f}, FAE "
          f"{fae['total_bytes_per_step']:,.0f} (all-to-all {fae['a2a_bytes_per_step']:,.0f}, "
          f"sync {fae['sync_bytes_per_step']:,.0f}); predicted {policy['predicted']['a2a_bytes_per_step']:,.0f} + "
          f"{policy['predicted']['sync_bytes_per_step']:,.0f}")
    results: dict[str, list[dict]] = {"base": [], "fae": []}
    for _ in range(args.pairs):
        for name, extra in (("base", []), ("fae", ["--policy", str(args.out / "base" / "policy.schedule.json")])):
            out = subprocess.run([*torchrun, *train, *extra, "--json"], cwd=REPO, capture_output=True, text=True,
                                 check=True).stdout
            results[name].append(json.loads(out.strip().splitlines()[-1]))
    for key in ("samples_per_s", "eval_auc", "eval_logloss"):
        b = statistics.median(r[key] for r in results["base"])
        f = statistics.median(r[key] for r in results["fae"])
        print(f"{key}: baseline {b:,.4f}, FAE {f:,.4f} ({f / b:.3f}x) "
              f"[{', '.join(f'{r[key]:,.4f}' for r in results['base'])} | {', '.join(f'{r[key]:,.4f}' for r in results['fae'])}]")


if __name__ == "__main__":
    main()

"""FAE on the Criteo Kaggle layout (bench/RESULTS.md §23): what the schedule's own budget chooses, and what the
largest hot set it allows does when applied.

    .venv/bin/python bench/fae_kaggle.py [--steps 400] [--link 200mbit] [--out /tmp/tracekit-bench-fae-kaggle]

`tracekit optimize --policies schedule --check-all` on the demo's layout (Criteo Kaggle ×0.01,
dim 16, 2 gloo ranks), twice: without --budget (the schedule sizes its hot set by its own merit),
and with --budget 12.4% (FAE's default hot memory as a share of the tables: the largest hot set the
own budget considers), which re-runs the schedule whatever analyze decided. Prints, per case, the
hot set, the all-hot sample share, analyze's decision and, where re-run, samples/s and eval AUC
against the baseline with the predicted step time beside the measured one.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LAYOUT = ["--preset", "criteo-kaggle", "--scale", "0.01", "--dim", "16", "--samples", "1000000", "--log-every", "100"]


def optimize(out: Path, steps: int, link: str | None, *budget: str) -> tuple[dict | None, dict]:
    """compare's summary (None where nothing was re-run) and the schedule section analyze wrote."""
    launch = ([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"] if link is None
              else [sys.executable])
    where = [] if link is None else ["--cluster", "2x1", "--link", link]
    done = subprocess.run([sys.executable, "-m", "tracekit", "optimize", "-o", str(out), "--policies", "schedule",
                           "--check-all", *where, *budget, "--json", "--", *launch, "train.py", *LAYOUT,
                           "--steps", str(steps)], cwd=REPO, capture_output=True, text=True, check=True)
    lines = done.stdout.strip().splitlines()
    summary = json.loads(lines[-1]) if lines and lines[-1].startswith("{") else None
    return summary, json.loads((out / "base" / "policy.json").read_text())["schedule"]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--out", type=Path, default=Path("/tmp/tracekit-bench-fae-kaggle"))
    p.add_argument("--link", default=None, help="run on an emulated 2x1 cluster at this link rate (needs root)")
    args = p.parse_args()
    print(f"machine: {platform.processor() or platform.machine()}, 2 cores, gloo on CPU, 2 ranks "
          f"({'one host, loopback' if args.link is None else f'2 nodes at {args.link}'}); Criteo Kaggle "
          f"layout ×0.01, dim 16, batch 512 per rank, {args.steps} steps")
    for name, budget in (("own budget", ()), ("--budget 12.4%", ("--budget", "12.4%"))):
        summary, section = optimize(args.out / name.replace(" ", "-").replace("%", ""), args.steps, args.link, *budget)
        predicted = section["predicted"]
        print(f"\n{name}: {predicted['hot_rows']:,} hot rows ({section['budget_bytes_per_rank'] / 1e6:.2f} MB per rank), "
              f"{section['hot_sample_fraction']:.1%} of samples all-hot; "
              + ("recommended" if section.get("recommended", True) else f"not recommended: {section['reason']}"))
        print(f"  why: {section['why']}")
        if summary is None:
            print("  not re-run (nothing to apply)")
            continue
        base, run = summary["runs"][0], next(r for r in summary["runs"] if r["run"].endswith("schedule"))
        auc = (run["metrics"] or {}).get("eval_auc"), (base["metrics"] or {}).get("eval_auc")
        print(f"  samples/s {base['samples_per_s']:,.0f} -> {run['samples_per_s']:,.0f} "
              f"(×{run['samples_per_s'] / base['samples_per_s']:.2f}); eval AUC {auc[1]:.4f} -> {auc[0]:.4f} "
              f"(Δ{auc[0] - auc[1]:+.4f}); step {base['step_time_s'] * 1e3:.2f} -> {run['step_time_s'] * 1e3:.2f} ms "
              f"measured, {predicted['step_time_s'] * 1e3:.2f} ms predicted")


if __name__ == "__main__":
    main()

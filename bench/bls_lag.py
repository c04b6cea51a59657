"""BLS with stragglers: measured makespans against the lag recurrence (issue 12's targets).

    .venv/bin/python bench/bls_lag.py [--world 4] [--steps 200] [--bounds 0,1,2,4,8] [--probability 0.1] [--out DIR]

Every run is `train.py --inference` on the same model and data, recorded (the same tracing cost
for all), one gloo rank a process on CPU.
1. Balanced, synchronous collectives: its step time D becomes the straggler delay.
2. Balanced, lag bound max(--bounds): the point-to-point exchange's cost a step, x_p2p (the run's
   `exchange_s` metric: the main thread's time posting requests and waiting for rows), and the
   balanced comparison (issue 12: no gain, no loss).
3. Stragglers `--probability`:D, synchronous collectives: measured `sync`. From its trace, per
   rank and step, the compute c (no exchange, no waiting) and the collectives' transfer x
   (analyses.policies.lag.work_matrix); the recurrence at bound 0 with that x replays it (a check
   of the model), and without a bound, with x_p2p, gives the ideal: the slowest rank's own total.
4. Stragglers, each bound B (every rank meets the same delays: each draws on its own seeded
   generator): measured, predicted = the recurrence at B with c and x_p2p, its error, and the gap
   recovered = (sync − measured) / (sync − ideal).
The trace leaves out the first step (start-up); the prediction fills it with each rank's median.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from analyses.context import open_context  # noqa: E402
from analyses.policies import lag  # noqa: E402
from analyses.timeline import compute as timeline  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--world", type=int, choices=(2, 4), default=4, help="ranks (issue 12: 4)")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--bounds", default="0,1,2,4,8")
    p.add_argument("--probability", type=float, default=0.1)
    p.add_argument("--out", type=Path, default=Path("/tmp/tracekit-bench-bls"))
    args = p.parse_args()
    bounds = [int(b) for b in args.bounds.split(",")]
    model = ["--preset", "criteo-kaggle", "--scale", "0.001", "--dim", "16", "--bottom-mlp", "64,16",
             "--top-mlp", "64,1", "--batch-size", "256", "--samples", str(args.steps * 256 * args.world),
             "--steps", str(args.steps), "--inference", "--json"]
    run = Runner(args.out, args.world)
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, gloo on CPU, "
          f"{args.world} ranks; criteo-kaggle x 0.001, dim 16, batch 256 per rank, {args.steps} iterations, recorded")

    # 1-2. balanced: the step time (the straggler delay) and the point-to-point exchange's cost
    plain = run("balanced-sync", model)["makespan_s"]
    largest = max(bounds)
    balanced = run(f"balanced-bound{largest}", [*model, "--lag-bound", str(largest)])
    x_p2p = balanced["exchange_s"]
    delay_ms = plain / args.steps * 1e3
    straggler = f"{args.probability}:{delay_ms:.1f}"

    # 3. stragglers, synchronous collectives: measured, and its trace's compute and transfer
    sync = run("sync", [*model, "--straggler", straggler])["makespan_s"]
    c, x_sync, _, _ = lag.work_matrix(timeline(open_context(args.out / "sync")).tables["timeline"])
    c, x_sync = _fill_warmup(c, args.steps), _fill_warmup(x_sync, args.steps)
    sync_predicted = lag.replay(c, 0, x_sync)
    ideal = lag.replay(c, None, x_p2p)

    # 4. stragglers, each bound
    rows = []
    for bound in bounds:
        measured = run(f"bound{bound}", [*model, "--straggler", straggler, "--lag-bound", str(bound)])["makespan_s"]
        predicted = lag.replay(c, bound, x_p2p)
        recovered = (sync - measured) / (sync - ideal) if sync > ideal else None
        rows.append({"bound": bound, "measured_s": measured, "predicted_s": predicted,
                     "error": measured / predicted - 1, "gap_recovered": recovered})

    print(f"step time D {delay_ms:.1f} ms (balanced, synchronous); stragglers {straggler} (PROB:DELAY_MS); "
          f"exchange a step: collectives' transfer {x_sync.mean() * 1e3:.2f} ms (sync trace), "
          f"point to point x_p2p {x_p2p * 1e3:.2f} ms (balanced bound-{largest} run)")
    print(f"{'run':<34} {'measured s':>10} {'predicted s':>11} {'error':>7} {'gap recovered':>13}")
    print(f"{'synchronous collectives':<34} {sync:10.3f} {sync_predicted:11.3f} {sync / sync_predicted - 1:+7.1%}")
    print(f"{'ideal (no synchronisation)':<34} {'':>10} {ideal:11.3f}")
    for row in rows:
        gap = "" if row["gap_recovered"] is None else f"{row['gap_recovered']:.0%}"
        print(f"{'bound ' + str(row['bound']):<34} {row['measured_s']:10.3f} {row['predicted_s']:11.3f} "
              f"{row['error']:+7.1%} {gap:>13}")
    if sync <= ideal:
        print(f"gap recovered undefined: the synchronous run ({sync:.3f} s) is not slower than the ideal "
              f"({ideal:.3f} s)")
    print(f"balanced: synchronous {plain:.3f} s, bound {largest} {balanced['makespan_s']:.3f} s "
          f"({balanced['makespan_s'] / plain - 1:+.1%})")
    (args.out / "results.json").write_text(json.dumps({
        "world": args.world, "steps": args.steps, "cores": os.cpu_count(), "straggler": straggler,
        "sync_s": sync, "sync_predicted_s": sync_predicted, "ideal_s": ideal, "exchange_p2p_s": x_p2p,
        "exchange_collectives_s": float(x_sync.mean()), "rows": rows,
        "balanced": {"sync_s": plain, "bound": largest, "bls_s": balanced["makespan_s"]}}, indent=1))


class Runner:
    """Record `train.py` on `world` ranks under out/NAME; returns the run's manifest metrics."""

    def __init__(self, out: Path, world: int) -> None:
        self.out, self.world = out, world

    def __call__(self, name: str, argv: list[str]) -> dict:
        run_dir = self.out / name
        train = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={self.world}",
                 "train.py", *argv]
        record = [sys.executable, "-m", "tracekit", "record", "-o", str(run_dir), "--force", "--lookup-every", "0",
                  "--", *train]
        done = subprocess.run(record, cwd=REPO, capture_output=True, text=True)
        if done.returncode:
            sys.exit(f"{name}: exit {done.returncode}\n{done.stderr[-4000:]}")
        return json.loads((run_dir / "manifest.json").read_text())["metrics"]


def _fill_warmup(m: np.ndarray, steps: int) -> np.ndarray:
    """ranks × replayed steps, padded to `steps` with each rank's median (the warm-up steps)."""
    missing = steps - m.shape[1]
    return np.hstack([np.repeat(np.median(m, axis=1, keepdims=True), missing, axis=1), m]) if missing > 0 else m


if __name__ == "__main__":
    main()

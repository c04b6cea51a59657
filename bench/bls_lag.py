"""BLS on 4 ranks with stragglers: measured makespan against the lag recurrence (issue 12's target).

    .venv/bin/python bench/bls_lag.py [--steps 200] [--bounds 0,1,2,4,8] [--probability 0.1] [--out DIR]

1. The synchronous inference run (collectives), untraced, without stragglers: its step time D.
2. The same, recorded, with `--straggler PROB:D`: each rank delays an iteration by one step with
   probability PROB, drawing on its own seeded generator, so every run below meets the same delays.
   Its per-rank work c[p][t] = step − blocking wait (analyses.policies.lag.work_matrix) is replayed
   through the recurrence for every bound, and for no bound (the slowest rank's own total: the ideal).
3. `--lag-bound B` runs with the same stragglers (recorded, for the same tracing cost): measured
   makespan (manifest metrics) against the prediction, and the share of the gap between the
   synchronous makespan and the ideal that the bound recovers.
4. Balanced (no stragglers): synchronous against the largest bound.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from analyses.context import open_context  # noqa: E402
from analyses.policies import lag  # noqa: E402
from analyses.timeline import compute as timeline  # noqa: E402

WORLD = 4


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--bounds", default="0,1,2,4,8")
    p.add_argument("--probability", type=float, default=0.1)
    p.add_argument("--out", type=Path, default=Path("/tmp/tracekit-bench-bls"))
    p.add_argument("--world", type=int, default=4, help="ranks (4: the issue's; this 2-core box oversubscribes them)")
    args = p.parse_args()
    global WORLD
    WORLD = args.world
    model = ["--preset", "criteo-kaggle", "--scale", "0.001", "--dim", "16", "--bottom-mlp", "64,16",
             "--top-mlp", "64,1", "--batch-size", "256", "--samples", str(args.steps * 256 * WORLD),
             "--steps", str(args.steps), "--inference", "--json"]
    print(f"machine: {platform.processor() or platform.machine()}, 2 cores, gloo on CPU, {WORLD} ranks; "
          f"criteo-kaggle x 0.001, dim 16, batch 256 per rank, {args.steps} iterations")
    plain = _makespan(_run(None, model))
    delay_ms = plain / args.steps * 1e3
    straggler = f"{args.probability}:{delay_ms:.1f}"
    print(f"synchronous, balanced: {plain:.3f} s ({delay_ms:.1f} ms a step); stragglers {straggler}")
    sync_dir = args.out / "sync"
    _run(sync_dir, [*model, "--straggler", straggler])
    c, _, _ = lag.work_matrix(timeline(open_context(sync_dir)).tables["timeline"])
    sync = _manifest_makespan(sync_dir)
    ideal = lag.replay(c, None)
    print(f"synchronous with stragglers: measured {sync:.3f} s, recurrence {lag.replay(c, 0):.3f} s; "
          f"ideal (no synchronisation) {ideal:.3f} s")
    print(f"{'bound':>5} {'measured s':>11} {'predicted s':>12} {'diff':>7} {'gap recovered':>14}")
    rows = []
    for bound in map(int, args.bounds.split(",")):
        run_dir = args.out / f"bound{bound}"
        _run(run_dir, [*model, "--straggler", straggler, "--lag-bound", str(bound)])
        measured, predicted = _manifest_makespan(run_dir), lag.replay(c, bound)
        recovered = (sync - measured) / (sync - ideal) if sync > ideal else None
        rows.append({"bound": bound, "measured_s": measured, "predicted_s": predicted, "recovered": recovered})
        print(f"{bound:>5} {measured:11.3f} {predicted:12.3f} {measured / predicted - 1:+7.1%} "
              f"{'' if recovered is None else f'{recovered:.0%}':>14}")
    largest = max(map(int, args.bounds.split(",")))
    balanced = _makespan(_run(None, [*model, "--lag-bound", str(largest)]))
    print(f"balanced: synchronous {plain:.3f} s, bound {largest} {balanced:.3f} s ({balanced / plain - 1:+.1%})")
    (args.out / "results.json").write_text(json.dumps({"sync": sync, "ideal": ideal, "rows": rows,
                                                       "balanced": [plain, balanced]}, indent=1))


def _run(run_dir: Path | None, argv: list[str]) -> str:
    train = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={WORLD}", "train.py",
             *argv]
    command = train if run_dir is None else [sys.executable, "-m", "tracekit", "record", "-o", str(run_dir), "--force",
                                             "--lookup-every", "0", "--", *train]
    return subprocess.run(command, cwd=REPO, capture_output=True, text=True, check=True).stdout


def _makespan(stdout: str) -> float:
    return float(json.loads(next(line for line in stdout.splitlines() if line.startswith("{")))["makespan_s"])


def _manifest_makespan(run_dir: Path) -> float:
    return float(json.loads((run_dir / "manifest.json").read_text())["metrics"]["makespan_s"])


if __name__ == "__main__":
    main()

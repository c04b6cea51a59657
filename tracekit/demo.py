"""The main job of the README (`make demo`): the whole loop on built-in synthetic data.

    tracekit optimize -o runs/demo --policies replication,schedule --objective bytes --check-all -- \\
        torchrun --standalone --nproc-per-node 2 train.py --preset criteo-kaggle --scale 0.01 ...

records the reference trainer on 2 gloo ranks (the Criteo Kaggle layout at 1% of its rows, with
its fitted skew), analyses it, re-runs it with each policy the analysis derived (recommended or
not: the measurement checks the decision), and prints the measured figures beside the predicted
ones (about three minutes on this project's 2-core machine).
Every run stays in runs/demo for `tracekit sql` and `tracekit compare`.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RUN_DIR = Path("runs") / "demo"  # under REPO, where the job runs
DEMO_ARGS = ["--preset", "criteo-kaggle", "--scale", "0.01", "--dim", "16", "--samples", "1000000",
             "--steps", "400", "--log-every", "100"]
OPTIMIZE_ARGS = ["--policies", "replication,schedule", "--objective", "bytes", "--check-all"]
"""Replicas sized for the fewest bytes; every section re-run, recommended or not, so the measurement
checks analyze's decision (on loopback, where bytes cost next to nothing, it recommends nothing)."""


def main() -> int:
    train = ["torchrun", "--standalone", "--nproc-per-node", "2", "train.py", *DEMO_ARGS, *sys.argv[1:]]
    print(f"$ tracekit optimize -o {RUN_DIR} {' '.join(OPTIMIZE_ARGS)} -- " + " ".join(train), flush=True)
    return subprocess.call([sys.executable, "-m", "tracekit", "optimize", "-o", str(RUN_DIR), *OPTIMIZE_ARGS, "--",
                            sys.executable, "-m", "torch.distributed.run", *train[1:]], cwd=REPO)


if __name__ == "__main__":
    sys.exit(main())

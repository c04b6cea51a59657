"""The main job of the README (`make demo`): the reference trainer on built-in synthetic data.

Trains the reference DLRM for about two minutes on 2 gloo ranks (torchrun) and prints its
progress and summary. The record -> analyze -> re-run -> compare -> report loop joins this
job as those commands land.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEMO_ARGS = ["--steps", "3000", "--eval-every", "1000", "--log-every", "250", "--zipf", "1.05", "--samples", "3500000"]


def main() -> int:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(REPO / "train.py"), *DEMO_ARGS, *sys.argv[1:]]
    print("$ torchrun --standalone --nproc-per-node 2 train.py " + " ".join(DEMO_ARGS + sys.argv[1:]), flush=True)
    return subprocess.call(cmd, cwd=REPO)


if __name__ == "__main__":
    sys.exit(main())

"""The main job of the README (`make demo`): the loop on built-in synthetic data, as far as it is built.

1. `tracekit record -o runs/demo -- torchrun --nproc-per-node 2 train.py ...` records the reference
   trainer on 2 gloo ranks (Criteo-like skew, evaluation passes included; about two minutes here);
2. `tracekit analyze runs/demo` derives skew, traffic, timeline, cache and cost figures and the
   policies with their predicted savings (training rows only), writing policy.json.

The re-run with the policy, `compare` and `report` join this job as those commands land.
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
    print(f"$ tracekit record -o {RUN_DIR} --force -- " + " ".join(train), flush=True)
    code = subprocess.call([sys.executable, "-m", "tracekit", "record", "-o", str(RUN_DIR), "--force", "--",
                            sys.executable, "-m", "torch.distributed.run", *train[1:]], cwd=REPO)
    if code != 0:
        return code
    print(f"\n$ tracekit analyze {RUN_DIR}", flush=True)
    return subprocess.call([sys.executable, "-m", "tracekit", "analyze", str(RUN_DIR)], cwd=REPO)


if __name__ == "__main__":
    sys.exit(main())

"""The main job of the README (`make demo`): the whole loop on built-in synthetic data.

    tracekit optimize -o runs/demo --policies replication,schedule --objective bytes --check-all \\
        --cluster 2x1 --link 200mbit -- python train.py --preset criteo-kaggle --scale 0.01 ...

records the reference trainer on 2 gloo ranks (the Criteo Kaggle layout at 1% of its rows, with
its fitted skew), analyses it, re-runs it with each policy the analysis derived (recommended or
not: the measurement checks the decision), and prints the measured figures beside the predicted
ones, ending with the verdict (about two minutes on this project's 2-core machine). It runs on an
emulated cluster of 2 nodes whose link (200mbit) makes the embedding exchange cost time, where root
and network namespaces allow (`tracekit cluster`); elsewhere on one host's loopback, saying why, where
the exchange costs next to nothing and no policy pays.
Every run stays in runs/demo for `tracekit sql` and `tracekit compare`.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RUN_DIR = Path("runs") / "demo"  # under REPO, where the job runs
DEMO_ARGS = ["--preset", "criteo-kaggle", "--scale", "0.01", "--dim", "16", "--samples", "1000000",
             "--log-every", "100"]
OPTIMIZE_ARGS = ["--policies", "replication,schedule", "--objective", "bytes", "--check-all"]
"""Replicas sized for the fewest bytes; every section re-run, recommended or not, so the measurement
checks analyze's decision."""
NODES, LINK = 2, "200mbit"
STEPS = {"cluster": 200, "loopback": 400}  # a step on the link takes ~4× one on loopback


def cluster_unavailable() -> str | None:
    """Why the demo cannot run on an emulated cluster here (no root, no iproute2, no tbf), or None."""
    from tracekit.app.cluster import Cluster, ClusterError, check_prerequisites

    try:
        check_prerequisites(Cluster(NODES, 1, LINK))
    except ClusterError as err:
        return str(err)
    except (OSError, subprocess.CalledProcessError) as err:
        return f"network namespaces cannot be made here ({err})"
    return None


def main() -> int:
    why_not = cluster_unavailable()
    where = "loopback" if why_not else "cluster"
    steps = ["--steps", str(STEPS[where])]
    if why_not:
        print(f"on one host's loopback, where the embedding exchange costs next to nothing, so no policy pays: "
              f"{why_not}", flush=True)
        train = ["torchrun", "--standalone", "--nproc-per-node", str(NODES), "train.py", *DEMO_ARGS, *steps, *sys.argv[1:]]
        options, command = OPTIMIZE_ARGS, [sys.executable, "-m", "torch.distributed.run", *train[1:]]
    else:
        train = ["python", "train.py", *DEMO_ARGS, *steps, *sys.argv[1:]]
        options = [*OPTIMIZE_ARGS, "--cluster", f"{NODES}x1", "--link", LINK]
        command = [sys.executable, *train[1:]]
    print(f"$ tracekit optimize -o {RUN_DIR} {' '.join(options)} -- " + " ".join(train), flush=True)
    return subprocess.call([sys.executable, "-m", "tracekit", "optimize", "-o", str(RUN_DIR), *options, "--",
                            *command], cwd=REPO)


if __name__ == "__main__":
    sys.exit(main())

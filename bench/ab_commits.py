"""Samples/s of the untraced reference trainer at two commits, alternating run by run.

    .venv/bin/python bench/ab_commits.py 62213b5 [--pairs 5] -- --preset criteo-kaggle --scale 0.01 ...

Checks out OLD in a scratch worktree (the compiled kernel copied from this checkout, so both run
the same C++), then runs `torchrun --nproc-per-node 2 train.py ARGS --json` from OLD and from this
checkout in turn, `--pairs` times, and prints both medians, their ratio and the per-pair ratios.
Used for "a path costs nothing when unused" (bench/RESULTS.md §6: replication with no --policy).
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def samples_per_s(tree: Path, args: list[str]) -> float:
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          "train.py", *args, "--json"], cwd=tree, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])["samples_per_s"]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("old")
    p.add_argument("--pairs", type=int, default=5)
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)
    args, train = p.parse_args(argv[:cut]), argv[cut + 1:]
    scratch = Path(tempfile.mkdtemp(prefix="tracekit-ab-"))
    old = scratch / "old"
    subprocess.run(["git", "worktree", "add", "--detach", str(old), args.old], cwd=REPO, check=True,
                   capture_output=True)
    try:
        for kernel in (REPO / "tracekit" / "dlrm").glob("_sparse_update*.so"):
            shutil.copy(kernel, old / "tracekit" / "dlrm" / kernel.name)
        runs: dict[str, list[float]] = {"old": [], "new": []}
        for _ in range(args.pairs):
            runs["old"].append(samples_per_s(old, train))
            runs["new"].append(samples_per_s(REPO, train))
        o, n = statistics.median(runs["old"]), statistics.median(runs["new"])
        pairs = [b / a for a, b in zip(runs["old"], runs["new"])]
        print(f"machine: {platform.processor() or platform.machine()}, 2 cores, gloo, 2 ranks; train.py {' '.join(train)}")
        print(f"{args.old}: median {o:,.0f} samples/s {[round(x) for x in runs['old']]}")
        print(f"HEAD: median {n:,.0f} samples/s {[round(x) for x in runs['new']]}")
        print(f"HEAD / {args.old}: {n / o:.3f} (medians), per pair {[round(x, 3) for x in pairs]}, "
              f"median pair {statistics.median(pairs):.3f}")
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(old)], cwd=REPO, capture_output=True)
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()

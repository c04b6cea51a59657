"""Recording a wide, long run, a soak (bench/RESULTS.md §25): 8 ranks × 1,000 steps on this machine, lookups
every step; then the same with the disk slowed (every Parquet part 0.5 s late,
TRACEKIT_FAULT_SLOW_WRITE_S), where the writer falls behind; and slowed with the bound on the ids a
rank holds for its writer lowered (TRACEKIT_MAX_PENDING_IDS) so that it sheds.

For each: the accesses written equal those fed (recounted from the very samples the trainer
consumed), rows dropped, the ranks' resident memory over the run (sampled from their heartbeats
each second: max − min after the first fifth of the run, against its median), and samples/s beside
an untraced run of the same command. From the repo root:

    .venv/bin/python bench/soak.py [--ranks 8] [--steps 1000] [--slow-write 0.5] [--shed-bound 16384] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import pyarrow.compute as pc
import pyarrow.parquet as pq

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tracekit.dlrm.data import open_dataset  # noqa: E402
from tracekit.app.hang import read_heartbeats  # noqa: E402

TRAINER = ["--tables", "8", "--rows", "100000", "--dim", "16", "--bottom-mlp", "32,16", "--top-mlp", "32,1",
           "--batch-size", "64", "--pooling", "4", "--eval-fraction", "0", "--log-every", "100000", "--json"]


def fed_accesses(ranks: int, steps: int) -> int:
    """Every id the trainer's first `steps` global batches look up (they are all recorded)."""
    dataset = open_dataset("synthetic", tables=8, rows=100000, num_dense=13, pooling=4, samples=64 * ranks * (steps + 1),
                           seed=0, zipf=None, drift=0.0, preset=None, scale=1.0)
    batch = dataset.batch(0, 64 * ranks * steps)
    return int(batch.lengths.sum())


def run(command: list[str], env: dict[str, str], run_dir: Path | None) -> dict:
    """The job's JSON summary, and (traced) the ranks' RSS sampled from their heartbeats."""
    rss: dict[int, list[int]] = {}
    done = threading.Event()

    def sample() -> None:
        while not done.wait(1.0):
            for rank, beat in read_heartbeats(run_dir).items():
                if beat.get("rss_bytes"):
                    rss.setdefault(rank, []).append(beat["rss_bytes"])

    if run_dir is not None:
        threading.Thread(target=sample, daemon=True).start()
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, env={**os.environ, **env})
    done.set()
    if result.returncode != 0:
        sys.exit(f"{' '.join(command)} failed ({result.returncode}):\n{result.stderr[-3000:]}")
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    return {"samples_per_s": summary["samples_per_s"], "rss": rss, "stderr": result.stderr}


def memory(rss: dict[int, list[int]]) -> str:
    """Per rank after the first fifth of the samples: (max − min) / median."""
    spans = []
    for rank, values in sorted(rss.items()):
        kept = values[len(values) // 5:]
        if kept:
            spans.append((max(kept) - min(kept)) / statistics.median(kept))
    return (f"max − min {max(spans):.1%} of the median at most (over {len(spans)} ranks, "
            f"{min(len(v) for v in rss.values())}+ samples each)" if spans else "no samples")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=8)
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--slow-write", type=float, default=0.5)
    p.add_argument("--shed-bound", type=int, default=16384,
                   help="TRACEKIT_MAX_PENDING_IDS of the third run, low enough that the slowed writer sheds")
    p.add_argument("--out", type=Path, default=Path("/tmp/tracekit-soak"))
    args = p.parse_args()
    python = str(ROOT / ".venv" / "bin" / "python")
    job = [python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(args.ranks), "train.py",
           *TRAINER, "--steps", str(args.steps), "--samples", str(64 * args.ranks * (args.steps + 1))]
    fed = fed_accesses(args.ranks, args.steps)
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores; {args.ranks} gloo ranks, "
          f"{args.steps} steps, train.py {' '.join(TRAINER)}; lookups every step")
    untraced = run(job, {}, None)
    print(f"untraced: {untraced['samples_per_s']:,.0f} samples/s")
    slow = {"TRACEKIT_FAULT_SLOW_WRITE_S": str(args.slow_write)}
    for name, folder, env in (("traced", "traced", {}),
                              (f"traced, every part {args.slow_write} s late", "slow", slow),
                              (f"traced, every part {args.slow_write} s late, at most {args.shed_bound:,} ids held",
                               "shed", {**slow, "TRACEKIT_MAX_PENDING_IDS": str(args.shed_bound)})):
        run_dir = args.out / folder
        command = [python, "-m", "tracekit", "record", "--force", "--lookup-every", "1", "-o", str(run_dir), "--", *job]
        t0 = time.monotonic()
        got = run(command, env, run_dir)
        manifest = json.loads((run_dir / "manifest.json").read_text())
        written = sum(pc.sum(pq.read_table(part, columns=["count"])["count"]).as_py() or 0
                      for part in run_dir.glob("accesses/rank=*/*.parquet"))
        dropped = Counter()
        for per in (manifest.get("dropped_rows") or {}).values():
            dropped.update(per)
        print(f"\n{name}: {got['samples_per_s']:,.0f} samples/s ({got['samples_per_s'] / untraced['samples_per_s'] - 1:+.1%}"
              f" against untraced), {time.monotonic() - t0:.0f} s")
        shed = dropped.get("accesses", 0)
        print(f"  accesses: {written:,} lookups written of {fed:,} fed ({'equal' if written == fed else 'NOT equal'}); "
              f"written + shed {'=' if written + shed == fed else '!='} fed; dropped rows: {dict(dropped) or 'none'}")
        print(f"  resident memory per rank: {memory(got['rss'])}")
        print(f"  trace: {sum(p.stat().st_size for p in run_dir.rglob('*.parquet')) / 1e6:.1f} MB; "
              f"status {manifest['status']}")


if __name__ == "__main__":
    main()

"""`tracekit simulate` against the target's size: wall time and peak memory of a projection with its
sections derived for the target, and the speedups it predicts, at 4, 16, 64, 256 and 1,024 ranks
(bench/RESULTS.md §41).

    .venv/bin/python bench/simulate_scale.py [--runs DIR] [--repeat 3] [--link 100gbit] [--per-node 8]

Two workloads, recorded once into --runs (lookups on every step) unless there already:
- demo: the demo's job, criteo-kaggle at 1% of its rows, dim 16, batch 512, 200 steps on 2 ranks;
- wide8: 26 tables of 20,000 rows, dim 16, batch 256, 60 steps on 8 ranks (issue 54's run).
Each (workload, world) is projected `--repeat` times in a fresh process (`python -m tracekit simulate
RUN --json`, what a user waits for), the worlds interleaved within each repetition; the figure is the
median wall time and the largest peak resident memory of the process. Prints a table per workload and
writes --runs/simulate_scale.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
WORLDS = (4, 16, 64, 256, 1024)
WORKLOADS = {
    "demo": (2, ["--preset", "criteo-kaggle", "--scale", "0.01", "--dim", "16", "--samples", "1000000",
                 "--steps", "200", "--log-every", "100"]),
    "wide8": (8, ["--tables", "26", "--rows", "20000", "--dim", "16", "--batch-size", "256", "--samples", "200000",
                  "--steps", "60", "--log-every", "100", "--bottom-mlp", "64,16", "--top-mlp", "64,1"]),
}


def record(run: Path, ranks: int, args: list[str]) -> None:
    if (run / "manifest.json").is_file():
        return
    subprocess.run([sys.executable, "-m", "tracekit", "record", "-o", str(run), "--force", "--lookup-every", "1", "--",
                    sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
                    "train.py", *args], cwd=REPO, check=True, capture_output=True)


PEAK = ("import resource, subprocess, sys; r = subprocess.run(sys.argv[1:]); "
        "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, file=sys.stderr); sys.exit(r.returncode)")
"""Runs a command and prints its process tree's peak resident memory (KiB) last on stderr."""


def project(run: Path, world: int, per_node: int, link: str) -> tuple[float, float, dict]:
    """(wall seconds, peak RSS GiB, the summary) of one `tracekit simulate` in a fresh process."""
    nodes, ranks = max(world // per_node, 1), min(per_node, world)
    start = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", PEAK, sys.executable, "-m", "tracekit", "simulate", str(run),
                          "--topology", f"{nodes}x{ranks}", "--inter-bw", link, "--no-report", "--json"],
                         cwd=REPO, check=True, capture_output=True, text=True)
    wall = time.perf_counter() - start
    return wall, int(out.stderr.strip().splitlines()[-1]) / 2**20, json.loads(out.stdout)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--runs", type=Path, default=Path("/tmp/tracekit-bench-simulate"))
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--link", default="100gbit")
    p.add_argument("--per-node", type=int, default=8)
    p.add_argument("--workloads", default=",".join(WORKLOADS))
    args = p.parse_args()
    print(f"machine: {platform.processor() or platform.machine()}, 2 cores; python {platform.python_version()}; "
          f"targets of {args.per_node} ranks a node at {args.link} between nodes")
    results = {}
    for name in args.workloads.split(","):
        ranks, train = WORKLOADS[name]
        run = args.runs / name
        record(run, ranks, train)
        walls: dict[int, list[float]] = {w: [] for w in WORLDS}
        peaks: dict[int, float] = dict.fromkeys(WORLDS, 0.0)
        rows: dict[int, list[dict]] = {}
        for _ in range(args.repeat):
            for world in WORLDS:  # interleaved: a slow minute of the box falls on every world alike
                wall, peak, summary = project(run, world, args.per_node, args.link)
                walls[world].append(wall)
                peaks[world] = max(peaks[world], peak)
                rows[world] = summary["rows"]
        results[name] = {str(w): {"wall_s": statistics.median(walls[w]), "walls_s": walls[w], "peak_gib": peaks[w],
                                  "rows": rows[w]} for w in WORLDS}
        show(name, results[name])
    (args.runs / "simulate_scale.json").write_text(json.dumps(results, indent=1))


def show(name: str, by_world: dict) -> None:
    print(f"\n{name}: median wall (s) and peak RSS (GiB) of `tracekit simulate`, sections derived for each target;"
          " step time (ms) and speedup of each section")
    sections = sorted({r["policy"] for w in by_world.values() for r in w["rows"]} - {"baseline"})
    print("| ranks | wall s | peak GiB | baseline ms | " + " | ".join(sections) + " |")
    print("|---:|---:|---:|---:|" + "---:|" * len(sections))
    for world, w in by_world.items():
        rows = {r["policy"]: r for r in w["rows"]}
        cells = [f"{rows[s]['step_time_s'] * 1e3:.1f} ({rows[s]['speedup']:.2f}×)" if s in rows else "–"
                 for s in sections]
        print(f"| {world} | {w['wall_s']:.1f} | {w['peak_gib']:.2f} | {rows['baseline']['step_time_s'] * 1e3:.1f} | "
              + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()

"""FlexShard's tiers against replication alone on an emulated cluster (bench/RESULTS.md §24).

    .venv/bin/python bench/tiers_cluster.py [--shape 2x2] [--link 200mbit] [--steps 40] [--budget 10%]
        [--out DIR] [--analyse-only]

The workload is FlexShard's setting: sequence features with many ids per sample (the Criteo Kaggle
layout × 0.01, its first 4 tables sequence features, 8 ids per bag, dim 64, lr 0.01). One
`tracekit optimize --cluster SHAPE --link LINK --policies replication,tiers --check-all`: the
baseline recorded on the cluster, analysed, and both sections re-run there at the same replica
memory per rank (the budget analyze chose), whichever it recommended. Prints, per run, the step
time and the exchange's bytes within and between nodes, measured beside predicted, the sync's bytes,
the loss curve against the baseline, and `simulate`'s projection of the same policy file to 8×8
(and the target shape) from the cluster baseline. Writes OUT/results.json.
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

from analyses import simulate  # noqa: E402
from analyses.compare import compare  # noqa: E402
from tracekit.topology import Topology  # noqa: E402
from tracekit.units import parse_rate  # noqa: E402

WORKLOAD = ["--preset", "criteo-kaggle", "--scale", "0.01", "--sequence-tables", "4", "--pooling", "8",
            "--batch-size", "256", "--samples", "400000", "--eval-fraction", "0.02", "--log-every", "1000",
            "--lr", "0.01"]
FIGURES = ("step_time_s", "intra_bytes_per_step", "inter_bytes_per_step", "a2a_bytes_per_step", "sync_bytes_per_step")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="2x2")
    p.add_argument("--link", default="200mbit")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--budget", help="replica memory per rank for both sections (default: analyze's choice)")
    p.add_argument("--out", type=Path, default=Path("/tmp/tracekit-bench-tiers"))
    p.add_argument("--analyse-only", action="store_true", help="re-read the runs an earlier invocation left in --out")
    args = p.parse_args()
    shape = Topology.parse(args.shape)
    train = [sys.executable, "train.py", *WORKLOAD, "--steps", str(args.steps)]
    if not args.analyse_only:
        run = subprocess.run([sys.executable, "-m", "tracekit", "optimize", "-o", str(args.out), "--cluster",
                              shape.name, "--link", args.link, "--policies", "replication,tiers", "--check-all",
                              *(["--budget", args.budget] if args.budget else []), "--json", "--", *train],
                             cwd=REPO, capture_output=True, text=True)
        if run.returncode != 0:
            sys.exit(f"optimize failed ({run.returncode}): {run.stderr[-3000:]}")
    runs = sorted(d for d in args.out.iterdir() if d.is_dir() and d.name != "base")
    summary = compare(args.out / "base", runs).summary
    rows = {(r["run"].rsplit("/", 1)[-1], r["section"], r["figure"]): r for r in summary["rows"]}
    print(f"machine: {platform.processor() or platform.machine()}, 2 cores, gloo on CPU; tracekit cluster "
          f"{shape.name} at {args.link}; train.py {' '.join(WORKLOAD)} --steps {args.steps}\n")
    print("| run | step (ms) measured | predicted | inter-node exchange MB/step measured | predicted "
          "| intra-node MB/step measured | predicted | sync MB/step measured | predicted | loss max abs diff |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    results = []
    for figures in summary["runs"]:
        name = Path(figures["run"]).name
        section = name.split(".")[0]
        predicted = {f: (rows.get((name, section, f)) or {}).get("predicted") for f in FIGURES}
        results.append({"run": name, "measured": {f: figures.get(f) for f in FIGURES}, "predicted": predicted,
                        "loss_max_abs_diff": figures.get("loss_max_abs_diff"),
                        "samples_per_s": figures.get("samples_per_s")})
        print(f"| {name} | {_ms(figures.get('step_time_s'))} | {_ms(predicted['step_time_s'])} "
              f"| {_mb(figures.get('inter_bytes_per_step'))} | {_mb(predicted['inter_bytes_per_step'])} "
              f"| {_mb(figures.get('intra_bytes_per_step'))} | {_mb(predicted['intra_bytes_per_step'])} "
              f"| {_mb(figures.get('sync_bytes_per_step'))} | {_mb(predicted['sync_bytes_per_step'])} "
              f"| {figures.get('loss_max_abs_diff') or 0:.2e} |")
    by_name = {r["run"]: r for r in results}
    base, rep, tiers = (by_name.get(n, {}).get("measured", {}) for n in ("base", "replication", "tiers"))
    if base and tiers and rep:
        print(f"\ninter-node exchange bytes, tiers against the baseline: "
              f"{tiers['inter_bytes_per_step'] / base['inter_bytes_per_step'] - 1:+.1%}; step time, replication over "
              f"tiers: {rep['step_time_s'] / tiers['step_time_s']:.2f}x; baseline over tiers: "
              f"{base['step_time_s'] / tiers['step_time_s']:.2f}x")
    policy_path = args.out / "base" / "policy.json"
    projections = []
    for target in (shape, Topology(8, 8)):  # the recorded one as written, 8x8 with sections derived for it
        summary = simulate.project(args.out / "base", simulate.Target(target.nodes, target.ranks_per_node,
                                                                      inter_bw=parse_rate(args.link)),
                                   policy_path if target == shape else None)
        for r in summary["rows"]:
            projections.append({"target": target.name, "policy": r["policy"], "method": r["method"],
                                "step_time_s": r["step_time_s"], "inter_node_bytes_per_step": r["inter_node_bytes_per_step"],
                                "speedup": r["speedup"]})
    print("\n| simulate onto | policy | method | step (ms) | inter-node MB/step | speedup |\n|---|---|---|---:|---:|---:|")
    for r in projections:
        print(f"| {r['target']} | {r['policy']} | {r['method']} | {_ms(r['step_time_s'])} "
              f"| {_mb(r['inter_node_bytes_per_step'])} | {r['speedup'] or 0:.2f}x |")
    (args.out / "results.json").write_text(json.dumps({"runs": results, "simulate": projections,
                                                       "notes": summary.get("notes", [])}, indent=1))


def _ms(value: float | None) -> str:
    return "n/a" if value is None else f"{value * 1e3:,.1f}"


def _mb(value: float | None) -> str:
    return "n/a" if value is None else f"{value / 1e6:,.2f}"


if __name__ == "__main__":
    main()

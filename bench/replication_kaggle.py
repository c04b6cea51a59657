"""Replication on the Criteo Kaggle layout, measured against predicted (bench/RESULTS.md §6).

    .venv/bin/python bench/replication_kaggle.py [--scale 0.01] [--steps 300] [--worlds 2,4] [--pairs 3]
        [--train-args "--sequence-tables 4 --pooling 2"] [--out DIR]

Per world size, all runs recorded with `--lookup-every 1` (the same tracing, so times compare):
1. `tracekit optimize --policies replication --objective bytes`: the baseline, its analysis, the
   chosen policy (least network bytes: on loopback the time objective replicates little) re-run;
2. a policy of the first rows of the same order up to 10% of the embedding bytes (FlexShard's
   budget), its bytes predicted by the same replay (analyses.policies.replication.curve), re-run;
3. `--pairs - 1` more baseline / chosen-policy pairs, alternating, for the step time (medians).
Prints replica rows, all-to-all and total embedding bytes per step (measured, predicted, saving
against the baseline) and step times (medians over the pairs, against the prediction).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from analyses import exchange
from analyses.network import network  # noqa: E402
from analyses.compare import compare  # noqa: E402
from analyses.context import open_context  # noqa: E402
from analyses.policies import replication  # noqa: E402
from tracekit.policy import load_policy, write_policy  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--scale", type=float, default=0.01)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--worlds", default="2,4")
    p.add_argument("--pairs", type=int, default=3)
    p.add_argument("--share", type=float, default=0.10, help="replica budget of the second policy, share of rows")
    p.add_argument("--out", type=Path, default=Path("/tmp/tracekit-bench-replication"))
    p.add_argument("--train-args", default="", help='more options of train.py, e.g. "--sequence-tables 4 --pooling 2"')
    args = p.parse_args()
    print(f"machine: {platform.processor() or platform.machine()}, 2 cores, gloo on CPU; "
          f"preset criteo-kaggle x {args.scale}, dim 16, batch 512 per rank, {args.steps} steps {args.train_args}")
    for world in map(int, args.worlds.split(",")):
        out = args.out / f"w{world}"
        train = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
                 "train.py", "--preset", "criteo-kaggle", "--scale", str(args.scale), "--dim", "16",
                 "--samples", "1000000", "--steps", str(args.steps), "--log-every", "1000", *args.train_args.split()]
        subprocess.run([sys.executable, "-m", "tracekit", "optimize", "-o", str(out), "--policies", "replication",
                        "--objective", "bytes", "--json", "--", *train], cwd=REPO, capture_output=True, text=True,
                       check=True)
        budget_policy = share_policy(out / "base", args.share)
        record(out / "share", [*train, "--policy", str(budget_policy)])
        bases, reps = [out / "base"], [out / "replication"]
        for i in range(1, args.pairs):
            record(out / f"base{i}", train)
            record(out / f"replication{i}", [*train, "--policy", str(out / "base" / "policy.replication.json")])
            bases.append(out / f"base{i}")
            reps.append(out / f"replication{i}")
        report(world, out, bases, reps)


def record(run_dir: Path, command: list[str]) -> None:
    subprocess.run([sys.executable, "-m", "tracekit", "record", "-o", str(run_dir), "--force", "--lookup-every", "1",
                    "--", *command], cwd=REPO, capture_output=True, check=True)


def share_policy(base: Path, share: float) -> Path:
    """policy.share.json: the first rows of replication's order within `share` of the embedding bytes."""
    with open_context(base) as ctx:
        s = exchange.baseline(ctx)
        c = replication.curve(ctx, s, "tk_order_share", replication.benefit_key(s, network(ctx)))
        total = sum(t.num_rows * t.row_bytes for t in ctx.model.tables)
    k = int((c.replica_bytes <= share * total).nonzero()[0].max())
    policy = load_policy(base / "policy.json")
    keep = {key: v for key, v in policy.items() if key not in ("replication", "tiers", "schedule", "compression", "lag")}
    keep["replication"] = {
        "kind": "hybrid", "rows": "policy/share_rows.parquet", "budget_bytes_per_rank": int(c.replica_bytes[k]),
        "sync": c.sync_kind(k),
        "predicted": {"a2a_bytes_per_step": float(c.a2a_out[k]), "a2a_remote_bytes_per_step": float(c.a2a_rem[k]),
                      "sync_bytes_per_step": float(c.sync[k]), "hot_rows": k,
                      "step_time_s": None if c.step_time is None else float(c.step_time[k])},
        "why": f"the first {k} rows of replication's order: {share:.0%} of the embedding bytes"}
    rows = c.order.head(k).select("table_name", "row")
    return write_policy(base / "policy.share.json", keep, rows={"share_rows": rows})


def report(world: int, out: Path, bases: list[Path], reps: list[Path]) -> None:
    summary = compare(bases[0], [reps[0], out / "share", *bases[1:], *reps[1:]]).summary
    runs = {Path(r["run"]).name: r for r in summary["runs"]}
    base = runs["base"]
    model = load_policy(out / "base" / "policy.json")["model"]
    rows = sum(t["num_rows"] for t in model["tables"])
    a2a0 = base["a2a_bytes_per_step"]
    print(f"\nworld {world}: baseline all-to-all {a2a0:,.0f} bytes/step")
    for name, label in (("replication", "chosen (least network bytes)"), ("share", "10% of the bytes")):
        policy = load_policy(out / "base" / f"policy.{name}.json")["replication"]
        predicted, run = policy["predicted"], runs[name]
        predicted_total = predicted["a2a_bytes_per_step"] + predicted["sync_bytes_per_step"]
        print(f"  {label}: {predicted['hot_rows']:,} rows = {predicted['hot_rows'] / rows:.2%}, {policy['sync']}")
        print(f"    all-to-all  {run['a2a_bytes_per_step']:,.0f} measured, {predicted['a2a_bytes_per_step']:,.0f} "
              f"predicted: {1 - run['a2a_bytes_per_step'] / a2a0:.1%} saved")
        print(f"    total       {run['total_bytes_per_step']:,.0f} measured, {predicted_total:,.0f} predicted: "
              f"{1 - run['total_bytes_per_step'] / a2a0:.1%} saved")
    base_times = [runs[p.name]["step_time_s"] for p in bases]
    rep_times = [runs[p.name]["step_time_s"] for p in reps]
    predicted = load_policy(out / "base" / "policy.replication.json")["replication"]["predicted"]["step_time_s"]
    b, r = statistics.median(base_times), statistics.median(rep_times)
    print(f"  step time (median over {len(bases)} alternating runs each): baseline {b * 1e3:.2f} ms "
          f"{[round(t * 1e3, 2) for t in base_times]}, replicated {r * 1e3:.2f} ms {[round(t * 1e3, 2) for t in rep_times]}; "
          f"predicted {predicted * 1e3:.2f} ms ({r / predicted - 1:+.1%})")
    print(json.dumps({"world": world, "base_step_s": base_times, "rep_step_s": rep_times, "predicted_s": predicted}))


if __name__ == "__main__":
    main()

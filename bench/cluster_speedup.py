"""Policies on an emulated cluster, and `simulate` checked against it (bench/RESULTS.md §8).

    .venv/bin/python bench/cluster_speedup.py [--configs 2x1@200mbit,2x1@1gbit,2x1@10gbit,2x2@200mbit]
        [--steps 60] [--batch-size 2048] [--out DIR]

Per configuration NODESxRANKS@LINK, on the criteo-kaggle preset (scale 0.01, dim 64):
1. `tracekit optimize --cluster NODESxRANKS --link LINK --objective bytes`: the baseline recorded on
   the emulated cluster, analysed, each policy section re-run there, and compared: the step-time
   speedup of each policy, the loss curve's largest difference against the baseline, and the
   baseline's communication share (projected onto its own cluster: communication over the step);
2. `simulate` of that baseline onto its own topology and link with its policy.json as written: predicted
   step time of every policy against the measured one;
3. `simulate` of one baseline recorded on loopback at 2 ranks (one node, `torchrun --standalone`) onto
   NODESxRANKS at LINK with the same policy as written: the projection of a run to a cluster it never
   ran on, against what that cluster measured. The emulated ranks share the box's 2 cores, so their
   compute is not a loopback rank's: `--compute-scale` gives the target the cluster baseline's compute
   (its free-communication step over the loopback run's), which isolates the network; the same
   without it (compute as recorded on loopback); and with it, priced half duplex (gloo's pairs).
Prints one table per configuration and writes OUT/results.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from analyses import simulate  # noqa: E402
from analyses.compare import compare  # noqa: E402
from analyses.context import Options, open_context  # noqa: E402
from tracekit.policy import read_policy  # noqa: E402
from tracekit.topology import Topology  # noqa: E402
from tracekit.units import parse_rate  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--configs", default="2x1@200mbit,2x1@1gbit,2x1@10gbit,2x2@200mbit")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--batch-size", type=int, default=2048)
    p.add_argument("--policies", default="replication,schedule")
    p.add_argument("--train-args", default="", help="more options of train.py")
    p.add_argument("--out", type=Path, default=Path("/tmp/tracekit-bench-cluster"))
    p.add_argument("--analyse-only", action="store_true",
                   help="re-read the runs an earlier invocation left in --out (no new runs)")
    args = p.parse_args()
    train = ["train.py", "--preset", "criteo-kaggle", "--scale", "0.01", "--batch-size", str(args.batch_size),
             "--samples", "2000000", "--steps", str(args.steps), "--log-every", "1000", *args.train_args.split()]
    print(f"machine: {platform.processor() or platform.machine()}, 2 cores, gloo on CPU over emulated links; "
          f"criteo-kaggle x 0.01, dim 64, batch {args.batch_size} per rank, {args.steps} steps")
    loopback: dict[int, Path] = {}
    results = []
    for config in args.configs.split(","):
        shape, _, link = config.partition("@")
        nodes, per_node = Topology.parse(shape).nodes, Topology.parse(shape).ranks_per_node
        out = args.out / config.replace("@", "-")
        if args.analyse_only:
            summary = compare(out / "base", sorted(d for d in out.iterdir() if d.is_dir() and d.name != "base")).summary
            results.append(measure(config, nodes, per_node, parse_rate(link), out, summary, args.out / "loopback-w2"))
            show(results[-1])
            continue
        run = subprocess.run([sys.executable, "-m", "tracekit", "optimize", "-o", str(out), "--cluster", shape,
                              "--link", link, "--objective", "bytes", "--policies", args.policies, "--json", "--",
                              sys.executable, *train], cwd=REPO, capture_output=True, text=True)
        if run.returncode != 0:
            print(f"{config}: optimize failed ({run.returncode}): {run.stderr[-2000:]}")
            continue
        summary = json.loads(run.stdout.strip().splitlines()[-1])
        if 2 not in loopback:
            loopback[2] = record_loopback(args.out / "loopback-w2", 2, train)
        results.append(measure(config, nodes, per_node, parse_rate(link), out, summary, loopback[2]))
        show(results[-1])
    (args.out / "results.json").write_text(json.dumps(results, indent=1))


def record_loopback(run_dir: Path, world: int, train: list[str]) -> Path:
    subprocess.run([sys.executable, "-m", "tracekit", "record", "-o", str(run_dir), "--force", "--lookup-every", "1",
                    "--", sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
                    *train], cwd=REPO, check=True, capture_output=True)
    return run_dir


def measure(config: str, nodes: int, per_node: int, link: float, out: Path, summary: dict, loop: Path) -> dict:
    base = out / "base"
    policy_path = base / "policy.json"
    target = simulate.Target(nodes, per_node, inter_bw=link)
    own = simulate.project(base, target, policy_path, derive=False)
    on_cluster = _by_policy(own)
    loopback = _by_policy(_projected(loop, target, policy_path))
    scale = on_cluster["baseline"]["compute_s"] / loopback["baseline"]["compute_s"]
    isolated = _by_policy(_projected(loop, replace(target, compute_scale=scale), policy_path))
    half = _by_policy(_projected(loop, replace(target, compute_scale=scale, duplex=False), policy_path))
    base_time = summary["runs"][0]["step_time_s"]
    runs = []
    for figures in summary["runs"]:
        name = Path(figures["run"]).name
        key = "baseline" if name == "base" else name
        runs.append({"run": name, "step_time_s": figures["step_time_s"], "speedup": base_time / figures["step_time_s"],
                     "loss_max_abs_diff": figures.get("loss_max_abs_diff"),
                     "bytes_per_step": figures.get("bytes_per_step"),
                     "predicted_same_cluster_s": on_cluster.get(key, {}).get("step_time_s"),
                     "predicted_from_loopback_s": isolated.get(key, {}).get("step_time_s"),
                     "predicted_loopback_compute_s": loopback.get(key, {}).get("step_time_s"),
                     "predicted_half_duplex_s": half.get(key, {}).get("step_time_s"),
                     "predicted_bytes_per_step": isolated.get(key, {}).get("bytes_per_step")})
    return {"config": config, "comm_share": on_cluster["baseline"]["comm_share"], "compute_scale": scale,
            "runs": runs, "notes": summary.get("notes", [])}


def _projected(loop: Path, target, policy_path: Path) -> dict:
    """The loopback run projected onto `target` with the cluster baseline's policy as written (its world
    may be the target's, not the loopback run's: simulate applies its rows to the regrouped samples)."""
    with open_context(loop, Options(replay_steps=0)) as ctx:
        result, _ = simulate.simulate(ctx, target, read_policy(policy_path), policy_path, derive=False)
    return {"rows": result.tables["simulate"].to_dicts()}


def _by_policy(summary: dict) -> dict[str, dict]:
    return {r["policy"]: r for r in summary["rows"]}


def show(r: dict) -> None:
    print(f"\n{r['config']}: baseline communication share {r['comm_share']:.0%}; the loopback run's compute "
          f"x{r['compute_scale']:.2f} on the cluster")
    print(f"{'run':<12} {'step ms':>8} {'speedup':>8} {'loss Δ':>9} {'bytes/step':>12} {'sim (same) ms':>14} "
          f"{'err':>6} {'sim (loopback) ms':>18} {'err':>6} {'loopback compute':>17} {'err':>6} {'half duplex':>12} "
          f"{'err':>6}")
    for x in r["runs"]:
        def err(p):
            return "" if p is None else f"{p / x['step_time_s'] - 1:+.1%}"
        print(f"{x['run']:<12} {x['step_time_s'] * 1e3:8.1f} {x['speedup']:8.2f} "
              f"{(x['loss_max_abs_diff'] or 0):9.2e} {(x['bytes_per_step'] or 0):12,.0f} "
              f"{(x['predicted_same_cluster_s'] or 0) * 1e3:14.1f} {err(x['predicted_same_cluster_s']):>6} "
              f"{(x['predicted_from_loopback_s'] or 0) * 1e3:18.1f} {err(x['predicted_from_loopback_s']):>6} "
              f"{(x['predicted_loopback_compute_s'] or 0) * 1e3:17.1f} {err(x['predicted_loopback_compute_s']):>6} "
              f"{(x['predicted_half_duplex_s'] or 0) * 1e3:12.1f} {err(x['predicted_half_duplex_s']):>6}")
    for note in r["notes"]:
        print(f"  note: {note}")


if __name__ == "__main__":
    main()

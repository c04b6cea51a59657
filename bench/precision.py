"""`--precision bf16` measured (bench/RESULTS.md §13): train.py's samples/s at fp32 and bf16, and the eval AUC
after the same steps.

    .venv/bin/python bench/precision.py [--runs 5] [--steps 200] [--pooling 1] [--auc-steps 200]
        [--wait-idle SECONDS] [--out FILE]

Throughput: bench/vs_torchrec.py's model (8 tables x 100k rows x dim 64, bottom MLP 512-256-64, top
MLP 512-256-1, batch 512 per rank, uniform ids, SGD, table-wise), 2 ranks under torchrun (gloo on
CPU, NCCL where train.py finds CUDA), fp32 and bf16 alternating run by run, --runs each; medians.
AUC: the criteo-kaggle preset x 0.01 (bench/dct_dp.py's), batch 2048 per rank, --auc-steps steps,
one run per precision (same seed and data, so deterministic up to bf16 rounding); the eval AUC on
the held-out 10%. The target: bf16 within 0.002 AUC of fp32.

Prints a table (machine named: CPU, cores, bf16 instructions, torch, device) and writes the JSON to
--out. Other processes' CPU use during each run is measured (bench/vs_torchrec.py's other_load):
a run where it exceeded 10% is flagged, its timing is skewed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.vs_torchrec import BUSY_WARN, SHAPE_ARGS, other_load, stop_torchrun, wait_until_idle  # noqa: E402

WORLD = 2
PRECISIONS = ("fp32", "bf16")
AUC_ARGS = ["--preset", "criteo-kaggle", "--scale", "0.01", "--batch-size", "2048"]
AUC_TARGET = 0.002


def train(args: list[str], timeout_s: float) -> dict:
    """One 2-rank train.py run; its JSON summary, with `cpu_other_busy` added."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={WORLD}",
           "train.py", *args, "--json"]

    def run() -> subprocess.CompletedProcess:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            out, err = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            out, err = stop_torchrun(proc)
            sys.exit(f"timed out after {timeout_s:.0f} s: {' '.join(cmd)}\n{err[-4000:]}")
        return subprocess.CompletedProcess(cmd, proc.returncode, out, err)

    proc, busy = other_load(run)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode or not lines:
        sys.exit(f"exit {proc.returncode}: {' '.join(cmd)}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return {**json.loads(lines[-1]), "cpu_other_busy": busy}


def machine() -> dict:
    """CPU model, cores, its bf16 instructions, torch and the GPU if any."""
    cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    model = next((ln.split(":", 1)[1].strip() for ln in cpuinfo.splitlines() if ln.startswith("model name")),
                 platform.processor() or platform.machine())
    flags = set(next((ln.split(":", 1)[1].split() for ln in cpuinfo.splitlines() if ln.startswith("flags")), []))
    import torch

    return {"cpu": model, "cores": os.cpu_count(), "bf16_isa": sorted(flags & {"avx512_bf16", "amx_bf16"}),
            "torch": torch.__version__,
            "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--runs", type=int, default=5, help="throughput runs per precision, alternating")
    p.add_argument("--steps", type=int, default=200, help="steps per throughput run (5 warm-up steps untimed)")
    p.add_argument("--pooling", type=int, default=1, help="ids per bag in the throughput runs")
    p.add_argument("--auc-steps", type=int, default=200, help="training steps before the AUC evaluation")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds allowed per run")
    p.add_argument("--wait-idle", type=float, default=0.0, metavar="SECONDS",
                   help="before each run, wait up to this long for other processes to leave the CPUs idle")
    p.add_argument("--out", type=Path, default=Path("/tmp/tracekit-bench-precision.json"))
    args = p.parse_args()
    info = machine()
    speed_args = [*SHAPE_ARGS, "--pooling", str(args.pooling), "--zipf", "0", "--eval-fraction", "0",
                  "--steps", str(args.steps), "--log-every", "1000"]
    auc_args = [*AUC_ARGS, "--steps", str(args.auc_steps), "--log-every", "1000"]

    # throughput: fp32, bf16, fp32, bf16, ... so drift in the machine's speed hits both alike
    speed: dict[str, list[dict]] = {name: [] for name in PRECISIONS}
    for run in range(args.runs):
        for name in PRECISIONS:
            wait_until_idle(args.wait_idle)
            summary = train([*speed_args, "--precision", name], args.timeout)
            speed[name].append(summary)
            print(f"run {run + 1}/{args.runs} {name}: {summary['samples_per_s']:,.0f} samples/s"
                  f"{'  (busy machine)' if summary['cpu_other_busy'] > BUSY_WARN else ''}", file=sys.stderr, flush=True)
    auc = {name: train([*auc_args, "--precision", name], args.timeout) for name in PRECISIONS}

    rows = {name: {"samples_per_s_median": statistics.median(s["samples_per_s"] for s in speed[name]),
                   "samples_per_s": [s["samples_per_s"] for s in speed[name]],
                   "busy_runs": sum(s["cpu_other_busy"] > BUSY_WARN for s in speed[name]),
                   "eval_auc": auc[name]["eval_auc"], "eval_logloss": auc[name]["eval_logloss"]}
            for name in PRECISIONS}
    first = speed["fp32"][0]
    result = {"machine": info, "world_size": first["world_size"], "backend": first["backend"],
              "device": first["device"], "threads_per_rank": first["threads"],
              "speed_args": speed_args, "auc_args": auc_args, "precisions": rows,
              "speedup": rows["bf16"]["samples_per_s_median"] / rows["fp32"]["samples_per_s_median"],
              "auc_delta": rows["bf16"]["eval_auc"] - rows["fp32"]["eval_auc"]}

    isa = ", ".join(info["bf16_isa"]) or "no bf16 instructions"
    print(f"machine: {info['cpu']} ({isa}), {info['cores']} cores, torch {info['torch']}"
          f"{', ' + info['gpu'] if info['gpu'] else ''}; {result['backend']} on {result['device']}, "
          f"world {result['world_size']}, {result['threads_per_rank']} thread(s) per rank")
    print(f"throughput: {' '.join(speed_args)} ({args.runs} alternating runs each)")
    print(f"AUC: {' '.join(auc_args)}")
    print(f"{'precision':<9}  {'median samples/s':>16}  {'min':>9}  {'max':>9}  {'eval AUC':>8}  {'logloss':>7}")
    for name, r in rows.items():
        print(f"{name:<9}  {r['samples_per_s_median']:>16,.0f}  {min(r['samples_per_s']):>9,.0f}  "
              f"{max(r['samples_per_s']):>9,.0f}  {r['eval_auc']:>8.4f}  {r['eval_logloss']:>7.4f}")
    within = "within" if abs(result["auc_delta"]) <= AUC_TARGET else "NOT within"
    print(f"bf16 / fp32: x{result['speedup']:.2f} samples/s; AUC {result['auc_delta']:+.4f} "
          f"({within} the {AUC_TARGET} target)")
    busy = sum(r["busy_runs"] for r in rows.values())
    if busy:
        print(f"warning: other processes used over {BUSY_WARN:.0%} of the CPUs during {busy} of "
              f"{2 * args.runs} throughput runs: those timings are skewed (rerun with --wait-idle)")
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"json: {args.out}")


if __name__ == "__main__":
    main()

"""What tracing costs: samples/s of the reference trainer untraced, under `tracekit record`
(default settings, then raw lookups on every step), and under torch.profiler with shapes
recorded; then the bytes of trace per embedding lookup on the criteo-kaggle preset.

Runs alternate (untraced, traced, traced with lookups every step, profiled, untraced, ...), each
a fresh torchrun; medians and ratios are printed with the machine. On CPU: 2 ranks on gloo, one
core each. With `--device cuda`: 1 rank on NCCL, NVML sampled while traced. From the repo root:

    .venv/bin/python bench/record_overhead.py --runs 5
    .venv/bin/python bench/record_overhead.py --workload proxy --quick --steps 1000 --runs 10   # ~7 ms steps
    .venv/bin/python bench/record_overhead.py --workload proxy --ranks 1 --batch 1536 --quick --steps 1000 --runs 8
    .venv/bin/python bench/record_overhead.py --workload host26 --quick --runs 4 --outside-window   # the host-bound proxy
    python3 bench/record_overhead.py --device cuda --python python3 --workload kaggle --quick --runs 3
    python3 bench/record_overhead.py --device cuda --python python3 --runs 3      # on a GPU machine
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def samples_per_s(command: list[str], env: dict[str, str] | None = None) -> tuple[float, float]:
    """The trainer's samples/s and the CPU seconds the command's processes used (every thread of every
    rank, start-up included), or NaNs (with its stderr shown) if the command failed."""
    summary, cpu_s = run_job(command, env)
    return summary.get("samples_per_s", math.nan), cpu_s


def run_job(command: list[str], env: dict[str, str] | None = None) -> tuple[dict, float]:
    """The JSON summary the job printed last and the CPU seconds its processes used, or ({}, NaN) (with
    its stderr shown) if the command failed."""
    before = _children_cpu_s()
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, env={**os.environ, **(env or {})})
    cpu_s = _children_cpu_s() - before
    if result.returncode != 0:
        print(f"{' '.join(command)} failed ({result.returncode}):\n{result.stderr[-2000:]}", file=sys.stderr)
        return {}, math.nan
    return json.loads(result.stdout.strip().splitlines()[-1]), cpu_s


def _children_cpu_s() -> float:
    """User and system CPU seconds of every process run and reaped below this one so far."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def trace_bytes(run_dir: Path) -> int:
    return sum(p.stat().st_size for p in run_dir.rglob("*.parquet"))


def machine(device: str) -> str:
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")
    text = f"{cpu}, {os.cpu_count()} cores, {platform.system()}"
    if device == "cuda":
        import torch

        text += f"; {torch.cuda.get_device_name()} (torch {torch.__version__})"
    return text


def writer_cpu_s(run_dir: Path) -> float:
    """The trace writer threads' CPU seconds, mean over the ranks, of the run just recorded."""
    per_rank = json.loads((run_dir / "manifest.json").read_text()).get("writer_cpu_s") or {}
    return statistics.mean(per_rank.values()) if per_rank else math.nan


def writer_rescues(run_dir: Path) -> int:
    """How often the ranks' watchdogs lifted an idle writer in the run just recorded."""
    per_rank = json.loads((run_dir / "manifest.json").read_text()).get("writer_scheduling") or {}
    return sum(s["rescues"] for s in per_rank.values())


def report(results: dict[str, list[float]], cpu: dict[str, list[float]]) -> None:
    """The Markdown table of samples/s per variant against "untraced" (medians), with the CPU seconds
    each run used (every process of it: start-up, the ranks' threads, and for a traced run its writer
    threads and `record`'s own summary), then each other variant against the untraced runs run by
    run; a failed run (nan) is left out of the medians and of its pairs."""
    base, base_cpu = finite_median(results["untraced"]), finite_median(cpu["untraced"])
    print("| variant | median samples/s | runs | vs untraced | median CPU s a run (all processes) | CPU vs untraced |\n"
          "|---|---:|---|---:|---:|---:|")
    for name, values in results.items():
        med, med_cpu = finite_median(values), finite_median(cpu[name])
        print(f"| {name} | {med:,.0f} | {', '.join(f'{v:,.0f}' for v in values)} | {med / base - 1:+.1%} "
              f"| {med_cpu:.1f} | {med_cpu / base_cpu - 1:+.1%} |")
    failed = {name: sum(math.isnan(v) for v in values) for name, values in results.items()}
    if any(failed.values()):
        print(f"\nfailed runs (nan, left out of the medians and the pairs): {failed}")
    for name, values in results.items():
        if name != "untraced":
            pairs = [t / u - 1 for u, t in zip(results["untraced"], values)]
            print(f"\n{name} vs untraced, run by run: {', '.join(f'{p:+.1%}' for p in pairs)}; "
                  f"median of the pairs {finite_median(pairs):+.1%}")


def finite_median(values: list[float]) -> float:
    """The median of the values that are numbers (a failed run is nan), or nan if none is."""
    kept = [v for v in values if not math.isnan(v)]
    return statistics.median(kept) if kept else math.nan


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--workload", choices=["default", "kaggle", "proxy", "proxy26", "host26"], default="default",
                   help="kaggle: the criteo-kaggle preset at full size, batch 16384 on cuda (--scale on cpu); "
                        "proxy: GPU-like short steps on CPU (8 tables x 100k rows, dim 16, batch 64, pooling 4, "
                        "small MLPs); proxy26: the same with 26 tables; host26: a GPU host's host-bound rank: "
                        "`python train.py`, one rank, OMP_NUM_THREADS=1, 26 tables x 100k rows, dim 16, "
                        "batch 512, ~6.6 ms steps, the second core left free as a GPU host leaves its others")
    p.add_argument("--ranks", type=int, help="ranks (default: 2 on cpu, 1 on cuda)")
    p.add_argument("--batch", type=int, default=64,
                   help="the proxy workloads' batch per rank (one rank: 1536 gives ~5.7 ms steps here)")
    p.add_argument("--scale", type=float, default=1.0, help="the kaggle workload's table scale")
    p.add_argument("--keep", type=Path, help="copy the last traced run directory here")
    p.add_argument("--outside-window", action="store_true",
                   help="also trace with every step but the first outside the window (record --steps 0:1)")
    p.add_argument("--python", default=str(ROOT / ".venv" / "bin" / "python"), help="interpreter to run with")
    p.add_argument("--quick", action="store_true",
                   help="only untraced vs traced with the defaults (more runs in the same time), no size run")
    p.add_argument("--writer-nice-0", action="store_true",
                   help="also trace with the writer thread at the rank's own priority (TRACEKIT_WRITER_NICE=0)")
    p.add_argument("--writer-not-idle", action="store_true",
                   help="also trace with the writer thread at nice +10 but never SCHED_IDLE (TRACEKIT_WRITER_IDLE=0)")
    args = p.parse_args()
    ranks = args.ranks or (2 if args.device == "cpu" and args.workload != "host26" else 1)
    torchrun = [args.python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks)]
    if args.workload == "host26":
        torchrun = [args.python]
        os.environ["OMP_NUM_THREADS"] = "1"
    train = ["--pooling", "1", "--zipf", "0", "--eval-fraction", "0", "--json", "--steps", str(args.steps),
             "--device", args.device]
    if args.workload == "kaggle":
        batch = 16384 if args.device == "cuda" else 512
        train = ["--preset", "criteo-kaggle", "--scale", str(args.scale), "--pooling", "1", "--eval-fraction", "0",
                 "--json", "--steps", str(args.steps), "--device", args.device, "--batch-size", str(batch),
                 "--samples", str(batch * ranks * (args.steps + 1))]
    elif args.workload == "host26":
        train = ["--tables", "26", "--rows", "100000", "--dim", "16", "--bottom-mlp", "32,16", "--top-mlp", "32,1",
                 "--batch-size", "512", "--eval-fraction", "0", "--json", "--steps", str(args.steps),
                 "--device", args.device]
    elif args.workload.startswith("proxy"):
        tables = "26" if args.workload == "proxy26" else "8"
        train = ["--tables", tables, "--rows", "100000", "--dim", "16", "--bottom-mlp", "32,16", "--top-mlp", "32,1",
                 "--batch-size", str(args.batch), "--pooling", "4", "--zipf", "0", "--eval-fraction", "0", "--json",
                 "--steps", str(args.steps), "--device", args.device,
                 "--samples", str(args.batch * ranks * (args.steps + 1))]
    elif args.device == "cuda":
        train += ["--batch-size", "8192", "--rows", "500000", "--samples", str(8192 * (args.steps + 1))]

    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"

        def traced(train_args: list[str], *options: str) -> list[str]:
            return [args.python, "-m", "tracekit", "record", "--force", "-o", str(run_dir), *options, "--",
                    *torchrun, "train.py", *train_args]

        variants = {
            "untraced": [*torchrun, "train.py", *train],
            "tracekit record": traced(train),
            "tracekit record, lookups every step": traced(train, "--lookup-every", "1"),
            "torch.profiler, record_shapes": [*torchrun, "bench/profiled_train.py", *train],
        }
        if args.quick:
            variants = {name: variants[name] for name in ("untraced", "tracekit record")}
        envs = {}
        if args.outside_window:
            variants["tracekit record --steps 0:2 (outside the window)"] = traced(train, "--steps", "0:2")
        if args.writer_nice_0:
            variants["tracekit record, writer at nice 0"] = traced(train)
            envs["tracekit record, writer at nice 0"] = {"TRACEKIT_WRITER_NICE": "0"}
        if args.writer_not_idle:
            variants["tracekit record, writer at nice +10 only"] = traced(train)
            envs["tracekit record, writer at nice +10 only"] = {"TRACEKIT_WRITER_IDLE": "0"}
        results: dict[str, list[float]] = {name: [] for name in variants}
        cpu: dict[str, list[float]] = {name: [] for name in variants}
        writer_cpu: dict[str, list[float]] = {name: [] for name, command in variants.items() if "record" in command}
        rescues = dict.fromkeys(writer_cpu, 0)
        for i in range(args.runs):
            for name, command in variants.items():
                speed, cpu_s = samples_per_s(command, envs.get(name))
                results[name].append(speed)
                cpu[name].append(cpu_s)
                if name in writer_cpu:
                    writer_cpu[name].append(writer_cpu_s(run_dir))
                    rescues[name] += writer_rescues(run_dir)
            print(f"run {i + 1}/{args.runs}: " + ", ".join(f"{k} {v[-1]:,.0f}" for k, v in results.items()),
                  file=sys.stderr, flush=True)

        print(f"machine: {machine(args.device)}\n{args.device}, {ranks} rank(s) "
              f"({'gloo, 1 core each' if args.device == 'cpu' else 'NCCL'}); "
              f"train.py {' '.join(train)}; {args.runs} alternating runs each")
        report(results, cpu)
        print("\ntrace writer thread CPU per rank (median over the runs): " + "; ".join(
            f"{name} {statistics.median(v):.2f} s ({statistics.median(v) / args.steps * 1e3:.2f} ms a step)"
            for name, v in writer_cpu.items()))
        print("times a watchdog lifted an idle writer, all runs and ranks: "
              + "; ".join(f"{name} {n}" for name, n in rescues.items()))
        if args.keep:
            shutil.copytree(run_dir, args.keep, dirs_exist_ok=True)
        if args.quick or args.workload != "default":
            return 0

        # bytes per lookup on the criteo-kaggle preset (26 tables, one id each)
        steps, batch = 100, 512
        preset = ["--preset", "criteo-kaggle", "--scale", "0.02", "--batch-size", str(batch), "--steps", str(steps),
                  "--eval-fraction", "0", "--json", "--device", args.device]
        subprocess.run(traced(preset), cwd=ROOT, capture_output=True, text=True, check=True)
        lookups = steps * ranks * batch * 26
        size = trace_bytes(run_dir)
        print(f"\ncriteo-kaggle preset (scale 0.02), {steps} steps x {ranks * batch} samples x 26 tables = "
              f"{lookups:,} lookups: {size:,} bytes of Parquet = {size / lookups:.2f} B per lookup "
              "(lookups table every 10th step)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

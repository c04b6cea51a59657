"""Compare tracekit's reference DLRM trainer with TorchRec's, on the same model and data shape.

For each pooling (ids per bag) in 1 and 20, runs the two trainers alternately, --runs times each
(ours, torchrec, ours, torchrec, ...), so slow drift in the machine's speed hits both alike. Each
run is a fresh 2-rank `torchrun` on gloo/CPU that prints a JSON summary line with samples_per_s
(global). Prints medians, min/max and the ratio ours/torchrec per pooling, with the machine.

Needs the toolkit venv (`make venv`, .venv) for ours and bench/.venv-torchrec
(`bash bench/setup_torchrec_venv.sh`) for TorchRec. Uses only the standard library, so any
python3 runs it. From the repo root:

    python3 bench/vs_torchrec.py                       # both, 5 runs per pooling
    python3 bench/vs_torchrec.py --only torchrec --runs 3
    python3 bench/vs_torchrec.py --markdown >> bench/RESULTS.md

Progress and warnings go to stderr; the table (or Markdown with --markdown) to stdout.
The machine may be shared: the driver measures how much CPU other processes used during
each run and warns (and notes it in the output) when that was over 10%, since it skews the
timing; --wait-idle SECONDS waits for quiet before each run.
"""

import argparse
import datetime
import functools
import json
import os
import platform
import resource
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORLD_SIZE = 2
BACKEND = "gloo"
POOLINGS = (1, 20)
# Model and batch shape shared by both trainers (env.md section 4's config).
SHAPE_ARGS = [
    "--tables", "8", "--rows", "100000", "--dim", "64", "--dense", "13",
    "--bottom-mlp", "512,256,64", "--top-mlp", "512,256,1", "--batch-size", "512",
]
# torchrec-pinned: TorchRec with each rank pinned to its own core, as our trainer pins itself,
# so the ratio to it shows what is left of our lead without the pinning. ours-bf16: our trainer
# with --precision bf16 (the MLPs and the interaction in bf16, fp32 master weights and tables).
# torchrec-tuned: TorchRec pinned and, on an AMD CPU with AVX-512, with MKL's AVX-512 GEMMs
# (MKL_ENABLE_INSTRUCTIONS=AVX512), the two process-level settings our trainer makes
# (tracekit/dlrm/runtime.py): the ratio to it is what our design alone is worth.
IMPLS = ("ours", "ours-bf16", "torchrec", "torchrec-pinned", "torchrec-tuned")
TORCHREC_VENV = ROOT / "bench" / ".venv-torchrec"
VENVS = {"ours": ROOT / ".venv", "ours-bf16": ROOT / ".venv", "torchrec": TORCHREC_VENV,
         "torchrec-pinned": TORCHREC_VENV, "torchrec-tuned": TORCHREC_VENV}
SETUP_HINT = {"ours": "make venv", "ours-bf16": "make venv", "torchrec": "bash bench/setup_torchrec_venv.sh",
              "torchrec-pinned": "bash bench/setup_torchrec_venv.sh",
              "torchrec-tuned": "bash bench/setup_torchrec_venv.sh"}
STOP_GRACE_S = 30.0  # time torchrun gets to end its ranks after SIGTERM
BUSY_WARN = 0.10  # warn when other processes used more than this fraction of the CPUs


@functools.lru_cache(maxsize=None)
def avx512_gemm_on_amd() -> bool:
    """Whether our trainer turns MKL's AVX-512 GEMMs on here (tracekit/dlrm/runtime.py's test,
    run in a child so that this driver's own environment stays as it is)."""
    probe = ("import os; from tracekit.dlrm.runtime import avx512_gemm_on_amd; "
             "print(avx512_gemm_on_amd())")
    env = {k: v for k, v in os.environ.items() if k != "MKL_ENABLE_INSTRUCTIONS"}
    out = subprocess.run([str(VENVS["ours"] / "bin" / "python"), "-c", probe], cwd=ROOT, env=env,
                         capture_output=True, text=True)
    return out.stdout.strip() == "True"


class RunFailed(Exception):
    """Raised when a benchmark subprocess exits non-zero or prints no JSON summary."""


def command(impl: str, pooling: int, steps: int) -> list[str]:
    """The torchrun command line for one run of `impl` (paths relative to the repo root)."""
    torchrun = str(VENVS[impl].relative_to(ROOT) / "bin" / "torchrun")
    launch = [torchrun, "--standalone", "--nproc-per-node", str(WORLD_SIZE)]
    if impl in ("ours", "ours-bf16"):
        precision = ["--precision", "bf16"] if impl == "ours-bf16" else []
        return [*launch, "train.py", *SHAPE_ARGS, "--pooling", str(pooling), "--zipf", "0",
                "--eval-fraction", "0", "--steps", str(steps), *precision, "--json"]
    pin = ["--pin"] if impl in ("torchrec-pinned", "torchrec-tuned") else []
    return [*launch, "bench/torchrec_dlrm.py", *SHAPE_ARGS, "--pooling", str(pooling),
            "--steps", str(steps), *pin, "--json"]


def _cpu_seconds() -> tuple[float, float]:
    """(non-idle CPU seconds of the whole machine, CPU seconds of our reaped children)."""
    with open("/proc/stat") as f:
        ticks = [int(x) for x in f.readline().split()[1:9]]
    busy_ticks = sum(ticks) - ticks[3] - ticks[4]  # all but idle and iowait
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return busy_ticks / os.sysconf("SC_CLK_TCK"), children.ru_utime + children.ru_stime


def other_load(fn, *args):
    """Call fn(*args); return (its result, share of all CPUs used by *other* processes meanwhile).

    Other = the machine's non-idle time minus the CPU time of our children (torchrun and its
    ranks, reaped when fn returns), over wall time x cores. 0.0 means the run had the
    machine to itself.
    """
    busy0, ours0 = _cpu_seconds()
    t0 = time.monotonic()
    result = fn(*args)
    wall = time.monotonic() - t0
    busy1, ours1 = _cpu_seconds()
    other = (busy1 - busy0) - (ours1 - ours0)
    return result, max(0.0, other / (wall * (os.cpu_count() or 1)))


def wait_until_idle(max_wait_s: float) -> None:
    """Poll until other processes leave the CPUs idle for a second, at most max_wait_s."""
    deadline = time.monotonic() + max_wait_s
    while time.monotonic() < deadline:
        _, busy = other_load(time.sleep, 1.0)
        if busy <= BUSY_WARN:
            return
    if max_wait_s > 0:
        log(f"CPUs still busy after waiting {max_wait_s:.0f} s; running anyway")


def stop_torchrun(proc: subprocess.Popen) -> tuple[str, str]:
    """End a torchrun and its ranks; return its remaining (stdout, stderr).

    torchrun starts each rank in a session of its own, so killing torchrun's process group
    misses them, and ranks left behind by a SIGKILLed torchrun hang. SIGTERM instead: torchrun
    then terminates its ranks itself. SIGKILL only if it has not exited within STOP_GRACE_S.
    """
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.communicate(timeout=STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.communicate()


def run_once(impl: str, pooling: int, steps: int, timeout_s: float) -> dict:
    """Run one benchmark and return its JSON summary (the last stdout line)."""
    cmd = command(impl, pooling, steps)
    shown = " ".join(cmd)
    env = dict(os.environ)
    if impl == "torchrec-tuned" and avx512_gemm_on_amd():
        env["MKL_ENABLE_INSTRUCTIONS"] = "AVX512"
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env)
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
    except BaseException as e:  # TimeoutExpired or KeyboardInterrupt
        stdout, stderr = stop_torchrun(proc)
        if isinstance(e, subprocess.TimeoutExpired):
            raise RunFailed(f"timed out after {timeout_s:.0f} s: {shown}\n"
                            f"--- stderr ---\n{stderr}") from e
        raise
    lines = stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        raise RunFailed(f"exit code {proc.returncode}: {shown}\n--- stdout ---\n{stdout}"
                        f"--- stderr ---\n{stderr}")
    try:
        summary = json.loads(lines[-1])
        float(summary["samples_per_s"])
    except (ValueError, KeyError, TypeError) as e:
        raise RunFailed(f"last stdout line is not a JSON summary with samples_per_s ({e!r}): "
                        f"{shown}\n--- stdout ---\n{stdout}--- stderr ---\n{stderr}") from e
    return summary


def collect(impls: tuple[str, ...], runs: int, steps: int, timeout_s: float,
            wait_idle_s: float) -> dict:
    """{(impl, pooling): [summary, ...]}, alternating impls within each run index."""
    results: dict[tuple[str, int], list[dict]] = {(i, p): [] for i in impls for p in POOLINGS}
    for pooling in POOLINGS:
        for run in range(runs):
            for impl in impls:
                wait_until_idle(wait_idle_s)
                summary, busy = other_load(run_once, impl, pooling, steps, timeout_s)
                summary["cpu_other_busy"] = busy
                if busy > BUSY_WARN:
                    log(f"warning: other processes used {busy:.0%} of the CPUs during this "
                        "run, so its timing is skewed")
                results[(impl, pooling)].append(summary)
                log(f"pooling {pooling:>2} run {run + 1}/{runs} {impl:<8} "
                    f"{summary['samples_per_s']:>9,.0f} samples/s")
    return results


def machine(impls: tuple[str, ...]) -> dict:
    """CPU model, core count and the torch version in each venv used."""
    model = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            model = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")),
                         model)
    except OSError:
        pass
    torch_versions = {}
    for impl in impls:
        python = VENVS[impl] / "bin" / "python"
        out = subprocess.run([str(python), "-c", "import torch; print(torch.__version__)"],
                             capture_output=True, text=True)
        torch_versions[impl] = out.stdout.strip() or "unknown"
    return {"cpu": model, "cores": os.cpu_count(), "os": platform.platform(),
            "python": platform.python_version(), "torch": torch_versions}


def summarize(results: dict, impls: tuple[str, ...]) -> list[dict]:
    """One row per pooling: stats per impl and, with both impls, the ratio of medians."""
    rows = []
    for pooling in POOLINGS:
        row: dict = {"pooling": pooling}
        for impl in impls:
            row[impl] = _stats(results[(impl, pooling)])
        if "ours" in impls:
            row["ratio"] = {i: row["ours"]["median"] / row[i]["median"] for i in impls if i != "ours"}
        rows.append(row)
    return rows


def busy_note(results: dict) -> str:
    """'' when other processes left the CPUs alone during every run, else how often not."""
    every = [s for v in results.values() for s in v]
    busy = sum(s["cpu_other_busy"] > BUSY_WARN for s in every)
    if not busy:
        return ""
    return (f"during {busy} of {len(every)} runs other processes used over {BUSY_WARN:.0%} of "
            "the CPUs: those timings are skewed (rerun on a quiet machine, or with --wait-idle)")


def _stats(summaries: list[dict]) -> dict:
    sps = [s["samples_per_s"] for s in summaries]
    step_ms = [s["step_ms"] for s in summaries if "step_ms" in s]
    return {"runs": len(sps), "median": statistics.median(sps), "min": min(sps), "max": max(sps),
            "step_ms_median": statistics.median(step_ms) if step_ms else None}


def machine_line(info: dict, threads: str) -> str:
    torch = ", ".join(f"{v} ({impl} venv)" for impl, v in info["torch"].items())
    return (f"{info['cpu']}, {info['cores']} cores; torch {torch}; backend {BACKEND}, "
            f"world size {WORLD_SIZE}, {threads} thread(s) per rank")


def format_table(rows: list[dict], impls: tuple[str, ...], info: dict, threads: str,
                 note: str) -> str:
    header = f"{'pooling':>7}  {'impl':<15}  {'runs':>4}  {'median':>9}  {'min':>9}  {'max':>9}  "
    lines = [f"machine: {machine_line(info, threads)}",
             "global samples/s (world size x batch per rank x steps / elapsed)",
             header + "ours/impl", "-" * (len(header) + 9)]
    for row in rows:
        for impl in impls:
            s = row[impl]
            ratio = f"{row['ratio'][impl]:.2f}" if impl in row.get("ratio", {}) else ""
            lines.append(f"{row['pooling']:>7}  {impl:<15}  {s['runs']:>4}  {s['median']:>9,.0f}  "
                         f"{s['min']:>9,.0f}  {s['max']:>9,.0f}  {ratio}")
    if note:
        lines.append(f"warning: {note}")
    return "\n".join(lines)


def format_markdown(rows: list[dict], impls: tuple[str, ...], info: dict, threads: str,
                    runs: int, steps: int, note: str, reproduce: str) -> str:
    today = datetime.date.today().isoformat()
    out = [f"## DLRM training throughput: tracekit vs TorchRec ({today})", "",
           f"- Machine: {machine_line(info, threads)}.",
           f"- Model and batch, the same flags for both: `{' '.join(SHAPE_ARGS)}`; "
           "uniform ids (`--zipf 0` for ours); SGD.",
           "- TorchRec 1.8.0 (fbgemm-gpu-cpu 1.8.0): table_wise sharding, fused (FBGEMM TBE) "
           "kernel, SGD fused into backward; input is a pool of 10 pre-generated batches per rank.",
           f"- {runs} runs per cell, run alternately (ours, torchrec, ...); each run times "
           f"{steps} steps after warm-up. Samples/s are global (all ranks).",
           f"- Reproduce: `{reproduce}`", "",
           "| pooling | impl | median samples/s | min | max | median step ms | ours / impl |",
           "|---:|---|---:|---:|---:|---:|---:|"]
    for row in rows:
        for impl in impls:
            s = row[impl]
            ratio = f"**{row['ratio'][impl]:.2f}**" if impl in row.get("ratio", {}) else ""
            step = f"{s['step_ms_median']:.1f}" if s["step_ms_median"] is not None else "n/a"
            out.append(f"| {row['pooling']} | {impl} | {s['median']:,.0f} | {s['min']:,.0f} | "
                       f"{s['max']:,.0f} | {step} | {ratio} |")
    if note:
        out += ["", f"**Warning:** {note}."]
    return "\n".join(out) + "\n"


def log(msg: str) -> None:
    print(f"[vs_torchrec] {msg}", file=sys.stderr, flush=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--runs", type=int, default=5, help="runs per implementation and pooling")
    p.add_argument("--steps", type=int, default=50, help="timed steps per run")
    p.add_argument("--only", metavar="IMPL[,IMPL]",
                   help=f"comma-separated subset of {', '.join(IMPLS)} (default: all)")
    p.add_argument("--markdown", action="store_true",
                   help="print a Markdown section for bench/RESULTS.md instead of the table")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds allowed per run")
    p.add_argument("--wait-idle", type=float, default=0.0, metavar="SECONDS",
                   help="before each run, wait up to this long for other processes to leave "
                        "the CPUs idle (0: only warn)")
    args = p.parse_args(argv)
    if args.runs < 1 or args.steps < 1:
        p.error(f"--runs and --steps must be >= 1, got {args.runs} and {args.steps}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    impls = tuple(args.only.split(",")) if args.only else IMPLS
    unknown = set(impls) - set(IMPLS)
    if unknown:
        log(f"--only: unknown implementation(s) {', '.join(sorted(unknown))}; choose from {', '.join(IMPLS)}")
        return 2
    for impl in impls:
        if not (VENVS[impl] / "bin" / "torchrun").exists():
            log(f"{VENVS[impl].relative_to(ROOT)}/bin/torchrun not found; "
                f"build it with `{SETUP_HINT[impl]}`, or pick one side with --only")
            return 1
    if "ours" in impls and not (ROOT / "train.py").exists():
        log("train.py not found at the repo root; run with --only torchrec until it exists")
        return 1

    try:
        results = collect(impls, args.runs, args.steps, args.timeout, args.wait_idle)
    except RunFailed as e:
        log(f"run failed: {e}")
        return 1

    threads = ",".join(sorted({str(s.get("threads", "?")) for v in results.values() for s in v}))
    rows = summarize(results, impls)
    info = machine(impls)
    note = busy_note(results)
    if args.markdown:
        reproduce = " ".join(["python3", "bench/vs_torchrec.py", *(argv or sys.argv[1:])])
        print(format_markdown(rows, impls, info, threads, args.runs, args.steps, note, reproduce))
    else:
        print(format_table(rows, impls, info, threads, note))
    return 0


if __name__ == "__main__":
    sys.exit(main())

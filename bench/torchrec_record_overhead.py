"""What `tracekit record` costs a TorchRec job (bench/RESULTS.md §12): samples/s of bench/torchrec_dlrm.py (TorchRec's
DLRM, 8 tables x 100k rows x dim 64, FBGEMM's fused table-wise kernel, 2 gloo ranks) untraced and
under `tracekit record` with its defaults, alternating, each a fresh torchrun; medians, the ratio of
the medians and the run-by-run pairs, with the machine; beside them what recording costs in CPU,
steadier than samples/s on a shared box: rank 0's training thread a timed step (the job's
`train_thread_cpu_ms`), and the writer threads a step (the manifest's `writer_cpu_s`). Each traced
run is checked to hold every lookup it made (`accesses` summed = steps x ranks x batch x tables x
pooling, warm-up included).

Needs the TorchRec venv with tracekit installed in it, as a user would (`bash
bench/setup_torchrec_venv.sh`, then `bench/.venv-torchrec/bin/pip install .`). From the repo root:

    .venv/bin/python bench/torchrec_record_overhead.py [--runs 5] [--steps 100] [--pooling 1]
    .venv/bin/python bench/torchrec_record_overhead.py --runs 16 --variant 'writer held=--flush-interval 1000'
"""

from __future__ import annotations

import argparse
import math
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.record_overhead import finite_median, machine, report, run_job  # noqa: E402
from tracekit.run import open_run  # noqa: E402

PYTHON = ROOT / "bench" / ".venv-torchrec" / "bin" / "python"
RANKS, TABLES = 2, 8


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--steps", type=int, default=100, help="timed steps per run")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--pooling", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=512)
    p.add_argument("--python", type=Path, default=PYTHON, help="the TorchRec venv's interpreter")
    p.add_argument("--variant", action="append", default=[], metavar="NAME=OPTIONS",
                   help="also run `tracekit record OPTIONS` as NAME, in turn with the others, e.g. "
                        "'writer held=--flush-interval 1000' (repeatable)")
    args = p.parse_args()
    traced = {"tracekit record": []}
    for spec in args.variant:
        name, sep, options = spec.partition("=")
        if not sep or not name or name in ("untraced", *traced):
            sys.exit(f"--variant {spec!r}: expected NAME=OPTIONS with a new NAME, e.g. 'held=--flush-interval 1000'")
        traced[name] = options.split()
    check = subprocess.run([str(args.python), "-c", "import torchrec, tracekit"], capture_output=True, text=True)
    if check.returncode != 0:
        sys.exit(f"{args.python} cannot import torchrec and tracekit ({check.stderr.strip().splitlines()[-1:]}): "
                 "bash bench/setup_torchrec_venv.sh, then bench/.venv-torchrec/bin/pip install .")
    job = ["bench/torchrec_dlrm.py", "--json", "--steps", str(args.steps), "--warmup", str(args.warmup),
           "--pooling", str(args.pooling), "--batch-size", str(args.batch_size)]
    torchrun = [str(args.python), "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(RANKS)]
    expected = (args.steps + args.warmup) * RANKS * args.batch_size * TABLES * args.pooling

    with tempfile.TemporaryDirectory() as tmp:
        run_dirs = {name: Path(tmp) / f"run{i}" for i, name in enumerate(traced)}
        variants = {"untraced": [*torchrun, *job],
                    **{name: [str(args.python), "-m", "tracekit", "record", "--force", "-o", str(run_dirs[name]),
                              *options, "--", *torchrun, *job] for name, options in traced.items()}}
        results: dict[str, list[float]] = {name: [] for name in variants}
        cpu: dict[str, list[float]] = {name: [] for name in variants}
        train_ms: dict[str, list[float]] = {name: [] for name in variants}
        writer_ms: dict[str, list[float]] = {name: [] for name in traced}
        for i in range(args.runs):
            checked = []
            for name, command in variants.items():
                summary, cpu_s = run_job(command)
                results[name].append(summary.get("samples_per_s", math.nan))
                cpu[name].append(cpu_s)
                train_ms[name].append(summary.get("train_thread_cpu_ms", math.nan))
                if name in traced and summary:
                    run = open_run(run_dirs[name])
                    writer_ms[name].append(1000 * statistics.mean(run.manifest.writer_cpu_s.values())
                                           / (args.steps + args.warmup))
                    recorded = run.scan("accesses").select("count").collect()["count"].sum()
                    if recorded < expected:
                        sys.exit(f"{name}: the run holds {recorded:,} lookups, expected at least {expected:,}: "
                                 "not traced?")
                    checked.append(f"{name} accesses {recorded:,}")
            print(f"run {i + 1}/{args.runs}: " + ", ".join(f"{k} {v[-1]:,.0f}" for k, v in results.items())
                  + f"; {', '.join(checked)}", file=sys.stderr, flush=True)

    print(f"machine: {machine('cpu')}\ncpu, {RANKS} gloo ranks; TorchRec DLRM {TABLES} x 100k x 64, pooling "
          f"{args.pooling}, batch {args.batch_size} per rank, {args.steps} timed steps; {args.runs} alternating runs")
    report(results, cpu)
    trains = ", ".join(f"{name} {finite_median(v):.2f}" for name, v in train_ms.items())
    writers = "; ".join(f"{name} median {finite_median(v):.2f} ({', '.join(f'{w:.2f}' for w in v)})"
                        for name, v in writer_ms.items() if v)
    print(f"\nrank 0's training thread, CPU ms a timed step (medians): {trains}; the writer threads, CPU ms a "
          f"step per rank (warm-up included): {writers}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

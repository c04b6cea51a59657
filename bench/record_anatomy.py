"""Where recording's cost goes on a host-bound rank: each step's wall time split into the training
thread's CPU time, the garbage collector's share of it, and waiting (for the GIL, or the core), in the
recorded blocks of one `tracekit record --every 1000:500` run against its unrecorded ones.

The traced program is this file in its inner role: it times every step of train.py from the step
clock, and with `--variant` switches parts of recording off, to see what each costs:
- `full`: recording as it is;
- `no-count`: the writer takes the kept calls and drops them (no counting, no `accesses` or `lookups`
  Parquet): what the training thread's share costs, and the writer's taking;
- `no-keep`: the lookup hook returns at once: the class-level forward and the other collectors.

From the repo root (one run of 6,000 steps of the host-bound proxy, ~1 min):

    .venv/bin/python bench/record_anatomy.py --variant full
    .venv/bin/python bench/record_anatomy.py --variant no-count --runs 2
"""

from __future__ import annotations

import argparse
import atexit
import gc
import json
import os
import runpy
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from record_blocks import PROXY  # the host-bound proxy (bench/ is the script's first path)

ROOT = Path(__file__).resolve().parent.parent
BLOCK, SETTLE = 500, 150  # steps a block; steps left out at each block's start (the writer's flush of the last)


def inner(variant: str, out: str, train_args: list[str]) -> None:
    """Run train.py in this (traced) process, timing each step; write the per-step figures to `out`."""
    import numpy as np
    import torch  # noqa: F401 -- activates the collectors

    from collectors import embedding, staging, steps

    rows: list[tuple[int, int, int]] = []
    gc_ns, started = [0], [0]

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            started[0] = time.perf_counter_ns()
        else:
            gc_ns[0] += time.perf_counter_ns() - started[0]

    gc.callbacks.append(on_gc)
    advance = steps.StepClock.advance

    def timed_advance(self, *args, **kwargs):
        rows.append((time.monotonic_ns(), time.thread_time_ns(), gc_ns[0]))
        return advance(self, *args, **kwargs)

    steps.StepClock.advance = timed_advance
    if variant == "no-keep":
        embedding.EmbeddingHandle._on_forward = lambda self, module, args, kwargs, output: None
    elif variant == "no-count":
        def dropped(self, whole, running):
            self._taken = []
            return iter(())
        staging.Staging._counted = dropped
        staging.lookup_rows = lambda calls: tuple(np.zeros(0, dtype=np.int64) for _ in range(5))
        staging.lookup_sources = lambda calls, sample: None
    atexit.register(lambda: Path(out).write_text(json.dumps(rows)))
    sys.argv = ["train.py", *train_args]
    runpy.run_path(str(ROOT / "train.py"), run_name="__main__")


def split(rows: list[list[int]]) -> dict:
    """Mean µs a step of wall, CPU, GC and waiting in the recorded and unrecorded blocks."""
    import numpy as np

    r = np.array(rows, dtype=np.int64)
    d = np.diff(r, axis=0) / 1e3
    step = np.arange(1, len(r))
    kept = (step >= 2 * BLOCK) & (step % BLOCK >= SETTLE)
    out = {}
    for name, sel in (("recorded", kept & (step % (2 * BLOCK) < BLOCK)), ("unrecorded", kept & (step % (2 * BLOCK) >= BLOCK))):
        wall, cpu, gc_us = d[sel, 0], d[sel, 1], d[sel, 2]
        out[name] = {"wall": wall.mean(), "cpu": cpu.mean(), "gc": gc_us.mean(), "wait": (wall - cpu).mean(),
                     "p50": float(np.median(wall)), "steps": int(sel.sum()),
                     "cpu_pct": [float(np.percentile(cpu, q)) for q in (50, 90, 99)],
                     "cpu_tail": float(np.clip(cpu - np.percentile(cpu, 90), 0, None).mean())}
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--variant", choices=["full", "no-count", "no-keep"], default="full")
    p.add_argument("--runs", type=int, default=1)
    p.add_argument("--steps", type=int, default=6000)
    p.add_argument("--inner", help=argparse.SUPPRESS)
    p.add_argument("--python", default=str(ROOT / ".venv" / "bin" / "python"))
    args, rest = p.parse_known_args()
    if args.inner:
        inner(args.variant, args.inner, [*rest, "--steps", str(args.steps)])
        return 0
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")
    print(f"machine: {cpu}, {os.cpu_count()} cores; the host-bound proxy, one rank, OMP_NUM_THREADS=1, "
          f"{args.steps} steps, record --every {2 * BLOCK}:{BLOCK}; variant {args.variant}")
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.runs):
            out = Path(tmp) / "steps.json"
            command = [args.python, "-m", "tracekit", "record", "--force", "-o", str(Path(tmp) / "run"),
                       "--every", f"{2 * BLOCK}:{BLOCK}", "--", args.python, __file__, "--variant", args.variant,
                       "--inner", str(out), *PROXY, "--steps", str(args.steps)]
            r = subprocess.run(command, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True)
            if r.returncode != 0:
                raise SystemExit(f"{' '.join(command)} failed:\n{r.stderr[-3000:]}")
            s = split(json.loads(out.read_text()))
            rec, un = s["recorded"], s["unrecorded"]
            print(f"run {i + 1}: samples/s recorded/unrecorded {un['wall'] / rec['wall']:.3f} (means), "
                  f"{un['p50'] / rec['p50']:.3f} (medians); a recorded step costs {rec['wall'] - un['wall']:+.0f} µs: "
                  f"training thread CPU {rec['cpu'] - un['cpu']:+.0f} (of it GC {rec['gc'] - un['gc']:+.0f}), "
                  f"waiting {rec['wait'] - un['wait']:+.0f}; unrecorded step {un['wall']:.0f} µs, "
                  f"{rec['steps']} + {un['steps']} steps", flush=True)
            print(f"  training thread CPU p50/p90/p99 µs: recorded {'/'.join(f'{v:.0f}' for v in rec['cpu_pct'])}, "
                  f"unrecorded {'/'.join(f'{v:.0f}' for v in un['cpu_pct'])}; mean above p90: "
                  f"{rec['cpu_tail']:.0f} / {un['cpu_tail']:.0f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What recording adds to the training thread, itemised: microseconds per embedding call, per
collective and per step, untraced against under `tracekit record` (the real collectors, installed
the way `record` installs them).

Each measurement is a fresh process, one rank on gloo, alternating untraced and traced. A step is
`--tables` EmbeddingBag forwards (batch `--batch` x pooling `--pooling` ids each, dim 16, 100k rows),
then, apart, an all_reduce of 16 floats and an all_to_all_single of the step's pooled rows, and an
backward and an optimizer step; each part is timed on its own with `time.perf_counter_ns` over `--steps` steps, the
first 50 left out. Medians over the runs; the added cost is traced minus untraced:

    .venv/bin/python bench/record_costs.py --runs 5
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WARMUP = 50
PARTS = ("embedding call", "collective", "backward", "optimizer step")


def child(tables: int, batch: int, pooling: int, steps: int) -> None:
    """Run the timed loop in this process and print, per part, its nanoseconds per call as JSON."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{os.environ.get('COST_PORT', '29611')}",
                           rank=0, world_size=1)
    # frozen tables, as the reference trainer's shards are (it updates rows itself): the backward and
    # the optimizer step stay small, so that what recording adds to them shows
    bags = torch.nn.ModuleList(torch.nn.EmbeddingBag.from_pretrained(torch.randn(100_000, 16), mode="sum")
                               for _ in range(tables))
    dense = torch.nn.Linear(16, 1)
    optimizer = torch.optim.SGD(dense.parameters(), lr=0.01)
    generator = torch.Generator().manual_seed(0)
    offsets = torch.arange(0, batch * pooling, pooling)
    small = torch.zeros(16)
    spent = dict.fromkeys(PARTS, 0)
    calls = {"embedding call": tables, "collective": 2, "backward": 1, "optimizer step": 1}
    for step in range(steps + WARMUP):
        ids = [torch.randint(0, 100_000, (batch * pooling,), generator=generator) for _ in range(tables)]
        t0 = time.perf_counter_ns()
        pooled = [bag(i, offsets) for bag, i in zip(bags, ids)]
        t1 = time.perf_counter_ns()
        dist.all_reduce(small)
        out = torch.empty(batch * tables, 16)
        dist.all_to_all_single(out, torch.cat(pooled).detach())
        t2 = time.perf_counter_ns()
        loss = dense(torch.stack(pooled).sum(0)).sum()  # the phase is "train": grad is enabled
        loss.backward()
        t3 = time.perf_counter_ns()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        t4 = time.perf_counter_ns()
        if step >= WARMUP:
            spent["embedding call"] += t1 - t0
            spent["collective"] += t2 - t1
            spent["backward"] += t3 - t2
            spent["optimizer step"] += t4 - t3
    dist.barrier()
    dist.destroy_process_group()
    print(json.dumps({part: spent[part] / (steps * calls[part]) for part in PARTS}))


def measure(command: list[str]) -> dict[str, float]:
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed ({result.returncode}):\n{result.stderr[-2000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--tables", type=int, default=8)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--pooling", type=int, default=4)
    p.add_argument("--record", default="", help="extra `tracekit record` options, e.g. '--lookup-every 1'")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    shape = ["--tables", str(args.tables), "--batch", str(args.batch), "--pooling", str(args.pooling),
             "--steps", str(args.steps)]
    if args.child:
        child(args.tables, args.batch, args.pooling, args.steps)
        return 0
    python = sys.executable
    me = [python, __file__, "--child", *shape]
    got: dict[str, list[dict[str, float]]] = {"untraced": [], "traced": []}
    with tempfile.TemporaryDirectory() as tmp:
        traced = [python, "-m", "tracekit", "record", "--force", "-o", str(Path(tmp) / "run"),
                  *args.record.split(), "--", *me]
        for i in range(args.runs):
            got["untraced"].append(measure(me))
            got["traced"].append(measure(traced))
            print(f"run {i + 1}/{args.runs}: " + ", ".join(
                f"{part} {got['untraced'][-1][part] / 1e3:.1f} -> {got['traced'][-1][part] / 1e3:.1f} us"
                for part in PARTS), file=sys.stderr, flush=True)
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores; one rank on gloo; "
          f"{args.tables} tables x {args.batch} x {args.pooling} ids a step, {args.steps} steps, {args.runs} "
          f"alternating runs, medians; record {args.record or '(defaults)'}")
    print("| part | untraced us/call | traced us/call | added us/call | added per step (us) |")
    print("|---|---:|---:|---:|---:|")
    per_step = {"embedding call": args.tables, "collective": 2, "backward": 1, "optimizer step": 1}
    total = 0.0
    for part in PARTS:
        untraced = statistics.median(g[part] for g in got["untraced"]) / 1e3
        traced_us = statistics.median(g[part] for g in got["traced"]) / 1e3
        added = traced_us - untraced
        total += added * per_step[part]
        print(f"| {part} | {untraced:.1f} | {traced_us:.1f} | {added:+.1f} | {added * per_step[part]:+.1f} |")
    print(f"| a step | | | | **{total:+.1f}** |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

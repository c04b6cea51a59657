"""What the averaging hook `tracekit record` gives a DDP model costs a step, against DDP's built-in
all-reduce: 2 gloo ranks (one core each) train two copies of a DLRM-sized MLP (338k parameters,
batch 512), one with DDP's built-in hook, one with tracekit's (collectors/comm.py
`_average_bucket_hook`, the comm collector installed as under `record`), alternating step by step
in one process; wall ms a step on rank 0, medians, and a check that both end with the same weights,
bit for bit.

    .venv/bin/python -m torch.distributed.run --standalone --nproc-per-node 2 bench/ddp_comm_hook.py [--steps 400]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.record_overhead import machine  # noqa: E402
from collectors import comm  # noqa: E402
from collectors.steps import StepClock  # noqa: E402
from tracekit.store import RunWriter  # noqa: E402


def mlp() -> nn.Module:
    torch.manual_seed(0)
    sizes = [13, 512, 256, 64, 512, 256, 1]
    layers: list[nn.Module] = []
    for n_in, n_out in zip(sizes, sizes[1:]):
        layers += [nn.Linear(n_in, n_out), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=400, help="steps of each model")
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    cores = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cores[rank % len(cores)]})  # one core a rank, as the benches' jobs run
    torch.set_num_threads(1)
    trace = tempfile.TemporaryDirectory()
    writer = RunWriter(trace.name, rank)
    handle = comm.install(writer, StepClock())
    models = {name: DistributedDataParallel(mlp()) for name in ("built-in", "tracekit's hook")}
    models["built-in"]._tracekit_checked = True  # keeps DDP's own all-reduce (collectors/comm.py)
    optimizers = {name: torch.optim.SGD(m.parameters(), lr=0.01) for name, m in models.items()}
    x, y = torch.randn(512, 13), torch.rand(512, 1)
    ms: dict[str, list[float]] = {name: [] for name in models}
    for i in range(args.steps):
        for name in list(models) if i % 2 else list(models)[::-1]:
            dist.barrier()
            t0 = time.perf_counter()
            loss = nn.functional.binary_cross_entropy_with_logits(models[name](x), y)
            optimizers[name].zero_grad()
            loss.backward()
            optimizers[name].step()
            ms[name].append(1000 * (time.perf_counter() - t0))
    same = {name: all(torch.equal(a, b) for a, b in zip(models["built-in"].parameters(), m.parameters()))
            for name, m in models.items()}
    if rank == 0:
        base = statistics.median(ms["built-in"])
        print(f"machine: {machine('cpu')}; 2 gloo ranks, {args.steps} steps of each model, alternating")
        for name, times in ms.items():
            median = statistics.median(times)
            print(f"{name:16s} {median:7.3f} ms a step  {median / base - 1:+.1%}  "
                  f"weights equal to built-in's: {same[name]}")
    dist.barrier()
    handle.uninstall()
    writer.close()
    trace.cleanup()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

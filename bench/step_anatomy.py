"""Where a step of the reference trainer goes, per rank: wall and CPU time of each phase, and the
CPU time of every thread of the process (the training thread, gloo's threads, the prefetcher).

A phase's wall time less its CPU time is time the training thread spent off the CPU: waiting on a
collective, or runnable while another thread had the core. The threads' CPU time shows what the
collectives cost the rank's core beside the training thread (gloo moves the bytes on its own
threads, pinned with the rank). Run it like train.py, with the same arguments:

    torchrun --standalone --nproc-per-node 2 bench/step_anatomy.py --tables 8 --rows 100000 \\
        --dim 64 --bottom-mlp 512,256,64 --top-mlp 512,256,1 --batch-size 512 --pooling 1 \\
        --zipf 0 --eval-fraction 0 --steps 300

Each rank prints one JSON line on stderr (`step_anatomy`): per phase {calls, wall_ms, cpu_ms} per
call, and per thread name its CPU seconds over the whole run (setup included).
"""

import functools
import json
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tracekit.dlrm import train  # noqa: E402
from tracekit.dlrm.sharding import ShardedEmbeddings  # noqa: E402

PHASES: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0.0])  # name -> [calls, wall s, cpu s]


def timed(name: str, fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        wall, cpu = time.perf_counter(), time.thread_time()
        try:
            return fn(*args, **kwargs)
        finally:
            entry = PHASES[name]
            entry[0] += 1
            entry[1] += time.perf_counter() - wall
            entry[2] += time.thread_time() - cpu
    return wrapper


def thread_cpu_s() -> dict[str, float]:
    """CPU seconds of each thread of this process, summed by thread name."""
    out: dict[str, float] = defaultdict(float)
    tick = os.sysconf("SC_CLK_TCK")
    for task in Path("/proc/self/task").iterdir():
        try:
            name = (task / "comm").read_text().strip()
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # the thread ended meanwhile
            continue
        out[name] += (int(fields[11]) + int(fields[12])) / tick  # utime + stime
    return dict(out)


def reporting_first(destroy):
    """`destroy_process_group` that first prints this rank's line (training and evaluation are done)."""
    @functools.wraps(destroy)
    def wrapper(*args, **kwargs):
        phases = {name: {"calls": calls, "wall_ms": wall / calls * 1e3, "cpu_ms": cpu / calls * 1e3}
                  for name, (calls, wall, cpu) in PHASES.items() if calls}
        line = {"step_anatomy": {"rank": int(os.environ.get("RANK", 0)), "phases": phases,
                                 "threads_cpu_s": thread_cpu_s()}}
        print(json.dumps(line), file=sys.stderr, flush=True)
        return destroy(*args, **kwargs)
    return wrapper


if __name__ == "__main__":
    ShardedEmbeddings.forward = timed("embeddings forward", ShardedEmbeddings.forward)
    DistributedDataParallel.forward = timed("dense forward", DistributedDataParallel.forward)
    torch.Tensor.backward = timed("backward (DDP's wait included)", torch.Tensor.backward)
    for optimizer in (torch.optim.SGD, torch.optim.Adagrad):  # train.py's dense optimizers
        optimizer.step = timed("dense optimizer step", optimizer.step)
    dist.destroy_process_group = reporting_first(dist.destroy_process_group)
    sys.exit(train.main())

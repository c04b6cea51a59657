"""Run a function on N real gloo ranks (spawned processes) and collect what each returns.

Worker exceptions come back with their traceback, as in TorchRec's multi-process tests.
"""

from __future__ import annotations

import os
import pickle
import queue as queue_mod
import socket
import time
import traceback
from datetime import timedelta

import torch.distributed as dist
import torch.multiprocessing as mp

TIMEOUT_S = 300


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world_size, port, fn, args, queue):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=TIMEOUT_S))
        result = fn(rank, world_size, *args)
        dist.barrier()
        queue.put((rank, pickle.dumps(result), None))  # plain pickle: no shared-memory fds
    except BaseException:  # report every failure, KeyboardInterrupt included, to the parent
        queue.put((rank, None, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(world_size: int, fn, *args) -> list:
    """fn(rank, world_size, *args) on each rank; returns the results in rank order."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, fn, args, queue)) for r in range(world_size)]
    for p in procs:
        p.start()
    results, errors = {}, []
    deadline = time.monotonic() + TIMEOUT_S
    try:
        while len(results) < world_size:
            try:
                rank, result, error = queue.get(timeout=1)
            except queue_mod.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in results]
                if dead or time.monotonic() > deadline:
                    errors.append(f"ranks {dead} died (exit codes {[procs[r].exitcode for r in dead]})"
                                  if dead else f"timed out after {TIMEOUT_S} s")
                    break
                continue
            results[rank] = pickle.loads(result) if result is not None else None
            if error:
                errors.append(f"rank {rank}:\n{error}")
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    if errors:
        raise RuntimeError("\n".join(errors))
    return [results[r] for r in range(world_size)]

"""`tracekit record` on a GPU (marked gpu: `pytest -m gpu`): the reference trainer on CUDA recorded
exactly, and a user script's NCCL collectives with exact bytes. Read back with pyarrow alone: the
GPU machines have no polars or duckdb."""

from __future__ import annotations

import json
import sys
import textwrap
from collections import Counter
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch

from tests.recorded import REPO, TINY, expected_accesses, record

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

TORCHRUN_1 = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1"]


def rows(run_dir: Path, table: str) -> list[dict]:
    return pq.read_table(run_dir / table).to_pylist()


def test_the_trainer_on_cuda_is_recorded_exactly_with_gpu_samples(tmp_path: Path) -> None:
    code, run_dir = record(tmp_path, *TORCHRUN_1, str(REPO / "train.py"), *TINY, "--device", "cuda")
    assert code == 0
    counts: Counter = Counter()
    for r in rows(run_dir, "accesses"):
        counts[(r["step"], r["table_name"], r["row"])] += r["count"]
    assert counts == expected_accesses(1, 4)
    steps = rows(run_dir, "steps")
    assert [r["step"] for r in steps] == [0, 1, 2, 3] and all(r["loss"] > 0 for r in steps)
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["status"] == "completed" and manifest["gpu"]["samples"] is True, manifest["gpu"]
    assert len(rows(run_dir, "gpu")) > 0


NCCL_SCRIPT = """
import torch, torch.distributed as dist
from torch import nn
dist.init_process_group("nccl")
device = torch.device("cuda", 0)
torch.cuda.set_device(device)
x = torch.arange(12, dtype=torch.float32, device=device)
out = torch.empty_like(x)
dist.all_to_all_single(out, x, [12], [12])                      # 48 bytes each way
work = dist.all_reduce(torch.ones(1000, device=device), async_op=True)
work.wait()                                                     # 4000 bytes
model = nn.parallel.DistributedDataParallel(nn.Linear(64, 32).to(device), device_ids=[0])
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(3):
    model(torch.randn(8, 64, device=device)).sum().backward()
    opt.step(); opt.zero_grad()
torch.cuda.synchronize()
dist.barrier()
dist.destroy_process_group()
"""


def test_nccl_collectives_are_recorded_with_exact_bytes(tmp_path: Path) -> None:
    script = tmp_path / "nccl_script.py"
    script.write_text(textwrap.dedent(NCCL_SCRIPT))
    code, run_dir = record(tmp_path, *TORCHRUN_1, str(script))
    assert code == 0
    comms = sorted(rows(run_dir, "comms"), key=lambda r: r["seq"])
    by_op = Counter(r["op"] for r in comms)
    assert by_op["all_to_all_single"] == 1 and by_op["barrier"] == 1
    a2a = next(r for r in comms if r["op"] == "all_to_all_single")
    assert (a2a["bytes_out"], a2a["bytes_in"], a2a["splits_out"], a2a["splits_in"]) == (48, 48, [48], [48])
    reduce = next(r for r in comms if r["op"] == "all_reduce" and r["bytes_out"] == 4000)
    assert reduce["async"] and reduce["t_end_ns"] >= reduce["t_start_ns"]
    buckets = [r for r in comms if r["tag"].startswith("ddp_bucket_")]
    assert [r["step"] for r in buckets] == [0, 1, 2]
    assert {r["bytes_out"] for r in buckets} == {4 * (64 * 32 + 32)}
    assert all(r["t_end_ns"] >= r["t_start_ns"] > 0 for r in comms)


def test_the_kaggle_layout_at_batch_65536_on_cuda_records_every_id(tmp_path: Path) -> None:
    """26 tables at full size, 65,536 samples a step: 1.7M ids a step, more than a flush, counted on the
    device's side stream; the ids recorded are exactly the ids fed, with nothing lost."""
    run_dir = tmp_path / "kaggle"
    import subprocess

    steps, batch = 3, 65_536
    r = subprocess.run([sys.executable, "-m", "tracekit", "record", "-o", str(run_dir), "--", sys.executable,
                        str(REPO / "train.py"), "--preset", "criteo-kaggle", "--device", "cuda", "--batch-size",
                        str(batch), "--steps", str(steps), "--samples", str(batch * (steps + 1)), "--eval-fraction",
                        "0", "--dim", "16"], cwd=REPO, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["lost_rows"] == {} and manifest["writer_errors"] == 0, manifest
    table = pq.read_table(run_dir / "accesses", columns=["step", "count"])
    assert sum(table.column("count").to_pylist()) == steps * 26 * batch
    assert r.stderr.strip().splitlines()[-1] == "  the trace is whole: no row lost"

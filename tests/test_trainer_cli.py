"""train.py as a user runs it: one process and torchrun, its JSON summary, its errors, Ctrl-C."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tracekit.dlrm.config import TrainConfig
from tracekit.dlrm.data import open_dataset
from tracekit.dlrm.train import run

REPO = Path(__file__).resolve().parents[1]
TINY = ["--tables", "4", "--rows", "1000", "--dim", "8", "--bottom-mlp", "16,8", "--top-mlp", "16,1",
        "--batch-size", "64", "--samples", "8192"]
SUMMARY_KEYS = {"world_size", "steps", "samples", "samples_per_s", "train_loss", "eval_auc", "eval_logloss"}


def train(*args: str, timeout: int = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "train.py", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout)


def torchrun(*args: str, timeout: int = 180) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "train.py", *args]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout)


def test_single_process_prints_one_json_summary() -> None:
    r = train(*TINY, "--steps", "5", "--json")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    assert len(lines) == 1, r.stdout
    summary = json.loads(lines[0])
    assert SUMMARY_KEYS <= summary.keys()
    assert summary["world_size"] == 1 and summary["steps"] == 5 and summary["samples"] == 5 * 64


def test_epochs_cover_the_training_split_once_keeping_the_last_partial_batch() -> None:
    # 1000 samples, 10% held out: 900 train samples = 14 full batches of 64 and one of 4
    r = train(*TINY[:-2], "--samples", "1000", "--epochs", "1", "--json")
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout)
    assert (summary["steps"], summary["samples"]) == (15, 900)


@pytest.mark.parametrize("args, message", [
    (["--batch-size", "0"], "--batch-size must be positive, got 0"),
    (["--sharding", "diagonal"], "--sharding must be one of table, row, got 'diagonal'"),
    (["--bottom-mlp", "16,32", "--dim", "8"], "--bottom-mlp must end in --dim (8)"),
    (["--data", "criteo:/no/such/file.txt"], "/no/such/file.txt"),
    (["--data", "kafka:topic"], "kafka"),
])
def test_bad_configuration_is_refused_with_a_clear_message(args: list[str], message: str) -> None:
    r = train(*TINY, *args)
    assert r.returncode == 2, r.stderr
    assert message in r.stderr, r.stderr
    assert "Traceback" not in r.stderr, r.stderr


def test_malformed_criteo_file_names_file_and_line(tmp_path: Path) -> None:
    good = "\t".join(["1"] + ["3"] * 13 + ["68fd1e64"] * 26)
    path = tmp_path / "bad.txt"
    path.write_text(good + "\n" + good + "\n" + "1\t2\t3\n")
    r = train("--data", f"criteo:{path}", "--steps", "1")
    assert r.returncode == 2
    assert str(path) in r.stderr and "line 3" in r.stderr, r.stderr


@pytest.mark.slow
def test_torchrun_two_ranks() -> None:
    r = torchrun(*TINY, "--steps", "5", "--json")
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    assert summary["world_size"] == 2 and summary["backend"] == "gloo" and summary["samples"] == 5 * 128


@pytest.mark.slow
def test_impossible_layout_is_refused_before_any_process_group() -> None:
    started = time.monotonic()
    r = torchrun(*TINY, "--tables", "1", "--steps", "5")
    assert r.returncode != 0
    assert "table-wise sharding needs at least one table per rank: 1 tables, 2 ranks" in r.stderr, r.stderr
    assert time.monotonic() - started < 60


@pytest.mark.slow
def test_ctrl_c_stops_every_rank_without_a_hang() -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "train.py",
           *TINY, "--steps", "1000000", "--log-every", "10"]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    for line in proc.stdout:  # wait until training runs
        if line.startswith("step 20/"):
            break
    os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does: the whole process group
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail("ranks still running 60 s after Ctrl-C")
    assert proc.returncode != 0
    leftover = subprocess.run(["pgrep", "-s", str(proc.pid)], capture_output=True, text=True).stdout.split()
    assert not leftover, f"processes left behind: {leftover}"


def test_planted_signal_is_learned() -> None:
    cfg = TrainConfig(tables=8, rows=[2000], dim=16, bottom_mlp=[32, 16], top_mlp=[32, 1], batch_size=256,
                      steps=150, samples=60_000, log_every=1000, lr=0.2)
    dataset = open_dataset("synthetic", tables=8, rows=2000, num_dense=13, pooling=2, samples=60_000, seed=0,
                           zipf=1.05, drift=0.0, preset=None, scale=1.0)
    result = run(cfg, dataset, rank=0, world_size=1, device=torch.device("cpu"))
    assert result.eval_auc > 0.65, result.summary()
    assert result.losses[-1] < result.losses[0]


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cuda_requested_without_a_gpu_is_refused() -> None:
    r = train(*TINY, "--device", "cuda")
    assert r.returncode == 2 and "--device cuda: no CUDA device is available" in r.stderr, r.stderr

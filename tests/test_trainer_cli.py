"""train.py as a user runs it: one process and torchrun, its JSON summary, its errors, Ctrl-C."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
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


# train.py, run as it is, with torch.distributed.init_process_group leaving a mark (a file named
# after the rank) before it starts the process group as asked
SPY = """
import os, runpy, sys
import torch.distributed as dist

init_process_group = dist.init_process_group

def marked(*args, **kwargs):
    open(os.path.join(os.environ["SPY_MARKS"], "rank" + os.environ["RANK"]), "w").close()
    return init_process_group(*args, **kwargs)

dist.init_process_group = marked
sys.argv[0] = "train.py"
runpy.run_path("train.py", run_name="__main__")
"""


def rank_of_two(rank: int, master_port: int, marks: Path, *args: str) -> subprocess.Popen:
    """Rank `rank` of a world of 2, as torchrun would start it, its master at 127.0.0.1:`master_port`."""
    env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(master_port), "SPY_MARKS": str(marks)}
    return subprocess.Popen([sys.executable, "-c", SPY, *args], cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


@pytest.fixture
def master(tmp_path: Path):
    """A listening socket on the ranks' MASTER_PORT, which no rank's store can then bind: a rank that
    starts a process group marks it and connects to it (rank 1) or fails to bind it (rank 0)."""
    (tmp_path / "marks").mkdir()
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        yield listener, tmp_path / "marks"


@pytest.mark.slow
def test_impossible_layout_is_refused_before_any_process_group(master) -> None:
    listener, marks = master
    ranks = [rank_of_two(r, listener.getsockname()[1], marks, *TINY, "--tables", "1", "--steps", "5") for r in (0, 1)]
    outputs = [rank.communicate(timeout=120) for rank in ranks]
    assert [rank.returncode for rank in ranks] == [2, 2], outputs
    assert "table-wise sharding needs at least one table per rank: 1 tables, 2 ranks" in outputs[0][1], outputs
    assert list(marks.iterdir()) == []  # no rank called init_process_group
    listener.setblocking(False)
    with pytest.raises(BlockingIOError):  # and none connected to the master port
        listener.accept()


@pytest.mark.slow
def test_a_rank_that_starts_a_process_group_is_seen_doing_it(master) -> None:
    """What the test above watches for, seen: rank 1 of a possible layout marks, then connects."""
    listener, marks = master
    rank = rank_of_two(1, listener.getsockname()[1], marks, *TINY, "--steps", "5")
    try:
        listener.settimeout(120)  # a bound for a rank that never connects, not a speed to meet
        connection, _ = listener.accept()
        connection.close()
        assert [p.name for p in marks.iterdir()] == ["rank1"]
    finally:
        rank.kill()
        rank.communicate()


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

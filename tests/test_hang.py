"""Hang diagnosis (tracekit/app/hang.py, collectors/heartbeat.py): a rank stopped with SIGSTOP (1 of 2,
1 of 4, and 1 of 2 on an emulated cluster of 2 nodes) is named as silent within `--hang-after` + 5 s, with the collective (op, tag, call number)
the others wait in; after SIGCONT the run completes and its trace is whole. A rank that skips a
collective is named with the call on which the two disagree. And the diagnosis itself, from made-up
heartbeats."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from tests.recorded import REPO
from tests.test_cluster import needs_cluster
from tracekit.app.hang import HANG_FLOOR_S, describe, diagnose, threshold

STEPS = 500
LOOP = textwrap.dedent(f"""
    import datetime, time, torch, torch.distributed as dist
    import tracekit
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    x = torch.ones(256)
    for step in range({STEPS}):
        with tracekit.label("exchange"):
            dist.all_reduce(x)
        time.sleep(0.02)
        tracekit.step()
    dist.barrier()
    dist.destroy_process_group()
""")
SKIP = textwrap.dedent("""
    import datetime, time, torch, torch.distributed as dist
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=10))
    x = torch.ones(4)
    for i in range(20):
        if not (dist.get_rank() == 1 and i == 15):  # rank 1 skips one all_reduce
            dist.all_reduce(x)
        time.sleep(0.02)
    dist.barrier()
    dist.destroy_process_group()
""")


def start(tmp_path: Path, text: str, ranks: int, hang_after: int = 3, nodes: int = 0) -> tuple[subprocess.Popen, Path]:
    """`text` as a job of `ranks` ranks under `tracekit record`, or on an emulated cluster of `nodes`
    nodes (`tracekit cluster --record`)."""
    script, run = tmp_path / "job.py", tmp_path / "run"
    script.write_text(text)
    if nodes:
        how = ["cluster", "--nodes", str(nodes), "--ranks-per-node", str(ranks // nodes), "--link", "1gbit",
               "--record", str(run), "--hang-after", str(hang_after), "--", "python", str(script)]
    else:
        how = ["record", "--hang-after", str(hang_after), "-o", str(run), "--", sys.executable, "-m",
               "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks), str(script)]
    proc = subprocess.Popen([sys.executable, "-m", "tracekit", *how], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    return proc, run


def wait_for(path: Path, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if path.exists():
            return True
        time.sleep(0.2)
    return False


@pytest.mark.parametrize("ranks, stopped, nodes", [(2, 1, 0), (4, 2, 0), pytest.param(
    2, 1, 2, marks=needs_cluster, id="cluster-2x1")])
def test_a_stopped_rank_is_named_and_the_run_completes_after_sigcont(tmp_path: Path, ranks: int, stopped: int,
                                                                      nodes: int) -> None:
    proc, run = start(tmp_path, LOOP, ranks, nodes=nodes)
    try:
        beat = run / "ranks" / f"heartbeat-rank={stopped}.json"
        assert wait_for(beat, 120), "no heartbeat"
        time.sleep(2)
        pid = json.loads(beat.read_text())["pid"]
        os.kill(pid, signal.SIGSTOP)
        try:
            assert wait_for(run / "hang.json", 3 + 5 + 1), "no hang.json within --hang-after + 5 s"
            time.sleep(0.5)
            hang = json.loads((run / "hang.json").read_text())
            live = subprocess.run([sys.executable, "-m", "tracekit", "watch", str(run), "--once"], cwd=REPO,
                                  capture_output=True, text=True, timeout=60)
        finally:
            os.kill(pid, signal.SIGCONT)
        out, err = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert list(hang["silent"]) == [str(stopped)]
    group = hang["groups"][0]
    assert (group["op"], group["tag"]) == ("all_reduce", "exchange") and group["call"] > 1
    assert set(group["waiting"]) == {str(r) for r in range(ranks)} - {str(stopped)}
    assert str(stopped) in group["not_there"]
    assert f"rank {stopped} has sent no heartbeat" in err and "waiting in all_reduce (exchange)" in err
    assert "the hang cleared" in err and "Traceback" not in err
    # watch shows it live: each rank's collective now, and the diagnosis
    assert "ranks now" in live.stdout and "all_reduce (exchange), call #" in live.stdout, live.stdout
    assert f"rank {stopped} has sent no heartbeat" in " ".join(live.stdout.split()), live.stdout
    assert proc.returncode == 0, err[-3000:]
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["status"] == "completed" and not manifest["dropped_rows"]
    assert manifest["steps"] == {str(r): STEPS for r in range(ranks)}
    comms = pq.read_table(run / "comms").to_pylist()
    per_rank = {r: sum(1 for c in comms if c["rank"] == r and c["tag"] == "exchange") for r in range(ranks)}
    assert per_rank == {r: STEPS for r in range(ranks)}  # the trace is whole
    assert (run / "ranks" / "stacks-rank=0.txt").read_text().count("Thread") >= 2  # the live ranks' stacks
    assert not list((run / "ranks").glob("heartbeat-*"))


def test_a_skipped_collective_names_the_call_the_ranks_disagree_on(tmp_path: Path) -> None:
    proc, run = start(tmp_path, SKIP, 2)
    out, err = proc.communicate(timeout=300)
    hang = json.loads((run / "hang.json").read_text())
    group = hang["groups"][0]
    # the later all_reduces pair up one off; rank 0's 20th call is its last all_reduce, rank 1's the barrier
    assert group["call"] == 20 and group["op"] == "all_reduce"
    assert group["waiting"]["1"]["op"] == "barrier" and group["waiting"]["1"]["call"] == 20
    assert "disagrees: its call #20 of this group is barrier" in group["not_there"]["1"]
    assert "disagrees" in err and hang["silent"] == {}


def beat(rank: int, now: float, *, age: float = 0.0, open_: dict | None = None, calls: dict | None = None,
         step: int = 10) -> dict:
    return {"rank": rank, "pid": 100 + rank, "host": "h", "wall_time": now - age, "step": step, "step_s": 0.1,
            "open": open_, "calls": calls or {}}


def call(n: int, since: float, op: str = "all_to_all_single", group: str = "1") -> dict:
    return {"op": op, "tag": "t", "group": group, "group_size": 3, "call": n, "since": since}


def test_the_diagnosis_names_who_waits_who_is_silent_and_who_is_elsewhere() -> None:
    now = 1000.0
    beats = {0: beat(0, now, open_=call(7, now - 30), calls={"1": 6}),
             1: beat(1, now, age=40, calls={"1": 5}, step=9),  # stopped before entering call 7
             2: beat(2, now, open_=call(8, now - 30), calls={"1": 7})}  # a call ahead: it skipped one
    hang = diagnose(beats, now, hang_after=20)
    assert list(hang["silent"]) == ["1"] and hang["silent"]["1"]["since_s"] == 40
    (group,) = hang["groups"]
    assert group["call"] == 7 and set(group["waiting"]) == {"0", "2"}
    assert group["not_there"]["1"].startswith("never entered it: 5 calls")
    assert group["not_there"]["2"].startswith("in call #8")
    text = describe(hang)
    assert "rank 1 has sent no heartbeat for 40 s" in text and "call #7 of group 1" in text
    assert diagnose(beats | {1: beat(1, now, open_=call(7, now - 1), calls={"1": 6})}, now + 0, 60) is None


def test_the_default_threshold_follows_the_step_time() -> None:
    assert threshold({}, None) == HANG_FLOOR_S and threshold({0: {"step_s": 2.0}}, None) == 200.0
    assert threshold({0: {"step_s": 0.01}}, None) == HANG_FLOOR_S and threshold({0: {"step_s": 2.0}}, 5) == 5

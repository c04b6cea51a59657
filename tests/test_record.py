"""`tracekit record` end to end: real subprocesses, real Parquet, exact counts."""

from __future__ import annotations

import json
import sys
import threading
from collections import Counter
from pathlib import Path

import polars as pl
import pytest
from click.testing import CliRunner

from tracekit import thread_priority
from tracekit.app.cli import cli
from tests.recorded import REPO, TINY, expected_accesses, one_table_script, record, record_gloo
from tracekit.run import open_run

def expected_tables(world_size: int, sharding: str, sequence_tables: int) -> list[dict]:
    """Manifest `tables` of a TINY run: 4 tables of 500 rows and dim 8, the first `sequence_tables`
    unpooled; table-wise, t0..t3 go to ranks 0, 1, 0, 1 (equal sizes: round robin); row-wise,
    rank r holds rows [r * 500 / world_size, (r + 1) * 500 / world_size) of every table."""
    block = 500 // world_size
    tables = []
    for t in range(4):
        shards = ([{"rank": t % world_size, "first_row": 0, "num_rows": 500}] if sharding == "table" else
                  [{"rank": r, "first_row": r * block, "num_rows": block} for r in range(world_size)])
        tables.append({"name": f"t{t}", "num_rows": 500, "dim": 8, "dtype": "float32", "padding_idx": None,
                       "kind": "sequence" if t < sequence_tables else "pooled", "placement": "sharded",
                       "shards": shards})
    return tables


def recorded_accesses(run_dir: Path) -> Counter:
    rows = open_run(run_dir).scan("accesses").collect().to_dicts()
    counts: Counter = Counter()
    for r in rows:
        counts[(r["step"], r["table_name"], r["row"])] += r["count"]
    return counts


def test_single_process_trainer_is_recorded_exactly(tmp_path: Path) -> None:
    code, run_dir = record(tmp_path, sys.executable, str(REPO / "train.py"), *TINY)
    assert code == 0
    assert recorded_accesses(run_dir) == expected_accesses(1, 4)
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert (manifest["status"], manifest["exit_code"], manifest["ranks"]) == ("completed", 0, [0])
    assert manifest["tables"] == expected_tables(1, "table", 0)
    steps = open_run(run_dir).scan("steps").collect()
    assert steps["step"].to_list() == [0, 1, 2, 3]
    assert all(0 < loss < 2 for loss in steps["loss"].to_list())  # the loss backward() ran from


@pytest.mark.slow
@pytest.mark.parametrize(("sharding", "sequence_tables"), [("table", 0), ("table", 2), ("row", 2)])
def test_torchrun_two_ranks_are_recorded_exactly(tmp_path: Path, sharding: str, sequence_tables: int) -> None:
    code, run_dir = record(tmp_path, sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc-per-node", "2", str(REPO / "train.py"), *TINY,
                           "--sharding", sharding, "--sequence-tables", str(sequence_tables))
    assert code == 0
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["status"] == "completed" and manifest["ranks"] == [0, 1], manifest  # not the launcher
    assert manifest["tables"] == expected_tables(2, sharding, sequence_tables)
    assert set(manifest["writer_cpu_s"]) == {"0", "1"} and all(s > 0 for s in manifest["writer_cpu_s"].values())
    policy = "idle" if thread_priority.may_leave_idle(threading.get_native_id()) else "nice +10"
    scheduling = manifest["writer_scheduling"]  # lifted when a flush ran late (a loaded machine)
    assert {rank: s["policy"] for rank, s in scheduling.items()} == {"0": policy, "1": policy}
    assert all(isinstance(s["rescues"], int) and s["rescues"] >= 0 for s in scheduling.values())
    expected = expected_accesses(2, 4)
    assert recorded_accesses(run_dir) == expected  # global rows: row-wise shards are looked up with local ids
    run = open_run(run_dir)
    lookups = Counter(run.scan("lookups").select("step", "table_name", "row").collect().rows())
    assert lookups == Counter({key: n for key, n in expected.items() if key[0] == 0})  # step 0 is sampled
    held = {(table["name"], shard["rank"]): range(shard["first_row"], shard["first_row"] + shard["num_rows"])
            for table in manifest["tables"] for shard in table["shards"]}
    for table, rank, row in run.scan("accesses").select("table_name", "rank", "row").collect().rows():
        assert row in held.get((table, rank), range(0)), (table, rank, row)  # each rank reads its own rows


def test_exit_code_passes_through_and_the_run_is_marked_failed(tmp_path: Path) -> None:
    code, run_dir = record(tmp_path, sys.executable, "-c", "import torch, sys; sys.exit(3)")
    assert code == 3
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert (manifest["status"], manifest["exit_code"]) == ("failed", 3)


def test_bad_invocations_are_refused_with_one_line(tmp_path: Path) -> None:
    runner = CliRunner()
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "keep.txt").write_text("x")
    r = runner.invoke(cli, ["record", "-o", str(busy), "--", sys.executable, "-c", "pass"])
    assert r.exit_code == 2 and "directory is not empty (use --force" in r.output, r.output
    assert (busy / "keep.txt").exists()
    r = runner.invoke(cli, ["record", "-o", str(tmp_path / "x"), "--", "no-such-command-xyz"])
    assert r.exit_code == 2 and "command not found: no-such-command-xyz" in r.output, r.output
    r = runner.invoke(cli, ["record", "--frobnicate", "--", "true"])
    assert r.exit_code == 2 and "No such option" in r.output, r.output


@pytest.mark.slow
def test_collectives_and_gradients_are_recorded_exactly(tmp_path: Path) -> None:
    code, run_dir = record(tmp_path, sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc-per-node", "2", str(REPO / "train.py"), *TINY, options=("--grad-every", "2"))
    assert code == 0
    comms = open_run(run_dir).scan("comms").collect()
    a2a = comms.filter(comms["op"] == "all_to_all_single").sort("rank", "seq")
    per_rank = [a2a.filter(a2a["rank"] == r).to_dicts() for r in (0, 1)]
    assert len(per_rank[0]) == len(per_rank[1]) == 4 * 4  # lengths, ids, pooled fwd, pooled bwd
    for mine, theirs in zip(*per_rank):  # the k-th all-to-all of rank 0 pairs with rank 1's
        assert mine["step"] == theirs["step"]
        assert mine["splits_out"][1] == theirs["splits_in"][0] and mine["splits_in"][1] == theirs["splits_out"][0]
    # table-wise, 2 tables per rank, 32 samples per rank, pooling 3, dim 8:
    # lengths int32 2*32*4, ids int64 2*32*3*8, pooled rows float32 2*32*8*4 to each peer
    implied = [[256, 256], [1536, 1536], [2048, 2048], [2048, 2048]]
    for rows in per_rank:
        assert [r["splits_out"] for r in rows[:4]] == implied
    from tracekit.dlrm.model import DenseArch
    dense = DenseArch(13, [16, 8], [16, 1], 4)
    dense_bytes = 4 * sum(p.numel() for p in dense.parameters())
    ddp = comms.filter(comms["tag"] == "_sum_allreduce_hook")
    for r in (0, 1):
        steps = ddp.filter(pl.col("rank") == r).group_by("step").agg(pl.col("bytes_out").sum()).sort("step")
        assert steps["step"].to_list() == [0, 1, 2, 3] and set(steps["bytes_out"].to_list()) == {dense_bytes}
    assert (comms["t_end_ns"] >= comms["t_start_ns"]).all()

    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["collector_settings"]["grad_every"] == 2
    grads = open_run(run_dir).scan("grads").collect()
    per_rank_grads = [grads.filter(pl.col("rank") == r).drop("rank").sort("step", "name") for r in (0, 1)]
    assert per_rank_grads[0].equals(per_rank_grads[1])  # read after DDP's all-reduce: the same on both ranks
    for step in (0, 2):  # the sampled steps of 4
        rows = per_rank_grads[0].filter(pl.col("step") == step)
        assert rows["name"].to_list() == sorted(name for name, _ in dense.named_parameters())  # no `module.`
        assert rows["numel"].sum() == dense_bytes // 4
    assert set(per_rank_grads[0]["step"]) == {0, 2}


KILL_SCRIPT = one_table_script("import glob, os, signal, sys, time, torch\nimport pyarrow.parquet as pq", 1000, """\
    if step == 40:  # wait (at most a minute) until step 39's rows are on disk, then die
        def written(table):
            parts = glob.glob(os.path.join(os.environ["TRACEKIT_RUN_DIR"], table, "rank=0", "*.parquet"))
            return any(39 in pq.read_table(p, columns=["step"])["step"].to_pylist() for p in parts)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not (written("steps") and written("accesses")):
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGKILL)
""")


def test_a_killed_process_leaves_readable_files_and_a_failed_manifest(tmp_path: Path) -> None:
    code, run_dir = record(tmp_path, sys.executable, "-c", KILL_SCRIPT)
    assert code == 128 + 9
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert (manifest["status"], manifest["exit_code"]) == ("failed", -9)
    steps = sorted(open_run(run_dir).scan("steps").collect()["step"].to_list())
    assert steps == list(range(len(steps))) and len(steps) >= 40, steps  # no gap, all flushed before the kill
    accesses = open_run(run_dir).scan("accesses").collect()
    assert accesses.filter(pl.col("step") < 40)["count"].sum() == 2 * 40  # (mid-write kills: test_crash_safety.py)
    # what only the running rank needed is gone: its disk reserve, its heartbeat, an unwritten stacks file
    assert sorted(p.name for p in (run_dir / "ranks").iterdir()) == [], list((run_dir / "ranks").iterdir())


@pytest.mark.slow
def test_ctrl_c_marks_the_run_interrupted(tmp_path: Path) -> None:
    import os
    import signal
    import subprocess

    run_dir = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "tracekit", "record", "-o", str(run_dir), "--",
                             sys.executable, str(REPO / "train.py"), *TINY[:-2], "--steps", "100000",
                             "--log-every", "10"], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    for line in proc.stdout:
        if line.startswith("step 20/"):
            break
    os.killpg(proc.pid, signal.SIGINT)  # a terminal's Ctrl-C reaches the whole process group
    assert proc.wait(timeout=60) == 130
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["status"] == "interrupted", manifest
    assert len(open_run(run_dir).scan("steps").collect()) >= 20


USER_SCRIPT = """\
torch.manual_seed(0)
emb = torch.nn.EmbeddingBag(1000, 8, mode="sum")
head = DistributedDataParallel(torch.nn.Linear(8, 1))
opt = torch.optim.SGD(list(emb.parameters()) + list(head.parameters()), lr=0.1)
send, recv = ([1, 3], [1, 2]) if rank == 0 else ([2, 2], [3, 2])
for step in range(5):
    ids = torch.arange(step * 8, step * 8 + 8) + rank * 100
    pooled = emb(ids, torch.tensor([0, 2, 4, 6]))
    out = torch.empty(sum(recv), 8)
    dist.all_to_all_single(out, pooled.detach(), recv, send)
    (head(pooled).sum() + out.sum() * 0).backward()
    opt.step()
    opt.zero_grad()
"""


@pytest.mark.slow
def test_a_user_script_is_recorded_without_changing_it(tmp_path: Path) -> None:
    run_dir = record_gloo(tmp_path, "user_train.py", USER_SCRIPT)
    # not under DDP, so each rank trains a table of its own (tests/test_table_identity.py)
    assert json.loads((run_dir / "manifest.json").read_text())["tables"] == [
        {"name": f"EmbeddingBag_0@rank{r}", "num_rows": 1000, "dim": 8, "dtype": "float32", "kind": "pooled",
         "padding_idx": None, "placement": "local", "shards": [{"rank": r, "first_row": 0, "num_rows": 1000}]}
        for r in (0, 1)]
    run = open_run(run_dir)
    accesses = run.scan("accesses").collect()
    for r in (0, 1):
        mine = accesses.filter(pl.col("rank") == r)
        assert set(mine["table_name"]) == {f"EmbeddingBag_0@rank{r}"}
        expected = {(s, s * 8 + i + r * 100) for s in range(5) for i in range(8)}
        assert set(zip(mine["step"], mine["row"])) == expected and set(mine["count"]) == {1}
    comms = run.scan("comms").collect()
    a2a = comms.filter(pl.col("op") == "all_to_all_single").sort("rank", "step")
    assert a2a.filter(pl.col("rank") == 0)["splits_out"].to_list() == [[32, 96]] * 5  # 8 floats a row
    assert a2a.filter(pl.col("rank") == 1)["splits_in"].to_list() == [[96, 64]] * 5
    ddp = comms.filter(pl.col("tag") == "ddp_bucket_0")
    assert len(ddp) == 10 and set(ddp["bytes_out"]) == {(8 + 1) * 4}  # Linear(8, 1): 9 floats


def test_record_ends_with_a_summary_and_json_for_scripts(tmp_path: Path) -> None:
    script = tmp_path / "script.py"
    script.write_text("import torch, tracekit\n"
                      "emb = torch.nn.EmbeddingBag(10, 4)\n"
                      "for _ in range(3):\n"
                      "    emb(torch.tensor([[1, 2]]))\n"
                      "    tracekit.step(samples=1)\n")
    run_dir = tmp_path / "run"
    r = CliRunner().invoke(cli, ["record", "-o", str(run_dir), "--json", "--", sys.executable, str(script)])
    assert r.exit_code == 0, r.output
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    assert (summary["status"], summary["exit_code"], summary["ranks"], summary["steps"]) == ("completed", 0, [0], {"0": 3})
    assert summary["rows"] == {"accesses": 6, "lookups": 2, "steps": 3} and summary["dropped_rows"] == {}
    assert summary["record_exit_code"] == 0 and summary["traced"] is True
    assert summary["bytes"] == sum(p.stat().st_size for p in run_dir.rglob("*.parquet"))
    r = CliRunner().invoke(cli, ["record", "-o", str(run_dir), "--force", "--", sys.executable, str(script)])
    assert "tracekit: completed after" in r.stderr and "rows: accesses 6, lookups 2, steps 3" in r.stderr
    assert "command exited with 0; tracekit record exits with 0" in r.stderr and "steps per rank: 0: 3" in r.stderr

"""`tracekit record` into a run directory whose disk fills: the command runs on and its exit code
comes back, the manifest ends final (not `running`) with `truncated_at` naming each rank's last
whole step, every Parquet part on disk reads, nothing prints a traceback, `record` says in one line
per rank that the trace is incomplete and why, and `analyze` keeps to the whole steps. The disk is a
2 MB tmpfs (needs root to mount; skipped otherwise). `--max-size` stops each rank at its share the
same way, before a disk fills."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from analyses.analyze import analyze
from analyses.context import open_context
from tests.prerequisites import missing
from tests.recorded import REPO


@pytest.fixture
def small_disk(tmp_path: Path):
    mount = tmp_path / "disk"
    mount.mkdir()
    if os.geteuid() != 0:
        missing("mounting a tmpfs needs root")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount)], capture_output=True, text=True)
    if done.returncode != 0:
        missing(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True)


def test_a_full_disk_leaves_a_final_manifest_and_the_commands_exit_code(small_disk: Path, tmp_path: Path) -> None:
    run = small_disk / "run"
    r = subprocess.run([sys.executable, "-m", "tracekit", "record", "-o", str(run), "--", sys.executable, "-m",
                        "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "train.py", "--steps", "200",
                        "--log-every", "1000"], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "Traceback" not in r.stdout + r.stderr, r.stderr[-3000:]
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["status"] == "completed" and manifest["exit_code"] == 0
    truncated = {int(rank): step for rank, step in manifest["truncated_at"].items()}
    assert set(truncated) == {0, 1} and all(0 <= step < 199 for step in truncated.values()), truncated
    assert all(sum(rows.values()) > 0 for rows in manifest["dropped_rows"].values())
    for rank, step in truncated.items():
        assert f"the trace is incomplete: rank {rank} lost rows from step {step + 1} on" in r.stderr
        assert "No space left on device" in manifest["writer_first_errors"][str(rank)]
    for part in run.rglob("*.parquet"):
        pq.read_table(part)  # every part on disk is whole
    assert not list(run.rglob("*.tmp")) and not list(run.rglob(".reserve*"))

    copy = tmp_path / "copy"  # analysis writes beside the run: not on the full disk
    shutil.copytree(run, copy)
    summary = analyze(copy)
    assert any("only steps up to" in w for w in summary["warnings"]), summary["warnings"]
    with open_context(copy) as ctx:
        assert ctx.truncated_at == min(truncated.values())
        assert ctx.sql("SELECT max(step) FROM accesses").fetchall()[0][0] <= ctx.truncated_at
        assert ctx.sql("SELECT max(step) FROM steps").fetchall()[0][0] == ctx.truncated_at


def test_max_size_stops_writing_at_each_ranks_share(tmp_path: Path) -> None:
    run = tmp_path / "run"
    cap = 300_000
    r = subprocess.run([sys.executable, "-m", "tracekit", "record", "--max-size", "300kB", "-o", str(run), "--",
                        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                        "train.py", "--steps", "200", "--log-every", "1000"], cwd=REPO, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr[-3000:]
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["status"] == "completed" and manifest["collector_settings"]["max_size"] == cap
    assert set(manifest["truncated_at"]) == {"0", "1"}
    assert all("--max-size" in error for error in manifest["writer_first_errors"].values())
    parts = {rank: [p.stat().st_size for p in run.glob(f"*/rank={rank}/*.parquet")] for rank in (0, 1)}
    for sizes in parts.values():  # a rank stops once its share is written: at most one part past it
        assert sum(sizes) - max(sizes) < cap // 2 <= sum(sizes), sizes
    assert "the trace is incomplete: rank 0" in r.stderr

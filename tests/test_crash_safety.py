"""A recorded process killed (SIGKILL) while a part file is being written, through the store's
fault-injection point (TRACEKIT_FAULT_KILL_BEFORE_RENAME): what it leaves must read as a trace."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pyarrow.parquet as pq

from tests.recorded import one_table_script, record
from tracekit.parts import FAULT_KILL_BEFORE_RENAME
from tracekit.run import open_run

# Trains until the store kills it; stepping on past 60 s of sleeps means the fault never fired.
SCRIPT = one_table_script("import time, torch", 30_000, "    time.sleep(0.002)\n")


def test_a_kill_between_writing_a_part_and_its_rename_leaves_only_whole_parts(tmp_path: Path) -> None:
    # the env command sets the fault for the traced process only, never for this one
    code, run_dir = record(tmp_path, "env", f"{FAULT_KILL_BEFORE_RENAME}=steps:2", sys.executable, "-c", SCRIPT)
    assert code == 128 + 9
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert (manifest["status"], manifest["exit_code"]) == ("failed", -9)

    steps_dir = run_dir / "steps" / "rank=0"
    killed_in = steps_dir / ".part-00002.parquet.tmp"
    assert sorted(p.name for p in steps_dir.glob("*.parquet")) == ["part-00000.parquet", "part-00001.parquet"]
    assert list(run_dir.rglob(".*.tmp")) == [killed_in]  # the kill came mid-write, and only there
    parts = sorted(run_dir.rglob("*.parquet"))
    assert {p.parent.parent.name for p in parts} >= {"steps", "accesses"}
    for part in parts:
        pq.read_table(part)  # whole, not truncated

    # the parts renamed before the kill hold every step up to it, and the unrenamed one the next ones
    on_disk = open_run(run_dir).scan("steps").collect()["step"].to_list()
    unrenamed = pq.read_table(killed_in)["step"].to_pylist()
    assert on_disk and unrenamed
    assert sorted(on_disk) + sorted(unrenamed) == list(range(len(on_disk) + len(unrenamed)))

"""`record --steps A:B` and `--every N:M` (tracekit/window.py): accesses, lookups and comms of the
window's steps only, every step's `steps` row kept, exact counts inside the window, and analyses
that average over the recorded steps."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import polars as pl
import pytest

from analyses import traffic
from analyses.context import open_context
from tests.recorded import REPO, TINY, record
from tracekit.run import open_run
from tracekit.window import Window

TORCHRUN_2 = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
STEPS = 1000


def test_every_100_10_over_1000_steps_records_exactly_100_steps(tmp_path: Path) -> None:
    trainer = [*TINY[:-2], "--steps", str(STEPS), "--samples", str(64 * (STEPS + 1)), "--log-every", "10000"]
    code, run = record(tmp_path, *TORCHRUN_2, str(REPO / "train.py"), *trainer,
                       options=("--every", "100:10", "--lookup-every", "5"))
    assert code == 0
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["collector_settings"]["window"] == {"first": 0, "stop": None, "every": 100, "keep": 10}
    assert not manifest["dropped_rows"]
    recorded = {s for s in range(STEPS) if s % 100 < 10}
    tables = open_run(run)
    for table in ("accesses", "comms"):
        steps = set(tables.scan(table).filter(pl.col("phase") == "train").select("step").unique().collect()["step"])
        assert steps == recorded, (table, sorted(steps ^ recorded)[:10])
    lookups = set(tables.scan("lookups").select("step").unique().collect()["step"])
    assert lookups == {s for s in recorded if s % 5 == 0}
    assert tables.scan("steps").select("step").unique().collect().height == STEPS  # every step's time is kept
    # inside the window the counts are exact: each recorded step looks up 2 ranks × 32 samples × 4 tables × 3 ids
    per_step = tables.scan("accesses").filter(pl.col("phase") == "train").group_by("step").agg(
        pl.col("count").sum()).collect()
    assert set(per_step["count"]) == {2 * 32 * 4 * 3}
    with open_context(run) as ctx:  # analyses see the recorded steps only, and average over them
        assert ctx.window == Window(0, None, 100, 10)
        assert traffic.training_steps(ctx) == len(recorded)
        per_rank = ctx.sql("SELECT count(DISTINCT step) FROM steps").fetchall()[0][0]
        assert per_rank == len(recorded)


def test_a_steps_window_and_bad_windows(tmp_path: Path) -> None:
    window = Window.parse(steps="1000:5000", every="100:10")
    assert window.on(1005) and not window.on(1010) and not window.on(999) and not window.on(5000)
    assert window.sql("step") == "(step >= 1000 AND step < 5000 AND step % 100 < 10)"
    assert Window.parse().everything and Window.parse().sql() == "TRUE" and Window.parse(steps=":20").stop == 20
    for steps, every, says in (("5:5", None, "STOP must be after FIRST"), ("x", None, "expected FIRST:STOP"),
                               (None, "10:20", "expected N:M with 0 < M <= N"), (None, "0:0", "expected N:M")):
        with pytest.raises(ValueError, match=says):
            Window.parse(steps=steps, every=every)
    code, run = record(tmp_path, sys.executable, "-c", "print(1)", options=("--every", "10:20"))
    assert code == 2 and not run.exists()

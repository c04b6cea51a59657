"""A trace writer that falls behind (every Parquet part written late, a slow disk) never makes
training wait: each rank holds at most TRACEKIT_MAX_PENDING_IDS ids for it and sheds the calls
beyond, counted in the manifest's `dropped_rows`. The ids written plus those shed are exactly the
ids fed, and `record`, `watch`, `analyze` and the report say what was shed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow.compute as pc
import pyarrow.parquet as pq

from analyses.analyze import analyze
from reports.inputs import load
from reports.verdict import warnings
from tests.recorded import REPO, TINY
from tracekit.dlrm.data import open_dataset

STEPS, RANKS, SAMPLES = 300, 2, 32 * 2 * 301
TRAINER = [*TINY[:TINY.index("--samples")], "--samples", str(SAMPLES), "--pooling", "3", "--eval-fraction", "0",
           "--steps", str(STEPS), "--log-every", "1000"]


def fed_ids() -> int:
    """Every id the trainer's STEPS global batches look up, from the very samples it consumes."""
    dataset = open_dataset("synthetic", tables=4, rows=500, num_dense=13, pooling=3, samples=SAMPLES, seed=0,
                           zipf=None, drift=0.0, preset=None, scale=1.0)
    return int(dataset.batch(0, 32 * RANKS * STEPS).lengths.sum())


def test_a_writer_behind_sheds_beyond_its_bound_and_every_tool_says_so(tmp_path: Path) -> None:
    run = tmp_path / "run"
    env = {**os.environ, "TRACEKIT_FAULT_SLOW_WRITE_S": "0.3", "TRACEKIT_MAX_PENDING_IDS": "3000"}
    r = subprocess.run([sys.executable, "-m", "tracekit", "record", "-o", str(run), "--flush-interval", "0.2",
                        "--lookup-every", "0", "--", sys.executable, "-m", "torch.distributed.run", "--standalone",
                        "--nproc-per-node", str(RANKS), "train.py", *TRAINER], cwd=REPO, env=env, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr[-3000:]
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["status"] == "completed" and manifest["steps"] == {str(k): STEPS for k in range(RANKS)}
    shed = sum(per.get("accesses", 0) for per in manifest["dropped_rows"].values())
    assert shed > 0, manifest["dropped_rows"]
    written = sum(pc.sum(pq.read_table(part, columns=["count"])["count"]).as_py() or 0
                  for part in run.glob("accesses/rank=*/*.parquet"))
    assert written + shed == fed_ids() and written > 0  # nothing lost unaccounted, nothing counted twice
    assert manifest["truncated_at"] == {}  # shedding is not a failed write: no step is cut off

    assert manifest["lost_rows"]["accesses"] == shed and manifest["lost_lookups"] == shed
    last = r.stderr.strip().splitlines()[-1]
    assert "the trace is NOT whole" in last and f"accesses {shed:,} ({shed:,} lookups)" in last, last
    live = subprocess.run([sys.executable, "-m", "tracekit", "watch", str(run), "--once"], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert f"accesses {shed:,}" in live.stdout.split("dropped rows:")[1].splitlines()[0], live.stdout
    summary = analyze(run)
    assert any(w.startswith("the trace lost rows") and f"accesses {shed:,}" in w for w in summary["warnings"])
    said = warnings(load(run))
    assert any(w.startswith("the trace lost rows") and f"accesses {shed:,}" in w for w in said), said

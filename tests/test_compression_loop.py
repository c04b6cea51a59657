"""The compression loop end to end on the reference trainer: a recorded run analysed, its
compression sections applied by the trainer, and the bytes `compare` measures against what
`analyze` predicted — DCT-MP's output all-to-all to the byte, DCT-DP's gradient exchange below
DDP's (its bytes depend on the gradients' drift around a stale threshold, so they are predicted
approximately)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from analyses.analyze import analyze
from analyses.compare import compare
from analyses.context import Options
from tests.recorded import REPO, TINY, record
from tracekit.optimize import reruns

STEPS = 8


def _record(tmp: Path, *extra: str) -> Path:
    options = dict(zip(TINY[::2], TINY[1::2])) | {"--steps": str(STEPS)}
    code, run_dir = record(tmp, sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(REPO / "train.py"), *[x for kv in options.items() for x in kv], *extra,
                           options=("--lookup-every", "1", "--grad-every", "1"))
    assert code == 0
    return run_dir


@pytest.mark.slow
def test_compression_sections_are_applied_and_measured_against_their_prediction(tmp_path: Path) -> None:
    base = _record(tmp_path / "base")
    report = analyze(base, Options(policies=("compression",)))
    assert "mp" in report["policies"]["compression"], report["not_derived"]
    plans, _ = reruns(base / "policy.json")
    by_name = {p.name: p.policy for p in plans}
    mp_run = _record(tmp_path / "mp", "--policy", str(by_name["compression.mp"]))
    rows = {r["figure"]: r for r in compare(base, [mp_run]).tables["compare_policy"].iter_rows(named=True)
            if r["section"] == "compression.mp"}
    assert rows["a2a_bytes_per_step"]["measured"] == rows["a2a_bytes_per_step"]["predicted"]
    if "compression.dp" in by_name:
        dp_run = _record(tmp_path / "dp", "--policy", str(by_name["compression.dp"]))
        result = compare(base, [dp_run])
        dp = {r["figure"]: r for r in result.tables["compare_policy"].iter_rows(named=True)
              if r["section"] == "compression.dp"}
        base_dp, run_dp = (m["dp_bytes_per_step"] for m in result.summary["runs"])
        assert run_dp < base_dp
        assert dp["dp_bytes_per_step"]["measured"] == run_dp

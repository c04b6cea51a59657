"""What a report reads from a run: the manifest, what `tracekit analyze` wrote (RUN/analysis/*.parquet,
RUN/analysis/summary.json, RUN/policy.json), and NVML samples where the run has them. Nothing here
computes an analysis: a run that must have one and has none is refused (`tracekit analyze RUN` first).
"""

from __future__ import annotations

import json
import os
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import polars as pl

from tracekit import manifest
from tracekit.errors import RunNotFound, TracekitError
from tracekit.manifest import Manifest
from tracekit.run_dir import ANALYSIS, MANIFEST, RunDir

SUMMARY = Path(ANALYSIS) / "summary.json"
"""What `tracekit analyze` writes last: a run without it has not been analysed."""


@dataclass
class RunInputs:
    path: Path
    manifest: Manifest
    tables: dict[str, pl.DataFrame]
    policy: dict[str, Any] | None
    summary: dict[str, Any] | None = None  # analyze's summary (analysis/summary.json)
    gpu: pl.DataFrame | None = None

    @property
    def name(self) -> str:
        return str(self.path)

    def table(self, name: str) -> pl.DataFrame | None:
        frame = self.tables.get(name)
        return frame if frame is not None and frame.height else None


class NotAnalysed(TracekitError):
    """A report asked of a run `tracekit analyze` has not analysed."""


def load(path: str | os.PathLike, *, analysed: bool = True) -> RunInputs:
    """The run at `path`; with `analysed`, a run `tracekit analyze` has not analysed raises TracekitError
    (a run only compared with another needs no analysis)."""
    path = Path(path)
    if not (path / MANIFEST).is_file():
        raise RunNotFound(f"{path} is not a run: it has no {MANIFEST} (record one with `tracekit record`)")
    summary_path = path / SUMMARY
    if analysed and not summary_path.is_file():
        raise NotAnalysed(f"{path} has not been analysed (no {SUMMARY}): run `tracekit analyze "
                            f"{shlex.quote(str(path))}` first")
    summary = json.loads(summary_path.read_text()) if summary_path.is_file() else None
    run = RunDir.at(path)
    tables = {p.stem: _floats(pl.read_parquet(p)) for p in sorted(run.analysis.glob("*.parquet"))}
    policy_path = run.policy
    policy = json.loads(policy_path.read_text()) if policy_path.is_file() else None
    if policy is not None:
        hot = run.policy_rows / "hot_rows.parquet"
        if hot.is_file():
            tables["hot_rows"] = pl.read_parquet(hot)
    return RunInputs(path, manifest.read(path), tables, policy, summary, _gpu(path))


def _floats(frame: pl.DataFrame) -> pl.DataFrame:
    """Decimal columns (DuckDB's sum over no rows) as Float64, which plotly and arithmetic take."""
    return frame.with_columns(pl.col(pl.Decimal).cast(pl.Float64))


def _gpu(path: Path) -> pl.DataFrame | None:
    parts = sorted((path / "gpu").glob("rank=*/*.parquet"))
    if not parts:
        return None
    frame = pl.scan_parquet(parts, hive_partitioning=True).select("t_ns", "device", "util_gpu", "mem_used",
                                                                    "power_mw").collect()
    return frame.sort("t_ns") if frame.height else None

"""What a report reads from a run: the manifest, what `tracekit analyze` wrote (RUN/analysis/*.parquet,
RUN/policy.json), and NVML samples where the run has them. Nothing here computes an analysis: a run
without RUN/analysis is analysed first with analyses.analyze.analyze.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import polars as pl

from tracekit.errors import RunNotFound


@dataclass
class RunInputs:
    path: Path
    manifest: dict[str, Any]
    tables: dict[str, pl.DataFrame]
    policy: dict[str, Any] | None
    summary: dict[str, Any] | None = None  # analyze's summary (analysis/summary.json, or this report's run)
    gpu: pl.DataFrame | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def name(self) -> str:
        return str(self.path)

    def table(self, name: str) -> pl.DataFrame | None:
        frame = self.tables.get(name)
        return frame if frame is not None and frame.height else None


def load(path: str | os.PathLike, *, analyse: bool = True) -> RunInputs:
    """The run at `path`, analysed first where it has no analysis folder (and `analyse`)."""
    path = Path(path)
    manifest_path = path / "manifest.json"
    if not manifest_path.is_file():
        raise RunNotFound(f"{path} is not a run: it has no manifest.json (record one with `tracekit record`)")
    summary = None
    notes: list[str] = []
    if analyse and not (path / "analysis").is_dir():
        from analyses.analyze import analyze

        summary = analyze(path)
        notes.append(f"{path} had no analysis: `tracekit analyze` ran first")
    elif (path / "analysis" / "summary.json").is_file():  # what analyze derived, and why not the rest
        summary = json.loads((path / "analysis" / "summary.json").read_text())
    tables = {p.stem: _floats(pl.read_parquet(p)) for p in sorted((path / "analysis").glob("*.parquet"))}
    policy_path = path / "policy.json"
    policy = json.loads(policy_path.read_text()) if policy_path.is_file() else None
    if policy is not None:
        hot = path / "policy" / "hot_rows.parquet"
        if hot.is_file():
            tables["hot_rows"] = pl.read_parquet(hot)
    return RunInputs(path, json.loads(manifest_path.read_text()), tables, policy, summary, _gpu(path), notes)


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

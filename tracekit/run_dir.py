"""The run directory's layout (DESIGN.md §3): every file and folder of a run, named once.

    run = RunDir.at("runs/base")
    run.manifest            # runs/base/manifest.json      (tracekit/manifest.py reads and writes it)
    run.table("comms")      # runs/base/comms/             rank=R/part-NNNNN.parquet below it
    run.ranks               # runs/base/ranks/             each rank's report at exit, heartbeats
    run.analysis_table("skew"), run.analysis_json("summary")   # what `analyze` writes
    run.policy, run.policy_rows                                 # policy.json and the row lists beside it
    run.report              # runs/base/report.html

Standard library only: the command line and the traced processes import it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

MANIFEST = "manifest.json"
POLICY = "policy.json"
POLICY_ROWS = "policy"  # the folder of a policy's row lists, beside its file
ANALYSIS = "analysis"
RANKS = "ranks"
REPORT = "report.html"


@dataclass(frozen=True)
class RunDir:
    """The paths of one run directory (`RunDir.at(path)`); nothing is read or created here."""

    path: Path
    manifest: Path
    policy: Path
    policy_rows: Path
    analysis: Path
    ranks: Path
    report: Path

    @classmethod
    def at(cls, path: str | os.PathLike) -> RunDir:
        run = Path(path)
        return cls(run, run / MANIFEST, run / POLICY, run / POLICY_ROWS, run / ANALYSIS, run / RANKS, run / REPORT)

    def table(self, name: str) -> Path:
        """The folder of a trace table's part files (one `rank=R` folder per rank below it)."""
        return self.path / name

    def analysis_table(self, name: str) -> Path:
        return self.analysis / f"{name}.parquet"

    def analysis_json(self, name: str) -> Path:
        return self.analysis / f"{name}.json"

"""The analysis context: leaving its `with` block closes the DuckDB connection and removes the
spill directory it made; `memo` derives a value once per context."""

from __future__ import annotations

from pathlib import Path

import duckdb
import pytest

from analyses.context import open_context
from tests.test_traffic import MS, make_run


def test_leaving_the_context_closes_the_connection_and_removes_its_spill_directory(tmp_path: Path) -> None:
    run = make_run(tmp_path / "run", steps={0: [(0, MS)]})
    with open_context(run) as ctx:
        spill = Path(ctx.sql("SELECT current_setting('temp_directory')").fetchall()[0][0])
        assert spill.is_dir() and spill.name.startswith("tracekit-duckdb-")
    assert not spill.exists()
    with pytest.raises(duckdb.Error):
        ctx.sql("SELECT 1")
    ctx.close()  # a second close does nothing


def test_memo_derives_once_per_context(tmp_path: Path) -> None:
    run = make_run(tmp_path / "run", steps={0: [(0, MS)]})
    calls: list[str] = []

    def derive() -> int:
        calls.append("derived")
        return len(calls)

    with open_context(run) as ctx:
        assert ctx.memo("figure", derive) == ctx.memo("figure", derive) == 1
    with open_context(run) as other:
        assert other.memo("figure", derive) == 2

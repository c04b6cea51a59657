"""The run store's read side: open a recorded run and read its trace tables with Polars or DuckDB.

    run = open_run("runs/base")
    run.tables()                                  # ['accesses', 'comms', 'steps']
    run.scan("comms").group_by("op").agg(pl.col("bytes_out").sum()).collect()
    run.relation("steps").aggregate("rank, count(*)").fetchall()

Both readers see every rank's part files with `rank` as a column (hive partitioning), `count` as a
64-bit integer (so no sum overflows, though files keep int32), and the columns a minor version added
in runs recorded before it (`LATER_COLUMNS`): `phase` as `train` (schema 1.0), `schedule` as null
(before 1.2), the lookups' `feature` as 0 (before 1.4), their `src` and `src_sample` as null (before
1.7). Before a table is read, each part file's schema version is checked: an unknown major version is
refused.
Polars and DuckDB are imported on first use, so importing this module stays cheap.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

import pyarrow as pa
import pyarrow.parquet as pq

from tracekit.errors import SchemaVersionError, TracekitError
from tracekit.phases import TRAIN
from tracekit.schema import SCHEMA_VERSION, TABLES, VERSION_KEY, major
from tracekit.manifest import read as read_manifest

if TYPE_CHECKING:
    import duckdb
    import polars as pl

LATER_COLUMNS: dict[str, tuple[str | int | None, str]] = {
    "phase": (TRAIN, "VARCHAR"), "schedule": (None, "VARCHAR"), "feature": (0, "SMALLINT"),
    "t_backward_ns": (None, "BIGINT"), "t_grads_ns": (None, "BIGINT"), "t_backward_end_ns": (None, "BIGINT"),
    "t_wait_ns": (None, "BIGINT"), "src": (None, "INTEGER"), "src_sample": (None, "INTEGER")}
"""Columns added after schema 1.0 (phase in 1.1, schedule in 1.2, feature in 1.4, the backward's times in
1.5, comms' wait in 1.6, lookups' sources in 1.7), and what the readers show for them in a table whose part files predate them, with its SQL type."""
_POLARS_TYPES = {"VARCHAR": "String", "SMALLINT": "Int16", "INTEGER": "Int32", "BIGINT": "Int64"}


def open_run(path: str | os.PathLike) -> Run:
    """The run recorded at `path`; RunNotFound if it is not a run directory."""
    return Run(Path(path))


class Run:
    """A recorded run: its manifest and its trace tables."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.manifest = read_manifest(path)
        self._checked: set[str] = set()
        self._filled: dict[str, list[str]] = {}  # table -> the LATER_COLUMNS its part files predate

    def tables(self) -> list[str]:
        """The trace tables that have at least one part file, in schema order."""
        return [table for table in TABLES if self.parts(table)]

    def scan(self, table: str) -> pl.LazyFrame:
        """All ranks' rows of `table` as a Polars LazyFrame, with a `rank` column. Dictionary
        columns (table_name) read as String, as they do in DuckDB."""
        import polars as pl

        self._check(table)
        frame = pl.scan_parquet(self._glob(table), hive_partitioning=True)
        frame = frame.with_columns(pl.lit(LATER_COLUMNS[c][0], dtype=getattr(pl, _POLARS_TYPES[LATER_COLUMNS[c][1]]))
                                   .alias(c) for c in self._filled[table])
        dictionaries = [f.name for f in TABLES[table] if pa.types.is_dictionary(f.type)]
        widened = [pl.col("count").cast(pl.Int64)] if table == "accesses" else []
        return frame.with_columns(pl.col(dictionaries).cast(pl.String), *widened)

    def relation(self, table: str, con: duckdb.DuckDBPyConnection | None = None,
                 parts: list[Path] | None = None) -> duckdb.DuckDBPyRelation:
        """All ranks' rows of `table` (of its part files `parts` only, where given) as a DuckDB
        relation on `con` (a new in-memory connection if None), with a `rank` column."""
        import duckdb

        self._check(table)
        con = duckdb.connect() if con is None else con
        files = self._glob(table) if parts is None else [str(p) for p in parts]
        relation = con.read_parquet(files, hive_partitioning=True)
        for column in self._filled[table]:
            value, sql_type = LATER_COLUMNS[column]
            relation = relation.project(f"*, CAST({'NULL' if value is None else repr(value)} AS {sql_type}) AS {column}")
        if table == "accesses":
            relation = relation.project('* REPLACE (CAST("count" AS BIGINT) AS "count")')
        return relation

    def _glob(self, table: str) -> str:
        return str(self.path / table / "**" / "*.parquet")

    def parts(self, table: str) -> list[Path]:
        """The part files of `table`, every rank's, in path order."""
        return sorted((self.path / table).glob("*/*.parquet"))

    def _check(self, table: str) -> None:
        """Refuse an unknown or absent table, or part files of a schema major version we do not know."""
        if table in self._checked:
            return
        if table not in TABLES:
            raise TracekitError(f"unknown trace table {table!r}; the trace tables are {', '.join(TABLES)}")
        parts = self.parts(table)
        if not parts:
            present = ", ".join(self.tables()) or "none"
            raise TracekitError(f"{self.path} has no {table} table (no {table} rows were recorded); it has: {present}")
        schemas = [check_version(part) for part in parts]
        self._filled[table] = []
        for column in [c for c in LATER_COLUMNS if c in TABLES[table].names]:
            present = {column in schema.names for schema in schemas}
            if len(present) > 1:
                raise TracekitError(f"{self.path / table}: some part files have a {column} column and some do "
                                    "not; a run directory holds one recording (record again with --force)")
            if present == {False}:
                self._filled[table].append(column)
        self._checked.add(table)


def check_version(part: Path) -> pa.Schema:
    """The schema of Parquet file `part`; SchemaVersionError unless it was written with our schema
    major version."""
    try:
        schema = pq.read_schema(part)
    except (pa.ArrowException, OSError) as err:
        raise TracekitError(f"{part} is not a readable Parquet file ({err}); was it truncated or written "
                            "by something else?") from None
    metadata = schema.metadata or {}
    version = metadata.get(VERSION_KEY, b"").decode(errors="replace")
    if not version:
        raise SchemaVersionError(f"{part} has no {VERSION_KEY.decode()} metadata; it was not written by tracekit")
    if major(version) != major(SCHEMA_VERSION):
        raise SchemaVersionError(
            f"{part} has trace schema version {version}; this tracekit reads version {SCHEMA_VERSION} "
            f"(major {major(SCHEMA_VERSION)}): use a tracekit that matches the recording"
        )
    return schema

"""A run's manifest.json, typed: what ran, on which ranks, with which tables and shards, and how the
recording ended. The only module that reads or writes the file.

`tracekit record` writes it when the run starts and again, finalised, when it ends (tracekit/app/
recording.py); every reader (the run API, the analyses, the report, `watch`) goes through `read`:

    manifest = read("runs/base")         # RunNotFound without a run directory or manifest
    manifest.world_size, manifest.status, manifest.tables[0].shards[0].first_row
    manifest.table("t0").owner(row)      # the rank holding one row of t0

The file's JSON stays what it always was: `Manifest.from_json` reads every manifest a past version
wrote (a field it lacks takes its default), `to_json` writes the same keys back, and a key this
version does not know survives the round trip in `extra`. docs/design.md §3 lists the fields.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tracekit.errors import RunNotFound, TracekitError
from tracekit.files import read_json, write_text
from tracekit.run_dir import MANIFEST, RunDir

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8, "int8": 1, "uint8": 1, "int16": 2, "int32": 4,
               "int64": 8}
"""Bytes of an element of each dtype, as the manifest and `comms` name them (less any `torch.`)."""


def dtype_bytes(dtype: str) -> int:
    """Bytes of one element of `dtype` (with or without `torch.`), 4 (float32's) for a dtype the
    table above does not name."""
    return DTYPE_BYTES.get(dtype.removeprefix("torch."), 4)


@dataclass(frozen=True)
class TableShard:
    """The rows (and, for TorchRec's column-wise shards, the columns) of a table that one rank holds."""

    rank: int
    first_row: int
    num_rows: int  # this shard's rows
    first_col: int | None = None
    num_cols: int | None = None

    @classmethod
    def from_json(cls, body: dict) -> TableShard:
        return cls(int(body["rank"]), int(body.get("first_row", 0)), int(body["num_rows"]),
                   body.get("first_col"), body.get("num_cols"))

    def to_json(self) -> dict:
        return {k: v for k, v in dataclasses.asdict(self).items()
                if v is not None or k not in ("first_col", "num_cols")}

    def holds(self, row: int) -> bool:
        return self.first_row <= row < self.first_row + self.num_rows


@dataclass(frozen=True)
class Table:
    """One logical embedding table: its size, and the shards the ranks hold (a replicated table lists
    every copy)."""

    name: str
    num_rows: int  # the whole table's rows
    dim: int
    dtype: str = "float32"
    kind: str = "pooled"  # "pooled" | "sequence"
    placement: str | None = None  # "sharded" | "replicated" | "local"
    padding_idx: int | None = None
    shards: tuple[TableShard, ...] = ()
    sharding_type: str | None = None  # a TorchRec table's, where its collector knew them
    compute_kernel: str | None = None

    @classmethod
    def from_json(cls, body: dict) -> Table:
        return cls(body["name"], int(body["num_rows"]), int(body["dim"]), body.get("dtype", "float32"),
                   body.get("kind", "pooled"), body.get("placement"), body.get("padding_idx"),
                   tuple(TableShard.from_json(s) for s in body.get("shards", ())),
                   body.get("sharding_type"), body.get("compute_kernel"))

    def to_json(self) -> dict:
        out = {"name": self.name, "num_rows": self.num_rows, "dim": self.dim, "dtype": self.dtype,
               "kind": self.kind, "padding_idx": self.padding_idx, "placement": self.placement}
        out.update({k: getattr(self, k) for k in ("sharding_type", "compute_kernel") if getattr(self, k) is not None})
        out["shards"] = [s.to_json() for s in self.shards]
        return out

    @property
    def row_bytes(self) -> int:
        return self.dim * dtype_bytes(self.dtype)

    def owner(self, row: int) -> int | None:
        """The rank holding `row` (the first shard that does), None if no shard does."""
        return next((s.rank for s in self.shards if s.holds(row)), None)

    def rows_on(self, rank: int) -> int:
        """The rows of this table that `rank` holds."""
        return sum(s.num_rows for s in self.shards if s.rank == rank)


@dataclass
class Manifest:
    """manifest.json. The writer fills it as the run goes (None: not known yet, or never learnt);
    the maps keyed by rank have the rank as a string key, as JSON has them."""

    schema_version: str | None = None
    tracekit_version: str | None = None
    run_id: str | None = None
    command: list[str] = field(default_factory=list)
    cwd: str | None = None
    started_at: str | None = None
    ended_at: str | None = None
    status: str | None = None  # "running" | "completed" | "failed" | "interrupted"
    exit_code: int | None = None
    record_exit_code: int | None = None
    traced: bool | None = None
    untraced_reason: str | None = None
    world_size: int | None = None
    ranks: list[int] | None = None
    backend: str | None = None
    hosts: list[str] = field(default_factory=list)
    devices: dict = field(default_factory=dict)
    torch_version: str | None = None
    environment: dict = field(default_factory=dict)
    collector_settings: dict = field(default_factory=dict)
    topology: dict | None = None  # written by `tracekit cluster`
    gpu: dict | None = None
    tables: tuple[Table, ...] | None = ()  # None: the recording could not say (`finalise_errors` says why)
    torchrec_plan: dict | None = None
    policy: dict | None = None  # {"path", "sha256", "applied", ...}: what the traced program applied
    metrics: dict | None = None
    steps: dict | None = None
    clock_anchors: dict | None = None
    written_rows: dict | None = None
    dropped_rows: dict | None = None
    lost_rows: dict | None = None
    lost_lookups: int | None = None
    truncated_at: dict | None = None
    writer_errors: int | None = None
    writer_first_errors: dict | None = None
    writer_cpu_s: dict | None = None
    writer_scheduling: dict | None = None
    finalise_errors: list | None = None
    extra: dict = field(default_factory=dict)  # keys this version does not know, kept as read
    present: frozenset[str] | None = field(default=None, compare=False)
    """The keys the file held (None: every field), so an old manifest is written back as it was."""

    @classmethod
    def from_json(cls, body: dict) -> Manifest:
        names = {f.name for f in dataclasses.fields(cls)} - {"extra", "present"}
        known = {k: v for k, v in body.items() if k in names}
        if known.get("tables") is not None:
            known["tables"] = tuple(Table.from_json(t) for t in known["tables"])
        return cls(**known, extra={k: v for k, v in body.items() if k not in names},
                   present=frozenset(body))

    def to_json(self) -> dict:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
               if f.name not in ("extra", "present") and (self.present is None or f.name in self.present)}
        if out.get("tables") is not None:
            out["tables"] = [t.to_json() for t in self.tables]
        return {**out, **self.extra}

    @classmethod
    def of(cls, **fields: Any) -> Manifest:
        """A manifest that writes just `fields` (a run's first manifest, before the ranks report)."""
        return cls(**fields, present=frozenset(fields))

    def updated(self, **fields: Any) -> Manifest:
        """This manifest with `fields` set (and written, should the file it was read from lack them)."""
        present = None if self.present is None else self.present | fields.keys()
        return dataclasses.replace(self, **fields, present=present)

    def table(self, name: str) -> Table:
        for table in self.tables or ():
            if table.name == name:
                return table
        raise KeyError(name)


def read(run_dir: str | os.PathLike) -> Manifest:
    """The manifest of the run at `run_dir`; RunNotFound if the directory or its manifest is missing,
    TracekitError naming the file if it is not a JSON object."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise RunNotFound(f"{run_dir} does not exist (a run directory from `tracekit record -o`?)")
    path = RunDir.at(run_dir).manifest
    if not path.is_file():
        raise RunNotFound(f"{run_dir} has no {MANIFEST}; is it a tracekit run directory?")
    body = read_json(path, TracekitError)
    if not isinstance(body, dict):
        raise TracekitError(f"{path}: expected a JSON object, got {type(body).__name__}")
    try:
        return Manifest.from_json(body)
    except (KeyError, TypeError, ValueError) as e:
        raise TracekitError(f"{path}: a table or shard lacks a field or has a bad value ({e!r})") from e


def write(run_dir: str | os.PathLike, manifest: Manifest) -> Path:
    """Write `<run_dir>/manifest.json` atomically: the old manifest stays intact unless the new one is
    complete (data that JSON cannot encode raises TypeError before any file is touched)."""
    text = json.dumps(manifest.to_json(), sort_keys=True, indent=2) + "\n"
    return write_text(RunDir.at(run_dir).manifest, text)

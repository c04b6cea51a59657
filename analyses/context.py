"""What every analysis starts from: a recorded run opened once, a DuckDB connection holding every
trace table as a view (training rows also as `train_<table>`; `comms` with each call's `role` in
the embedding exchange, analyses.roles), the model from the manifest, the
options of `tracekit analyze`, what analyses derived from it so far, and the shapes they hand back.

    with open_context("runs/base", Options(budget_bytes=64 << 20)) as ctx:
        ctx.sql("SELECT table_name, sum(count) FROM train_accesses GROUP BY ALL").pl()
        ctx.model.tables[0].row_bytes, ctx.model.world_size
        ctx.write("skew", frame)                   # RUN/analysis/skew.parquet, atomically
        ctx.memo(network, lambda: _network(ctx))   # derived once, kept until the context closes

Analyses never loop in Python over trace rows: DuckDB (with a memory limit, spilling to disk)
does the passes over the big tables (`accesses`, `lookups`), Polars the small results.
`phase = 'train'` rows feed every statistic and policy; `eval` rows are reported beside them.

State lives on the context and nowhere else: `memo` keeps what an analysis derived (the
attribution, the exchange replay, the network model, each policy), and temporary tables
(`tk_*`) live on its connection. Each temporary table is created by one module, whose docstring
lists the ones other modules read, with their columns; a module reads one by the name the owner's
memoized function returns (`attribution.attributed(ctx).tables.names`), so the call that builds a
table always comes before a read of it.
Closing the context (leaving the `with`, or `close()`) closes the connection, removes its spill
directory and drops the memo.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Hashable, Protocol, TypeVar

import duckdb
import polars as pl

from analyses.quality import Budget
from analyses.roles import with_roles
from tracekit.errors import TracekitError
from tracekit.files import replacing, write_text
from tracekit.manifest import Manifest, Table
from tracekit.policy import Section
from tracekit.run import Run, open_run
from tracekit.schema import PHASED
from tracekit.topology import Topology
from tracekit.window import Window
from tracekit.run_dir import RunDir

T = TypeVar("T")

MEMORY_LIMIT = "1GB"
STREAMED = ("accesses", "lookups")
"""Trace tables every query reads from their Parquet parts; the others (comms, steps, ...), read
by many queries and a few rows per step, are read once into the connection (a long run writes
them in thousands of small parts)."""


@dataclass(frozen=True)
class Model:
    tables: tuple[Table, ...]
    world_size: int

    @property
    def embedding_bytes(self) -> int:
        """Every table's rows, in bytes (one copy)."""
        return sum(t.num_rows * t.row_bytes for t in self.tables)

    def table(self, name: str) -> Table:
        for table in self.tables:
            if table.name == name:
                return table
        raise KeyError(name)

    def policy_model(self) -> dict:
        """The `model` object of policy.json."""
        return {"tables": [{"name": t.name, "num_rows": t.num_rows, "dim": t.dim} for t in self.tables],
                "world_size": self.world_size}


@dataclass
class Options:
    """The options of `tracekit analyze` (None: derived from the run)."""

    budget_bytes: int | None = None  # replica/cache bytes per rank
    budget_fraction: float | None = None  # or a fraction of the embedding bytes
    topology: Topology | None = None  # None: the recorded one (analyses.policies.tiers.topology)
    intra_bw: float | None = None  # bytes/s
    inter_bw: float | None = None
    policies: tuple[str, ...] = ("replication", "tiers", "schedule", "compression", "lag")
    objective: str = "time"  # a replica budget's figure of merit: predicted step "time", or network "bytes"
    replay_steps: int = 256  # the lookups' sampled steps the exchange replays use, evenly spaced (0: all)
    memory_limit: str = MEMORY_LIMIT  # DuckDB's cap (it spills to disk past it): "1GB", "512MiB"
    quality_budget: Budget = Budget()  # the most a lossy section may cost the model (analyses.quality)


@dataclass
class Result:
    """What one analysis hands back: tables written as `analysis/<name>.parquet`, the figures the
    summary prints (JSON-able), and what it could not compute, each with the reason."""

    tables: dict[str, pl.DataFrame] = field(default_factory=dict)
    summary: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


@dataclass
class PolicyResult:
    """One policy: its policy.json section (typed, with its prediction), the row lists it refers to
    (written as `policy/<name>.parquet`), and the evidence (which trace rows, which formula); or,
    when it cannot be derived from this run, no section and the reason. Compression derives two
    sections, its parts, by label (compression.dp, compression.mp); the other policies one."""

    name: str
    section: Section | None = None
    parts: dict[str, Section] = field(default_factory=dict)
    rows: dict[str, pl.DataFrame] = field(default_factory=dict)
    evidence: dict[str, Any] = field(default_factory=dict)
    reason: str | None = None
    tables: dict[str, pl.DataFrame] = field(default_factory=dict)  # analysis tables, e.g. a budget sweep

    def sections(self) -> dict[str, Section]:
        """Every section derived, by its label (tracekit.policy.LABELS); {} where none was."""
        return {self.name: self.section} if self.section is not None else dict(self.parts)

    def as_json(self) -> dict | None:
        """What was derived as policy.json holds it (compression's parts under "dp" and "mp"), before
        analyses.decision decides; None where nothing was."""
        if self.section is not None:
            return self.section.to_json()
        return {label.partition(".")[2]: part.to_json() for label, part in self.parts.items()} or None


class Background(Protocol):
    """Work beside the analysis (tracekit.app.calibration.Calibration): started with the file of the rows'
    counts (analyses.row_totals.kept_file), waited for where its result is read; `wait` returns None
    where it succeeded, else why not."""

    def start(self, row_totals: Path | None = None) -> None: ...

    def wait(self) -> str | None: ...


class Context:
    """A run opened for analysis. Build with `open_context`; close with `with` or `close()`."""

    def __init__(self, run: Run, options: Options, memory_limit: str = MEMORY_LIMIT) -> None:
        self.run = run
        self.path = run.path
        self.options = options
        self.manifest = run.manifest
        self.present = run.tables()
        self.model = model_of(self.manifest)
        # a trace cut short (a full disk): the steps every rank wrote whole, the only ones analysed
        cut = self.manifest.truncated_at or {}
        self.truncated_at: int | None = min(int(step) for step in cut.values()) if cut else None
        # `record --steps/--every`: the steps recorded, the only ones analysed (per-step figures average over them)
        self.window = Window.of_settings(self.manifest.collector_settings)
        self._memo: dict[Hashable, Any] = {}
        self.calibrating: Background | None = None  # the rank-side calibration running beside the analysis
        self._closed = False
        self._spill = tempfile.mkdtemp(prefix="tracekit-duckdb-")  # DuckDB spills here past memory_limit
        try:
            self.con = duckdb.connect(config={"memory_limit": memory_limit, "threads": os.cpu_count() or 1,
                                              "temp_directory": self._spill, "preserve_insertion_order": False})
        except BaseException:
            shutil.rmtree(self._spill, ignore_errors=True)
            raise
        try:
            self.con.sql("SET enable_progress_bar = false")  # our own progress line says where analysis is
            for table in self.present:
                relation = run.relation(table, self.con)
                self.con.register(f"{table}_rel", relation)
                kind = "VIEW" if table in STREAMED else "TEMP TABLE"
                rows = f"SELECT * FROM {table}_rel{self.steps_kept(relation.columns)}"
                if table == "comms":  # each call's role in the embedding exchange (analyses.roles)
                    rows = with_roles(f"({rows})")
                self.con.sql(f"CREATE {kind} {table} AS {rows}")
                if table in PHASED:
                    self.con.sql(f"CREATE VIEW train_{table} AS SELECT * FROM {table} WHERE phase = 'train'")
        except BaseException:
            self.close()
            raise

    def steps_kept(self, columns: list[str]) -> str:
        """The WHERE clause (or "") that keeps a trace table's rows of the steps analysed: the
        recorded window's, up to `truncated_at`."""
        kept = ([self.window.sql("step")] if not self.window.everything else []) + \
            ([f"step <= {self.truncated_at}"] if self.truncated_at is not None else [])
        return f" WHERE {' AND '.join(kept)}" if kept and "step" in columns else ""

    def __enter__(self) -> Context:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the connection, remove the spill directory and drop the memo; again: nothing."""
        if self._closed:
            return
        self._closed = True
        self._memo.clear()
        self.con.close()
        shutil.rmtree(self._spill, ignore_errors=True)

    def memo(self, key: Hashable, derive: Callable[[], T]) -> T:
        """`derive()`, computed once per context under `key` and kept until the context closes: the
        one place analyses keep what they derived (the policies build on the exchange replay, that
        on the attribution, and `analyze` asks for each again). `key`: the public function that
        derives the value, with the arguments it varies by, e.g. `(access_sample, rows, tables)`."""
        if key not in self._memo:
            self._memo[key] = derive()
        return self._memo[key]

    def has(self, table: str) -> bool:
        return table in self.present

    def sql(self, query: str, params: list | None = None) -> duckdb.DuckDBPyRelation:
        return self.con.sql(query, params=params) if params is not None else self.con.sql(query)

    def frame(self, query: str, params: list | None = None) -> pl.DataFrame:
        return self.sql(query, params).pl()

    def train_steps(self) -> int:
        """Training steps the run completed (the most any rank did), 0 without a steps table."""
        if not self.has("steps"):
            return 0
        return int(self.con.sql("SELECT count(DISTINCT step) FROM steps").fetchall()[0][0])

    def write_json(self, name: str, value: Any) -> Path:
        """Write `value` as RUN/analysis/<name>.json (via a temporary file, renamed)."""
        return write_text(RunDir.at(self.path).analysis_json(name), json.dumps(value, default=str, indent=1) + "\n")

    def write(self, name: str, frame: pl.DataFrame) -> Path:
        """Write `frame` as RUN/analysis/<name>.parquet (via a temporary file, renamed)."""
        target = RunDir.at(self.path).analysis_table(name)
        with replacing(target) as tmp:
            frame.write_parquet(tmp, compression="zstd")
        return target


def model_of(manifest: Manifest) -> Model:
    return Model(manifest.tables or (), int(manifest.world_size or 1))


def open_context(path: str | os.PathLike, options: Options | None = None, *,
                 memory_limit: str = MEMORY_LIMIT) -> Context:
    """The run at `path` ready for analysis, to use as `with open_context(path) as ctx:` (or close
    with `ctx.close()`); TracekitError (one line naming the file) for an empty run or unreadable
    trace files."""
    run = open_run(path)
    if not run.tables():
        raise TracekitError(f"{run.path}: the run holds no trace rows (status {run.manifest.status!r}); "
                            "nothing to analyse")
    try:
        return Context(run, options or Options(), memory_limit)
    except duckdb.Error as err:
        raise TracekitError(f"{run.path}: cannot read the trace ({str(err).splitlines()[0]})") from None


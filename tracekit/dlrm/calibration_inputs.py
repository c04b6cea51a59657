"""The rank-side calibration's inputs (tracekit/dlrm/calibrate.py): a recorded run's sizes
(analyses.run_sizes reads them) as the trainer's table specs and each table's id distribution, and
the local batches drawn from it.

    inputs = make_inputs(sizes.tables, sizes.samples, sizes.row_counts, world_size=sizes.world_size,
                         optimizer=sizes.optimizer, omp_threads=sizes.omp_threads, run=sizes.run)
    batches = Batches.draw(inputs, b=32, count=4, seed=0)   # lengths, values = batches[i]
    replicated = most_read_rows(inputs, k=100)              # the k most read rows, per table

Tables whose fp32 rows exceed MAX_TABLE_BYTES in all are scaled down (the same share of each; row
r's reads then fold onto row r mod rows). Without the run's per-row counts the ids follow a Zipf law.
"""

from __future__ import annotations

from collections.abc import Sequence
import itertools
import statistics
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch

from tracekit.dlrm.tables import TableSpec
from tracekit.manifest import Table

MAX_TABLE_BYTES = 64 << 20  # tables above this in all are scaled down (rows); more than any CPU cache holds
FALLBACK_ZIPF = 1.05  # ids' skew where the run has no accesses table


@dataclass
class Inputs:
    """What the calibration takes from a run."""

    tables: list[TableSpec]  # rows as calibrated: possibly scaled down (MAX_TABLE_BYTES)
    run_rows: list[int]  # the run's rows per table
    ids_per_sample: list[float]  # per table
    batch: int  # samples per rank per step
    world_size: int
    optimizer: str = "sgd"
    threads: int = 1
    weights: list[torch.Tensor] = field(default_factory=list, repr=False)  # per table: P(row) ∝ weight
    id_source: str = "accesses"
    run: str | None = None

    def describe(self) -> dict:
        return {"run": self.run, "world_size": self.world_size, "batch_per_rank": self.batch,
                "optimizer": self.optimizer, "id_source": self.id_source,
                "tables": [{"name": t.name, "rows": rows, "dim": t.dim, "pooled": t.pooled,
                            "ids_per_sample": round(m, 4), "rows_calibrated": t.rows}
                           for t, rows, m in zip(self.tables, self.run_rows, self.ids_per_sample)]}


def make_inputs(tables: Sequence[Table], samples: list[int], row_counts: pa.Table | None, *, world_size: int,
                optimizer: str, omp_threads: int, run: str | None = None) -> Inputs:
    """The calibration's inputs from a run's sizes (analyses.run_sizes reads them): `tables` as the
    manifest lists them, the samples of each training step per rank, each row's training lookups
    `row_counts` (table_name, row, count; None: the ids follow a Zipf law), the trainer's optimizer and
    the run's OMP_NUM_THREADS (0: unset)."""
    dims = [e.dim for e in tables]
    dim = max(set(dims), key=dims.count)  # the trainer's tables share one dim
    run_rows = [e.num_rows for e in tables]
    specs = [TableSpec(e.name, rows, dim, e.kind == "pooled")
             for e, rows in zip(tables, _scaled_rows(run_rows, dim))]
    if row_counts is not None and row_counts.num_rows:
        weights, source = [], "accesses"
        for spec in specs:
            mine = row_counts.filter(pc.equal(row_counts.column("table_name"), spec.name))
            rows = torch.from_numpy(mine.column("row").to_numpy().astype(np.int64))
            counts = torch.from_numpy(mine.column("count").to_numpy().astype(np.float32))
            weights.append(torch.zeros(spec.rows).index_add_(0, rows % spec.rows, counts))  # folded if scaled
        per_sample = [float(w.sum()) / sum(samples) for w in weights]
    else:
        source = f"zipf {FALLBACK_ZIPF}, 1 id per sample per table (the run has no accesses table)"
        weights = [torch.arange(1, spec.rows + 1, dtype=torch.float32).pow(-FALLBACK_ZIPF) for spec in specs]
        per_sample = [1.0] * len(specs)
    threads = omp_threads or (1 if world_size > 1 else torch.get_num_threads())
    return Inputs(specs, run_rows, per_sample, int(statistics.median(samples)), world_size, optimizer, threads,
                  weights, source, run)


def _scaled_rows(rows: list[int], dim: int) -> list[int]:
    """Rows per table as calibrated: as in the run, or, where the tables' fp32 rows exceed
    MAX_TABLE_BYTES in all, the same share of each (row r's reads then fold onto row r mod rows)."""
    share = min(1.0, MAX_TABLE_BYTES / (sum(rows) * dim * 4))
    return [max(1, int(n * share)) for n in rows]


@dataclass
class Batches:
    """A few local batches of one size, drawn from the run's id distribution, cycled through."""

    lengths: list[torch.Tensor]
    values: list[torch.Tensor]

    @staticmethod
    def draw(inputs: Inputs, b: int, count: int, seed: int) -> "Batches":
        gen = torch.Generator().manual_seed(seed)
        out = Batches([], [])
        for _ in range(count):
            lengths = torch.stack([torch.full((b,), int(m), dtype=torch.int64)
                                   + (torch.rand(b, generator=gen) < m - int(m)).long() for m in inputs.ids_per_sample])
            values = [torch.multinomial(w, n, replacement=True, generator=gen) if n else torch.empty(0, dtype=torch.int64)
                      for w, n in zip(inputs.weights, lengths.sum(dim=1).tolist())]
            out.lengths.append(lengths)
            out.values.append(torch.cat(values))
        return out

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        j = i % len(self.values)
        return self.lengths[j], self.values[j]


def most_read_rows(inputs: Inputs, k: int) -> list[torch.Tensor]:
    """The k most read rows over all tables (as a replication policy picks them), per table."""
    weights = torch.cat(inputs.weights)
    top = torch.topk(weights, k).indices
    base = [0, *itertools.accumulate(t.rows for t in inputs.tables)]
    return [torch.sort(top[(top >= lo) & (top < hi)] - lo)[0] for lo, hi in zip(base, base[1:])]

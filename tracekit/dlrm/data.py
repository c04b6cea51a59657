"""The trainer's data: one `Dataset` interface over synthetic, Criteo TSV and Parquet input.

A dataset is a fixed sequence of samples; `batch(start, stop)` returns samples
[start, stop) in the `Batch` layout, the same every time. The trainer splits each global
batch by rank, so each rank asks only for its own slice, and holds out the tail for
evaluation.

    open_dataset("synthetic", ...)          SyntheticDataset (tracekit.dlrm.synthetic)
    open_dataset("criteo:train.txt.gz", ...)  a Criteo TSV file, loaded into memory
    open_dataset("parquet:clicks.parquet", ...)  a Parquet file, loaded into memory
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Protocol

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch

from tracekit.dlrm.batch import Batch
from tracekit.dlrm.criteo import CATEGORICAL_COLUMNS, read_criteo
from tracekit.dlrm.presets import Preset, get_preset
from tracekit.dlrm.synthetic import SyntheticDataset
from tracekit.errors import ConfigError, DataError

DEFAULT_ZIPF = 1.05  # synthetic tables without a preset: moderate skew
SCHEMES = ("synthetic", "criteo:PATH", "parquet:PATH")


class Dataset(Protocol):
    """What the trainer reads: sizes, and samples by index range."""

    num_samples: int  # samples in the dataset (train + eval)
    num_dense: int
    table_rows: list[int]  # rows per table; T = len(table_rows)
    table_names: list[str]

    def batch(self, start: int, stop: int) -> Batch:
        """Samples [start, stop), deterministic."""
        ...

    def take(self, index: torch.Tensor) -> Batch:
        """The samples of the given indices (int64, any order), as `batch` gives them."""
        ...


class TabularDataset:
    """Samples held in memory: dense features, labels and one jagged id column per table.

    `lengths` is int64 [T, n]; `values[t]` holds table t's ids in sample order.
    """

    def __init__(
        self,
        *,
        dense: torch.Tensor,
        labels: torch.Tensor,
        lengths: torch.Tensor,
        values: list[torch.Tensor],
        table_rows: list[int],
        table_names: list[str],
    ) -> None:
        self.num_samples = labels.shape[0]
        self.num_dense = dense.shape[1]
        self.table_rows = list(table_rows)
        self.table_names = list(table_names)
        self._dense, self._labels, self._lengths, self._values = dense, labels, lengths, values
        self._offsets = torch.nn.functional.pad(torch.cumsum(lengths, dim=1), (1, 0))

    def batch(self, start: int, stop: int) -> Batch:
        """Samples [start, stop), copied (the caller may modify them)."""
        if not 0 <= start <= stop <= self.num_samples:
            raise IndexError(f"batch [{start}, {stop}) is outside the dataset's {self.num_samples} samples")
        first, last = self._offsets[:, start].tolist(), self._offsets[:, stop].tolist()
        return Batch(
            dense=self._dense[start:stop].clone(),
            lengths=self._lengths[:, start:stop].clone(),
            values=torch.cat([v[a:b] for v, a, b in zip(self._values, first, last)]),
            labels=self._labels[start:stop].clone(),
        )

    def take(self, index: torch.Tensor) -> Batch:
        """The samples of the given indices (int64, any order), as `batch` gives them."""
        if index.numel() and not (0 <= int(index.min()) and int(index.max()) < self.num_samples):
            raise IndexError(f"sample indices outside the dataset's {self.num_samples} samples")
        lengths = self._lengths[:, index]
        values = []
        for t, column in enumerate(self._values):
            first = self._offsets[t, index]
            within = torch.arange(int(lengths[t].sum())) - torch.repeat_interleave(
                torch.cumsum(lengths[t], 0) - lengths[t], lengths[t])
            values.append(column[torch.repeat_interleave(first, lengths[t]) + within])
        return Batch(dense=self._dense[index], lengths=lengths, values=torch.cat(values), labels=self._labels[index])


def open_dataset(
    spec: str,
    *,
    tables: int,
    rows: list[int] | int | None,
    num_dense: int,
    pooling: int,
    samples: int,
    seed: int,
    zipf: float | list[float] | None,
    drift: float,
    preset: str | None,
    scale: float,
) -> Dataset:
    """Open the dataset named by `spec`: "synthetic", "criteo:PATH" or "parquet:PATH".

    Parameters
    ----------
    tables, rows, num_dense
        The synthetic shape: `rows` is one count for every table or one per table. A
        Criteo file hashes its categories into `rows`; a Parquet file checks its ids
        against `rows`, or takes max id + 1 per table when `rows` is None.
    pooling, seed, zipf, drift
        Synthetic only: ids per bag, the seed, the Zipf exponent (one for all tables or one
        per table; default 1.05, or the preset's fitted values), and the row rotation over
        the dataset in table lengths (see `tracekit.dlrm.synthetic`).
    samples
        The synthetic dataset's size; a file source loads at most this many lines.
    preset, scale
        "criteo-kaggle" replaces tables, rows and num_dense by the Criteo Kaggle layout with
        its rows times `scale` (synthetic and criteo sources). `scale` is used only with a
        preset.

    Raises
    ------
    ConfigError
        An impossible option: a non-positive size, an unknown preset or spec scheme, or a
        list whose length does not match the tables.
    DataError
        A missing or malformed input file.
    """
    scheme, _, path = spec.partition(":")
    if spec != "synthetic" and (scheme not in ("criteo", "parquet") or not path):
        raise ConfigError(f"unknown data source {spec!r}; expected one of: {', '.join(SCHEMES)}")
    if samples < 1:
        raise ConfigError(f"samples must be positive, got {samples}")
    layout = get_preset(preset, scale=scale) if preset is not None else None
    if scheme == "parquet":
        if layout is not None:
            raise ConfigError(f"a preset does not apply to parquet data ({spec}): the file defines the tables")
        return read_parquet(path, rows=rows, limit=samples)
    if scheme == "criteo":
        table_rows = list(layout.table_rows) if layout else _rows_per_table(rows, len(CATEGORICAL_COLUMNS), spec)
        return read_criteo_dataset(path, table_rows=table_rows, limit=samples)
    return _synthetic(layout, tables, rows, num_dense, pooling, samples, seed, zipf, drift)


def _synthetic(layout: Preset | None, tables: int, rows: list[int] | int | None, num_dense: int, pooling: int,
               samples: int, seed: int, zipf: float | list[float] | None, drift: float) -> SyntheticDataset:
    if layout is not None:
        table_rows, num_dense = list(layout.table_rows), layout.num_dense
        exponents = list(layout.zipf) if zipf is None else _per_table(zipf, len(table_rows), "zipf")
    else:
        if tables < 1:
            raise ConfigError(f"tables must be positive, got {tables}")
        table_rows = _rows_per_table(rows, tables, "synthetic")
        exponents = _per_table(DEFAULT_ZIPF if zipf is None else zipf, tables, "zipf")
    return SyntheticDataset(
        table_rows=table_rows, zipf=exponents, num_dense=num_dense, pooling=pooling,
        samples=samples, seed=seed, drift=drift, table_names=list(layout.table_names) if layout else None,
    )


def _rows_per_table(rows: list[int] | int | None, tables: int, source: str) -> list[int]:
    if rows is None:
        raise ConfigError(f"{source} needs rows per table (--rows) or a preset")
    table_rows = _per_table(rows, tables, "rows")
    if min(table_rows) < 1:
        raise ConfigError(f"rows must be positive, got {rows}")
    return [int(r) for r in table_rows]


def _per_table(value: float | list[float] | list[int] | int, tables: int, name: str) -> list:
    """One value for every table, or a list with one per table."""
    if not isinstance(value, (list, tuple)):
        return [value] * tables
    if len(value) != tables:
        raise ConfigError(f"{name} takes one value or one per table ({tables}), got {len(value)}")
    return list(value)


def read_criteo_dataset(path: str | Path, *, table_rows: list[int], limit: int | None = None) -> TabularDataset:
    """A Criteo TSV file as a dataset: category value v of column Ct is row v % table_rows[t].

    A missing category is an empty bag (length 0) in that table. See `read_criteo` for the
    format and the checks.
    """
    if len(table_rows) != len(CATEGORICAL_COLUMNS) or min(table_rows) < 1:
        raise ConfigError(f"a Criteo file needs {len(CATEGORICAL_COLUMNS)} positive table sizes, got {table_rows}")
    log = read_criteo(path, limit=limit)
    present = log.categories >= 0
    modulus = torch.tensor(table_rows, dtype=torch.int64)
    return TabularDataset(
        dense=log.dense,
        labels=log.labels,
        lengths=present.T.long().contiguous(),
        values=[log.categories[present[:, t], t] % modulus[t] for t in range(len(table_rows))],
        table_rows=table_rows,
        table_names=list(CATEGORICAL_COLUMNS),
    )


def read_parquet(path: str | Path, *, rows: list[int] | int | None = None, limit: int | None = None) -> TabularDataset:
    """A Parquet file as a dataset: `label`, float `dense_*` columns, integer `cat_*` id columns.

    Each `cat_*` column is one table holding one id per sample (null: an empty bag). Tables
    and dense features are ordered by the number after the prefix when every name has one
    (cat_2 before cat_10), otherwise in file order. The label must be 0 or 1; a null dense
    value reads as 0. Rows per table are `rows` (one for all, or one per table) or, when
    None, the largest id + 1. At most `limit` rows of the file are loaded.

    Raises
    ------
    DataError
        The file is missing or unreadable, has no rows, no label, no cat_* or no dense_*
        columns, a non-numeric column, a label not 0/1, a negative id, or an id >= its
        table's rows.
    """
    path = Path(path)
    if not path.is_file():
        raise DataError(f"parquet: {path}: no such file")
    try:
        table = pq.read_table(path)
    except (pa.ArrowException, OSError) as err:
        raise DataError(f"parquet: {path}: cannot read: {err}") from None
    if limit is not None:
        table = table.slice(0, limit)
    if "label" not in table.column_names:
        raise DataError(f"parquet: {path}: no label column (columns: {', '.join(table.column_names)})")
    if table.num_rows == 0:
        raise DataError(f"parquet: {path}: no rows")
    cat_columns, dense_columns = _ordered(table.column_names, "cat_"), _ordered(table.column_names, "dense_")
    for columns, what in ((cat_columns, "cat_* id"), (dense_columns, "dense_* feature")):
        if not columns:
            raise DataError(f"parquet: {path}: no {what} columns (columns: {', '.join(table.column_names)})")
    ids = [_ids(table, name, path) for name in cat_columns]
    if rows is None:
        table_rows = [int(column.max()) + 1 if len(column) else 1 for column, _ in ids]
    else:
        table_rows = _rows_per_table(rows, len(cat_columns), f"parquet:{path}")
    for (column, _), name, limit_rows in zip(ids, cat_columns, table_rows):
        if len(column) and int(column.max()) >= limit_rows:
            raise DataError(
                f"parquet: {path}: column {name} has id {int(column.max())}, but its table has {limit_rows} rows"
            )
    return TabularDataset(
        dense=_parquet_dense(table, dense_columns, path),
        labels=_parquet_labels(table, path),
        lengths=torch.stack([present.long() for _, present in ids]),
        values=[column for column, _ in ids],
        table_rows=table_rows,
        table_names=cat_columns,
    )


def _ordered(names: list[str], prefix: str) -> list[str]:
    """Columns named prefix*, by numeric suffix when every one has one, else in file order."""
    chosen = [n for n in names if n.startswith(prefix)]
    if all(re.fullmatch(r"\d+", n[len(prefix):]) for n in chosen):
        chosen.sort(key=lambda n: int(n[len(prefix):]))
    return chosen


def _ids(table: pa.Table, name: str, path: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """(int64 ids of the non-null cells, bool [n] which cells are non-null) of one id column."""
    column = table[name]
    if not pa.types.is_integer(column.type):
        raise DataError(f"parquet: {path}: column {name} is {column.type}, expected integer ids")
    present = pc.is_valid(column).to_numpy(zero_copy_only=False)
    ids = column.drop_null().to_numpy().astype(np.int64)
    if len(ids) and ids.min() < 0:
        raise DataError(f"parquet: {path}: column {name} has a negative id ({int(ids.min())})")
    return torch.from_numpy(ids), torch.from_numpy(present)


def _parquet_dense(table: pa.Table, names: list[str], path: Path) -> torch.Tensor:
    columns = []
    for name in names:
        if not (pa.types.is_floating(table[name].type) or pa.types.is_integer(table[name].type)):
            raise DataError(f"parquet: {path}: column {name} is {table[name].type}, expected numbers")
        columns.append(table[name].cast(pa.float32()).fill_null(0).to_numpy())
    return torch.from_numpy(np.stack(columns, axis=1))


def _parquet_labels(table: pa.Table, path: Path) -> torch.Tensor:
    column = table["label"]
    if not (pa.types.is_floating(column.type) or pa.types.is_integer(column.type) or pa.types.is_boolean(column.type)):
        raise DataError(f"parquet: {path}: column label is {column.type}, expected 0/1")
    labels = column.cast(pa.float32()).to_numpy(zero_copy_only=False)
    valid = np.isin(labels, (0.0, 1.0))
    if not valid.all():
        bad = labels[~valid][0]
        found = "null" if math.isnan(bad) else f"{bad:g}"
        raise DataError(f"parquet: {path}: column label must be 0 or 1, found {found}")
    return torch.from_numpy(labels.astype(np.float32))

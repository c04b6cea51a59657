"""Tests for the trainer's datasets: synthetic determinism and skew, Criteo TSV, Parquet, options."""

from __future__ import annotations

import gzip
import math
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from tests.prerequisites import needs
from tracekit.dlrm.batch import Batch
from tracekit.dlrm.criteo import read_criteo
from tracekit.dlrm.data import open_dataset, read_parquet
from tracekit.dlrm.presets import CRITEO_KAGGLE_ROWS, CRITEO_KAGGLE_ZIPF, fit_criteo_zipf, fit_zipf_exponent, get_preset
from tracekit.dlrm.synthetic import SyntheticDataset, lowbias32_, splitmix64, splitmix64_int
from tracekit.errors import ConfigError, DataError

SHARED = Path(__file__).resolve().parents[1].parent / "shared"
CRITEO_SAMPLE = SHARED / "data" / "criteo-sample" / "criteo_dac_train_first10k.txt.gz"
needs_criteo_sample = needs(None if CRITEO_SAMPLE.is_file() else f"{CRITEO_SAMPLE} is not here")

OPTIONS = dict(
    tables=4, rows=1000, num_dense=5, pooling=3, samples=10_000, seed=0, zipf=None, drift=0.0, preset=None, scale=1.0
)


def synthetic(**changes) -> SyntheticDataset:
    return open_dataset("synthetic", **{**OPTIONS, **changes})


def assert_batches_equal(a: Batch, b: Batch) -> None:
    for name in ("dense", "lengths", "values", "labels"):
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype and torch.equal(x, y), name


def top_share(ids: torch.Tensor, fraction: float) -> float:
    """Share of the lookups that go to the most frequent `fraction` of the distinct ids."""
    counts = torch.unique(ids, return_counts=True)[1].sort(descending=True).values
    return float(counts[: math.ceil(fraction * len(counts))].sum() / counts.sum())


def bayes_auc(p: torch.Tensor, labels: torch.Tensor) -> float:
    ranks = torch.empty_like(p)
    ranks[torch.argsort(p)] = torch.arange(1, len(p) + 1, dtype=p.dtype)
    positives = labels.sum()
    return float((ranks[labels == 1].sum() - positives * (positives + 1) / 2) / (positives * (len(p) - positives)))


# --- hashing -------------------------------------------------------------------------------


def lowbias32_int(x: int) -> int:
    x &= 0xFFFFFFFF
    x ^= x >> 16
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)


def test_tensor_hashes_match_the_integer_references():
    inputs = [0, 1, -1, 2**31 - 1, -(2**31), 2**63 - 1, -(2**63), 0x0123456789ABCDEF, -987654321]
    got = splitmix64(torch.tensor(inputs)).tolist()
    assert [g & (2**64 - 1) for g in got] == [splitmix64_int(x) for x in inputs]
    words = [x & 0xFFFFFFFF for x in inputs]
    signed = torch.tensor([w - 2**32 if w >> 31 else w for w in words], dtype=torch.int32)
    assert [g & 0xFFFFFFFF for g in lowbias32_(signed).tolist()] == [lowbias32_int(w) for w in words]


# --- synthetic -----------------------------------------------------------------------------


@pytest.mark.parametrize("split", [0, 1, 37, 500, 999, 1000])
@pytest.mark.parametrize("drift", [0.0, 2.5])
def test_synthetic_batches_split_bit_exactly(split, drift):
    data = synthetic(drift=drift, zipf=[0.0, 0.8, 1.2, 3.0], rows=[1, 7, 1000, 2_000_000])
    assert_batches_equal(data.batch(0, 1000), Batch.concat([data.batch(0, split), data.batch(split, 1000)]))


def test_two_ranks_see_the_samples_of_one():
    data = synthetic(pooling=20, tables=8, rows=100_000)
    whole = data.batch(4096, 4096 + 512)
    assert_batches_equal(whole, Batch.concat([data.batch(4096, 4096 + 256), data.batch(4096 + 256, 4096 + 512)]))
    three = [data.batch(4096 + a, 4096 + b) for a, b in ((0, 100), (100, 101), (101, 512))]
    assert_batches_equal(whole, Batch.concat(three))


def test_synthetic_is_deterministic_and_depends_on_the_seed():
    assert_batches_equal(synthetic().batch(123, 456), synthetic().batch(123, 456))
    a, b = synthetic(seed=0).batch(0, 500), synthetic(seed=1).batch(0, 500)
    assert not torch.equal(a.values, b.values)
    assert not torch.equal(a.dense, b.dense)
    assert not torch.equal(a.labels, b.labels)


def test_synthetic_layout():
    data = synthetic(rows=[1, 3, 1000, 2**31 - 1], pooling=5, num_dense=7)
    batch = data.batch(10, 310)
    assert batch.dense.shape == (300, 7) and batch.dense.dtype == torch.float32
    assert batch.lengths.shape == (4, 300) and batch.lengths.dtype == torch.int64
    assert bool((batch.lengths == 5).all())
    assert batch.values.dtype == torch.int64 and batch.values.shape == (4 * 300 * 5,)
    per_table = batch.values.view(4, 300 * 5)
    for t, rows in enumerate(data.table_rows):
        assert 0 <= int(per_table[t].min()) and int(per_table[t].max()) < rows
    assert set(batch.labels.unique().tolist()) <= {0.0, 1.0}
    assert data.batch(5, 5).size == 0


def test_zipf_exponent_sets_the_skew():
    data = synthetic(tables=2, rows=100_000, pooling=20, zipf=[0.0, 1.2])
    ids = data.batch(0, 2000).values.view(2, -1)
    uniform, skewed = top_share(ids[0], 0.01), top_share(ids[1], 0.01)
    assert uniform < 0.05
    assert skewed > 0.5
    # the hottest row of a Zipf 1.2 table over 100k rows has about 20% of the lookups
    assert 0.18 < torch.bincount(ids[1]).max().item() / ids.shape[1] < 0.22


def test_hot_rows_are_scattered_over_the_table():
    ids = synthetic(tables=1, rows=1_000_000, pooling=20, zipf=1.2).batch(0, 2000).values
    hottest = torch.bincount(ids).argsort(descending=True)[:10]
    assert int(hottest.max()) > 100_000


def test_drift_moves_the_hot_set():
    def hot_rows(data, start):
        ids = data.batch(start, start + 500).values
        return set(torch.bincount(ids).argsort(descending=True)[:50].tolist())

    still, moving = synthetic(tables=1, pooling=20, zipf=1.2), synthetic(tables=1, pooling=20, zipf=1.2, drift=0.5)
    assert len(hot_rows(still, 0) & hot_rows(still, 9500)) > 40
    assert len(hot_rows(moving, 0) & hot_rows(moving, 9500)) < 10


def test_labels_carry_a_planted_signal():
    data = synthetic(tables=8, rows=100_000, pooling=20, num_dense=13, samples=100_000)
    labels = data.batch(0, 20_000).labels
    assert 0.25 < float(labels.mean()) < 0.5
    assert 0.75 < bayes_auc(data.click_probability(0, 20_000), labels) < 0.85


# --- presets and the Zipf fit --------------------------------------------------------------


def test_criteo_kaggle_preset_scales_the_tables():
    preset = get_preset("criteo-kaggle", scale=0.01)
    assert len(preset.table_rows) == len(preset.zipf) == 26 and preset.num_dense == 13
    assert preset.table_rows[2] == round(10131227 * 0.01) and min(preset.table_rows) == 2
    data = synthetic(preset="criteo-kaggle", scale=0.001, samples=1000)
    assert data.table_rows == [max(2, round(r * 0.001)) for r in CRITEO_KAGGLE_ROWS]
    assert data.zipf == list(CRITEO_KAGGLE_ZIPF) and data.num_dense == 13
    assert data.table_names[0] == "C1"


def test_zipf_fit_recovers_a_known_exponent():
    ranks = np.arange(1, 2001)
    p = ranks**-1.2 / (ranks**-1.2).sum()
    counts = np.random.default_rng(0).multinomial(500_000, p)
    assert fit_zipf_exponent(counts) == pytest.approx(1.2, abs=0.01)
    assert fit_zipf_exponent(np.array([7, 7, 7])) == 0.0


@needs_criteo_sample
def test_stored_criteo_exponents_match_a_fresh_fit():
    fitted = fit_criteo_zipf(CRITEO_SAMPLE)
    assert fitted == pytest.approx(CRITEO_KAGGLE_ZIPF, abs=6e-4)


# --- Criteo TSV ----------------------------------------------------------------------------


@needs_criteo_sample
def test_criteo_sample_parses():
    log = read_criteo(CRITEO_SAMPLE)
    assert log.num_lines == 10_000 and int(log.labels.sum()) == 2182
    # line 1: 0 1 1 5 0 1382 4 15 2 181 1 2 _ 2 68fd1e64 80e26c9b fb936136 ...
    assert log.labels[0] == 0
    assert log.dense[0, :3].tolist() == pytest.approx([math.log(2), math.log(2), math.log(6)])
    assert log.dense[0, 11] == 0  # I12 missing
    assert log.categories[0, :3].tolist() == [0x68FD1E64, 0x80E26C9B, 0xFB936136]
    assert int((log.categories[:, 2] < 0).sum()) == 357  # C3 missing, per SOURCE.md


@needs_criteo_sample
def test_criteo_dataset_hashes_categories_into_the_tables():
    data = open_dataset(f"criteo:{CRITEO_SAMPLE}", **{**OPTIONS, "rows": 1000, "samples": 20_000})
    assert data.num_samples == 10_000 and data.num_dense == 13 and data.table_rows == [1000] * 26
    batch = data.batch(0, 10_000)
    assert int(batch.lengths[2].sum()) == 10_000 - 357
    assert int(batch.values.max()) < 1000
    assert_batches_equal(batch, Batch.concat([data.batch(0, 4321), data.batch(4321, 10_000)]))
    preset = open_dataset(f"criteo:{CRITEO_SAMPLE}", **{**OPTIONS, "preset": "criteo-kaggle", "samples": 100})
    assert preset.num_samples == 100 and preset.table_rows == list(CRITEO_KAGGLE_ROWS)


def write_lines(path: Path, lines: list[str]) -> Path:
    text = "".join(line + "\n" for line in lines)
    if path.suffix == ".gz":
        path.write_bytes(gzip.compress(text.encode()))
    else:
        path.write_text(text)
    return path


GOOD_LINE = "\t".join(["1", *["3"] * 13, *["0a1b2c3d"] * 26])


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ("\t".join(GOOD_LINE.split("\t")[:39]), "expected 40 tab-separated fields, got 39"),
        (GOOD_LINE + "\t", "expected 40 tab-separated fields, got 41"),
        ("", "expected 40 tab-separated fields, got an empty line"),
        (GOOD_LINE.replace("1", "2", 1), "label: expected 0 or 1, got '2'"),
        (GOOD_LINE.replace("\t3\t", "\t3.5\t", 1), "I1: expected an integer or nothing, got '3.5'"),
        (GOOD_LINE.replace("0a1b2c3d", "0a1b2c3", 1), "C1: expected 8 hex digits or nothing, got '0a1b2c3'"),
        (GOOD_LINE.replace("0a1b2c3d", "0a1b2c3g", 1), "C1: expected 8 hex digits or nothing, got '0a1b2c3g'"),
    ],
)
@pytest.mark.parametrize("name", ["bad.txt", "bad.txt.gz"])
def test_malformed_criteo_lines_are_refused_with_their_line_number(tmp_path, line, expected, name):
    path = write_lines(tmp_path / name, [GOOD_LINE] * 16 + [line] + [GOOD_LINE, line[:-1] or "x"])
    with pytest.raises(DataError) as err:
        read_criteo(path)
    assert str(err.value) == f"criteo: {path} line 17: {expected}"


def test_criteo_checks_only_the_lines_it_loads(tmp_path):
    path = write_lines(tmp_path / "short.txt", [GOOD_LINE] * 5 + ["oops"])
    assert read_criteo(path, limit=5).num_lines == 5
    with pytest.raises(DataError, match="line 6: expected 40"):
        read_criteo(path, limit=6)


def test_missing_files_are_data_errors(tmp_path):
    for scheme in ("criteo", "parquet"):
        with pytest.raises(DataError, match=f"{scheme}: {tmp_path / 'nope'}: no such file"):
            open_dataset(f"{scheme}:{tmp_path / 'nope'}", **OPTIONS)


# --- Parquet -------------------------------------------------------------------------------


def write_parquet(path: Path, **columns) -> Path:
    pq.write_table(pa.table(columns), path)
    return path


def clicks(path: Path, **changes) -> Path:
    columns = {
        "label": pa.array([1, 0, 0, 1], pa.int8()),
        "dense_1": pa.array([0.5, None, 2.0, 3.0], pa.float32()),
        "cat_10": pa.array([9, 8, 7, 6], pa.int64()),
        "dense_0": pa.array([1.0, 2.0, 3.0, 4.0], pa.float64()),
        "cat_2": pa.array([3, None, 1, 0], pa.int64()),
    }
    return write_parquet(path, **{**columns, **changes})


def test_parquet_round_trip(tmp_path):
    data = read_parquet(clicks(tmp_path / "clicks.parquet"))
    assert data.table_names == ["cat_2", "cat_10"] and data.table_rows == [4, 10]
    batch = data.batch(0, 4)
    assert batch.labels.tolist() == [1, 0, 0, 1]
    assert batch.dense.tolist() == [[1.0, 0.5], [2.0, 0.0], [3.0, 2.0], [4.0, 3.0]]
    assert batch.lengths.tolist() == [[1, 0, 1, 1], [1, 1, 1, 1]]
    assert batch.values.tolist() == [3, 1, 0, 9, 8, 7, 6]
    assert_batches_equal(batch, Batch.concat([data.batch(0, 1), data.batch(1, 2), data.batch(2, 4)]))
    sized = open_dataset(f"parquet:{tmp_path / 'clicks.parquet'}", **{**OPTIONS, "rows": [5, 20], "samples": 3})
    assert sized.table_rows == [5, 20] and sized.num_samples == 3


@pytest.mark.parametrize(
    ("changes", "rows", "message"),
    [
        ({"cat_2": pa.array([3, -1, 1, 0])}, None, "column cat_2 has a negative id (-1)"),
        ({}, 8, "column cat_10 has id 9, but its table has 8 rows"),
        ({"label": pa.array([1, 0, 2, 1])}, None, "column label must be 0 or 1, found 2"),
        ({"label": pa.array([1, 0, None, 1], pa.int8())}, None, "column label must be 0 or 1, found null"),
        ({"cat_2": pa.array(["a", "b", "c", "d"])}, None, "column cat_2 is string, expected integer ids"),
    ],
)
def test_bad_parquet_is_refused_naming_file_and_column(tmp_path, changes, rows, message):
    path = clicks(tmp_path / "bad.parquet", **changes)
    with pytest.raises(DataError) as err:
        read_parquet(path, rows=rows)
    assert str(err.value) == f"parquet: {path}: {message}"


@pytest.mark.parametrize(
    ("columns", "message"),
    [
        ({"dense_0": pa.array([1.0]), "cat_0": pa.array([0])}, "no label column"),
        ({"label": pa.array([1]), "dense_0": pa.array([1.0])}, "no cat_* id columns"),
        ({"label": pa.array([1]), "cat_0": pa.array([0])}, "no dense_* feature columns"),
    ],
)
def test_parquet_without_a_needed_column_is_refused(tmp_path, columns, message):
    path = write_parquet(tmp_path / "partial.parquet", **columns)
    with pytest.raises(DataError, match=message.replace("*", r"\*")):
        read_parquet(path)


# --- options -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "changes", "message"),
    [
        ("csv:x.csv", {}, "unknown data source 'csv:x.csv'"),
        ("criteo:", {}, "unknown data source 'criteo:'"),
        ("synthetic", {"preset": "criteo-terabyte"}, "unknown preset 'criteo-terabyte'"),
        ("synthetic", {"preset": "criteo-kaggle", "scale": 0.0}, "scale must be a positive number"),
        ("synthetic", {"tables": 0}, "tables must be positive"),
        ("synthetic", {"rows": 0}, "rows must be positive"),
        ("synthetic", {"rows": [10, 10]}, "rows takes one value or one per table"),
        ("synthetic", {"rows": 2**31}, "rows per table must be in"),
        ("synthetic", {"zipf": -0.5}, "zipf exponents must be finite and >= 0"),
        ("synthetic", {"zipf": [1.0, 1.0]}, "zipf takes one value or one per table"),
        ("synthetic", {"pooling": 0}, "pooling must be positive"),
        ("synthetic", {"samples": 0}, "samples must be positive"),
        ("synthetic", {"num_dense": 0}, "num_dense must be positive"),
        ("synthetic", {"drift": math.inf}, "drift must be a finite number"),
        ("criteo:x.txt", {"rows": None}, "needs rows per table"),
        ("parquet:x.parquet", {"preset": "criteo-kaggle"}, "a preset does not apply to parquet data"),
    ],
)
def test_impossible_options_are_config_errors(spec, changes, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace("[", r"\[")):
        open_dataset(spec, **{**OPTIONS, **changes})


def test_batches_outside_the_dataset_are_refused():
    with pytest.raises(IndexError, match=r"batch \[9990, 10010\) is outside the dataset's 10000 samples"):
        synthetic().batch(9990, 10_010)

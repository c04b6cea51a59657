"""Named dataset shapes, and the Zipf fit that calibrates their skew to real data.

`criteo-kaggle` is the Criteo Kaggle (Display Advertising Challenge) layout: 13 dense
features and 26 tables with the dataset's cardinalities, each times `scale`, and one
Zipf exponent per table fitted by `fit_zipf_exponent` to the value counts of C1..C26 in
the first 10,000 lines of the Kaggle `train.txt` (see shared/data/criteo-sample/SOURCE.md;
the data itself is not redistributable and is not in this repository).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from tracekit.dlrm.criteo import CATEGORICAL_COLUMNS, NUM_DENSE, read_criteo
from tracekit.errors import ConfigError

CRITEO_KAGGLE_ROWS = (
    1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194,
    27, 14992, 5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572,
)  # fmt: skip
# fit_criteo_zipf("shared/data/criteo-sample/criteo_dac_train_first10k.txt.gz"), rounded
# to 3 decimals, on 2026-11-25 (tests/test_data.py re-fits and compares when the file is there)
CRITEO_KAGGLE_ZIPF = (
    1.768, 1.02, 0.756, 0.856, 2.217, 1.653, 0.683, 1.996, 3.464, 0.954, 0.74, 0.77, 0.761,
    1.723, 0.767, 0.796, 1.161, 0.884, 1.459, 0.127, 0.783, 1.9, 1.505, 0.987, 1.437, 0.863,
)  # fmt: skip
MIN_ROWS = 2  # a scaled table keeps at least this many rows


@dataclass(frozen=True)
class Preset:
    """A dataset shape: tables with their row counts and skew, and the dense width."""

    name: str
    table_names: tuple[str, ...]
    table_rows: tuple[int, ...]
    zipf: tuple[float, ...]
    num_dense: int


def criteo_kaggle(scale: float) -> Preset:
    """The Criteo Kaggle layout: 26 tables of the dataset's cardinalities times `scale`."""
    return Preset(
        name="criteo-kaggle",
        table_names=CATEGORICAL_COLUMNS,
        table_rows=tuple(max(MIN_ROWS, round(rows * scale)) for rows in CRITEO_KAGGLE_ROWS),
        zipf=CRITEO_KAGGLE_ZIPF,
        num_dense=NUM_DENSE,
    )


PRESETS = {"criteo-kaggle": criteo_kaggle}


def get_preset(name: str, *, scale: float = 1.0) -> Preset:
    """The preset called `name` with every table's rows times `scale` (rounded, at least 2)."""
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; the presets are: {', '.join(PRESETS)}")
    if not (math.isfinite(scale) and scale > 0):
        raise ConfigError(f"scale must be a positive number, got {scale}")
    return PRESETS[name](scale)


def fit_zipf_exponent(counts: np.ndarray | torch.Tensor, *, tolerance: float = 1e-9) -> float:
    """Maximum-likelihood Zipf exponent of a rank-frequency table (not a log-log regression).

    The values are ranked by count (rank 1 = most frequent) and modelled as
    P(rank k) = k^-a / sum_{j=1..n} j^-a over the n values seen. The log-likelihood is
    concave in a, and its derivative vanishes where the model's mean log-rank equals the
    observed one; that mean falls from its uniform value at a = 0 towards 0, so bisection
    finds the root. Equal counts give 0.

    The fit describes the sample: values never seen are outside the support, so a
    short sample of a large table, where most values appear once, reads as low skew.
    """
    ranked = np.sort(np.asarray(counts, dtype=np.float64))[::-1]
    ranked = ranked[ranked > 0]
    if len(ranked) < 2:
        raise ValueError("a Zipf fit needs at least two distinct values")
    log_rank = np.log(np.arange(1, len(ranked) + 1, dtype=np.float64))
    observed = float((ranked * log_rank).sum() / ranked.sum())

    def model_mean_log_rank(a: float) -> float:
        weights = np.exp(-a * log_rank)
        return float((weights * log_rank).sum() / weights.sum())

    low, high = 0.0, 1.0
    if model_mean_log_rank(low) <= observed:
        return 0.0
    while model_mean_log_rank(high) > observed:
        low, high = high, 2 * high
    while high - low > tolerance:
        middle = (low + high) / 2
        low, high = (middle, high) if model_mean_log_rank(middle) > observed else (low, middle)
    return (low + high) / 2


def fit_criteo_zipf(path: str | Path) -> tuple[float, ...]:
    """One `fit_zipf_exponent` per categorical column C1..C26 of a Criteo TSV file.

    Missing values are not counted.
    """
    categories = read_criteo(path).categories
    exponents = []
    for column in categories.T:
        _, counts = torch.unique(column[column >= 0], return_counts=True)
        exponents.append(fit_zipf_exponent(counts.numpy()))
    return tuple(exponents)

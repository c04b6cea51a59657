"""A deterministic synthetic click log: skewed embedding lookups, dense features, planted labels.

Sample i is a pure function of (seed, i), computed with counter-based hashing in vectorised
integer ops: no Python loop over samples and no global RNG state. So any slice of the
dataset can be generated on its own, and `batch(a, c)` equals
`Batch.concat([batch(a, b), batch(b, c)])` bit for bit, whatever b: every rank of a job
generates only its part of a global batch, and world size 1 and 2 see the same samples.
Per sample, only integer ops and single IEEE float ops (*, conversions) run, so a
vectorised kernel and its scalar tail cannot round differently. The lookup tables are
built once, in float64, when the dataset is created.

Per sample i, a 64-bit splitmix hash of (seed, i) gives a 32-bit base h_i; word m of the
sample is lowbias32(h_i + m * 0x9E3779B9). Words 0 .. T*P-1 draw the ids (table t,
position p is word t*P + p), the next `num_dense` words the dense features, the last one
the label.

Ids. Popularity rank k in table t follows a bounded power law P(k) ~ (k + 1)^-a_t
(a_t = 0: uniform), sampled by inverse CDF over 4096 equal-probability buckets: the
bucket is the top 12 bits of the word, the position inside it the low 20. The bucket
edges are the closed-form quantiles of the continuous law, rounded down to whole ranks,
and each bucket is uniform over its ranks. So the sampler's CDF is within about 1/4096 of
the continuous law's everywhere (any top-k share is off by at most ~0.025 percentage
points), a rank with more than 1/4096 of the mass gets buckets of its own, and what is
approximated is the shape inside a bucket: the tail, for a large exponent. A bucket wider
than 2^20 ranks (a large exponent on a table of millions of rows) reaches only every
(width / 2^20)-th rank of its range. Ranks map to rows by a fixed pseudo-random
permutation: the buckets' rank ranges are laid out in row space in a shuffled order, so
the hottest rows are scattered over the table, not 0, 1, 2, ....

Drift d rotates row ids: at sample i every id moves to (row + floor(d * rows * i /
samples)) mod rows, so over the whole dataset the mapping turns by d * rows. A hot row's
successor is a neighbouring, previously cold row: each step of the shift replaces the hot
set, and there are about d * rows steps in all.

Labels. logit = bias + w . dense + sum_t sqrt(P) * mean_p(e_t(row)) / sqrt(T), where e_t
is uniform in [-1, 1] per (table, row) from a hash of the row, and label ~
Bernoulli(sigmoid(logit)), with sigmoid read from a table on a 1/64 grid. The sqrt factors
keep the planted signal the same strength for any pooling P and table count T, and the
bias absorbs the hot rows' effects; so for any shape the Bayes AUC is about 0.8 and about
a third of the labels are positive. The logit is integer fixed point (2^-24 units), so
it is exact too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from tracekit.dlrm.batch import Batch
from tracekit.errors import ConfigError

BUCKET_BITS = 12  # inverse-CDF buckets per table: 4096
FRAC_BITS = 32 - BUCKET_BITS  # position inside a bucket
MAX_ROWS = (1 << 31) - 1  # rows are int32 inside the generator

DENSE_STD = 1.0  # spread of the dense part of the logit
SPARSE_GAIN = 1.7  # sparse part: effects are uniform in [-1, 1] (std 0.58), so std about 1.0
LOGIT_BIAS = -0.9  # about a third of the labels positive
LOGIT_UNIT_BITS = 24  # fixed-point logit: units of 2^-24
SIGMOID_STEP_BITS = 6  # sigmoid table on a 1/64 grid
SIGMOID_RANGE = 16  # ... over [-16, 16)

_M64 = (1 << 64) - 1
_GAMMA = 0x9E3779B97F4A7C15
_SPLITMIX = (0xBF58476D1CE4E5B9, 0x94D049BB133111EB)
_LOWBIAS = (0x7FEB352D, 0x846CA68B)
_WORD_STEP = 0x9E3779B9
_DENSE_BYTE_MEAN = 4 * 255 // 2  # dense value = (sum of a word's 4 bytes - 510) / 128
_DENSE_SCALE_BITS = 7
_DENSE_VALUE_STD = math.sqrt(4 * (256**2 - 1) / 12) / 2**_DENSE_SCALE_BITS


def _signed(value: int, bits: int) -> int:
    """The two's-complement reading of the low `bits` of `value` (what torch stores)."""
    value &= (1 << bits) - 1
    return value - (1 << bits) if value >> (bits - 1) else value


def splitmix64_int(x: int) -> int:
    """splitmix64 of one 64-bit integer, in Python ints: the reference for `splitmix64`."""
    z = (x + _GAMMA) & _M64
    z = ((z ^ (z >> 30)) * _SPLITMIX[0]) & _M64
    z = ((z ^ (z >> 27)) * _SPLITMIX[1]) & _M64
    return z ^ (z >> 31)


def splitmix64(x: torch.Tensor) -> torch.Tensor:
    """splitmix64 of an int64 tensor, element-wise, as int64 holding the 64 result bits.

    torch's `>>` on int64 is arithmetic, so each shift is masked to make it logical;
    multiplication wraps modulo 2^64 as in C.
    """
    z = x + _signed(_GAMMA, 64)
    z = z ^ ((z >> 30) & ((1 << 34) - 1))
    z = z * _signed(_SPLITMIX[0], 64)
    z = z ^ ((z >> 27) & ((1 << 37) - 1))
    z = z * _signed(_SPLITMIX[1], 64)
    return z ^ ((z >> 31) & ((1 << 33) - 1))


def lowbias32_(x: torch.Tensor) -> torch.Tensor:
    """Chris Wellons' lowbias32 integer hash, in place on an int32 tensor (shifts masked)."""
    x ^= (x >> 16) & 0xFFFF
    x.mul_(_signed(_LOWBIAS[0], 32))
    x ^= (x >> 15) & 0x1FFFF
    x.mul_(_signed(_LOWBIAS[1], 32))
    x ^= (x >> 16) & 0xFFFF
    return x


def power_law_quantiles(rows: int, exponent: float, buckets: int) -> torch.Tensor:
    """Quantiles q(j / buckets), j = 0..buckets, of a continuous power law on ranks [0, rows].

    The density is (x + 1/2)^-exponent on [0, rows], so rank k = floor(x) gets about
    (k + 1)^-exponent (midpoint rule: a Zipf law, approximated). Closed form, float64.
    """
    u = torch.arange(buckets + 1, dtype=torch.float64) / buckets
    log_span = math.log((rows + 0.5) / 0.5)
    b = 1.0 - exponent
    if b == 0.0:
        x = 0.5 * torch.exp(u * log_span)
    else:
        x = 0.5 * torch.exp(torch.log1p(u * math.expm1(b * log_span)) / b)
    q = x - 0.5
    q[-1] = rows
    return q


@dataclass(frozen=True)
class _BucketTable:
    """Row start and width of each inverse-CDF bucket of one table (see the module docstring)."""

    start: torch.Tensor  # int32 [buckets]: first row of the bucket's rank range
    width: torch.Tensor  # float32 [buckets]: ranks in the range (rounded down), times 2^-FRAC_BITS


def _bucket_table(rows: int, exponent: float, key: int) -> _BucketTable:
    """Lay the buckets' integer rank ranges out in row space in a key-dependent shuffled order.

    Bucket j covers ranks [L_j, L_{j+1}) with L_j = floor(q_j); a bucket with an empty range
    (a hot rank that spans several buckets) is a point mass on rank L_j, which is the first
    rank of the next non-empty range, so it shares that range's row start.
    """
    buckets = 1 << BUCKET_BITS
    low = power_law_quantiles(rows, exponent, buckets).floor().long().clamp(max=rows - 1)
    low[-1] = rows
    width = low[1:] - low[:-1]
    ranges = torch.nonzero(width > 0).flatten()
    order = torch.argsort(splitmix64(ranges + key))
    range_start = torch.empty_like(ranges)
    range_start[order] = torch.cumsum(width[ranges][order], 0) - width[ranges][order]
    # each bucket takes the row start of the first non-empty range at or after it
    owner = torch.searchsorted(ranges, torch.arange(buckets))
    return _BucketTable(start=range_start[owner].int(), width=_float32_down(width) * 2.0**-FRAC_BITS)


def _float32_down(values: torch.Tensor) -> torch.Tensor:
    """float32 nearest to each int64 at or below it.

    With the width w rounded down, float32(w * 2^-20 * position) for position < 2^20 stays
    below w: the product is at least 8 ulps under w, and rounding moves it half an ulp.
    """
    near = values.float()
    return torch.where(near.double() > values.double(), torch.nextafter(near, torch.zeros_like(near)), near)


class SyntheticDataset:
    """A virtual dataset of `samples` samples; `batch(start, stop)` computes them on demand.

    See the module docstring for the distributions and the determinism guarantee.
    `table_rows[t]` rows and Zipf exponent `zipf[t]` per table, exactly `pooling` ids per
    bag, `num_dense` dense features, and `drift` table lengths of row rotation over the
    dataset.
    """

    def __init__(
        self,
        *,
        table_rows: list[int],
        zipf: list[float],
        num_dense: int,
        pooling: int,
        samples: int,
        seed: int,
        drift: float = 0.0,
        table_names: list[str] | None = None,
    ) -> None:
        _check(table_rows, zipf, num_dense, pooling, samples, drift)
        self.table_rows = list(table_rows)
        self.table_names = list(table_names) if table_names else [f"t{t}" for t in range(len(table_rows))]
        self.zipf = list(zipf)
        self.num_dense = num_dense
        self.pooling = pooling
        self.num_samples = samples
        self.drift = drift
        self._key = _signed(splitmix64_int(seed), 64)
        self._build_id_tables()
        self._build_label_model()

    def _build_id_tables(self) -> None:
        T, P = len(self.table_rows), self.pooling
        tables = [
            _bucket_table(rows, a, _signed(splitmix64_int(self._key + 1 + t), 64))
            for t, (rows, a) in enumerate(zip(self.table_rows, self.zipf))
        ]
        self._start = torch.cat([b.start for b in tables])
        self._width = torch.cat([b.width for b in tables])
        half = 1 << (BUCKET_BITS - 1)  # (word >> FRAC_BITS) is signed: [-half, half)
        self._bucket_base = (torch.arange(T, dtype=torch.int32) * (1 << BUCKET_BITS) + half).view(T, 1, 1)
        self._id_words = self._word_offsets(0, T * P).view(T, 1, P)
        self._rows32 = torch.tensor(self.table_rows, dtype=torch.int32).view(T, 1)
        self._drift_rate = torch.tensor(self.table_rows, dtype=torch.float64).mul_(self.drift / self.num_samples)

    def _build_label_model(self) -> None:
        T, P, D = len(self.table_rows), self.pooling, self.num_dense
        self._tail_words = self._word_offsets(T * P, D + 1).view(1, D + 1)
        keys = [splitmix64_int(self._key - 1 - j) for j in range(T + D)]
        self._effect_mult = torch.tensor([_signed(k | 1, 32) for k in keys[:T]], dtype=torch.int32).view(T, 1, 1)
        signs = torch.tensor([1.0 if k >> 63 else -1.0 for k in keys[T:]], dtype=torch.float64)
        sizes = torch.tensor([0.5 + (k & 0xFFFF) / 0xFFFF for k in keys[T:]], dtype=torch.float64)
        weights = signs * sizes * DENSE_STD / (sizes.norm() * _DENSE_VALUE_STD)
        unit = 2.0**LOGIT_UNIT_BITS
        self._dense_weight = (weights * unit / 2**_DENSE_SCALE_BITS).round().long()
        self._effect_weight = round(SPARSE_GAIN * unit / (255 * math.sqrt(T * P)))
        self._effect_offset = T * P
        # the hot rows' effects add a constant per table; take it out of the bias so that
        # the share of positives does not depend on which rows the seed made hot
        hot_offset = self._effect_weight * P * float(self._mean_effect_bytes().sum())
        self._logit_bias = round(LOGIT_BIAS * unit - hot_offset)
        grid = 1 << SIGMOID_STEP_BITS
        centres = (torch.arange(2 * SIGMOID_RANGE * grid, dtype=torch.float64) + 0.5) / grid - SIGMOID_RANGE
        self._sigmoid = (torch.sigmoid(centres) * 2.0**32).round().long()

    def _mean_effect_bytes(self, probes: int = 64) -> torch.Tensor:
        """float64 [T]: E[2 x + 1] per table under the sampling law (x: a row's effect byte).

        Each bucket has mass 1/4096; its mean is taken over `probes` evenly spaced rows.
        """
        T, K = len(self.table_rows), 1 << BUCKET_BITS
        width = (self._width.double() * 2.0**FRAC_BITS).view(T, K, 1)
        steps = torch.arange(probes, dtype=torch.float64) / probes
        rows = self._start.view(T, K, 1) + (width * steps).int()
        effects = (rows * self._effect_mult) >> 24
        return (2 * effects.double() + 1).mean(dim=(1, 2))

    def _word_offsets(self, first: int, count: int) -> torch.Tensor:
        return torch.tensor(
            [_signed((first + m) * _WORD_STEP, 32) for m in range(count)], dtype=torch.int32
        )

    def batch(self, start: int, stop: int) -> Batch:
        """Samples [start, stop): a pure function of (seed, sample index)."""
        if not 0 <= start <= stop <= self.num_samples:
            raise IndexError(f"batch [{start}, {stop}) is outside the dataset's {self.num_samples} samples")
        return self.take(torch.arange(start, stop, dtype=torch.int64))

    def take(self, index: torch.Tensor) -> Batch:
        """The samples of the given indices (int64, any order), each as `batch` gives it."""
        rows, dense_bytes, label_words = self._draw(index)
        cells = self._sigmoid.shape[0]
        cell = (self._logit(dense_bytes, rows) >> (LOGIT_UNIT_BITS - SIGMOID_STEP_BITS)) + cells // 2
        threshold = self._sigmoid[cell.clamp_(0, cells - 1)]
        return Batch(
            dense=dense_bytes.float().mul_(2.0**-_DENSE_SCALE_BITS),
            lengths=torch.full(rows.shape[:2], self.pooling, dtype=torch.int64),
            values=rows.view(-1).long(),
            labels=((label_words.long() & 0xFFFFFFFF) < threshold).float(),
        )

    def click_probability(self, start: int, stop: int) -> torch.Tensor:
        """float64 [b]: the true P(label = 1) of samples [start, stop), for measuring the Bayes AUC."""
        rows, dense_bytes, _ = self._draw(torch.arange(start, stop, dtype=torch.int64))
        return torch.sigmoid(self._logit(dense_bytes, rows).double() * 2.0**-LOGIT_UNIT_BITS)

    def _draw(self, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Row ids int32 [T, b, P], centred dense bytes int32 [b, D] and label words int32 [b]."""
        if index.numel() and not (0 <= int(index.min()) and int(index.max()) < self.num_samples):
            raise IndexError(f"sample indices outside the dataset's {self.num_samples} samples")
        id_words, tail_words = self._words((splitmix64(index + self._key) >> 32).int())
        rows = self._draw_rows(id_words, index)
        D = self.num_dense
        byte_sums = tail_words[:, :D].contiguous().view(torch.uint8).view(-1, D, 4).sum(-1, dtype=torch.int32)
        return rows, byte_sums.sub_(_DENSE_BYTE_MEAN), tail_words[:, D]

    def _words(self, base: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The hashed words of each sample: int32 [T, b, P] for the ids, [b, D + 1] for the rest."""
        T, P, b = len(self.table_rows), self.pooling, base.shape[0]
        words = torch.empty(T * b * P + b * (self.num_dense + 1), dtype=torch.int32)
        id_words = words[: T * b * P].view(T, b, P)
        tail_words = words[T * b * P :].view(b, self.num_dense + 1)
        torch.add(base.view(1, b, 1), self._id_words, out=id_words)
        torch.add(base.view(b, 1), self._tail_words, out=tail_words)
        lowbias32_(words)  # one pass over both: fewer, larger ops
        return id_words, tail_words

    def _draw_rows(self, words: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """int32 [T, b, P] row ids: inverse CDF through the bucket tables, then drift."""
        bucket = (words >> FRAC_BITS).add_(self._bucket_base).view(-1)
        position = (words & ((1 << FRAC_BITS) - 1)).float()
        offset = position.mul_(self._width.index_select(0, bucket).view(words.shape)).int()
        rows = offset.add_(self._start.index_select(0, bucket).view(words.shape))
        if self.drift:
            rows = self._rotate(rows, index)
        return rows

    def _rotate(self, rows: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """(row + shift) mod rows, with shift = floor(drift * rows * i / samples) mod rows."""
        shift = torch.floor(index.double().view(1, -1) * self._drift_rate.view(-1, 1)).long()
        shift = torch.remainder(shift, self._rows32.long()).int()
        rows -= (self._rows32 - shift).unsqueeze(-1)  # now in [-rows, rows)
        rows += (rows >> 31) & self._rows32.unsqueeze(-1)
        return rows

    def _logit(self, dense_bytes: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """int64 [b] logits in units of 2^-24 (integer sums: exact in any order)."""
        effects = (rows * self._effect_mult) >> 24  # a signed byte x per (table, row): e = (2 x + 1) / 255
        effect_sum = effects.sum(0, dtype=torch.int32).sum(1, dtype=torch.int64)
        logit = (dense_bytes.long() * self._dense_weight).sum(-1)
        logit += (2 * effect_sum + self._effect_offset) * self._effect_weight + self._logit_bias
        return logit


def _check(table_rows: list[int], zipf: list[float], num_dense: int, pooling: int, samples: int,
           drift: float) -> None:
    """Refuse sizes the generator cannot produce, with the offending value."""
    if not table_rows:
        raise ConfigError("the synthetic dataset needs at least one table")
    if min(table_rows) < 1 or max(table_rows) > MAX_ROWS:
        raise ConfigError(f"rows per table must be in [1, {MAX_ROWS}], got {table_rows}")
    if len(zipf) != len(table_rows):
        raise ConfigError(f"zipf takes one exponent per table ({len(table_rows)}), got {len(zipf)}")
    if any(not (math.isfinite(a) and a >= 0) for a in zipf):
        raise ConfigError(f"zipf exponents must be finite and >= 0 (0 = uniform), got {zipf}")
    for name, value in (("num_dense", num_dense), ("pooling", pooling), ("samples", samples)):
        if value < 1:
            raise ConfigError(f"{name} must be positive, got {value}")
    if not math.isfinite(drift):
        raise ConfigError(f"drift must be a finite number of table lengths, got {drift}")

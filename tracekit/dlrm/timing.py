"""Timing code on the process's CPU clock and fitting linear cost models to the timings: the
rank-side calibration's measuring tools (tracekit/dlrm/calibrate.py).

    base_s, with_s, extra_s, noise_s = paired(plain_step, policy_step, repeats=7)
    coefficients, residual_s = fit_nonnegative(x, y)      # y ≈ x·c, every c ≥ 0

The clock is the process's CPU time (all its threads): the wall time of the same work on a core of
its own, which, unlike wall time, does not grow when other processes share the cores.
"""

from __future__ import annotations

import itertools
import math
import statistics
import time
from typing import Callable

import numpy as np


def clock() -> float:
    """The process's CPU time (all its threads), in seconds: every timing's clock."""
    return time.process_time()


def _median_se(values: list[float]) -> tuple[float, float]:
    """Median, and its standard error (1.2533 · σ / √n, σ from the median absolute deviation)."""
    m = statistics.median(values)
    mad = statistics.median(abs(v - m) for v in values)
    return m, 1.2533 * 1.4826 * mad / math.sqrt(len(values))


def paired(first: Callable[[int], None], second: Callable[[int], None], repeats: int, warmup: int = 2):
    """Time `first(i)` and `second(i)` alternately (order swapped each repeat): the median of each,
    and the median and standard error of their differences (second − first)."""
    for i in range(warmup):
        first(i)
        second(i)
    a, b = [], []
    for i in range(repeats):
        for fn, out in ((first, a), (second, b)) if i % 2 == 0 else ((second, b), (first, a)):
            t = clock()
            fn(i)
            out.append(clock() - t)
    diff, noise = _median_se([y - x for x, y in zip(a, b)])
    return statistics.median(a), statistics.median(b), diff, noise


def fit_nonnegative(x: np.ndarray, y: np.ndarray) -> tuple[list[float], float]:
    """Least squares y ≈ x·c with every c ≥ 0 (the best of the fits on each subset of the columns
    whose coefficients are all non-negative), and the residual: √(Σ r² / max(1, n − columns used))."""
    n, p = x.shape
    scale = np.maximum(np.abs(x).max(axis=0), 1e-30)
    xs = x / scale
    best, best_sse = np.zeros(p), float(np.sum(y ** 2))
    for used in itertools.chain.from_iterable(itertools.combinations(range(p), k) for k in range(1, p + 1)):
        cols = list(used)
        c, *_ = np.linalg.lstsq(xs[:, cols], y, rcond=None)
        if np.any(c < 0):
            continue
        sse = float(np.sum((y - xs[:, cols] @ c) ** 2))
        if sse < best_sse - 1e-18:
            best, best_sse = np.zeros(p), sse
            best[cols] = c
    used = int(np.count_nonzero(best))
    return [float(v) for v in best / scale], math.sqrt(best_sse / max(1, n - used))

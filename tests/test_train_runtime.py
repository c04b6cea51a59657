"""The trainer's runtime helpers: the prefetch thread, core pinning, the metrics."""

from __future__ import annotations

import os

import pytest
import torch

from tracekit.dlrm.metrics import log_loss, roc_auc
from tracekit.dlrm.runtime import pin_to_cores
from tracekit.dlrm.schedule import prefetched


def test_prefetched_keeps_order_and_ends() -> None:
    assert list(prefetched(iter(range(50)), depth=2)) == list(range(50))


def test_prefetched_reraises_the_producers_error() -> None:
    def items():
        yield 1
        raise ValueError("bad batch 2")

    got = []
    with pytest.raises(ValueError, match="bad batch 2"):
        for item in prefetched(items(), depth=2):
            got.append(item)
    assert got == [1]


def test_prefetched_stops_its_thread_when_the_consumer_stops() -> None:
    produced = []

    def items():
        for i in range(1000):
            produced.append(i)
            yield i

    for item in prefetched(items(), depth=2):
        if item == 3:
            break
    assert len(produced) < 10


def test_pinning_is_a_no_op_for_one_process_or_too_many_ranks() -> None:
    before = os.sched_getaffinity(0)
    assert pin_to_cores(0, 1) is None
    assert pin_to_cores(0, len(before) + 1) is None
    assert os.sched_getaffinity(0) == before


def test_roc_auc_counts_ties_as_half() -> None:
    assert roc_auc(torch.tensor([0.1, 0.4, 0.35, 0.8]), torch.tensor([0.0, 0.0, 1.0, 1.0])) == 0.75
    assert roc_auc(torch.tensor([0.5, 0.5]), torch.tensor([0.0, 1.0])) == 0.5
    assert log_loss(torch.tensor([0.0]), torch.tensor([1.0])) == pytest.approx(0.693147, abs=1e-6)

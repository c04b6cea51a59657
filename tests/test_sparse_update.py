"""The fused sparse SGD kernel applies exactly what index_add_ of per-id gradients applies."""

from __future__ import annotations

import pytest
import torch

from tests.prerequisites import needs
from tracekit.dlrm import optim


def _reference(weight, ids, lengths, grads, lr):
    expected = weight.clone()
    expected.index_add_(0, ids, grads.repeat_interleave(lengths, dim=0), alpha=-lr)
    return expected


@needs(None if optim._sparse_update is not None else "the C++ sparse-update kernel is not built (make venv builds it)")
@pytest.mark.parametrize("lengths", [[1, 1, 1, 1], [3, 0, 2, 5], [20] * 8, [0, 0, 0]])
def test_fused_kernel_matches_index_add(lengths: list[int]) -> None:
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(50, 16, generator=gen)
    lengths_t = torch.tensor(lengths)
    ids = torch.randint(0, 50, (int(lengths_t.sum()),), generator=gen)  # with repeats
    grads = torch.randn(len(lengths), 16, generator=gen)
    offsets = torch.cumsum(lengths_t, 0) - lengths_t
    expected = _reference(weight, ids, lengths_t, grads, 0.3)
    optim.SparseSGD(0.3).update(weight, ids, grads, lengths_t, offsets)
    torch.testing.assert_close(weight, expected)


def test_python_path_matches_index_add(monkeypatch) -> None:
    monkeypatch.setattr(optim, "_sparse_update", None)
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(30, 8, generator=gen)
    for lengths in ([2, 2, 2], [1, 0, 4]):  # equal bags take the per-position path
        lengths_t = torch.tensor(lengths)
        ids = torch.randint(0, 30, (int(lengths_t.sum()),), generator=gen)
        grads = torch.randn(3, 8, generator=gen)
        expected = _reference(weight, ids, lengths_t, grads, 0.5)
        optim.SparseSGD(0.5).update(weight, ids, grads, lengths_t, torch.cumsum(lengths_t, 0) - lengths_t)
        torch.testing.assert_close(weight, expected)


@needs(None if optim._sparse_update is not None else "the C++ sparse-update kernel is not built (make venv builds it)")
def test_fused_kernel_refuses_out_of_range_ids() -> None:
    weight = torch.zeros(4, 2)
    with pytest.raises(RuntimeError, match="outside the table's 4 rows"):
        optim._sparse_update.sgd_bags(weight, torch.tensor([7]), torch.tensor([0]), torch.ones(1, 2), 1.0)

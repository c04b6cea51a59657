"""Sparse optimizers for embedding rows, applied inside the backward pass.

Only the rows a step looked up are read and written: a table is never touched by a dense
gradient. `SparseSGD` adds the per-lookup gradients straight into the rows (duplicates add
up, as a sum of gradients would). `RowWiseAdagrad` first sums the gradients of each distinct
row, then keeps one accumulator per row (the mean of its squared gradient), as FBGEMM's
row-wise Adagrad does: w -= lr * g / (sqrt(state) + eps), state += mean(g**2).
"""

from __future__ import annotations

import torch

try:  # the fused CPU kernel built by `make venv` (setup.py); without it, plain index_add_
    from tracekit.dlrm import _sparse_update
except ImportError:
    _sparse_update = None


class SparseSGD:
    def __init__(self, lr: float) -> None:
        self.lr = lr

    def update(self, weight: torch.Tensor, ids: torch.Tensor, grads: torch.Tensor,
               bag_lengths: torch.Tensor | None = None, offsets: torch.Tensor | None = None) -> None:
        """Apply the gradient of a lookup to the rows it read; ids may repeat.

        Without `bag_lengths`, `grads[i]` belongs to row `ids[i]`. With them (and the bags'
        `offsets` into `ids`), `grads[k]` is the gradient of pooled bag k and applies to
        each of its `bag_lengths[k]` rows.
        """
        if bag_lengths is not None and use_fused_kernel(weight, grads):
            _sparse_update.sgd_bags(weight, ids, offsets, grads, -self.lr)
            return
        step = grads * -self.lr  # one scaled copy of the small per-bag gradient
        if bag_lengths is not None:
            bags, ids_per_bag = step.shape[0], ids.numel()
            if bags and ids_per_bag % bags == 0 and bool((bag_lengths == ids_per_bag // bags).all()):
                # equal bags: one index_add_ per position, without materialising per-id rows
                for column in ids.view(bags, -1).t():
                    weight.index_add_(0, column, step)
                return
            step = step.repeat_interleave(bag_lengths, dim=0, output_size=ids_per_bag)
        weight.index_add_(0, ids, step)


class RowWiseAdagrad:
    def __init__(self, lr: float, eps: float = 1e-8) -> None:
        self.lr = lr
        self.eps = eps
        self.state: dict[int, torch.Tensor] = {}  # id(weight) -> accumulator [rows]

    def update(self, weight: torch.Tensor, ids: torch.Tensor, grads: torch.Tensor,
               bag_lengths: torch.Tensor | None = None, offsets: torch.Tensor | None = None) -> None:
        """As `SparseSGD.update`; duplicate rows are summed before the accumulator update."""
        if bag_lengths is not None:
            grads = grads.repeat_interleave(bag_lengths, dim=0, output_size=ids.numel())
        acc = self.state.get(id(weight))
        if acc is None:
            acc = self.state[id(weight)] = torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device)
        rows, inverse = torch.unique(ids, return_inverse=True)
        summed = torch.zeros(rows.numel(), weight.shape[1], dtype=grads.dtype, device=grads.device)
        summed.index_add_(0, inverse, grads)
        acc_rows = acc[rows] + summed.pow(2).mean(dim=1)
        acc[rows] = acc_rows
        step = summed / (acc_rows.sqrt() + self.eps).unsqueeze(1)
        weight.index_add_(0, rows, step.to(weight.dtype), alpha=-self.lr)


def use_fused_kernel(weight: torch.Tensor, grads: torch.Tensor) -> bool:
    """The fused kernel serves contiguous float32 CPU tables; CUDA keeps index_add_."""
    return (_sparse_update is not None and weight.device.type == "cpu" and weight.is_contiguous()
            and weight.dtype == grads.dtype == torch.float32)


def sparse_optimizer(name: str, lr: float) -> SparseSGD | RowWiseAdagrad:
    return {"sgd": SparseSGD, "adagrad": RowWiseAdagrad}[name](lr)


def dense_optimizer(name: str, params, lr: float) -> torch.optim.Optimizer:
    """The optimizer of the MLPs: plain SGD, or Adagrad (element-wise) to match --optimizer."""
    if name == "adagrad":
        return torch.optim.Adagrad(params, lr=lr, eps=1e-8)
    return torch.optim.SGD(params, lr=lr)

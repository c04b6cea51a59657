"""The dense part of DLRM: bottom MLP, pairwise dot interaction, top MLP.

A plain `nn.Module` with no distributed code: it takes the dense features and the pooled
embeddings of the local batch, already gathered by `sharding.ShardedEmbeddings`, and
returns one click logit per sample.

    dense [b, n] -> bottom MLP -> x [b, D]
    z = [x, e_0 .. e_{T-1}]  [b, T+1, D]
    dots = z z^T, strictly lower triangle  [b, (T+1)T/2]
    top MLP([x, dots]) -> logit [b]

With `precision="bf16"` the three run under `torch.autocast` in bfloat16 (AMX / AVX512-BF16 on
CPUs, tensor cores on GPUs): the parameters stay fp32 (the master weights the optimizer updates,
cast per use), the pooled embeddings are cast at the interaction's input, and the logits come
back in fp32 for the loss.
"""

from __future__ import annotations

import torch
from torch import nn

COMPUTE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
"""DenseArch's precision -> the dtype its matmuls run in (config.PRECISIONS names the same)."""


def mlp(widths: list[int], *, last_relu: bool) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i, (fan_in, fan_out) in enumerate(zip(widths[:-1], widths[1:])):
        layers.append(nn.Linear(fan_in, fan_out))
        if i < len(widths) - 2 or last_relu:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class _Gram(torch.autograd.Function):
    """z z^T per sample, with a one-bmm backward: d(z z^T) = (G + G^T) z.

    autograd's bmm backward would compute two bmms and add them; for a [512, 9, 64] batch
    that is about 1 ms more per step on one CPU core.
    """

    @staticmethod
    def forward(ctx, z):
        ctx.save_for_backward(z)
        return torch.bmm(z, z.transpose(1, 2))

    @staticmethod
    def backward(ctx, grad):
        (z,) = ctx.saved_tensors
        return torch.bmm(grad + grad.transpose(1, 2), z)


class DenseArch(nn.Module):
    def __init__(self, num_dense: int, bottom_mlp: list[int], top_mlp: list[int], num_tables: int,
                 *, precision: str = "fp32") -> None:
        super().__init__()
        self.compute_dtype = COMPUTE_DTYPES[precision]
        features = num_tables + 1
        self.bottom = mlp([num_dense, *bottom_mlp], last_relu=True)
        self.top = mlp([bottom_mlp[-1] + features * (features - 1) // 2, *top_mlp], last_relu=False)
        rows, cols = torch.tril_indices(features, features, offset=-1)
        self.register_buffer("pairs", rows * features + cols, persistent=False)  # in the flat [F*F] Gram matrix

    def forward(self, dense: torch.Tensor, embedded: torch.Tensor) -> torch.Tensor:
        """dense [b, n], embedded [b, T, D] -> logits [b], fp32 at any precision."""
        if self.compute_dtype == torch.float32:
            return self._logits(dense, embedded)
        # autocast casts each weight once per forward and runs the linears and the bmm in bf16;
        # backward returns fp32 gradients to the fp32 parameters and embeddings
        with torch.autocast(dense.device.type, dtype=self.compute_dtype):
            return self._logits(dense, embedded).float()

    def _logits(self, dense: torch.Tensor, embedded: torch.Tensor) -> torch.Tensor:
        x = self.bottom(dense)
        # the pooled embeddings join x's dtype here (cat would promote x back to fp32); the tables stay fp32
        z = torch.cat([x.unsqueeze(1), embedded.to(x.dtype)], dim=1)
        # index_select on the flat Gram matrix: ~3x faster fwd+bwd on CPU than [:, rows, cols]
        dots = _Gram.apply(z).flatten(1).index_select(1, self.pairs)
        return self.top(torch.cat([x, dots], dim=1)).squeeze(1)

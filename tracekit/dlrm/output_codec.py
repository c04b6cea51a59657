"""Compression of the embedding output all-to-all: quantized rows (TorchRec's qcomms) and DCT-MP's
per-sample top-K (research/papers.md §3 and B.5).

The output dist returns rows [n, D] (one pooled vector per bag, or one looked-up row per
sequence id) to the ranks of their samples, and backward sends their gradients back the same way.
A codec changes what a row costs on the wire, never which rows travel: every row is encoded to the
same number of bytes, so the row splits of the plain exchange still hold, and it is decoded to fp32
on arrival. One all-to-all each way, as without compression.

- `dtype` (train.py `--a2a-dtype`): the values' precision, forward and backward alike. bf16 and
  fp16 are plain casts (2 bytes a value, half of fp32). fp8 is e4m3 with one fp32 scale per row
  (scale = amax / 448, fbgemm's row-wise fp8 layout): D + 4 bytes a row; without the scale the
  gradients (~1e-6) would all round to zero.
- `keep_ratio` (policy.json `compression.mp.keep_ratio`, DCT-MP): each row keeps its
  K = ⌈keep_ratio · D⌉ (at least 1) largest-magnitude values and zeroes the rest, a per-sample,
  data-dependent dropout. Forward sends the K values and their positions; backward sends the
  gradient at those K positions only: the receiver learnt them in forward, the sender kept them, and
  a dropped value has no gradient to return. Positions travel as one uint8 per value (D ≤ 256;
  int16 beyond), or as a D-bit mask per row when that is fewer bytes (K > D / 8).

Bytes per row, D = 16 (`row_bytes`):

    codec                      forward   backward
    fp32 (no codec)                 64         64
    bf16, fp16                      32         32
    fp8                             20         20
    keep 1/16 (K=1), fp32            5          4      4 value + 1 uint8 position
    keep 1/4 (K=4), fp32            18         16      16 value + 2-byte mask
    keep 1/4 (K=4), bf16            10          8

Two ranks, rank 0 returning 3 rows to itself and 1 to rank 1 (row splits [3, 1]), K = 1 at fp32:
the wire is uint8 [4, 5], so the all-to-all's byte splits are [15, 5] where fp32 rows gave [192, 64].
The comms table records exactly these bytes (tags `output_fwd_coded` / `output_bwd_coded`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

import tracekit
from tracekit import tags
from tracekit.dlrm.config import A2A_DTYPES

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3fn value
WIRE_DTYPES = dict(zip(A2A_DTYPES, (torch.float32, torch.bfloat16, torch.float16, FP8)))
"""--a2a-dtype name -> the values' dtype on the wire (fp8 travels as uint8 bytes with its row scales)."""


@dataclass(frozen=True)
class OutputCodec:
    """How the output all-to-all encodes its rows: value precision and DCT-MP keep ratio."""

    dtype: str = "fp32"  # one of A2A_DTYPES
    keep_ratio: float | None = None  # DCT-MP: fraction of each row's values kept; None: all, no positions

    @property
    def identity(self) -> bool:
        """Whether rows cross unchanged: the plain fp32 all-to-all serves them."""
        return self.dtype == "fp32" and self.keep_ratio is None

    def keep(self, dim: int) -> int:
        """K, the values a row keeps: ⌈keep_ratio · dim⌉, at least 1 (dim without DCT-MP)."""
        if self.keep_ratio is None:
            return dim
        return max(1, min(dim, math.ceil(self.keep_ratio * dim - 1e-9)))

    def row_bytes(self, dim: int) -> tuple[int, int]:
        """Bytes one row costs on the wire, forward and backward."""
        values = self._value_bytes(self.keep(dim))
        return values + self._position_bytes(dim), values

    def describe(self, dim: int) -> str:
        forward, backward = self.row_bytes(dim)
        what = self.dtype if self.keep_ratio is None else f"DCT-MP top {self.keep(dim)} of {dim}, {self.dtype} values"
        return f"{what}: {forward} bytes a row forward, {backward} backward (fp32: {4 * dim})"

    def exchange(self, send: torch.Tensor, splits_out: list[int], splits_in: list[int],
                 group: dist.ProcessGroup | None) -> torch.Tensor:
        """The output all-to-all of rows `send` [n, D] (row splits as all_to_all_single takes them),
        compressed both ways; returns the received rows [sum(splits_in), D] in fp32."""
        return _CodedAllToAll.apply(send, self, splits_out, splits_in, group)

    # rows -> wire -> rows -------------------------------------------------------------------

    def encode_forward(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Rows [n, D] -> wire [n, forward bytes or values], and the kept positions [n, K] (None: all)."""
        if self.keep_ratio is None:
            return self._encode_values(rows), None
        positions = rows.abs().topk(self.keep(rows.shape[1]), dim=1, sorted=False).indices.sort(dim=1).values
        values = self._encode_values(rows.gather(1, positions))
        return torch.cat([_bytes(values), self._encode_positions(positions, rows.shape[1])], dim=1), positions

    def decode_forward(self, wire: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Wire [n, ·] -> fp32 rows [n, D] (zeros where a value was dropped), and the positions."""
        if self.keep_ratio is None:
            return self._decode_values(wire, dim), None
        k = self.keep(dim)
        width = self._value_bytes(k)
        values = self._decode_values(_from_bytes(wire[:, :width], self._carrier()), k)
        positions = self._decode_positions(wire[:, width:], k, dim)
        return values.new_zeros(wire.shape[0], dim).scatter_(1, positions, values), positions

    def encode_backward(self, grad: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
        """Gradient rows [n, D] at this rank's received positions -> wire."""
        return self._encode_values(grad if positions is None else grad.gather(1, positions))

    def decode_backward(self, wire: torch.Tensor, positions: torch.Tensor | None, dim: int) -> torch.Tensor:
        """Wire -> fp32 gradient [n, D] of the rows this rank sent (zeros where it dropped values)."""
        if positions is None:
            return self._decode_values(wire, dim)
        values = self._decode_values(wire, positions.shape[1])
        return values.new_zeros(wire.shape[0], dim).scatter_(1, positions, values)

    # values and positions -------------------------------------------------------------------

    def _carrier(self) -> torch.dtype:
        """The dtype values travel in: fp8 rows go as uint8 bytes (with their scale)."""
        return torch.uint8 if self.dtype == "fp8" else WIRE_DTYPES[self.dtype]

    def _value_bytes(self, k: int) -> int:
        if self.dtype == "fp8":
            return k + 4
        return k * WIRE_DTYPES[self.dtype].itemsize

    def _encode_values(self, x: torch.Tensor) -> torch.Tensor:
        dtype = WIRE_DTYPES[self.dtype]
        if self.dtype != "fp8":
            return x.to(dtype).contiguous()
        scale = x.abs().amax(dim=1, keepdim=True).clamp(min=torch.finfo(torch.float32).tiny) / FP8_MAX
        q = (x / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
        return torch.cat([_bytes(q), _bytes(scale)], dim=1)  # scale: fp32, 4 bytes a row

    def _decode_values(self, wire: torch.Tensor, k: int) -> torch.Tensor:
        if self.dtype != "fp8":
            return wire.float()
        return _from_bytes(wire[:, :k], FP8).float() * _from_bytes(wire[:, k:], torch.float32)

    def _position_bytes(self, dim: int) -> int:
        if self.keep_ratio is None:
            return 0
        return min(self.keep(dim) * _index_dtype(dim).itemsize, math.ceil(dim / 8))

    def _mask(self, dim: int) -> bool:
        return self.keep(dim) * _index_dtype(dim).itemsize > math.ceil(dim / 8)

    def _encode_positions(self, positions: torch.Tensor, dim: int) -> torch.Tensor:
        """Sorted positions [n, K] -> uint8 [n, position bytes]: indices, or a little-endian bit mask."""
        if not self._mask(dim):
            return _bytes(positions.to(_index_dtype(dim)))
        n = positions.shape[0]
        bits = torch.zeros(n, math.ceil(dim / 8) * 8, dtype=torch.uint8, device=positions.device)
        bits.scatter_(1, positions, 1)
        weights = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8, device=positions.device)
        return (bits.view(n, bits.shape[1] // 8, 8) * weights).sum(dim=2, dtype=torch.uint8)

    def _decode_positions(self, wire: torch.Tensor, k: int, dim: int) -> torch.Tensor:
        if not self._mask(dim):
            return _from_bytes(wire, _index_dtype(dim)).long()
        shifts = torch.arange(8, dtype=torch.uint8, device=wire.device)
        bits = (wire.unsqueeze(2) >> shifts).bitwise_and(1).view(wire.shape[0], wire.shape[1] * 8)[:, :dim]
        return bits.nonzero()[:, 1].view(wire.shape[0], k)  # row-major: each row's positions ascending


class _CodedAllToAll(torch.autograd.Function):
    """The output all-to-all through a codec: encode, one all_to_all_single of the wire rows, decode;
    backward the same with the gradients, along the reversed splits. The calls are labelled
    tracekit.tags.OUTPUT_FWD_CODED and OUTPUT_BWD_CODED."""

    @staticmethod
    def forward(ctx, send, codec, splits_out, splits_in, group):
        wire, ctx.sent = codec.encode_forward(send)
        recv = wire.new_empty(sum(splits_in), wire.shape[1])
        with tracekit.label(tags.OUTPUT_FWD_CODED):
            dist.all_to_all_single(recv, wire, splits_in, splits_out, group=group)
        out, ctx.received = codec.decode_forward(recv, send.shape[1])
        ctx.codec, ctx.splits_out, ctx.splits_in, ctx.group, ctx.dim = codec, splits_out, splits_in, group, send.shape[1]
        return out

    @staticmethod
    def backward(ctx, grad):
        wire = ctx.codec.encode_backward(grad.contiguous(), ctx.received)
        back = wire.new_empty(sum(ctx.splits_out), wire.shape[1])
        with tracekit.label(tags.OUTPUT_BWD_CODED):
            dist.all_to_all_single(back, wire, ctx.splits_out, ctx.splits_in, group=ctx.group)
        return ctx.codec.decode_backward(back, ctx.sent, ctx.dim), None, None, None, None


def _index_dtype(dim: int) -> torch.dtype:
    return torch.uint8 if dim <= 256 else torch.int16 if dim <= 32768 else torch.int32


def _bytes(x: torch.Tensor) -> torch.Tensor:
    """[n, m] of any dtype -> its bytes, uint8 [n, m · itemsize] (flat views: an empty [0, m] slice
    has strides that a dtype view refuses)."""
    return x.contiguous().reshape(-1).view(torch.uint8).reshape(x.shape[0], x.shape[1] * x.element_size())


def _from_bytes(wire: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """uint8 [n, m] -> dtype [n, m / itemsize]."""
    return wire.contiguous().reshape(-1).view(dtype).reshape(wire.shape[0], wire.shape[1] // dtype.itemsize)

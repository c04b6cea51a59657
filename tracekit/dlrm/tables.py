"""The embedding tables' specs and initial values. A table's rows are drawn in chunks of
_INIT_CHUNK_ROWS rows, each seeded by (seed, table, chunk), so any shard, any replica and any row
start from the same values at any world size and under any sharding.

    spec = TableSpec("t0", rows=1000, dim=16)
    init_shard(spec, 0, 0, 500, seed=0)              # rows [0, 500) of table 0
    init_rows(spec, 0, torch.tensor([7, 3]), seed=0) # rows 7 and 3, as that shard holds them
"""

from __future__ import annotations

import math

import torch

from tracekit.placement import TableSpec

_INIT_CHUNK_ROWS = 1 << 16  # rows per independently seeded init chunk


def _init_chunk(spec: TableSpec, t: int, chunk: int, seed: int) -> torch.Tensor:
    """Rows of init chunk `chunk` of table t, uniform(±sqrt(1/rows)), seeded by (seed, t, chunk)."""
    lo = chunk * _INIT_CHUNK_ROWS
    hi = min(spec.rows, lo + _INIT_CHUNK_ROWS)
    gen = torch.Generator().manual_seed((seed * 1_000_003 + t) * 1_000_003 + chunk)
    bound = math.sqrt(1.0 / spec.rows)
    return torch.empty(hi - lo, spec.dim).uniform_(-bound, bound, generator=gen)


def init_shard(spec: TableSpec, t: int, start: int, stop: int, seed: int) -> torch.Tensor:
    """Rows [start, stop) of table t, the same at any world size."""
    pieces = []
    for chunk in range(start // _INIT_CHUNK_ROWS, math.ceil(stop / _INIT_CHUNK_ROWS)):
        lo = chunk * _INIT_CHUNK_ROWS
        block = _init_chunk(spec, t, chunk, seed)
        pieces.append(block[max(start, lo) - lo : min(stop, lo + block.shape[0]) - lo])
    return torch.cat(pieces) if pieces else torch.empty(0, spec.dim)


def init_rows(spec: TableSpec, t: int, rows: torch.Tensor, seed: int) -> torch.Tensor:
    """Initial values of the given rows of table t (any order): those its shard starts from."""
    out = torch.empty(rows.numel(), spec.dim)
    chunks = torch.div(rows, _INIT_CHUNK_ROWS, rounding_mode="floor")
    for chunk in torch.unique(chunks).tolist():
        where = (chunks == chunk).nonzero().flatten()
        out[where] = _init_chunk(spec, t, chunk, seed)[rows[where] - chunk * _INIT_CHUNK_ROWS]
    return out

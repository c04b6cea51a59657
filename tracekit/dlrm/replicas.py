"""Replicated rows: a copy on every rank (hybrid replication: SCARS, HugeCTR, FlexShard tier 1).

Every rank holds the same copy of the replicated rows of every table, in one [K, D] tensor ordered
by (table, row). A lookup of a replicated row is served from it where the sample is, and leaves the
all-to-all (tracekit/dlrm/sharding.py decides what still travels). After backward, the gradients
of the replica rows are summed over the ranks and every rank applies the same optimizer update,
so the replicas stay identical and equal to what the owner's rows would have become:

    dense_allreduce   one all-reduce of the [K, D] gradient block
    sparse_allreduce  the touched rows only: an all-gather of each rank's count of distinct
                      replicated rows touched, an all-to-all of those ids to the other ranks, then one
                      all-reduce over the union of rows touched this step

Both are labelled `replica_sync`, so a trace tells them from the embedding exchange. Bytes per
step, summed over ranks (ring all-reduce 2(W−1)/W of the buffer per rank): dense 2(W−1)·K·rb;
sparse W(W−1)·8 + (W−1)·8·Σ_r u_r + 2(W−1)·U·rb (u_r rows touched by rank r, U their union),
the figures analyses.exchange replays.
"""

from __future__ import annotations

import itertools

import torch
import torch.distributed as dist

import tracekit
from tracekit import tags
from tracekit.policy import REPLICATION_SYNCS

SYNC_LABEL = tags.REPLICA_SYNC


class _ReplicaLookup(torch.autograd.Function):
    """Rows of the replica block; backward keeps the rows' gradients for the step's sync."""

    @staticmethod
    def forward(ctx, anchor, replicas, index):
        ctx.replicas = replicas
        ctx.save_for_backward(index)
        return replicas.weight.index_select(0, index)

    @staticmethod
    def backward(ctx, grad):
        (index,) = ctx.saved_tensors
        ctx.replicas.pending.append((index, grad))
        return None, None, None


class Replicas:
    """The replica block, the map from (table, row) to its index, and the step's synchronisation."""

    def __init__(self, replicated_rows: list[torch.Tensor], table_rows: list[int], dim: int, optimizer, *,
                 sync: str, init_rows, device: torch.device, group: dist.ProcessGroup | None,
                 label: str = SYNC_LABEL) -> None:
        """`replicated_rows[t]`: table t's rows held here, a copy on every rank of `group` (any order,
        no duplicates); `table_rows[t]`: the whole table's rows; `init_rows(t, rows)` gives their
        initial values, the same the owner's shard starts from. The sync runs over `group` (None: the
        default group) under the tag `label`."""
        if sync not in REPLICATION_SYNCS:
            raise ValueError(f"sync must be one of {REPLICATION_SYNCS}, got {sync!r}")
        self.sync_kind, self.optimizer, self.group, self.device = sync, optimizer, group, device
        self.label = label
        self.table_base = torch.tensor([0, *itertools.accumulate(table_rows)][:-1], dtype=torch.int64, device=device)
        rows = [torch.sort(r.to(torch.int64))[0] for r in replicated_rows]
        self.keys = torch.cat([r.to(device) + self.table_base[t] for t, r in enumerate(rows)])
        self.counts = [r.numel() for r in rows]
        self.rows = rows
        self.weight = torch.cat([init_rows(t, r).reshape(-1, dim) for t, r in enumerate(rows)]).to(device)
        self.pending: list[tuple[torch.Tensor, torch.Tensor]] = []

    @property
    def size(self) -> int:
        return self.keys.numel()

    def find(self, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """For global keys (table base + row): whether each is replicated, and its replica index."""
        if self.size == 0:
            return torch.zeros_like(keys, dtype=torch.bool), torch.zeros_like(keys)
        index = torch.searchsorted(self.keys, keys).clamp_(max=self.size - 1)
        return self.keys[index] == keys, index

    def lookup(self, anchor: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """Rows `index` of the block, joined to autograd through `anchor`."""
        return _ReplicaLookup.apply(anchor, self, index)

    def rows_of(self, t: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Table t's replicated rows (sorted) and their current values."""
        start = sum(self.counts[:t])
        return self.rows[t], self.weight[start:start + self.counts[t]]

    # the step's synchronisation -------------------------------------------------------------

    def synchronise(self) -> None:
        """Sum this step's replica gradients over the ranks and apply the optimizer to them."""
        pending, self.pending = self.pending, []
        if self.size == 0:
            return
        if pending:
            index = torch.cat([i for i, _ in pending])
            grads = torch.cat([g for _, g in pending])
        else:
            index = torch.empty(0, dtype=torch.int64, device=self.device)
            grads = self.weight.new_empty(0, self.weight.shape[1])
        world = dist.get_world_size(self.group) if dist.is_initialized() else 1
        with tracekit.label(self.label):
            if self.sync_kind == "dense_allreduce":
                rows, summed = None, self.weight.new_zeros(self.weight.shape).index_add_(0, index, grads)
                if world > 1:
                    dist.all_reduce(summed, group=self.group)
                self._apply(torch.arange(self.size, device=self.device), summed)
                return
            touched, inverse = torch.unique(index, return_inverse=True)
            local = self.weight.new_zeros(touched.numel(), self.weight.shape[1]).index_add_(0, inverse, grads)
            rows = touched if world == 1 else self._union(touched, world)
            if rows.numel() == 0:
                return
            summed = self.weight.new_zeros(rows.numel(), self.weight.shape[1])
            summed.index_add_(0, torch.searchsorted(rows, touched), local)
            if world > 1:
                dist.all_reduce(summed, group=self.group)
            self._apply(rows, summed)

    def _union(self, touched: torch.Tensor, world: int) -> torch.Tensor:
        """The replica rows any rank touched this step: counts, then ids, to every other rank."""
        counts = torch.empty(world, dtype=torch.int64, device=self.device)
        dist.all_gather_single(counts, torch.tensor([touched.numel()], device=self.device), group=self.group)
        counts = counts.tolist()
        me = dist.get_rank(self.group)
        if sum(counts) == 0:
            return touched
        splits_out = [0 if q == me else touched.numel() for q in range(world)]
        splits_in = [0 if q == me else n for q, n in enumerate(counts)]
        received = touched.new_empty(sum(splits_in))
        dist.all_to_all_single(received, touched.repeat(world - 1), splits_in, splits_out, group=self.group)
        return torch.unique(torch.cat([touched, received]))

    def _apply(self, rows: torch.Tensor, grads: torch.Tensor) -> None:
        self.optimizer.update(self.weight, rows, grads)


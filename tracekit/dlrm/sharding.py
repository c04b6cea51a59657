"""Model-parallel embedding tables: the sharding plan, input dist, lookup and output dist.

The split is TorchRec's (input dist -> lookup -> output dist) without its class hierarchy.
Samples are data-parallel: rank r holds `b_r` samples. Tables are model-parallel, table-wise
(each table lives whole on one rank) or row-wise (each table is cut into one contiguous
block of rows per rank).

One forward pass on rank r, 2 ranks, table-wise, t0 on rank 0 and t1 on rank 1, b = 2:

    input dist 1 (lengths):  rank 0 sends its t1 bag lengths [1, 2] to rank 1, keeps t0's
    input dist 2 (ids):      rank 0 sends its t1 ids [3, 9, 4] to rank 1, keeps t0's
    lookup:                  rank 1 pools t1 for all 4 samples of the global batch
    output dist (pooled):    rank 1 sends rows 0-1 of its pooled t1 [2, D] back to rank 0

Sequence (unpooled) tables send every looked-up row back instead of one pooled row per bag
(FlexShard's traffic); the data-parallel side then sums each sample's rows, so the dense
model sees the same [b, T, D] input either way. Backward mirrors the output dist through
autograd; the owner applies the sparse optimizer to the rows it looked up, inside backward.

With replicated rows (tracekit/dlrm/replicas.py), an id of a replicated row is looked up where
its sample is and never sent. A pooled bag whose ids are all replicated leaves the exchange: its
lengths entry still travels, as -1, so the owner knows not to return a row for it; a mixed bag
sends its other ids, the owner pools them and the sum with the local replicated part is the
bag's. Sequence lookups of replicated rows simply leave. Lengths keep their size, so the exchange
needs no extra collective.

Across nodes, FlexShard's tier 2 (tracekit/dlrm/node_tier.py) takes its ids out of the batch the
same way, after the replicas, and serves them inside the node; what is left goes to the owners.

With a codec (tracekit/dlrm/output_codec.py), the output dist's rows and their gradients cross
quantized (bf16, fp16, fp8) or as DCT-MP's per-sample top-K values and positions; the same rows,
fewer bytes each. World size 1 has no exchange, so nothing to compress.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist
from torch import nn

import tracekit
from tracekit import tags
from tracekit.dlrm.optim import RowWiseAdagrad, SparseSGD
from tracekit.dlrm.output_codec import OutputCodec
from tracekit.dlrm.replicas import Replicas
from tracekit.dlrm.tables import init_shard
from tracekit.placement import ShardingPlan, TableSpec  # noqa: F401 (the trainer's plan, re-exported)


class Tier(Protocol):
    """What the exchange asks of FlexShard's tier 2 across nodes (tracekit/dlrm/node_tier.py's NodeTier,
    which builds on this module): take its ids out of a batch and serve them inside the node, and
    synchronise its node copies after the backward."""

    def serve(self, anchor: torch.Tensor, lengths: torch.Tensor, values: torch.Tensor,
              batch_sizes: list[int]) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor]]: ...

    def synchronise(self) -> None: ...


@dataclass
class Routing:
    """What rank r sends in the input dist, and how to read what comes back in the output dist."""

    lengths: torch.Tensor  # int32, ordered (dest, table on dest, sample)
    values: torch.Tensor  # int64 ids, ordered (dest, table on dest, sample, position)
    lengths_splits: list[int]  # per dest
    values_splits: list[int]  # per dest
    rows_back: list[int]  # embedding rows each owner returns in the output dist
    slots_back: torch.Tensor  # for each returned row: sample * T + table, its slot in [b, T]


class _FusedLookup(torch.autograd.Function):
    """Look rows up with the shard's own module; in backward, update those rows in place.

    `anchor` is a scalar that requires grad, so the output joins the autograd graph even
    though the table's weight does not require grad (it is never given a dense gradient).
    """

    @staticmethod
    def forward(ctx, anchor, module, optimizer, ids, offsets, bag_lengths):
        ctx.module, ctx.optimizer = module, optimizer
        ctx.save_for_backward(ids, bag_lengths, offsets)
        return module(ids) if offsets is None else module(ids, offsets)

    @staticmethod
    def backward(ctx, grad):
        ids, bag_lengths, offsets = ctx.saved_tensors
        ctx.optimizer.update(ctx.module.weight, ids, grad.contiguous(), bag_lengths, offsets)
        return None, None, None, None, None, None


class _AllToAll(torch.autograd.Function):
    """`all_to_all_single` of rows whose backward sends the gradients back the same way.

    Own function rather than torch.distributed.nn.functional's, which is deprecated in
    torch 2.13 in favour of a private module. The calls carry `labels`: (forward, backward).
    """

    @staticmethod
    def forward(ctx, send, splits_out, splits_in, group, labels):
        ctx.splits_out, ctx.splits_in, ctx.group, ctx.labels = splits_out, splits_in, group, labels
        recv = send.new_empty(sum(splits_in), *send.shape[1:])
        with tracekit.label(labels[0]):
            dist.all_to_all_single(recv, send, splits_in, splits_out, group=group)
        return recv

    @staticmethod
    def backward(ctx, grad):
        grad_send = grad.new_empty(sum(ctx.splits_out), *grad.shape[1:])
        with tracekit.label(ctx.labels[1]):
            dist.all_to_all_single(grad_send, grad.contiguous(), ctx.splits_out, ctx.splits_in, group=ctx.group)
        return grad_send, None, None, None, None


def exchange_rows(send: torch.Tensor, splits_out: list[int], splits_in: list[int],
                  group: dist.ProcessGroup | None,
                  labels: tuple[str, str] = (tags.OUTPUT_FWD, tags.OUTPUT_BWD)) -> torch.Tensor:
    """Rows to the ranks of `group` (`splits_out` to each, `splits_in` from each), their gradients
    back in backward, the calls labelled `labels` (forward, backward: the main exchange's output
    dist by default); with no group (one rank) the rows stay."""
    return send if group is None else _AllToAll.apply(send, splits_out, splits_in, group, labels)


class ShardedEmbeddings(nn.Module):
    """This rank's shards, and the collectives that serve every rank's lookups with them.

    A shard is looked up with shard-local ids; `tracekit.shard` tags each with its table and first
    row, so a trace names it by the table and records global rows.
    """

    def __init__(self, plan: ShardingPlan, rank: int, optimizer: SparseSGD | RowWiseAdagrad,
                 *, seed: int, device: torch.device, group: dist.ProcessGroup | None = None,
                 replicas: Replicas | None = None, node_tier: Tier | None = None,
                 codec: OutputCodec | None = None) -> None:
        super().__init__()
        self.plan, self.rank, self.optimizer, self.group = plan, rank, optimizer, group
        self.replicas = replicas
        self.node_tier = node_tier  # tier 2 across nodes (tracekit/dlrm/node_tier.py), or None
        self.codec = codec  # None: rows return as they are (fp32); else quantized or DCT-MP rows
        self.local_tables = plan.tables_on(rank)
        self.row_start = {t: plan.row_range(t, rank)[0] for t in self.local_tables}
        self.shards = nn.ModuleDict()
        for t in self.local_tables:
            spec = plan.tables[t]
            start, stop = plan.row_range(t, rank)
            weight = init_shard(spec, t, start, stop, seed).to(device)
            module = (nn.EmbeddingBag.from_pretrained(weight, mode="sum", freeze=True) if spec.pooled
                      else nn.Embedding.from_pretrained(weight, freeze=True))
            self.shards[spec.name] = tracekit.shard(module, table=spec.name, first_row=start,
                                                      num_rows=spec.rows)  # the whole table's rows
        self.anchor = torch.zeros((), device=device, requires_grad=True)
        self.register_buffer("blocks", torch.tensor([plan.block_rows(t) for t in range(len(plan.tables))],
                                                    device=device), persistent=False)
        self.register_buffer("pooled_mask", torch.tensor([spec.pooled for spec in plan.tables], device=device),
                             persistent=False)

    def forward(self, lengths: torch.Tensor, values: torch.Tensor, batch_sizes: list[int],
                local_only: bool = False) -> torch.Tensor:
        """lengths [T, b], values (table, sample, pos) -> embeddings [b, T, D] of the local batch.

        `batch_sizes[q]` is rank q's local batch this step (known to every rank). `local_only`:
        every rank's batch holds only replicated rows (an FAE hot batch), so nothing is exchanged.
        """
        T, b = lengths.shape
        given, served, parts = lengths, None, []  # parts: (slots, rows) served outside the global exchange
        if self.replicas is not None:
            lengths, values, replicated = self._serve_replicated(lengths, values)
            parts.append(replicated)
        if local_only:
            if not parts or values.numel():
                raise RuntimeError("a local-only batch holds rows that are not replicated")
            out = self.replicas.weight.new_zeros(b * T, self.replicas.weight.shape[1])
            return out.index_add(0, *parts[0]).view(b, T, -1)
        if self.node_tier is not None:
            lengths, values, near = self.node_tier.serve(self.anchor, lengths, values, batch_sizes)
            parts.append(near)
        if parts:  # a pooled bag left with no id is served where its sample is: sent as -1
            served = (lengths > 0) | (given == 0) | ~self.pooled_mask.view(T, 1)
        routing = self._route(lengths, values, served)
        recv_lengths, recv_values = self._input_dist(routing, batch_sizes)
        pooled, rows_out = self._lookup(recv_lengths, recv_values, batch_sizes)
        returned = self._output_dist(pooled, rows_out, routing.rows_back)
        out = torch.zeros(b * T, returned.shape[1], dtype=returned.dtype, device=returned.device)
        out = out.index_add(0, routing.slots_back, returned)
        for slots, rows in parts:
            out = out.index_add(0, slots, rows)
        return out.view(b, T, returned.shape[1])

    @property
    def serves_outside(self) -> bool:
        """Whether some ids are served outside the global exchange (its lengths then hold -1s)."""
        return self.replicas is not None or self.node_tier is not None

    def synchronise(self) -> None:
        """After backward: bring every rank's replica rows (and every node's tier-2 copy) to the
        same updated values."""
        if self.replicas is not None:
            self.replicas.synchronise()
        if self.node_tier is not None:
            self.node_tier.synchronise()

    def table_weights(self) -> dict[str, tuple[int, torch.Tensor]]:
        """Per local table, its first row and its rows' current values (replicated rows included)."""
        out = {}
        for t in self.local_tables:
            spec = self.plan.tables[t]
            weight = self.shards[spec.name].weight
            start, stop = self.plan.row_range(t, self.rank)
            for copies in (self.replicas, self.node_tier):
                rows, values = copies.rows_of(t) if copies is not None else (None, None)
                mine = None if rows is None else (rows >= start) & (rows < stop)
                if mine is not None and bool(mine.any()):
                    weight = weight.clone()
                    weight[rows[mine] - start] = values[mine]
            out[spec.name] = (self.row_start[t], weight)
        return out

    # replicated rows ----------------------------------------------------------------------

    def _serve_replicated(self, lengths: torch.Tensor, values: torch.Tensor):
        """Split the batch: ids of replicated rows looked up in the replicas here, the others left
        for the exchange.

        Returns the lengths [T, b] and ids left, and (slots, rows) of the replicated lookups.
        """
        T, b = lengths.shape
        bag = torch.repeat_interleave(torch.arange(T * b, device=lengths.device), lengths.flatten(),
                                      output_size=values.numel())  # t * b + sample
        table_of = torch.div(bag, b, rounding_mode="floor")
        hit, index = self.replicas.find(values + self.replicas.table_base[table_of])
        where = hit.nonzero().flatten()
        hit_bag, hit_table = bag[where], table_of[where]
        left = lengths - torch.bincount(hit_bag, minlength=T * b).view(T, b)
        slots = (hit_bag - hit_table * b) * T + hit_table
        rows = self.replicas.lookup(self.anchor, index[where])
        return left, values[~hit], (slots, rows)

    # input dist ---------------------------------------------------------------------------

    def _route(self, lengths: torch.Tensor, values: torch.Tensor, served: torch.Tensor | None) -> Routing:
        return route(self.plan, lengths, values, served, self.blocks)

    def _input_dist(self, routing: Routing, batch_sizes: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Two all-to-alls: bag lengths, then ids, each to the rank holding their rows (labelled
        tracekit.tags.INPUT_LENGTHS, INPUT_IDS)."""
        if self.plan.world_size == 1:
            return routing.lengths, routing.values
        mine = len(self.local_tables)
        lengths_in = [mine * bq for bq in batch_sizes]
        recv_lengths = routing.lengths.new_empty(sum(lengths_in))
        with tracekit.label(tags.INPUT_LENGTHS):
            dist.all_to_all_single(recv_lengths, routing.lengths, lengths_in, routing.lengths_splits,
                                   group=self.group)
        values_in = _segment_sums(self._ids_per_bag(recv_lengths), lengths_in)
        recv_values = routing.values.new_empty(sum(values_in))
        with tracekit.label(tags.INPUT_IDS):
            dist.all_to_all_single(recv_values, routing.values, values_in, routing.values_splits, group=self.group)
        return recv_lengths, recv_values

    # lookup -------------------------------------------------------------------------------

    def _lookup(self, recv_lengths: torch.Tensor, recv_values: torch.Tensor,
                batch_sizes: list[int]) -> tuple[list[torch.Tensor], list[list[int]]]:
        """Look up every id this rank received, one call per local table.

        Received data is ordered (source rank, local table, sample, position); each table's
        pieces are joined across source ranks so the table sees the global batch in rank order,
        which `tracekit.sources` declares: the items of the call, bags of a pooled table (those
        sent, not as -1: with replicas or tier 2 a bag's index among them need not be its sample)
        or ids of a sequence table, rows[q] from rank q (the exchange's group is every rank).
        Returns per local table its output rows (ordered source rank, then sample or id) and,
        per source rank, how many of those rows belong to it.
        """
        W, mine = self.plan.world_size, len(self.local_tables)
        lengths_by_src = recv_lengths.split([mine * bq for bq in batch_sizes])
        per_src = [lq.view(mine, -1) for lq in lengths_by_src]
        counts = (torch.stack([self._ids_per_bag(lq).sum(dim=1) for lq in per_src]).tolist() if mine
                  else [[] for _ in range(W)])
        value_pieces = recv_values.split([n for row in counts for n in row])
        if self.serves_outside and mine:  # bags sent as -1 were served where their sample is
            served = torch.stack([lq.ge(0).sum(dim=1) for lq in per_src]).tolist()
        outputs, rows_out = [], []
        for j, t in enumerate(self.local_tables):
            spec = self.plan.tables[t]
            ids = torch.cat([value_pieces[q * mine + j] for q in range(W)])
            if self.row_start[t]:
                ids = ids - self.row_start[t]
            module = self.shards[spec.name]
            rows, offsets, bag_lengths = [counts[q][j] for q in range(W)], None, None  # sequence: ids per source
            if spec.pooled:
                bag_lengths = torch.cat([per_src[q][j] for q in range(W)]).long()
                rows = list(batch_sizes)
                if self.serves_outside:
                    rows = [served[q][j] for q in range(W)]
                    bag_lengths = bag_lengths[bag_lengths >= 0]
                offsets = torch.cumsum(bag_lengths, 0) - bag_lengths
            with tracekit.sources(rows):  # the trace's `src` of each bag or id: rows[q] came from rank q
                outputs.append(_FusedLookup.apply(self.anchor, module, self.optimizer, ids, offsets, bag_lengths))
            rows_out.append(rows)
        return outputs, rows_out

    # output dist --------------------------------------------------------------------------

    def _output_dist(self, outputs: list[torch.Tensor], rows_out: list[list[int]],
                     rows_back: list[int]) -> torch.Tensor:
        """One all-to-all (autograd-aware) returning each source rank its rows, table by table."""
        W = self.plan.world_size
        pieces = [out.split(rows) for out, rows in zip(outputs, rows_out)]
        send = torch.cat([pieces[j][q] for q in range(W) for j in range(len(outputs))])
        if W == 1:
            return send
        splits_out = [sum(rows[q] for rows in rows_out) for q in range(W)]
        if self.codec is not None:
            return self.codec.exchange(send, splits_out, rows_back, self.group)
        return exchange_rows(send, splits_out, rows_back, self.group)


    def _ids_per_bag(self, lengths: torch.Tensor) -> torch.Tensor:
        """Received bag lengths as id counts: a bag sent as -1 holds none."""
        return lengths.clamp(min=0) if self.serves_outside else lengths


def route(plan: ShardingPlan, lengths: torch.Tensor, values: torch.Tensor, served: torch.Tensor | None = None,
          blocks: torch.Tensor | None = None) -> Routing:
    """Order a rank's ids (lengths [T, b], values) by destination rank under `plan`, and note where
    returned rows belong. The trainer's routing; it needs no process group, so `tracekit simulate`'s
    bytes are tested against it offline (tests/test_simulate.py).

    A returned row's slot is `sample * T + table` in the [b, T, D] output. `served` [T, b]
    (None: all) says which pooled bags the owners pool and return; the others are sent as -1.
    """
    T, b = lengths.shape
    W = plan.world_size
    per_value_slots = plan.kind == "row" or any(not spec.pooled for spec in plan.tables)
    slots = None
    if per_value_slots:
        bag = torch.repeat_interleave(torch.arange(T * b, device=lengths.device), lengths.flatten(),
                                      output_size=values.numel())  # t * b + sample
        table_of = torch.div(bag, b, rounding_mode="floor")
        slots = (bag - table_of * b) * T + table_of
    if plan.kind == "table":
        per_table = lengths.sum(dim=1).tolist()
        starts = [0]
        for n in per_table:
            starts.append(starts[-1] + n)
        order = [t for q in range(W) for t in plan.tables_on(q)]
        if order == list(range(T)):
            send_values, send_slots = values, slots
        else:
            send_values = torch.cat([values[starts[t]:starts[t + 1]] for t in order])
            if slots is not None:
                send_slots = torch.cat([slots[starts[t]:starts[t + 1]] for t in order])
        send_lengths = (lengths if served is None else torch.where(served, lengths, -1))[order].flatten()
        counts = [[per_table[t] if plan.owners[t] == q else 0 for t in range(T)] for q in range(W)]
    else:
        if blocks is None:
            blocks = torch.tensor([plan.block_rows(t) for t in range(T)], device=lengths.device)
        dest = torch.div(values, blocks[table_of], rounding_mode="floor")
        perm = torch.argsort(dest * T + table_of, stable=True)
        send_values, send_slots = values[perm], slots[perm]
        send_lengths = torch.bincount(dest * (T * b) + bag, minlength=W * T * b)
        counts = send_lengths.view(W, T, b).sum(dim=2).tolist()
        if served is not None:
            send_lengths.view(W, T * b)[:, ~served.flatten()] = -1

    grid = torch.arange(b, device=lengths.device) * T + torch.arange(T, device=lengths.device).view(T, 1)
    if served is None:  # a pooled table's returned rows go to slots sample * T + t
        kept, pooled_slots = [b] * T, grid
    else:
        kept = served.sum(dim=1).tolist()
        pooled_slots = grid[served].split(kept)
    lengths_splits, values_splits, rows_back, slots_back = [], [], [], []
    offset = 0
    for q in range(W):
        tables = plan.tables_on(q)
        lengths_splits.append(len(tables) * b)
        values_splits.append(sum(counts[q][t] for t in tables))
        rows = 0
        for t in tables:
            n = counts[q][t]
            if plan.tables[t].pooled:
                slots_back.append(pooled_slots[t])
                rows += kept[t]
            else:
                slots_back.append(send_slots[offset:offset + n])
                rows += n
            offset += n
        rows_back.append(rows)
    return Routing(send_lengths.to(torch.int32), send_values, lengths_splits, values_splits,
                   rows_back, torch.cat(slots_back))


def _segment_sums(values: torch.Tensor, sizes: list[int]) -> list[int]:
    return [int(piece.sum()) for piece in values.split(sizes)]

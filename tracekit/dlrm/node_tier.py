"""FlexShard's per-node tier (tier 2) across nodes: one copy of the tier-2 rows on every node,
sharded over the node's ranks, so a tier-2 lookup never leaves its node.

Topology N nodes × G ranks (global rank r on node r // G, local index r % G, as torchrun numbers
them). A tier-2 row x of table t whose recorded owner is o (tracekit/dlrm/sharding.py: the table's
rank, or the row's block) has its node copy on local index o mod G of every node: node n's rank
n·G + o mod G holds it (on o's own node that is o itself). Per step, a sample's ids split three ways:

    tier 1  (tracekit/dlrm/replicas.py)  replicated rows: looked up where the sample is
    tier 2  (here)                       to the node's rank holding the row's copy, over the node's group
    tier 3                               to the recorded owner, in the global exchange

so a pooled bag can be served in three parts, summed where the sample is; a bag left with no tier-3
id is sent as -1 in the global exchange (sharding.py), exactly as a bag of replicated rows is.

The tier-2 exchange, on the node's group (G ranks, group rank = local index), from source q to the
node's rank d (self included), with served2(j) the tables (in table order) of which local index j
holds a tier-2 row, b_q q's batch and rb = dim · 4:

    tier2_input_dist  lengths  4 · |served2(d mod G)| · b_q    one int32 per (table, sample), zeros too
                      ids      8 · n_qd                        n_qd: q's tier-2 ids whose copy is on d
    tier2_output_fwd  d -> q   rb · units_qd                   units: a pooled bag of q with a tier-2 id
                                                               on d, or one sequence lookup
    tier2_output_bwd  q -> d   the same as tier2_output_fwd

Ids go in (dest, table, sample, position) order; rows come back in the same order, one per unit.
With G = 1 every node is one rank: the rows are served in place and the exchange has no calls.

Gradients: the exchange's backward brings each copy the gradients of its node's lookups; after
backward `synchronise` sums them over the N copies of the same rows (the group of local index p:
ranks p, G + p, ..., one per node) with replicas.py's all-reduce, dense or sparse (`tier2_sync`),
labelled `tier2_sync`, and every copy applies the same optimizer update. So every copy equals what
the owner's row would have become, and the run computes what the run without tiers computes.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import tracekit
from tracekit import tags
from tracekit.dlrm.replicas import Replicas
from tracekit.dlrm.sharding import ShardingPlan, exchange_rows


def node_groups(world_size: int, per_node: int) -> tuple[dist.ProcessGroup | None, dist.ProcessGroup | None]:
    """This rank's node group (its node's G ranks; None for G = 1) and column group (the ranks of
    its local index on every node). Every rank creates every group, in the same order."""
    rank, nodes = dist.get_rank(), world_size // per_node
    node = column = None
    if per_node > 1:
        for n in range(nodes):
            group = dist.new_group(list(range(n * per_node, (n + 1) * per_node)))
            if n == rank // per_node:
                node = group
    for p in range(per_node):
        group = dist.new_group([n * per_node + p for n in range(nodes)])
        if p == rank % per_node:
            column = group
    return node, column


class NodeTier:
    """This rank's share of its node's tier-2 copy, and the exchange that serves the node's lookups."""

    def __init__(self, plan: ShardingPlan, rank: int, per_node: int, tier2_rows: list[torch.Tensor], optimizer, *,
                 sync: str, init_rows, device: torch.device, node_group: dist.ProcessGroup | None,
                 column_group: dist.ProcessGroup | None) -> None:
        self.plan, self.per_node, self.local = plan, per_node, rank % per_node
        self.node_first = rank - self.local
        self.node_group = node_group
        rows = [torch.sort(r.to(torch.int64))[0] for r in tier2_rows]
        # the local index holding each tier-2 row's node copy: its recorded owner's, mod G
        where = [self._owner(t, r) % per_node for t, r in enumerate(rows)]
        self.served = [[t for t in range(len(rows)) if bool((where[t] == j).any())] for j in range(per_node)]
        self.store = Replicas([r[w == self.local] for r, w in zip(rows, where)], [t.rows for t in plan.tables],
                              plan.tables[0].dim, optimizer, sync=sync, init_rows=init_rows, device=device,
                              group=column_group, label=tags.TIER2_SYNC)
        self.keys_base = self.store.table_base
        self.keys = torch.cat([r.to(device) + self.keys_base[t] for t, r in enumerate(rows)])
        self.holder = torch.cat(where).to(device)
        self.pooled = torch.tensor([t.pooled for t in plan.tables], device=device)

    def _owner(self, t: int, rows: torch.Tensor) -> torch.Tensor:
        """The recorded owner rank of each of table t's `rows`."""
        if self.plan.kind == "table":
            return torch.full_like(rows, self.plan.owners[t])
        return torch.div(rows, self.plan.block_rows(t), rounding_mode="floor")

    def serve(self, anchor: torch.Tensor, lengths: torch.Tensor, values: torch.Tensor,
              batch_sizes: list[int]) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """Take the tier-2 ids out of a batch (lengths [T, b], ids in (table, sample, position) order)
        and serve them inside the node. Returns the lengths and ids left for the global exchange and
        (slots, rows): the tier-2 units' rows and their slots sample * T + table in [b, T]."""
        T, b = lengths.shape
        bag = torch.repeat_interleave(torch.arange(T * b, device=lengths.device), lengths.flatten(),
                                      output_size=values.numel())  # t * b + sample
        table_of = torch.div(bag, b, rounding_mode="floor")
        keys = values + self.keys_base[table_of]
        index = torch.searchsorted(self.keys, keys).clamp_(max=max(self.keys.numel() - 1, 0))
        hit = self.keys[index] == keys if self.keys.numel() else torch.zeros_like(keys, dtype=torch.bool)
        where = hit.nonzero().flatten()
        dest, t2_bag, t2_ids = self.holder[index[where]], bag[where], values[where]
        left = lengths - torch.bincount(t2_bag, minlength=T * b).view(T, b)

        # what this rank sends each local index j: lengths of served2(j) x b, then ids (dest, table, sample, pos)
        counts = torch.bincount(dest * (T * b) + t2_bag, minlength=self.per_node * T * b).view(self.per_node, T, b)
        send_lengths = torch.cat([counts[j, self.served[j]].flatten() for j in range(self.per_node)]).to(torch.int32)
        key = dest * (T * b) + t2_bag
        order = torch.argsort(key, stable=True)
        send_ids, send_bag = t2_ids[order], t2_bag[order]
        sent_per_dest = torch.bincount(dest, minlength=self.per_node).tolist()
        # the units whose rows come back: a pooled bag's first id (per destination), or every sequence id
        send_table = torch.div(send_bag, b, rounding_mode="floor")
        starts = _unit_starts(key[order], self.pooled[send_table])
        slots_back = ((send_bag - send_table * b) * T + send_table)[starts]
        units_back = [int(s.sum()) for s in starts.split(sent_per_dest)]

        recv_lengths, recv_ids, sizes = self._input(send_lengths, send_ids, sent_per_dest, batch_sizes)
        rows, units_out = self._lookup(anchor, recv_lengths, recv_ids, sizes)
        returned = exchange_rows(rows, units_out, units_back, self.node_group,
                                 labels=(tags.TIER2_OUTPUT_FWD, tags.TIER2_OUTPUT_BWD))
        return left, values[~hit], (slots_back, returned)

    def _input(self, send_lengths, send_ids, sent_per_dest, batch_sizes):
        """The node's lengths and ids for this rank's copy; and per source (local index) its batch."""
        sizes = batch_sizes[self.node_first:self.node_first + self.per_node]
        if self.node_group is None:
            return send_lengths, send_ids, sizes
        mine = len(self.served[self.local])
        lengths_in = [mine * bq for bq in sizes]
        lengths_out = [len(self.served[j]) * sizes[self.local] for j in range(self.per_node)]
        with tracekit.label(tags.TIER2_INPUT):
            recv_lengths = send_lengths.new_empty(sum(lengths_in))
            dist.all_to_all_single(recv_lengths, send_lengths, lengths_in, lengths_out, group=self.node_group)
            ids_in = [int(piece.sum()) for piece in recv_lengths.split(lengths_in)]
            recv_ids = send_ids.new_empty(sum(ids_in))
            dist.all_to_all_single(recv_ids, send_ids, ids_in, sent_per_dest, group=self.node_group)
        return recv_lengths, recv_ids, sizes

    def _lookup(self, anchor, recv_lengths, recv_ids, sizes) -> tuple[torch.Tensor, list[int]]:
        """The rows of the received ids, one per unit, in the order they arrived; units per source."""
        tables = torch.tensor(self.served[self.local], dtype=torch.int64, device=recv_ids.device)
        # each received id's source and table: lengths arrive (source, table, sample)
        per_bag_table = torch.cat([tables.repeat_interleave(bq) for bq in sizes]) if tables.numel() else tables
        per_bag_source = torch.cat([torch.full((tables.numel() * bq,), q, device=recv_ids.device)
                                    for q, bq in enumerate(sizes)])
        bag_of = torch.repeat_interleave(torch.arange(recv_lengths.numel(), device=recv_ids.device),
                                         recv_lengths.long(), output_size=recv_ids.numel())
        table_of = per_bag_table[bag_of]
        found, index = self.store.find(recv_ids + self.keys_base[table_of])
        if not bool(found.all()):
            raise RuntimeError("a tier-2 id arrived at a rank that holds no copy of its row")
        starts = _unit_starts(bag_of, self.pooled[table_of])
        unit = torch.cumsum(starts.long(), 0) - 1
        looked = self.store.lookup(anchor, index)
        rows = looked.new_zeros(int(starts.sum()), looked.shape[1]).index_add(0, unit, looked)
        units_out = torch.bincount(per_bag_source[bag_of][starts], minlength=len(sizes)).tolist()
        return rows, units_out

    def synchronise(self) -> None:
        """Sum the copies' gradients over the nodes and apply them (module docstring)."""
        self.store.synchronise()

    def rows_of(self, t: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Table t's tier-2 rows held here (sorted) and their current values."""
        return self.store.rows_of(t)


def _unit_starts(bag: torch.Tensor, pooled: torch.Tensor) -> torch.Tensor:
    """For ids grouped by bag: whether each starts a unit (a pooled bag's first id, any sequence id)."""
    first = torch.ones_like(bag, dtype=torch.bool)
    if bag.numel() > 1:
        first[1:] = bag[1:] != bag[:-1]
    return first | ~pooled

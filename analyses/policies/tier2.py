"""FlexShard's per-node tier (tier 2) across nodes, replayed per id as the reference trainer serves
it (tracekit/dlrm/node_tier.py): its exchange inside each node, its sync across the node copies and
the memory a rank gives it, for tier 1 = the first K1 rows of an order and tier 2 = the next K2.

Topology N nodes × G ranks (rank r on node r // G, local index r % G). A tier-2 row whose recorded
owner is o (the manifest's shards: the table's rank, or the row's block) has its copy on local index
o mod G of every node, so a tier-2 id of source q goes to d = node(q)·G + o mod G. Per sampled step,
summed over ranks (bytes_out, self included; remote: d ≠ q, all of it inside a node):

    tier2_input_lengths  len_bytes · |served2(d mod G)| · b_q   per (q, d) of a node, zeros too
    tier2_input_ids      id_bytes per tier-2 id
    tier2_output_fwd     rb per unit: a pooled (table, sample) bag of q with ≥ 1 tier-2 id whose copy
                         is on d (a row-wise bag may make one unit per d), or one sequence lookup
    tier2_output_bwd     the same as tier2_output_fwd

served2(j): the tables with a tier-2 row whose owner o has o mod G == j. With G = 1 the rows are
served in place and the exchange has no calls (zero bytes).

Sync: the N ranks {n·G + p} hold the same block p (the tier-2 rows with o mod G == p) and run
tracekit/dlrm/replicas.py's sync among themselves (group size N), a block with no row not at all:

    dense   2(N−1) · Σ_{i ∈ block p} rb_i
    sparse  N(N−1) · 8  +  (N−1) · id_bytes · Σ_n u_{n,p}  +  2(N−1) · Σ_{i ∈ U_p} rb_i

u_{n,p}: the rows of block p that node n's samples looked up that step, U_p their union. Per row,
`steps` (steps touching it: Σ over U) is the order's (analyses.policies.replication: over every
step's accesses where recorded, in units of the sampled steps) and its node-steps (Σ over u) that
times its sampled node-steps per sampled step touching it (1 where the sampled lookups never saw
it), so both are exact where every step's lookups were recorded. Memory per rank: Σ rb of the
largest block (a rank holds one block).

    t2 = replay(ctx, "tk_order_replication", nodes, per_node)
    t2.exchange(k1, k1 + k2)     # per collective: (bytes_out, remote) per step
    t2.sync(k1, k1 + k2)         # {"dense_allreduce": bytes, "sparse_allreduce": bytes} per step
    t2.memory(k1, k1 + k2), t2.fit(k1, room)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import polars as pl

from analyses import exchange
from analyses.context import Context

COLLECTIVES = ("tier2_input_lengths", "tier2_input_ids", "tier2_output_fwd", "tier2_output_bwd")


@dataclass
class Tier2Replay:
    """The sampled lookups and the order's rows, as arrays the (K1, K2) figures are read from."""

    nodes: int
    per_node: int
    len_bytes: int
    id_bytes: int
    steps: int  # sampled steps
    pos: np.ndarray  # per lookup, grouped by unit: its row's position in the order (n outside it)
    remote: np.ndarray  # per lookup: its copy is on another rank than its source
    starts: np.ndarray  # per unit: the index of its first lookup
    unit_rb: np.ndarray
    unit_remote: np.ndarray
    block_rb: np.ndarray  # (G, n + 1): Σ rb of block p's rows among the first K of the order
    block_rows: np.ndarray  # (G, n + 1): their count
    rb_steps: np.ndarray  # (n + 1): Σ rb · steps touching the row, first K rows
    node_steps: np.ndarray  # (n + 1): Σ (step, node) pairs touching the row, first K rows
    table_positions: dict[tuple[int, int], np.ndarray]  # (tid, block) -> its rows' positions, sorted
    samples: np.ndarray  # per local index j: Σ b over the sampled steps of the ranks with index j

    def tier2(self, k1: int, k12: int) -> np.ndarray:
        """Per lookup: its row is in tier 2."""
        return (self.pos >= k1) & (self.pos < k12)

    def exchange(self, k1: int, k12: int) -> dict[str, tuple[float, float]]:
        """Per collective of the tier-2 exchange: (bytes_out, remote) per step (module docstring)."""
        if self.per_node == 1 or k12 <= k1:
            return {c: (0.0, 0.0) for c in COLLECTIVES}
        hit = self.tier2(k1, k12)
        units = (np.add.reduceat(hit.astype(np.int64), self.starts) > 0) if len(self.starts) else hit[:0]
        served = np.zeros(self.per_node)
        for (_, j), positions in self.table_positions.items():
            i = int(np.searchsorted(positions, k1))
            served[j] += i < len(positions) and positions[i] < k12
        lengths_out = self.len_bytes * float(served.sum() * self.samples.sum())
        lengths_self = self.len_bytes * float(served @ self.samples)
        rows = float(self.unit_rb[units].sum()), float(self.unit_rb[units & self.unit_remote].sum())
        per = {"tier2_input_lengths": (lengths_out, lengths_out - lengths_self),
               "tier2_input_ids": (self.id_bytes * float(hit.sum()), self.id_bytes * float((hit & self.remote).sum())),
               "tier2_output_fwd": rows, "tier2_output_bwd": rows}
        steps = max(self.steps, 1)
        return {c: (out / steps, rem / steps) for c, (out, rem) in per.items()}

    def sync(self, k1: int, k12: int) -> dict[str, float]:
        """Bytes per step of the node copies' sync, dense and sparse, summed over the column
        groups (module docstring); 0 without tier-2 rows."""
        n1 = self.nodes - 1
        if k12 <= k1 or n1 == 0:
            return {"dense_allreduce": 0.0, "sparse_allreduce": 0.0}
        blocks = int(((self.block_rows[:, k12] - self.block_rows[:, k1]) > 0).sum())
        rb = float((self.block_rb[:, k12] - self.block_rb[:, k1]).sum())
        touched = (n1 * self.id_bytes * (self.node_steps[k12] - self.node_steps[k1])
                   + 2 * n1 * (self.rb_steps[k12] - self.rb_steps[k1])) / max(self.steps, 1)
        return {"dense_allreduce": 2 * n1 * rb,
                "sparse_allreduce": self.nodes * n1 * exchange.COUNT_BYTES * blocks + float(touched)}

    def memory(self, k1: int, k12: int) -> float:
        """Tier-2 bytes a rank holds: its block's, the largest."""
        return float((self.block_rb[:, k12] - self.block_rb[:, k1]).max())

    def fit(self, k1: int, room: float) -> int:
        """The largest K1 + K2 whose tier-2 blocks each hold at most `room` bytes."""
        limits = [np.searchsorted(c, c[k1] + room, side="right") - 1 for c in self.block_rb]
        return max(int(min(limits)), k1)


def replay(ctx: Context, order: str, nodes: int, per_node: int) -> Tier2Replay:
    """The tier-2 replay of the order table `order` (tid, row, rb, steps, pos: analyses.policies.
    replication's) on `nodes` × `per_node` ranks; once per (context, order, topology) (ctx.memo)."""
    return ctx.memo((replay, order, nodes, per_node), lambda: _replay(ctx, order, nodes, per_node))


def _replay(ctx: Context, order: str, nodes: int, per_node: int) -> Tier2Replay:
    s = exchange.baseline(ctx)
    a, x = s.attribution.tables, s.tables.x
    g = per_node
    n = ctx.sql(f"SELECT count(*) FROM {order}").fetchall()[0][0]
    # units: a pooled bag's ids whose copies sit on one local index; each sequence lookup alone
    lookups = ctx.frame(f"""
        SELECT coalesce(o.pos, {n}) AS pos, l.src % {g} <> l.owner % {g} AS remote, m.rb,
               CASE WHEN l.seq THEN -1 - row_number() OVER () ELSE l.bag * {g} + l.owner % {g} END AS unit
        FROM {x} l JOIN {a.names} m USING (tid) LEFT JOIN {order} o USING (tid, "row")
        ORDER BY unit""")
    unit = lookups["unit"].to_numpy()
    starts = np.flatnonzero(np.concatenate([[True], unit[1:] != unit[:-1]])) if len(unit) else np.zeros(0, np.int64)
    remote = lookups["remote"].to_numpy().astype(bool)
    rb = lookups["rb"].to_numpy().astype(np.float64)
    rows = _order_rows(ctx, order, nodes, g)
    block = rows["block"].to_numpy().astype(np.int64)
    row_rb = rows["rb"].to_numpy().astype(np.float64)
    block_rb, block_rows = np.zeros((g, n + 1)), np.zeros((g, n + 1))
    for p in range(g):
        mine = block == p
        block_rb[p, 1:], block_rows[p, 1:] = np.cumsum(row_rb * mine), np.cumsum(mine)
    zero = np.zeros(1)
    rb_steps = np.concatenate([zero, np.cumsum(row_rb * rows["steps"].to_numpy())])
    node_steps = np.concatenate([zero, np.cumsum(rows["node_steps"].to_numpy())])
    key = rows["tid"].to_numpy().astype(np.int64) * g + block
    table_positions = {(int(k) // g, int(k) % g): np.flatnonzero(key == k) for k in np.unique(key)}
    found = dict(ctx.sql(f"""SELECT b.src % {g}, sum(b.b)::DOUBLE FROM {a.batches} b JOIN {a.steps} USING (step)
                             GROUP BY ALL""").fetchall())
    samples = np.array([found.get(j, 0.0) for j in range(g)])
    return Tier2Replay(nodes, g, s.len_bytes, s.id_bytes, s.sampled_steps, lookups["pos"].to_numpy(), remote,
                       starts, rb[starts], remote[starts], block_rb, block_rows, rb_steps, node_steps,
                       table_positions, samples)


def _order_rows(ctx: Context, order: str, nodes: int, g: int) -> pl.DataFrame:
    """Per row of the order, by position: tid, rb, steps, node_steps (module docstring) and block,
    the local index of its copy (its recorded owner mod G, from the manifest's shards)."""
    ranges = pl.DataFrame([{"tid": i, "rank": sh.rank, "first_row": sh.first_row, "num_rows": sh.num_rows}
                           for i, t in enumerate(ctx.model.tables) for sh in t.shards],
                          schema={"tid": pl.Int32, "rank": pl.Int64, "first_row": pl.Int64, "num_rows": pl.Int64})
    ctx.con.register("tk_shard_ranges", ranges)
    return ctx.frame(f"""
        WITH sampled AS (SELECT tid, "row", count(DISTINCT step)::DOUBLE AS steps,
                                count(DISTINCT step * {nodes} + src // {g})::DOUBLE AS node_steps
                         FROM {exchange.baseline(ctx).tables.x} GROUP BY ALL),
             owner AS (SELECT o.pos, min(r.rank) AS rank FROM {order} o JOIN tk_shard_ranges r
                       ON r.tid = o.tid AND o."row" >= r.first_row AND o."row" < r.first_row + r.num_rows
                       GROUP BY o.pos)
        SELECT o.pos, o.tid, o.rb, o.steps::DOUBLE AS steps,
               CASE WHEN x.steps IS NULL THEN o.steps WHEN o.steps = x.steps THEN x.node_steps
                    ELSE o.steps * x.node_steps / x.steps END AS node_steps,
               coalesce(w.rank, 0) % {g} AS block
        FROM {order} o LEFT JOIN sampled x USING (tid, "row") LEFT JOIN owner w USING (pos)
        ORDER BY o.pos""")

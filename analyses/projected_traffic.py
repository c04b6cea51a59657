"""A step's Traffic (analyses.step_traffic) projected: under a policy section's predicted exchange and
sync, with DCT's compression, and onto another world size and batch (`tracekit simulate`,
analyses.simulate).

Policies: the sections of a policy file that predict the exchange (replication, tiers, schedule).
Tiers across nodes (analyses.policies.tiers): the main exchange loses the tier-1 and tier-2 rows as
replication's does; the tier-2 exchange (its predicted bytes, own and remote) is spread evenly over
the rank pairs within each node; tier 1 syncs over every rank; the node copies' sync crosses only
between nodes (dense: a ring of the nodes over one node's tier-2 bytes; sparse: its wire bytes
evenly between the nodes). Scaled to another world, the tier-2 exchange keeps its bytes per sample
within the target's nodes ((R−1)/R of them between ranks) and the node sync is the dense ring.
Where the run has lookups and the section lists the rows it replicates (replication; tiers on one
node, whose tier 1 is replication), the bytes each pair of ranks no longer exchanges are replayed
from the recorded lookups as the trainer serves them (replicated_pairs: a hot id leaves the input
all-to-all; a pooled bag whose ids are all hot, or a hot sequence lookup, leaves the output
all-to-all forward and backward), so the exchange keeps its true shape after the hot rows leave;
otherwise (the FAE schedule, or no lookups) the embedding exchange scales by the policy's predicted
remote bytes over the recorded ones (self splits by the bytes_out ratio), every tag alike; the sync adds a ring of Σ rb (dense) or its predicted wire bytes over three
collectives (sparse: count all-gather, ids all-to-all, all-reduce over the union).
DCT's compression: compression.mp scales every floating-point all-to-all (the embedding outputs
and their gradients) by its predicted ratio; compression.dp takes DDP's gradient all-reduces out
of the ring and sends its predicted bytes as all-gathers instead, two per bucket (the counts, then
the entries).

At another world size W' or per-device batch b' (`scaled`) each collective keeps its bytes per sample,
spread evenly over the W'·W' rank pairs (balanced sharding assumed), all-reduces keep their size (the
model's), a policy keeps its share of the remote exchange, and its sync is the dense one, a ring of its
replicas.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import polars as pl

from analyses import exchange, roles
from analyses.context import Context
from analyses.policies.tiers import TIER1_BYTES, TIER2_BYTES, TIER2_EXCHANGE_BYTES, TIER2_EXCHANGE_REMOTE, TIER2_SYNC_BYTES
from analyses.step_traffic import Traffic
from tracekit.figures import A2A_BYTES, A2A_REMOTE_BYTES, DP_BYTES, SYNC_BYTES
from tracekit.policy import row_path
from tracekit.tags import SYNC_TAGS, TIER2_INPUT
from tracekit.topology import Topology

SPARSE_SYNC_CALLS = 3
TIER2_TAG = TIER2_INPUT  # the tier-2 exchange's bytes, its three tags as one


def with_policy(base: Traffic, section: dict, freed: dict[str, np.ndarray] | None = None) -> Traffic:
    """`base` (the recorded world and batch) under a policy section's predicted exchange and sync;
    `freed`: the bytes per step, by exchange part (analyses.roles.part) and rank pair, its replicas
    take out of the exchange."""
    predicted = section.get("predicted") or {}
    nodes = int((section.get("topology") or {}).get("nodes", 1))
    if nodes > 1:  # tiers across nodes: the main exchange as replication's, plus tier 2's
        return _with_tiers(base, section, nodes, freed)
    sync = float(predicted.get(SYNC_BYTES) or 0.0)
    replicas = float(predicted.get("replica_bytes_per_rank") or predicted.get(TIER1_BYTES) or 0.0)
    kind = section.get("sync") or section.get("tier1_sync") or "sparse_allreduce"
    exchange = (_scaled_exchange(base, predicted.get(A2A_BYTES), predicted.get(A2A_REMOTE_BYTES)) if freed is None
                else {tag: np.maximum(m - freed.get(tag, 0.0), 0.0) for tag, m in base.exchange.items()})
    return _with_sync(replace(base, exchange=exchange, replica_bytes=replicas), sync, kind)


def _scaled_exchange(base: Traffic, total_bytes: float | None, remote_bytes: float | None) -> dict[str, np.ndarray]:
    """The embedding exchange's matrices scaled to `remote_bytes` off the diagonal and the rest of
    `total_bytes` on it (None: as recorded), every tag alike; sync tags as they are."""
    embedding = {tag: m for tag, m in base.exchange.items() if not tag.startswith(SYNC_TAGS)}
    total = sum(embedding.values(), np.zeros((base.world, base.world)))
    remote, self_bytes = total.sum() - np.trace(total), np.trace(total)
    remote_bytes = remote if remote_bytes is None else remote_bytes
    total_bytes = total.sum() if total_bytes is None else total_bytes
    rem_ratio = remote_bytes / remote if remote else 1.0
    self_ratio = (total_bytes - remote_bytes) / self_bytes if self_bytes else 1.0
    exchange = dict(base.exchange)
    for tag, m in embedding.items():
        diagonal = np.diag(np.diag(m))
        exchange[tag] = (m - diagonal) * rem_ratio + diagonal * self_ratio
    return exchange


def _with_tiers(base: Traffic, section: dict, nodes: int, freed: dict[str, np.ndarray] | None) -> Traffic:
    """FlexShard's tiers on `nodes` nodes (analyses.policies.tiers): the main exchange without the
    tier-1 and tier-2 rows (replayed per pair where `freed` is given, else scaled to its predicted
    bytes), the tier-2 exchange spread evenly over each node's rank pairs, tier 1's sync over every
    rank and the node copies' sync between the nodes."""
    predicted = section.get("predicted") or {}
    t2_out = float(predicted.get(TIER2_EXCHANGE_BYTES) or 0.0)
    t2_remote = float(predicted.get(TIER2_EXCHANGE_REMOTE) or 0.0)
    if freed is not None:
        exchange = {tag: np.maximum(m - freed.get(tag, 0.0), 0.0) for tag, m in base.exchange.items()}
    else:
        exchange = _scaled_exchange(base, predicted.get(A2A_BYTES, 0.0) - t2_out,
                                    predicted.get(A2A_REMOTE_BYTES, 0.0) - t2_remote)
    exchange[TIER2_TAG] = _within_nodes(base.world, nodes, t2_out, t2_remote)
    tier2_sync = float(predicted.get(TIER2_SYNC_BYTES) or 0.0)
    tier1 = _with_sync(replace(base, exchange=exchange, replica_bytes=float(predicted.get(TIER1_BYTES) or 0.0),
                               node_bytes=float(predicted.get(TIER2_BYTES) or 0.0)),
                       float(predicted.get(SYNC_BYTES) or 0.0) - tier2_sync, section.get("tier1_sync", "sparse_allreduce"))
    return _with_node_sync(tier1, nodes, tier2_sync, section.get("tier2_sync", "sparse_allreduce"))


def _within_nodes(world: int, nodes: int, total: float, remote: float) -> np.ndarray:
    """`total` bytes a step within the nodes: `remote` evenly over the pairs of ranks of one node,
    the rest on the diagonal."""
    per_node = world // nodes
    node = np.arange(world) // per_node
    pairs = (node[:, None] == node[None, :]) & ~np.eye(world, dtype=bool)
    m = np.where(pairs, remote / max(int(pairs.sum()), 1), 0.0)
    return m + np.diag(np.full(world, (total - remote) / world))


def _with_node_sync(t: Traffic, nodes: int, wire: float, kind: str) -> Traffic:
    """`t` with the node copies' sync: `wire` bytes a step between the nodes (all of it), one dense
    ring of the nodes per block or replicas.py's three sparse calls."""
    if not wire or nodes < 2:
        return replace(t, node_wire=0.0, node_calls=0.0, node_ring=0.0)
    if kind == "dense_allreduce":  # 2(N−1)·S over the nodes for S per node
        return replace(t, node_wire=wire, node_calls=1.0, node_ring=wire / (2 * (nodes - 1)))
    return replace(t, node_wire=wire, node_calls=float(SPARSE_SYNC_CALLS), node_ring=0.0)


def with_compression(t: Traffic, name: str, part: dict) -> Traffic:
    """`t` with a compression part's predicted bytes (module docstring): compression.mp scales the
    floating-point all-to-alls, compression.dp moves DDP's gradients from the ring to all-gathers."""
    predicted = part.get("predicted") or {}
    if name == "compression.mp":
        ratio = float(predicted.get("ratio") or 1.0)
        return replace(t, exchange={tag: m * ratio if tag in t.float_tags else m for tag, m in t.exchange.items()})
    baseline, sent = predicted.get("baseline_dp_bytes_per_step"), predicted.get(DP_BYTES)
    if not baseline or sent is None or not t.ring_calls:
        return t
    w = t.world
    return replace(t, ring=max(t.ring - baseline / w, 0.0), ring_calls=0.0, gather=t.gather + sent / w,
                   gather_calls=t.gather_calls + 2 * t.ring_calls)


def replicated_pairs(ctx: Context, rows: pl.DataFrame) -> dict[str, np.ndarray]:
    """Bytes per step, by trainer tag and (sender, receiver), that replicating `rows` (table_name,
    row) takes out of the recorded exchange, replayed over the sampled lookups (module docstring)."""
    s = exchange.baseline(ctx)
    a = s.attribution.tables
    w = ctx.model.world_size
    ctx.con.register("tk_sim_rows", rows.select("table_name", pl.col("row").cast(pl.Int64)).to_arrow())
    ctx.sql(f"""CREATE OR REPLACE TEMP TABLE tk_sim_x AS
               SELECT l.step, l.src, l.owner, l.tid, l.seq, l.bag, n.rb, h."row" IS NOT NULL AS hot
               FROM {s.tables.x} l JOIN {a.names} n USING (tid)
               LEFT JOIN (SELECT n.tid, r."row" FROM tk_sim_rows r JOIN {a.names} n USING (table_name)) h
                 USING (tid, "row")""")
    flows = ctx.sql(f"""
        WITH bags AS (SELECT any_value(step) AS step, any_value(src) AS src, any_value(tid) AS tid,
                             any_value(rb) AS rb
                      FROM tk_sim_x WHERE NOT seq AND bag IS NOT NULL GROUP BY bag HAVING bool_and(hot)),
        rows_back AS (SELECT b.src, s.rank AS owner, sum(b.rb)::DOUBLE AS bytes
                      FROM bags b JOIN {a.shards} s USING (tid) GROUP BY ALL
                      UNION ALL
                      SELECT src, owner, sum(rb)::DOUBLE FROM tk_sim_x WHERE seq AND hot GROUP BY ALL)
        SELECT 'input_ids' AS collective, src, owner, ({s.id_bytes} * count(*))::DOUBLE AS bytes
        FROM tk_sim_x WHERE hot GROUP BY ALL
        UNION ALL SELECT 'output_fwd', owner, src, sum(bytes) FROM rows_back GROUP BY ALL
        UNION ALL SELECT 'output_bwd', src, owner, sum(bytes) FROM rows_back GROUP BY ALL""").fetchall()
    freed: dict[str, np.ndarray] = {}
    for collective, sender, receiver, b in flows:
        freed.setdefault(roles.part(collective), np.zeros((w, w)))[sender, receiver] += b / max(s.sampled_steps, 1)
    return freed


def section_rows(section: dict, name: str, policy_path) -> pl.DataFrame | None:
    """The rows a section takes out of the recorded exchange (replication's list; tiers' tier 1 on one
    node, tiers 1 and 2 across nodes)."""
    if policy_path is None:
        return None
    if name == "replication":
        return pl.read_parquet(row_path(policy_path, section["rows"]), columns=["table_name", "row"])
    if name == "tiers":  # on one node tier 1 leaves the exchange; across nodes tiers 1 and 2 leave the main one
        frame = pl.read_parquet(row_path(policy_path, section["rows"]))
        if int((section.get("topology") or {}).get("nodes", 1)) == 1:
            frame = frame.filter(pl.col("tier") == 1)
        return frame.select("table_name", "row")
    return None


def _with_sync(t: Traffic, sync_wire: float, kind: str) -> Traffic:
    if not sync_wire or t.world < 2:
        return replace(t, sync_wire=0.0, sync_calls=0.0, sync_ring=0.0)
    if kind == "dense_allreduce":  # 2(W−1)·S wire over the ranks for S per rank
        return replace(t, sync_wire=sync_wire, sync_calls=1.0, sync_ring=sync_wire / (2 * (t.world - 1)))
    return replace(t, sync_wire=sync_wire, sync_calls=float(SPARSE_SYNC_CALLS), sync_ring=0.0)



def scaled(t: Traffic, batch: float, target: Topology, new_batch: float) -> Traffic:
    """`t` (recorded on t.world ranks at `batch` per device) on target.world ranks at `new_batch`:
    exchange bytes per sample kept, spread evenly over the pairs; all-reduces keep their size; a
    sparse sync becomes the dense ring of the same replicas."""
    w2 = target.world
    exchange = {tag: np.full((w2, w2), m.sum() / max(batch * t.world, 1e-12) * new_batch / w2)
                for tag, m in t.exchange.items()}
    if TIER2_TAG in t.exchange:  # the tier-2 exchange stays within the target's nodes
        moved = t.exchange[TIER2_TAG].sum() / max(batch * t.world, 1e-12) * new_batch * w2
        remote = 0.0 if target.ranks_per_node == 1 else moved * (target.ranks_per_node - 1) / target.ranks_per_node
        exchange[TIER2_TAG] = _within_nodes(w2, target.nodes, moved if target.ranks_per_node > 1 else 0.0, remote)
    sync_ring = (t.sync_ring or t.replica_bytes) if t.sync_wire else 0.0
    out = Traffic(w2, exchange, t.exchange_calls, t.ring, t.ring_calls, t.gather, t.gather_calls, t.other_calls,
                  replica_bytes=t.replica_bytes)
    out = _with_sync(out, 2 * (w2 - 1) * sync_ring, "dense_allreduce")
    out = replace(out, node_bytes=t.node_bytes)  # the node copies' sync: dense, a ring of the target's nodes
    return _with_node_sync(out, target.nodes, 2 * (target.nodes - 1) * t.node_bytes if t.node_wire else 0.0,
                           "dense_allreduce")


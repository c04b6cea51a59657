"""What-if: a recorded run's training step projected onto another cluster (`tracekit simulate`).

From the run, each training step's communication by class of collective (training rows, averaged
over the N training steps, analyses.traffic.training_steps):

    exchange  the all-to-alls, per tag: bytes from rank to rank (Σ splits_out), calls per step
    ring      the all-reduces: bytes per rank S (DDP's buckets and the rest), calls per step
    gather    the all-gathers: bytes per rank g, calls per step
    other     every other collective: calls per step (latency only)

and its compute time: per step the slowest rank's step less the union of its collective intervals
(analyses.timeline's compute_s), the median over the steps after warm-up.

On a target of N nodes × R ranks (global rank r on node r // R; each node's link runs at `inter_bw`
each way, ranks within a node talk at `intra_bw`), per class and step:

    exchange  per tag, max( max_n link_n / inter_bw,  max_r intra_r / intra_bw )
              link_n = max(out_n, in_n): out_n, in_n the bytes node n sends to and receives from
              other nodes, both directions of a link at once (full duplex, the default);
              link_n = out_n + in_n with `duplex=False`, a bound for gloo's worst case: its TCP
              transport tells a peer it may send on the same stream as its own data, so when two
              ranks enter an exchange more than a few ms apart the later one's data crosses first
              and the earlier one's only after it (measured on `tracekit cluster`: the late rank's
              exchange then takes 2.0× its one-way time). The trainer's exchanges are lopsided
              (table-wise: most bytes go one way) and its async all-reduces use the idle direction,
              so full duplex is what its steps measure (bench/RESULTS.md §8).
              intra_r: the same for rank r's traffic within its node. Tags apart: the output
              all-to-all of a table-wise layout is lopsided one way, its backward the other.
    ring      a ring all-reduce: wire = 2(W−1)/W · S per rank to the next rank, one ring edge leaving
              each node: max(wire / inter_bw if N > 1, wire / intra_bw if R > 1); on gloo at W = 2
              the ring's two edges join the same pair, so twice that
    gather    an exchange of g from every rank to every other

    step time = compute · b'/b + Σ class times + α · collectives per step

with α the latency of one collective (`latency_s`, else the run's fitted α: analyses.network) and no
overlap of communication with compute (SCARS's t_iter = t_compute + t_comm). Between nodes the
link carries TCP over IPv4 on Ethernet at MTU 1500: 1448 payload bytes per 1514 bytes sent
(WIRE_EFFICIENCY), which is what a rate-limited link such as `tracekit cluster`'s delivers.

Bytes. At the run's own world size and batch they are exact: the baseline's are the recorded ones
and a policy's are its replayed `predicted` figures (analyses.exchange), and the network does not
change what is sent (method `replay`). At another world size W' or per-device batch b' each
collective keeps its bytes per sample, spread evenly over the W'·W' rank pairs (balanced sharding
assumed), all-reduces keep their size (the model's), a policy keeps its share of the remote
exchange, and its sync is the dense one, a ring of its replicas (method `scaled`).

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
the entries). `combined` is every section together, compression applied after the exchange's
replicas, as the trainer applies them.

    result = simulate(ctx, Target(nodes=2, ranks_per_node=1, inter_bw=25e6), policy)
    result.tables["simulate"]         # policy | method | bytes and time per step | speedup
    result.tables["simulate_sweep"]   # policy | inter_bw | step_time_s | speedup
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import polars as pl

from analyses import attribution, exchange, network, replay, traffic
from analyses.context import Context, Result, open_context
from analyses.network import WIRE_EFFICIENCY, exchange_time, ring_time
from analyses.traffic import A2A_OPS, GATHER_OPS, sql_list
from tracekit.figures import A2A_BYTES, A2A_REMOTE_BYTES, ALLREDUCE_BYTES, DP_BYTES, STEP_TIME, SYNC_BYTES
from analyses.policies.tiers import TIER1_BYTES, TIER2_BYTES, TIER2_EXCHANGE_BYTES, TIER2_EXCHANGE_REMOTE, TIER2_SYNC_BYTES
from tracekit.policy import check_model, load_policy, row_path, section_part
from tracekit.tags import INPUT_DIST, OUTPUT_BWD, OUTPUT_FWD, SYNC_TAGS, TIER2_INPUT
from tracekit.topology import Topology

SIMULATED = ("replication", "tiers", "schedule")
"""policy.json sections whose predictions say what the exchange becomes."""
COMPRESSED = ("compression.dp", "compression.mp")
"""policy.json's compression parts, projected on top of the exchange."""
SWEEP_RATES = (10e6, 25e6, 50e6, 100e6, 200e6, 500e6, 1e9, 2.5e9, 10e9, 25e9, 100e9)
"""Inter-node link rates of the sweep, bits per second."""
SPARSE_SYNC_CALLS = 3
TIER2_TAG = TIER2_INPUT  # the tier-2 exchange's bytes, its three tags as one


@dataclass(frozen=True)
class Target(Topology):
    """The cluster projected onto: its topology and rates (bytes/s; None: taken from the run)."""

    inter_bw: float
    intra_bw: float | None = None
    batch: int | None = None  # per device
    latency_s: float | None = None
    duplex: bool = True  # both directions of a link at once; False: gloo's worst case (module docstring)


@dataclass
class Traffic:
    """One training step's communication on `world` ranks (module docstring)."""

    world: int
    exchange: dict[str, np.ndarray]  # tag -> world × world bytes per step, rank to rank
    exchange_calls: float
    ring: float  # bytes per rank per step through all-reduces
    ring_calls: float
    gather: float
    gather_calls: float
    other_calls: float
    sync_wire: float = 0.0  # a policy's replica sync: wire bytes per step, all ranks
    sync_calls: float = 0.0
    sync_ring: float = 0.0  # ... when it is one dense all-reduce: its bytes per rank
    replica_bytes: float = 0.0  # a policy's replicas per rank (Σ rb), the dense sync's size
    float_tags: frozenset[str] = frozenset()  # all-to-all tags carrying floating-point rows (outputs, grads)
    node_wire: float = 0.0  # tiers across nodes: the node copies' sync, wire bytes per step between nodes
    node_calls: float = 0.0
    node_ring: float = 0.0  # ... when it is dense: one node's tier-2 bytes, in a ring of the nodes
    node_bytes: float = 0.0  # one node's tier-2 rows (Σ rb), the dense node sync's size

    @property
    def calls(self) -> float:
        return (self.exchange_calls + self.ring_calls + self.gather_calls + self.other_calls + self.sync_calls
                + self.node_calls)

    def figures(self) -> dict[str, float]:
        """Bytes per step in `comms`' convention (Σ ranks' bytes_out), and the sync's wire bytes."""
        w, total = self.world, self.total_exchange
        return {A2A_BYTES: float(total.sum()),
                A2A_REMOTE_BYTES: float(total.sum() - np.trace(total)),
                ALLREDUCE_BYTES: self.ring * w, SYNC_BYTES: self.sync_wire + self.node_wire,
                "bytes_per_step": float(total.sum()) + self.ring * w + self.gather * w
                                  + (self.sync_ring * w if self.sync_ring else self.sync_wire) + self.node_wire}

    @property
    def total_exchange(self) -> np.ndarray:
        return sum(self.exchange.values(), np.zeros((self.world, self.world)))


# what the run moved and computed ---------------------------------------------------------------

def recorded(ctx: Context) -> tuple[Traffic, dict]:
    """The run's training step: its Traffic (sync calls of a policy run left in as they are) and
    {steps, batch (mean samples per device), compute_s, step_time_s, latency_s}."""
    steps = max(traffic.training_steps(ctx), 1)
    w = ctx.model.world_size
    exchange: dict[str, np.ndarray] = {}
    float_tags = set()
    for tag, src, dst, b, is_float in ctx.sql(f"""
            SELECT coalesce(tag, ''), rank, i - 1, sum(splits_out[i])::DOUBLE,
                   bool_or(dtype LIKE '%float%' OR dtype LIKE '%half%')
            FROM (SELECT tag, rank, dtype, splits_out, generate_subscripts(splits_out, 1) AS i FROM train_comms
                  WHERE op IN ({sql_list(A2A_OPS)}) AND group_size = {w})
            GROUP BY ALL""").fetchall():
        if 0 <= src < w and 0 <= dst < w:
            exchange.setdefault(tag, np.zeros((w, w)))[src, dst] = b / steps
            if is_float:
                float_tags.add(tag)
    per_op = {op: (calls / steps / w, per_rank / steps) for op, calls, per_rank in ctx.sql(f"""
        SELECT CASE WHEN op IN ({sql_list(A2A_OPS)}) THEN 'a2a' WHEN op = 'all_reduce' THEN 'ring'
                    WHEN op IN ({sql_list(GATHER_OPS)}) THEN 'gather' ELSE 'other' END AS kind,
               count(*)::DOUBLE, max(per_rank)
        FROM (SELECT op, rank, sum(bytes_out) OVER (PARTITION BY op, rank)::DOUBLE AS per_rank FROM train_comms)
        GROUP BY kind""").fetchall()}
    none = (0.0, 0.0)
    run = Traffic(w, exchange, per_op.get("a2a", none)[0], per_op.get("ring", none)[1], per_op.get("ring", none)[0],
                  per_op.get("gather", none)[1], per_op.get("gather", none)[0], per_op.get("other", none)[0],
                  float_tags=frozenset(float_tags))
    return run, {"steps": steps, **_times(ctx, steps, w)}


def _times(ctx: Context, steps: int, world: int) -> dict:
    samples = ctx.sql("SELECT sum(samples)::DOUBLE FROM steps").fetchall()[0][0] if ctx.has("steps") else None
    if not samples:
        samples = float(attribution.batches(ctx)["b"].sum()) if ctx.has("comms") else 0.0
    out = {"batch": samples / steps / world if samples else None, "compute_s": None, STEP_TIME: None,
           "latency_s": network.network(ctx).alpha(network.A2A)}
    if not ctx.has("steps"):
        return out
    frame = compute_times(ctx)
    skip = network.warmup_steps(frame["step"].n_unique())
    per_step = (frame.filter(pl.col("step") >= frame["step"].min() + skip).group_by("step")
                .agg(pl.col("compute_s").max(), pl.col("step_s").max()))
    out["compute_s"] = float(per_step["compute_s"].median())
    out[STEP_TIME] = float(per_step["step_s"].median())
    return out


def compute_times(ctx: Context) -> pl.DataFrame:
    """Per (rank, training step): step_s and compute_s, the step less the time the rank spent in
    collectives: its synchronous calls, and its asynchronous ones only after the step's last
    synchronous call ended (waiting for them; before that they overlap the rank's computing, as
    DDP's bucket all-reduces overlap backward)."""
    steps = ctx.frame("SELECT rank, step, t_start_ns, t_end_ns FROM steps")
    calls = (ctx.frame("""SELECT rank, step, t_start_ns AS t0, t_end_ns AS t1, "async" FROM train_comms
                          WHERE t_end_ns > t_start_ns""") if ctx.has("comms")
             else pl.DataFrame(schema={"rank": pl.Int64, "step": pl.Int64, "t0": pl.Int64, "t1": pl.Int64,
                                       "async": pl.Boolean}))
    by_key = {key: part for key, part in calls.partition_by("rank", "step", as_dict=True).items()}
    rows = []
    for rank, step, w0, w1 in steps.iter_rows():
        part = by_key.get((rank, step))
        busy = 0 if part is None else _busy_ns(part, w0, w1)
        rows.append((rank, step, (w1 - w0) / 1e9, (w1 - w0 - busy) / 1e9))
    return pl.DataFrame(rows, schema={"rank": pl.Int64, "step": pl.Int64, "step_s": pl.Float64,
                                      "compute_s": pl.Float64}, orient="row")


def _busy_ns(calls: pl.DataFrame, w0: int, w1: int) -> int:
    sync = calls.filter(~pl.col("async"))
    last = int(sync["t1"].max()) if sync.height else w0
    spans = [(t0, t1) for t0, t1 in sync.select("t0", "t1").iter_rows()]
    spans += [(max(t0, last), t1) for t0, t1 in calls.filter(pl.col("async")).select("t0", "t1").iter_rows()]
    busy, end = 0, w0
    for t0, t1 in sorted((max(t0, w0), min(t1, w1)) for t0, t1 in spans):
        if t1 > max(t0, end):
            busy += t1 - max(t0, end)
            end = t1
    return busy


# a policy's step -------------------------------------------------------------------------------

def with_policy(base: Traffic, section: dict, freed: dict[str, np.ndarray] | None = None) -> Traffic:
    """`base` (the recorded world and batch) under a policy section's predicted exchange and sync;
    `freed`: the bytes per step, by tag and rank pair, its replicas take out of the exchange."""
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
    s = exchange.baseline(ctx)  # tk_x
    attribution.attributed(ctx)  # tk_names, tk_shards
    w = ctx.model.world_size
    ctx.con.register("tk_sim_rows", rows.select("table_name", pl.col("row").cast(pl.Int64)).to_arrow())
    ctx.sql("""CREATE OR REPLACE TEMP TABLE tk_sim_x AS
               SELECT l.step, l.src, l.owner, l.tid, l.seq, l.bag, n.rb, h."row" IS NOT NULL AS hot
               FROM tk_x l JOIN tk_names n USING (tid)
               LEFT JOIN (SELECT n.tid, r."row" FROM tk_sim_rows r JOIN tk_names n USING (table_name)) h
                 USING (tid, "row")""")
    flows = ctx.sql(f"""
        WITH bags AS (SELECT any_value(step) AS step, any_value(src) AS src, any_value(tid) AS tid,
                             any_value(rb) AS rb
                      FROM tk_sim_x WHERE NOT seq AND bag IS NOT NULL GROUP BY bag HAVING bool_and(hot)),
        rows_back AS (SELECT b.src, s.rank AS owner, sum(b.rb)::DOUBLE AS bytes
                      FROM bags b JOIN tk_shards s USING (tid) GROUP BY ALL
                      UNION ALL
                      SELECT src, owner, sum(rb)::DOUBLE FROM tk_sim_x WHERE seq AND hot GROUP BY ALL)
        SELECT 'input_ids' AS collective, src, owner, ({s.id_bytes} * count(*))::DOUBLE AS bytes
        FROM tk_sim_x WHERE hot GROUP BY ALL
        UNION ALL SELECT 'output_fwd', owner, src, sum(bytes) FROM rows_back GROUP BY ALL
        UNION ALL SELECT 'output_bwd', src, owner, sum(bytes) FROM rows_back GROUP BY ALL""").fetchall()
    freed: dict[str, np.ndarray] = {}
    for collective, sender, receiver, b in flows:
        tag = exchange.TRAINER_TAGS[collective]
        freed.setdefault(tag, np.zeros((w, w)))[sender, receiver] += b / max(s.sampled_steps, 1)
    return freed


def _section_rows(section: dict, name: str, policy_path) -> pl.DataFrame | None:
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


def scaled(t: Traffic, batch: float, target: Target, new_batch: float) -> Traffic:
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


# time on the target ----------------------------------------------------------------------------

def comm_time(t: Traffic, target: Target, intra: float, latency: float) -> float:
    n, r, full = target.nodes, target.ranks_per_node, target.duplex
    inter = target.inter_bw * WIRE_EFFICIENCY
    gather = np.full((t.world, t.world), t.gather) - np.diag(np.full(t.world, t.gather))
    seconds = (sum(exchange_time(m, n, r, inter, intra, full) for m in t.exchange.values())
               + ring_time(t.ring, n, r, inter, intra, full)
               + exchange_time(gather, n, r, inter, intra, full))
    if t.sync_ring:
        seconds += ring_time(t.sync_ring, n, r, inter, intra, full)
    elif t.sync_wire:  # sparse: its wire bytes, evenly from every rank to every other
        per_pair = t.sync_wire / (t.world * (t.world - 1))
        sync = np.full((t.world, t.world), per_pair) - np.diag(np.full(t.world, per_pair))
        seconds += exchange_time(sync, n, r, inter, intra, full)
    if t.node_ring:  # the node copies' dense sync: each node's blocks in a ring of the nodes
        seconds += ring_time(t.node_ring, n, 1, inter, intra, full)
    elif t.node_wire and n > 1:  # sparse: evenly from every node to every other
        per_pair = t.node_wire / (n * (n - 1))
        seconds += exchange_time(np.full((n, n), per_pair) - np.diag(np.full(n, per_pair)), n, 1, inter, intra, full)
    return seconds + latency * t.calls


# the projection --------------------------------------------------------------------------------

def simulate(ctx: Context, target: Target, policy: dict | None = None, policy_path=None) -> Result:
    """Tables `simulate` (baseline and each policy section on `target`) and `simulate_sweep` (the
    same over SWEEP_RATES), and a summary; notes on what was scaled or left out. `policy_path`
    (where `policy` was read from) locates its row lists, for the exact per-pair replay."""
    result = Result()
    if target.world < 1:
        raise ValueError("the target needs at least one rank")
    if not ctx.has("comms"):
        result.notes.append("the run has no comms table: nothing to project")
        return result
    base, run = recorded(ctx)
    if run["compute_s"] is None:
        result.notes.append("the run has no steps table: compute time unknown, step times not projected")
    batch = run["batch"] or 0.0
    new_batch = float(target.batch or batch)
    same = target.world == ctx.model.world_size and abs(new_batch - batch) < 1e-9
    intra = target.intra_bw or _intra_bw(ctx, result.notes)
    latency = run["latency_s"] if target.latency_s is None else target.latency_s
    compute = None if run["compute_s"] is None else run["compute_s"] * (new_batch / batch if batch else 1.0)

    cases = [("baseline", base)]
    policy = policy or {}
    for name in SIMULATED:
        if name in policy:
            rows = _section_rows(policy[name], name, policy_path) if ctx.has("lookups") else None
            freed = None if rows is None else replicated_pairs(ctx, rows)
            cases.append((name, with_policy(base, policy[name], freed)))
    exchanged = cases[1:]
    compressed = [(name, part) for name in COMPRESSED if (part := section_part(policy, name)) is not None]
    for name, part in compressed:
        cases.append((name, with_compression(base, name, part)))
    if len(exchanged) + len(compressed) > 1:  # as optimize's combined run: replication (or tiers) first
        combined = next((t for name, t in exchanged if name in ("replication", "tiers")), base)
        for name, part in compressed:
            combined = with_compression(combined, name, part)
        cases.append(("combined", combined))
    if "lag" in policy:
        result.notes.append("lag: not projected (it applies to inference; its makespan is the lag section's)")
    if not same:
        cases = [(name, scaled(t, batch, target, new_batch)) for name, t in cases]
        result.notes.append(f"world {ctx.model.world_size} → {target.world}, batch {batch:g} → {new_batch:g} per "
                            "device: bytes scaled per sample, spread evenly over the rank pairs; syncs dense")
    replayed = (_replayed(ctx, target, intra, dict(cases), base, new_batch / batch if batch else 1.0)
                if compute is not None else None)
    if replayed is not None:
        result.notes.append("step times: the recorded steps replayed on the target's links, each section's collectives "
                            "changed to its bytes (analyses/replay.py)")
    rows, sweep = [], []
    base_time = None
    for name, t in cases:
        comm = comm_time(t, target, intra, latency)
        step = None if compute is None else compute + comm
        if replayed is not None and name in replayed:
            step = replayed[name]
            comm = max(step - compute, 0.0)
        base_time = step if name == "baseline" else base_time
        rows.append({"policy": name, "method": "replay" if same else "scaled", "topology": target.name,
                     "world": target.world, "batch_per_device": new_batch, "inter_bw": target.inter_bw,
                     "intra_bw": intra, **t.figures(), "inter_node_bytes_per_step": _inter_bytes(t, target),
                     "collectives_per_step": t.calls, "compute_s": compute, "comm_s": comm, STEP_TIME: step,
                     "comm_share": None if not step else comm / step,
                     "speedup": None if not step or not base_time else base_time / step})
        for rate in SWEEP_RATES:
            c = comm_time(t, replace(target, inter_bw=rate / 8), intra, latency)
            sweep.append({"policy": name, "inter_bw": rate / 8, "comm_s": c,
                          STEP_TIME: None if compute is None else compute + c})
    table = pl.DataFrame(rows)
    sweep_frame = pl.DataFrame(sweep)
    base_sweep = sweep_frame.filter(pl.col("policy") == "baseline").select("inter_bw", base=STEP_TIME)
    sweep_frame = sweep_frame.join(base_sweep, on="inter_bw").with_columns(
        (pl.col("base") / pl.col(STEP_TIME)).alias("speedup")).drop("base")
    result.tables = {"simulate": table, "simulate_sweep": sweep_frame}
    result.summary = {"target": {"topology": target.name, "world": target.world, "inter_bw": target.inter_bw,
                                 "intra_bw": intra, "batch_per_device": new_batch, "latency_s": latency,
                                 "wire_efficiency": WIRE_EFFICIENCY, "full_duplex": target.duplex},
                      "source": {"world": ctx.model.world_size, "batch_per_device": batch, **run},
                      "method": "replay" if same else "scaled", "rows": rows}
    return result


def _replayed(ctx: Context, target: Target, intra: float, cases: dict[str, Traffic], base: Traffic,
              compute_scale: float) -> dict | None:
    """Each case's step on `target` by the replay of the recorded steps on its links: the median over the
    steps. On the recorded world and batch each section's collectives are changed to its bytes (`_change`);
    on another, every rank runs a recorded rank's program (its compute scaled with the batch) and each
    collective carries the case's scaled bytes (`_projected`). None where the run does not replay; a case
    the replay cannot express (tier 2's exchange, a collective of a subgroup on another world) is left out."""
    rp = replay.replay(ctx)
    if not rp.steps:
        return None
    source_one_node = len(set(rp.links.node_of)) == 1
    links = replay.Links(tuple(r // target.ranks_per_node for r in range(target.world)),
                         target.inter_bw * WIRE_EFFICIENCY if target.nodes > 1 else np.inf,
                         target.intra_bw or (rp.links.intra if source_one_node else intra), rp.links.alpha)
    same = target.world == base.world and compute_scale == 1.0
    out = {}
    for name, t in cases.items():
        change = _change(t, base) if same else _sync_change(t)
        steps = rp.steps if same else _projected(rp.steps, t, base, target.world, compute_scale)
        if change is not None and steps:
            out[name] = float(np.median(replay.run_steps(steps, links, change)))
    return out


def _projected(steps: list[replay.Step], t: Traffic, source: Traffic, world: int,
               compute_scale: float) -> list[replay.Step] | None:
    """The recorded steps on `world` ranks: rank r runs recorded rank r mod W's program and starts at its
    offset, its compute times `compute_scale`; each collective keeps its share of its class's recorded bytes
    (an all-to-all of its tag's, an all-reduce of the ring's, a gather of the gathers') of `t`'s bytes."""
    w = source.world
    out = []
    for s in steps:
        if any(len(c.ranks) != w for c in s.calls.values()):
            return None
        calls = {k: replace(c, ranks=tuple(range(world)), flows=_projected_flows(c, t, source, world), time_s=0.0,
                            entries=()) for k, c in s.calls.items()}
        programs = {r: [("compute", arg * compute_scale) if kind == "compute" else (kind, arg)
                        for kind, arg in s.programs[r % w]] for r in range(world)}
        out.append(replay.Step(s.step, {r: s.start[r % w] for r in range(world)}, programs, calls, s.measured_s))
    return out


def _projected_flows(c: replay.Call, t: Traffic, source: Traffic, world: int) -> np.ndarray:
    n = len(c.ranks)
    remote = float(c.flows.sum())
    if c.op in A2A_OPS and c.tag in t.exchange:
        recorded = source.exchange.get(c.tag)
        share = remote / (recorded.sum() - np.trace(recorded)) if recorded is not None and recorded.sum() else 0.0
        m = t.exchange[c.tag] * share
        return m - np.diag(np.diag(m))
    if c.op == network.ALL_REDUCE and source.ring:
        return replay.ring_flows(world, c.flows[0].sum() * n / (2 * (n - 1)) * t.ring / source.ring)  # S, scaled
    flows = np.zeros((world, world))
    if c.op in GATHER_OPS and source.gather:
        flows[:] = c.flows[0].max() * t.gather / source.gather
        np.fill_diagonal(flows, 0.0)
    return flows


def _sync_change(t: Traffic) -> replay.Change | None:
    """The sync a case adds, as calls after the backward; None for what the graph has no place for."""
    if TIER2_TAG in t.exchange or t.node_wire:
        return None
    return replay.Change(added=exchange.sync_calls(not t.sync_ring, t.sync_wire, t.world) if t.sync_wire else ())


def _change(t: Traffic, base: Traffic) -> replay.Change | None:
    """A case's Traffic as a change of the recorded graph: each exchange collective scaled by its tag's bytes
    between ranks, the sync added as its calls, the dense gradients' bytes (ring, or DCT-DP's gathers)
    scaled; None for what the graph has no place for (tier 2's exchange, the node copies' sync)."""
    if TIER2_TAG in t.exchange or t.node_wire:
        return None
    def remote(m: np.ndarray) -> float:
        return float(m.sum() - np.trace(m))
    scale = {}
    for tag, names in ((INPUT_DIST, ("input_lengths", "input_ids")), (OUTPUT_FWD, ("output_fwd",)),
                       (OUTPUT_BWD, ("output_bwd",))):
        if tag in base.exchange and remote(base.exchange[tag]):
            ratio = remote(t.exchange.get(tag, np.zeros_like(base.exchange[tag]))) / remote(base.exchange[tag])
            scale.update(dict.fromkeys(names, ratio))
    dense = ((t.ring + t.gather - base.gather) / base.ring) if base.ring else 1.0
    sync = exchange.sync_calls(not t.sync_ring, t.sync_wire, t.world) if t.sync_wire else ()
    return replay.Change(scale, 0.0, sync, 0.0, dense)


UNMEASURED_INTRA_BW = 10e9
"""Bytes/s assumed within a node where the run cannot tell (no one-node run to measure it on)."""


def _intra_bw(ctx: Context, notes: list[str]) -> float:
    """Within a node: the run's fitted link (analyses.network) where its ranks shared one node;
    a run recorded across nodes measured its links instead, so UNMEASURED_INTRA_BW, said in a note."""
    if Topology.of_run(ctx.manifest, ctx.model.world_size).nodes > 1:
        notes.append(f"within a node: {UNMEASURED_INTRA_BW / 1e9:g} GB/s assumed (the run was recorded across nodes, "
                     "so it measured the links between them; --intra-bw sets it)")
        return UNMEASURED_INTRA_BW
    return network.network(ctx).fit.bandwidth or UNMEASURED_INTRA_BW


def _inter_bytes(t: Traffic, target: Target) -> float:
    """Bytes per step that cross node boundaries (exchange, gathers, rings, sync), all nodes."""
    if target.nodes < 2:
        return 0.0
    node = np.arange(t.world) // target.ranks_per_node
    cross = node[:, None] != node[None, :]
    w = t.world
    ring_wire = 2 * (w - 1) / w * (t.ring + t.sync_ring)
    gather = t.gather * float(cross.sum())
    sparse = t.sync_wire / (w * (w - 1)) * float(cross.sum()) if t.sync_wire and not t.sync_ring else 0.0
    return float((t.total_exchange * cross).sum()) + ring_wire * target.nodes + gather + sparse + t.node_wire


def project(path, target: Target, policy_path=None) -> dict:
    """`tracekit simulate`: open the run at `path`, project it onto `target` with the policy file at
    `policy_path` (None: the baseline only), write RUN/analysis/simulate.parquet,
    simulate_sweep.parquet and simulate.json, and return the summary with the notes."""
    with open_context(path) as ctx:
        policy = None
        if policy_path is not None:
            policy = load_policy(policy_path)
            check_model(policy, tables=ctx.model.policy_model()["tables"], world_size=ctx.model.world_size,
                        path=policy_path)
        result = simulate(ctx, target, policy, policy_path)
        summary = {"run": str(ctx.path), "policy": None if policy_path is None else str(policy_path),
                   **result.summary, "notes": result.notes, "written": []}
        for name, frame in result.tables.items():
            summary["written"].append(str(ctx.write(name, frame)))
        ctx.write_json("simulate", summary)
    return summary

"""FlexShard-like tiers for a topology of H nodes × G ranks per node (papers.md §5, B.6):
tier 1 rows are replicated on every rank, tier 2 rows once per node (sharded over its ranks), the
rest (tier 3) stay sharded as recorded. Without --topology, the topology the run was recorded on
(`tracekit cluster`), else one node of the run's ranks: tier 2
is then the recorded sharding itself and the tiers reduce to replication (tier 1).

Rows are ranked as for replication (benefit per replica byte, analyses.policies.replication), so
tier 1 is a prefix K1 of that order and tier 2 the next K2 rows. A tier-2 row's node copy sits on
the node's rank with the same local index as its recorded owner o (rank node(q)·G + o mod G
serves source q), so a bag's ids keep one destination. Per item (a pooled bag at one owner, or a
sequence lookup) from source q to owner o, with m its last position in the order:

    m < K1            local                      (leaves the exchange)
    K1 <= m < K1+K2   to node(q)·G + o mod G     (local, or intra-node)
    otherwise         to o as recorded           (local, intra-node, or inter-node)

Bytes (lengths, ids, rows forward and backward) are replayed exactly over the recorded lookups for
any (K1, K2), intra- and inter-node separately (what a rank hands itself counts only in
a2a_bytes_per_step, which compares with `comms`); what no item carries (a sequence table's
lengths, bags without ids) stays where it was recorded. Synchronisation per step, over the
union U of touched rows of a tier (bytes summed over ranks, rb row bytes):

    tier 1  hierarchical all-reduce: intra 2H(G−1)·U1·rb, inter 2(H−1)·U1·rb; the index
            all-gather sends each rank's touched ids to the G−1 ranks of its node (intra) and the
            W−G others (inter); or dense over all K1 rows (no index), whichever is faster
    tier 2  all-reduce among the H node copies: inter 2(H−1)·U2·rb, plus (H−1)·id_bytes per
            touched (step, rank) pair (an upper bound on the node copies' index exchange)

Memory per rank: rb per tier-1 row, rb/G per tier-2 row; within the budget (Options, else the
replication policy's chosen replica bytes), K1 runs over log-spaced points (and replication's
choice) and K2 takes the rest of the budget (none on one node, where tier 2 changes nothing); the
pair with least time is chosen (analyses.network): the exchange's and the sync's collectives' α,
plus (β_intra · (intra a2a + intra sync) + β · (inter a2a + inter sync)) / W, β the run's fitted
link (across nodes on a cluster run), β_intra 1 / --intra-bw, else 0 (ranks of a node share
memory). On one node every figure is replication's (its exact replay, what the trainer does: the
hot ids of a mixed bag are served locally); across nodes items move whole, and the trainer does
not apply tier 2 there yet (analyses.decision then does not recommend the section).

Outputs: the `tiers` section (topology, predicted intra- and inter-node bytes separately) and
policy/tiers.parquet (table_name, row, tier) listing tier 1 and 2 rows (unlisted rows: tier 3).
"""

from __future__ import annotations

import numpy as np
import polars as pl

from analyses import attribution, exchange, network
from analyses.context import Context, PolicyResult
from analyses.exchange import ExchangeBaseline
from analyses.policies import replication
from tracekit.figures import A2A_BYTES, A2A_REMOTE_BYTES, COMM_TIME, INTER_BYTES, INTRA_BYTES, STEP_TIME, SYNC_BYTES
from tracekit.policy import Prediction, Tiers
from tracekit.topology import Topology


def topology(ctx: Context) -> Topology:
    """Options.topology, else the cluster the run was recorded on, else one node of its ranks."""
    return ctx.options.topology or Topology.of_run(ctx.manifest, ctx.model.world_size)


def classes(ctx: Context, s: ExchangeBaseline, order: str, per_node: int) -> pl.DataFrame:
    """Network bytes per step of items grouped by (maxpos, recorded class c0, tier-2 class c2);
    class 0 local, 1 intra-node, 2 inter-node; maxpos null: an id outside the order."""
    attribution.attributed(ctx)  # tk_names
    exchange.baseline(ctx)  # tk_x
    g = per_node
    item = exchange.item_bytes_sql(s.len_bytes, s.id_bytes)
    return ctx.frame(f"""
        WITH items AS (
            SELECT l.step, l.src, l.owner, l.tid, any_value(l.seq) AS seq, count(*) AS n_ids,
                   CASE WHEN count(o.pos) = count(*) THEN max(o.pos) END AS maxpos
            FROM tk_x l LEFT JOIN {order} o USING (tid, "row")
            GROUP BY l.step, l.src, l.owner, l.tid, CASE WHEN l.seq THEN l.sample ELSE l.gid END),
        sized AS (
            SELECT i.*, n.rb, 1 AS n_shards, 1 AS n_remote_shards, n_ids AS n_remote,
                   CASE WHEN i.owner = i.src THEN 0 WHEN i.owner // {g} = i.src // {g} THEN 1 ELSE 2 END AS c0,
                   CASE WHEN i.src % {g} = i.owner % {g} THEN 0 ELSE 1 END AS c2
            FROM items i JOIN tk_names n USING (tid))
        SELECT maxpos, c0, c2,
               sum(len_rem + ids_rem + 2 * row_rem)::DOUBLE / {max(s.sampled_steps, 1)} AS bytes
        FROM (SELECT maxpos, c0, c2, {item} FROM sized) GROUP BY ALL""")


def fixed_bytes(ctx: Context, s: ExchangeBaseline, per_node: int, hist: pl.DataFrame) -> dict[int, float]:
    """Bytes per step no item carries (sequence tables' lengths, bags without ids), by class
    (0: what a rank hands itself): the recorded exchange (tk_pairs) less the items' bytes."""
    exchange.baseline(ctx)  # tk_pairs
    g = per_node
    rows = ctx.sql(f"""SELECT CASE WHEN sender // {g} = receiver // {g} THEN 1 ELSE 2 END AS c,
                              sum(bytes)::DOUBLE / {max(s.sampled_steps, 1)}
                       FROM tk_pairs WHERE sender <> receiver GROUP BY ALL""").fetchall()
    recorded = {c: b for c, b in rows}
    recorded[0] = ctx.sql(f"""SELECT coalesce(sum(bytes), 0)::DOUBLE / {max(s.sampled_steps, 1)} FROM tk_pairs
                              WHERE sender = receiver""").fetchall()[0][0]
    return {c: recorded.get(c, 0.0) - float(hist.filter(pl.col("c0") == c)["bytes"].sum()) for c in (0, 1, 2)}


def _cumulative(hist: pl.DataFrame, n: int, where: pl.Expr) -> np.ndarray:
    """A[K] = bytes of the items matching `where` with maxpos < K, K = 0..n."""
    part = hist.filter(where & pl.col("maxpos").is_not_null())
    per = np.zeros(n + 1)
    np.add.at(per, part["maxpos"].to_numpy().astype(np.int64) + 1, part["bytes"].to_numpy())
    return np.cumsum(per)


def derive(ctx: Context) -> PolicyResult:
    """The tiers section and row list for the topology (module docstring); once per context
    (ctx.memo)."""
    return ctx.memo(derive, lambda: _derive(ctx))


def _derive(ctx: Context) -> PolicyResult:
    reason = replication.cannot(ctx)
    if reason:
        return PolicyResult("tiers", reason=reason)
    shape = topology(ctx)
    nodes, g = shape.nodes, shape.ranks_per_node
    if nodes * g != ctx.model.world_size:
        return PolicyResult("tiers", reason=f"topology {nodes}x{g} does not hold the run's "
                                            f"{ctx.model.world_size} ranks")
    s = exchange.baseline(ctx)
    net = network.network(ctx)
    rep = replication.derive(ctx)
    by_benefit = replication.benefit_curve(ctx)  # replication's order, in tk_order_replication
    order = by_benefit.order
    n = order.height
    hist = classes(ctx, s, "tk_order_replication", g)
    c0, c2 = pl.col("c0"), pl.col("c2")
    fixed = fixed_bytes(ctx, s, g, hist)
    total = {c: float(hist.filter(c0 == c)["bytes"].sum()) + fixed[c] for c in (0, 1, 2)}
    a_self, a_intra, a_inter = (_cumulative(hist, n, c0 == c) for c in (0, 1, 2))
    a_t2, a_t2_self = _cumulative(hist, n, c2 == 1), _cumulative(hist, n, c2 == 0)
    rb, steps, src_steps = (order[c].to_numpy().astype(np.float64) for c in ("rb", "steps", "src_steps"))
    cum_rb = np.concatenate([[0.0], np.cumsum(rb)])
    union = np.concatenate([[0.0], np.cumsum(rb * steps)]) / max(s.sampled_steps, 1)  # Σ rb·U per step
    pairs = np.concatenate([[0.0], np.cumsum(src_steps)]) / max(s.sampled_steps, 1)
    limit = float(replication.replica_budget(ctx))

    one = by_benefit if nodes == 1 else None
    # across nodes the fitted link is the nodes' (a cluster run's calls cross it); within a node
    # the ranks share memory: free beside it unless --intra-bw says otherwise
    beta = net.fit.beta_s_per_byte
    beta_intra = 1 / ctx.options.intra_bw if ctx.options.intra_bw else 0.0

    def figures(k1: int, k2: int) -> dict:
        if one is not None:  # one node: tier 1 is replication, as the trainer applies it
            return {"tier1_rows": k1, "tier2_rows": 0, INTRA_BYTES: float(one.a2a_rem[k1]),
                    INTER_BYTES: 0.0, A2A_BYTES: float(one.a2a_out[k1]),
                    A2A_REMOTE_BYTES: float(one.a2a_rem[k1]),
                    "sync_intra_bytes_per_step": float(one.sync[k1]), "sync_inter_bytes_per_step": 0.0,
                    COMM_TIME: float(one.comm_time[k1] + one.work[k1]), "memory_bytes_per_rank": cum_rb[k1],
                    "tier1_sync": one.sync_kind(k1), "error_s": float(one.error[k1]),
                    STEP_TIME: None if one.step_time is None else float(one.step_time[k1])}
        k12 = k1 + k2
        intra = (total[1] - a_intra[k12]) + (a_t2[k12] - a_t2[k1])
        inter = total[2] - a_inter[k12]
        own = (total[0] - a_self[k12]) + (a_t2_self[k12] - a_t2_self[k1])
        tier2_inter = 2 * (nodes - 1) * (union[k12] - union[k1]) + (nodes - 1) * s.id_bytes * (pairs[k12] - pairs[k1])
        options = []
        exchange_s = len(exchange.COLLECTIVES) * net.alpha(network.A2A)
        for kind, block, index in (("sparse_allreduce", union[k1], pairs[k1]), ("dense_allreduce", cum_rb[k1], 0.0)):
            sync_intra = 2 * nodes * (g - 1) * block + (g - 1) * s.id_bytes * index
            sync_inter = 2 * (nodes - 1) * block + (s.world - g) * s.id_bytes * index + tier2_inter
            calls = net.sync_calls(kind) if sync_intra + sync_inter > 0 else 0
            time = (exchange_s + calls * net.alpha(network.ALL_REDUCE)
                    + (beta_intra * (intra + sync_intra) + beta * (inter + sync_inter)) / s.world)
            options.append((time, kind, sync_intra, sync_inter))
        time, kind, sync_intra, sync_inter = min(options)
        calls = net.sync_calls(kind) if sync_intra + sync_inter > 0 else 0
        return {"tier1_rows": k1, "tier2_rows": k2, INTRA_BYTES: intra, INTER_BYTES: inter,
                A2A_BYTES: intra + inter + own, A2A_REMOTE_BYTES: intra + inter,
                "sync_intra_bytes_per_step": sync_intra, "sync_inter_bytes_per_step": sync_inter,
                COMM_TIME: time, "memory_bytes_per_rank": cum_rb[k1] + (cum_rb[k12] - cum_rb[k1]) / g,
                "tier1_sync": kind, "sync_calls": calls, STEP_TIME: None}

    candidates = []
    chosen_k = int((rep.section or {}).get("predicted", {}).get("hot_rows", 0))
    for k1 in sorted({*exchange.log_points(n, 60), chosen_k}):
        if cum_rb[k1] > limit:
            break
        room = (limit - cum_rb[k1]) * g + cum_rb[k1]  # tier-2 rows cost rb/G each
        k12 = int(np.searchsorted(cum_rb, room, side="right")) - 1
        candidates.append(figures(k1, 0 if nodes == 1 else max(k12 - k1, 0)))
    chosen = min(candidates, key=lambda f: (f[COMM_TIME], f["tier1_rows"]))
    base = figures(0, 0)
    step_time = chosen[STEP_TIME]
    if step_time is None and s.step_time_s is not None:
        step_time = max(0.0, s.step_time_s + chosen[COMM_TIME] - base[COMM_TIME])
        chosen["error_s"] = net.error(chosen["sync_calls"], chosen[COMM_TIME] - base[COMM_TIME])
    predicted = {**{k: float(v) for k, v in chosen.items()
                    if k not in ("tier1_sync", "error_s", STEP_TIME, "sync_calls")},
                 SYNC_BYTES: float(chosen["sync_intra_bytes_per_step"]
                                              + chosen["sync_inter_bytes_per_step"]),
                 "baseline_intra_bytes_per_step": float(base[INTRA_BYTES]),
                 "baseline_inter_bytes_per_step": float(base[INTER_BYTES]), STEP_TIME: step_time}
    k1, k2 = chosen["tier1_rows"], chosen["tier2_rows"]
    tier = pl.when(pl.col("pos") < k1).then(1).otherwise(2).cast(pl.Int8).alias("tier")
    rows = order.head(k1 + k2).with_columns(tier).select("table_name", "row", "tier")
    one_node = nodes == 1
    why = (f"one node: tier 2 is the recorded sharding, so the tiers reduce to replicating {k1} rows on every rank"
           if one_node else
           f"{k1} rows on every rank and {k2} once per node cut inter-node bytes from "
           f"{base['inter_bytes_per_step']:.3g} to {chosen['inter_bytes_per_step']:.3g} per step within "
           f"{chosen['memory_bytes_per_rank']:.3g} replica bytes per rank")
    spans = {}
    if step_time is not None:
        spans[STEP_TIME] = (max(step_time - chosen["error_s"], 0.0), step_time + chosen["error_s"])
    if one is not None:  # one node: replication's figures, with their interval from sampled steps
        spans.update(exchange.step_interval(ctx, s, "tk_order_replication", k1))
    else:  # across nodes: the sampled exchange's relative spread at the rows that leave it, on each byte figure
        spread = exchange.step_interval(ctx, s, "tk_order_replication", k1 + k2).get(A2A_REMOTE_BYTES)
        if spread:
            rel = (spread[1] - spread[0]) / 2 / max(sum(spread) / 2, 1.0)
            spans.update({f: (predicted[f] * (1 - rel), predicted[f] * (1 + rel)) for f in
                          (A2A_BYTES, A2A_REMOTE_BYTES, INTRA_BYTES, INTER_BYTES)})
    section = Tiers(topology={"nodes": nodes, "ranks_per_node": g}, rows="policy/tiers.parquet",
                    tier1_sync=chosen["tier1_sync"], budget_bytes_per_rank=int(limit),
                    prediction=Prediction(predicted, why, spans))
    notes = list(s.notes)
    if not one_node and not ctx.options.intra_bw:
        notes.append("no --intra-bw: traffic within a node taken as free beside the fitted inter-node link")
    evidence = {"ordering": "replication's benefit per replica byte", "candidates": len(candidates),
                "budget_bytes_per_rank": limit, "network": net.summary(),
                "reduces_to_replication": one_node, "notes": notes}
    return PolicyResult("tiers", section=section.to_json(), rows={"tiers": rows}, evidence=evidence)

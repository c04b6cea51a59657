"""FlexShard-like tiers for a topology of N nodes × G ranks per node (papers.md §5, B.6): tier 1
rows are replicated on every rank, tier 2 rows once per node (sharded over its ranks), the rest
(tier 3) stay sharded as recorded. Without --topology, the topology the run was recorded on
(`tracekit cluster`), else one node of the run's ranks: tier 2 is then the recorded sharding
itself and the tiers reduce to replication (tier 1).

Rows are ranked as for replication (benefit per replica byte, analyses.policies.replication), so
tier 1 is a prefix K1 of that order and tier 2 the next K2 rows. The bytes are what the reference
trainer does with them (tracekit/dlrm/node_tier.py), per id, replayed exactly over the recorded
lookups for any (K1, K2). A source q's ids split three ways:

    tier 1   looked up where the sample is                     (tracekit/dlrm/replicas.py)
    tier 2   to d = node(q)·G + o mod G, o the row's recorded owner, in the tier-2 exchange on the
             node's group (analyses.policies.tier2: lengths, ids, rows forward and backward)
    tier 3   to o in the main exchange: replication's replay with H = tier 1 ∪ tier 2, the first
             K1 + K2 rows (analyses.exchange: a hot id leaves; a pooled bag all of whose ids are in
             H is sent as −1 and leaves the output all-to-all; lengths keep their size)

so a pooled bag may be served in three parts. The main exchange's remote bytes split into intra-node
and inter-node by its sender's and receiver's nodes (rank // G: exchange.replication_savings with
per_node G); the tier-2 exchange's are all intra-node. What a rank hands itself counts only in
a2a_bytes_per_step (both exchanges: it compares with `comms`); tier2_exchange_bytes_per_step is the
tier-2 exchange's part. Synchronisation per step (bytes summed over ranks):

    tier 1   replication's sync over the W ranks (dense or sparse: exchange.sync_bytes). Its ring
             all-reduce (in rank order) crosses nodes on N of its W links: 1/G of its bytes are
             inter-node; its count all-gather and id all-to-all go from every rank to every other:
             (W − G)/(W − 1) of their bytes inter-node (analyses.simulate's rules)
    tier 2   the node copies' sync, one group of N ranks per local index (analyses.policies.tier2):
             all inter-node

Memory per rank: rb per tier-1 row plus the largest tier-2 block (a rank holds the copies of one
local index). Within the budget (Options, else the replication policy's chosen replica bytes), K1
runs over log-spaced points (and replication's choice) with K2 the rest of the budget (none on one
node, where tier 2 changes nothing), then at the best K1, K2 over log-spaced points below that
(a large tier 2's sync can cost more than it saves); the pair with least time is chosen (with
`--objective bytes`, across nodes, the pair with least bytes between nodes, exchange and syncs). Its time is
replication's (analyses.exchange_timing.timing: each collective of the main exchange costs α plus its
busiest link's transfer and what it held the ranks, scaled here by the bytes it still sends between
nodes, the link a cluster run's calls wait on), plus α for each of the tier-2 exchange's 4 calls
(G > 1, K2 > 0) and each sync's, plus β_intra · intra / W (β_intra 1 / --intra-bw, else 0: ranks of
a node share memory). The syncs' bytes between nodes cross the nodes' links, each carrying 1/N of
them at the link's rate (--inter-bw, else the cluster's the run was recorded on, times
analyses.network.WIRE_EFFICIENCY); without a known rate they go on the fitted link as replication's. Each sync (tier1_sync,
tier2_sync) is the one of least time. On one node every figure is replication's (its exact replay,
its timing).

Outputs: the `tiers` section (topology, predicted intra- and inter-node bytes separately) and
policy/tiers.parquet (table_name, row, tier) listing tier 1 and 2 rows (unlisted rows: tier 3).

    m = model(ctx)             # every (K1, K2) on topology(ctx)
    m.figures(k1, k2)          # the section's figures at that point
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import polars as pl

from analyses import exchange, exchange_timing, network
from analyses.context import Context, PolicyResult
from analyses.exchange import ExchangeBaseline
from analyses.network import WIRE_EFFICIENCY
from analyses.policies import replication, tier2
from tracekit.figures import A2A_BYTES, A2A_REMOTE_BYTES, COMM_TIME, INTER_BYTES, INTRA_BYTES, STEP_TIME, SYNC_BYTES
from tracekit.policy import REPLICATION_SYNCS, Prediction, Tiers
from tracekit.topology import Topology

TIER2_EXCHANGE_BYTES = "tier2_exchange_bytes_per_step"
TIER2_SYNC_BYTES = "tier2_sync_bytes_per_step"
TIER2_EXCHANGE_REMOTE = "tier2_exchange_remote_bytes_per_step"  # what crosses a node's own links
TIER1_BYTES = "tier1_bytes_per_rank"  # Σ rb of tier 1: the size of its dense sync
TIER2_BYTES = "tier2_bytes_per_node"  # Σ rb of tier 2: one node's copy, over its ranks' blocks
INTERNAL = ("tier1_sync", "tier2_sync", "error_s", STEP_TIME, "changed_calls", "tier2_collectives")


def topology(ctx: Context) -> Topology:
    """Options.topology, else the cluster the run was recorded on, else one node of its ranks."""
    return ctx.options.topology or Topology.of_run(ctx.manifest, ctx.model.world_size)


@dataclass
class TierModel:
    """Every (K1, K2) of replication's order on nodes × per_node ranks (module docstring)."""

    ctx: Context
    nodes: int
    per_node: int
    s: ExchangeBaseline
    net: network.Network
    curve: replication.Curve  # every prefix of replication's order, replayed
    cum_rb: np.ndarray  # Σ rb of the first K rows
    union: np.ndarray  # Σ rb · steps touching / sampled steps, first K rows: the sparse sync's all-reduce
    inter_base: dict[str, float]  # per collective: the recorded exchange's bytes between nodes, per step
    inter_freed: dict[str, np.ndarray]  # per collective: of them, freed with the first K rows in H
    t2: tier2.Tier2Replay | None  # None on one node
    beta: float
    beta_intra: float
    node_link: float | None  # bytes/s of a node's link each way (--inter-bw, else a cluster run's), or None

    def k2_within(self, k1: int, limit: float) -> int:
        """Tier-2 rows that fit beside k1 tier-1 rows in `limit` bytes per rank (0 on one node)."""
        if self.t2 is None or self.cum_rb[k1] > limit:
            return 0
        return self.t2.fit(k1, limit - self.cum_rb[k1]) - k1

    def figures(self, k1: int, k2: int) -> dict:
        """The section's predicted figures (and bookkeeping: INTERNAL) at (k1, k2)."""
        return self._one_node(k1) if self.t2 is None else self._across(k1, k2)

    def _one_node(self, k1: int) -> dict:
        one = self.curve  # tier 1 is replication, as the trainer applies it
        return {"tier1_rows": k1, "tier2_rows": 0, INTRA_BYTES: float(one.a2a_rem[k1]), INTER_BYTES: 0.0,
                A2A_BYTES: float(one.a2a_out[k1]), A2A_REMOTE_BYTES: float(one.a2a_rem[k1]),
                TIER2_EXCHANGE_BYTES: 0.0, TIER2_EXCHANGE_REMOTE: 0.0, TIER1_BYTES: float(self.cum_rb[k1]),
                TIER2_BYTES: 0.0, "sync_intra_bytes_per_step": float(one.sync[k1]),
                "sync_inter_bytes_per_step": 0.0, TIER2_SYNC_BYTES: 0.0,
                COMM_TIME: float(one.comm_time[k1] + one.work[k1]), "memory_bytes_per_rank": float(self.cum_rb[k1]),
                "tier1_sync": one.sync_kind(k1), "tier2_sync": "sparse_allreduce", "error_s": float(one.error[k1]),
                STEP_TIME: None if one.step_time is None else float(one.step_time[k1]), "changed_calls": 0,
                "tier2_collectives": {}}

    def _across(self, k1: int, k2: int) -> dict:
        c, w, g, net, s = self.curve, self.s.world, self.per_node, self.net, self.s
        k12 = k1 + k2
        left = {col: self.inter_base[col] - float(self.inter_freed[col][k12]) for col in exchange.COLLECTIVES}
        inter = sum(left.values())
        collectives = self.t2.exchange(k1, k12)
        t2_out = sum(out for out, _ in collectives.values())
        t2_remote = sum(rem for _, rem in collectives.values())
        # with one rank a node every remote byte is between nodes: the difference is 0 up to rounding,
        # which must not leave a byte figure (and its interval) below 0
        intra = max(float(c.a2a_rem[k12]) - inter, 0.0) + t2_remote

        def tier1(kind: str) -> tuple[float, float]:  # (intra, inter): the module docstring's shares
            total = float(c.dense[k1] if kind == "dense_allreduce" else c.sparse[k1])
            ring = total if kind == "dense_allreduce" else 2 * (w - 1) * float(self.union[k1])
            cross = ring / g + (total - ring) * (w - g) / (w - 1)
            return total - cross, cross

        def time(kind1: str, kind2: str) -> tuple[float, float, float | None, float]:
            """(comm, work, step, error): the main exchange as replication's timing prices it, its
            collectives' busiest links scaled by the bytes left between nodes; the syncs' bytes
            between nodes over the nodes' links where their rate is known (module docstring), else
            on the fitted link; each added call its α."""
            t1_intra, t1_inter = tier1(kind1)
            between = t1_inter + sync2[kind2]
            on_link = 0.0 if self.node_link else t1_intra + between  # the sync bytes timing prices
            remote = {col: s.base[col][1] * (left[col] / self.inter_base[col] if self.inter_base[col] else 1.0)
                      for col in exchange.COLLECTIVES}
            hot_ids = float(c.coverage[k1]) * s.lookups_per_rank
            t = exchange_timing.timing(self.ctx, s, remote, kind1 == "sparse_allreduce", on_link, hot_ids,
                                float(c.union_rows[k1]))
            alphas = ((net.sync_alpha(kind1) if t1_intra + t1_inter else 0.0)
                      + (net.sync_alpha(kind2) if sync2[kind2] else 0.0)
                      - (net.sync_alpha(kind1) if on_link else 0.0))  # timing priced one sync's calls
            extra = (tier2_calls * net.alpha(network.A2A) + alphas + self.beta_intra * intra / w
                     + (between / self.nodes / self.node_link + self.beta_intra * t1_intra / w if self.node_link
                        else 0.0))
            step = None if t.step_s is None else max(0.0, float(t.step_s) + extra)
            return float(t.comm_s) + extra, float(t.work_s), step, float(t.error_s)

        sync2 = self.t2.sync(k1, k12)
        tier2_calls = len(tier2.COLLECTIVES) if g > 1 and k2 > 0 else 0  # with G = 1 rows are served in place
        # the least time; ties go to the dense sync (the kinds' names order them)
        kind1, kind2 = min(((a, b) for a in REPLICATION_SYNCS for b in REPLICATION_SYNCS),
                           key=lambda kinds: (sum(time(*kinds)[:2]), kinds))
        comm, work, step, error = time(kind1, kind2)
        sync_intra, sync1_inter = tier1(kind1)
        syncs = ((kind1, sync_intra + sync1_inter), (kind2, sync2[kind2]))
        changed = tier2_calls + sum(net.sync_calls(kind) for kind, b in syncs if b > 0)
        return {"tier1_rows": k1, "tier2_rows": k2, INTRA_BYTES: intra, INTER_BYTES: inter,
                A2A_BYTES: float(c.a2a_out[k12]) + t2_out, A2A_REMOTE_BYTES: intra + inter,
                TIER2_EXCHANGE_BYTES: t2_out, TIER2_EXCHANGE_REMOTE: t2_remote,
                TIER1_BYTES: float(self.cum_rb[k1]), TIER2_BYTES: float(self.cum_rb[k12] - self.cum_rb[k1]),
                "sync_intra_bytes_per_step": sync_intra,
                "sync_inter_bytes_per_step": sync1_inter + sync2[kind2], TIER2_SYNC_BYTES: sync2[kind2],
                COMM_TIME: comm + work, "memory_bytes_per_rank": float(self.cum_rb[k1]) + self.t2.memory(k1, k12),
                "tier1_sync": kind1, "tier2_sync": kind2, "changed_calls": changed, STEP_TIME: step,
                "error_s": error, "tier2_collectives": collectives}


def model(ctx: Context) -> TierModel:
    """The tiers' replay on topology(ctx), once per context (ctx.memo); call after `derive`'s checks
    (replication.cannot, the topology holding the run's ranks)."""
    return ctx.memo(model, lambda: _model(ctx))


def _model(ctx: Context) -> TierModel:
    shape = topology(ctx)
    nodes, g = shape.nodes, shape.ranks_per_node
    s = exchange.baseline(ctx)
    curve = replication.benefit_curve(ctx)  # replication's order, in tk_order_replication
    n = curve.order.height
    rb, steps = (curve.order[c].to_numpy().astype(np.float64) for c in ("rb", "steps"))
    cum_rb = np.concatenate([[0.0], np.cumsum(rb)])
    union = np.concatenate([[0.0], np.cumsum(rb * steps)]) / max(s.sampled_steps, 1)
    inter_base = dict.fromkeys(exchange.COLLECTIVES, 0.0)
    inter_freed = {c: np.zeros(n + 1) for c in exchange.COLLECTIVES}
    t2 = None
    if nodes > 1:
        inter_base.update(ctx.sql(f"""SELECT collective, coalesce(sum(bytes), 0)::DOUBLE / {max(s.sampled_steps, 1)}
                                      FROM {s.tables.pairs} WHERE sender // {g} <> receiver // {g} GROUP BY ALL""").fetchall())
        saved = exchange.replication_savings(ctx, "tk_order_replication", n, per_node=g)
        inter_freed = {c: saved[f"{c}_rem"] for c in exchange.COLLECTIVES}
        t2 = tier2.replay(ctx, "tk_order_replication", nodes, g)
    net = network.network(ctx)
    # across nodes the fitted link is the nodes' (a cluster run's calls cross it); within a node
    # the ranks share memory: free beside it unless --intra-bw says otherwise
    beta_intra = 1 / ctx.options.intra_bw if ctx.options.intra_bw else 0.0
    recorded = (ctx.manifest.topology or {}).get("link_bytes_per_s")
    node_link = ctx.options.inter_bw or (recorded * WIRE_EFFICIENCY if recorded else None)
    return TierModel(ctx, nodes, g, s, net, curve, cum_rb, union, inter_base, inter_freed, t2,
                     net.fit.beta_s_per_byte, beta_intra, node_link)


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
    m = model(ctx)
    limit = float(replication.replica_budget(ctx))
    candidates = []
    chosen_k = int(rep.section.prediction.figures.get("hot_rows", 0) if rep.section else 0)
    for k1 in sorted({*exchange.log_points(m.curve.order.height, 60), chosen_k}):
        if m.cum_rb[k1] > limit:
            break
        candidates.append(m.figures(k1, m.k2_within(k1, limit)))
    merit = _merit(ctx.options.objective, nodes)
    k1 = min(candidates, key=merit)["tier1_rows"]  # then fewer tier-2 rows: its sync may cost more than it saves
    candidates += [m.figures(k1, k2) for k2 in exchange.log_points(m.k2_within(k1, limit), 20)[:-1]]
    chosen = min(candidates, key=merit)
    base = m.figures(0, 0)
    step_time = chosen[STEP_TIME]
    if step_time is None and s.step_time_s is not None:
        step_time = max(0.0, s.step_time_s + chosen[COMM_TIME] - base[COMM_TIME])
        chosen["error_s"] = net.error(chosen["changed_calls"], chosen[COMM_TIME] - base[COMM_TIME])
    predicted = {**{k: float(v) for k, v in chosen.items() if k not in INTERNAL},
                 SYNC_BYTES: float(chosen["sync_intra_bytes_per_step"] + chosen["sync_inter_bytes_per_step"]),
                 "baseline_intra_bytes_per_step": float(base[INTRA_BYTES]),
                 "baseline_inter_bytes_per_step": float(base[INTER_BYTES]), STEP_TIME: step_time}
    k1, k2 = chosen["tier1_rows"], chosen["tier2_rows"]
    tier = pl.when(pl.col("pos") < k1).then(1).otherwise(2).cast(pl.Int8).alias("tier")
    rows = m.curve.order.head(k1 + k2).with_columns(tier).select("table_name", "row", "tier")
    one_node = nodes == 1
    why = (f"one node: tier 2 is the recorded sharding, so the tiers reduce to replicating {k1} rows on every rank"
           if one_node else
           f"{k1} rows on every rank and {k2} once per node cut inter-node bytes from "
           f"{base[INTER_BYTES]:.3g} to {chosen[INTER_BYTES] + chosen['sync_inter_bytes_per_step']:.3g} per step "
           f"(exchange and sync) within {chosen['memory_bytes_per_rank']:.3g} replica bytes per rank")
    section = Tiers(topology={"nodes": nodes, "ranks_per_node": g}, rows="policy/tiers.parquet",
                    tier1_sync=chosen["tier1_sync"], tier2_sync=chosen["tier2_sync"], budget_bytes_per_rank=int(limit),
                    prediction=Prediction(predicted, why, _spans(ctx, s, chosen, predicted, step_time, one_node)))
    notes = list(s.notes)
    if not one_node and not ctx.options.intra_bw:
        notes.append("no --intra-bw: traffic within a node taken as free beside the fitted inter-node link")
    evidence = {"ordering": "replication's benefit per replica byte", "candidates": len(candidates),
                "budget_bytes_per_rank": limit, "network": net.summary(),
                "tier2_exchange": {c: {"bytes_per_step": out, "remote_bytes_per_step": rem}
                                   for c, (out, rem) in chosen["tier2_collectives"].items()},
                "reduces_to_replication": one_node, "notes": notes}
    return PolicyResult("tiers", section=section, rows={"tiers": rows}, evidence=evidence)


def _merit(objective: str, nodes: int):
    """The candidates' order: least communication time, or (objective "bytes", across nodes) least
    bytes between nodes, exchange and syncs; then fewer rows."""
    if objective == "bytes" and nodes > 1:
        return lambda f: (f[INTER_BYTES] + f["sync_inter_bytes_per_step"], f["tier1_rows"], f["tier2_rows"])
    return lambda f: (f[COMM_TIME], f["tier1_rows"], f["tier2_rows"])


def _spans(ctx: Context, s: ExchangeBaseline, chosen: dict, predicted: dict, step_time: float | None,
           one_node: bool) -> dict[str, tuple[float, float]]:
    """Intervals: the step time ± the model's error; the bytes, where lookups were sampled, from the
    sampled steps' spread (one node: replication's; across nodes: the main exchange's relative
    spread at the rows that leave it, on each byte figure)."""
    k1, k12 = chosen["tier1_rows"], chosen["tier1_rows"] + chosen["tier2_rows"]
    spans = {}
    if step_time is not None:
        spans[STEP_TIME] = (max(step_time - chosen["error_s"], 0.0), step_time + chosen["error_s"])
    if one_node:
        spans.update(exchange.step_interval(ctx, s, "tk_order_replication", k1))
        return spans
    spread = exchange.step_interval(ctx, s, "tk_order_replication", k12).get(A2A_REMOTE_BYTES)
    if spread:
        rel = (spread[1] - spread[0]) / 2 / max(sum(spread) / 2, 1.0)
        spans.update({f: (predicted[f] * (1 - rel), predicted[f] * (1 + rel)) for f in
                      (A2A_BYTES, A2A_REMOTE_BYTES, INTRA_BYTES, INTER_BYTES, TIER2_EXCHANGE_BYTES)})
    return spans

"""The embedding exchange's cost model (SCARS, papers.md §2, B.1; collective costs §1.3): bytes and
time per training step of every collective, under the recorded layout and under each candidate
policy, from the formulas and from an exact replay of the recorded `lookups`.

The exchange (DESIGN.md §4, tracekit/dlrm/sharding.py; TorchRec's input and output dist), per step,
from source rank q (b_q samples) to owner o (T_o tables with a shard on o, P_o of them pooled;
F_t the features looking table t up, 1 but for a TorchRec table: analyses.sources.features):

    input_lengths  q -> o   len_bytes · Σ_{t on o} F_t · b_q   (one int32 per (feature, sample))
    input_ids      q -> o   id_bytes · n_qo                    (n_qo: ids of q's samples held by o)
    output_fwd     o -> q   Σ_pooled F_t · rb_t · b_q + Σ_seq rb_t · n_qot    (rb_t = dim · dtype bytes)
    output_bwd     q -> o   the same as output_fwd

Bytes are summed over ranks' `bytes_out`, self-splits included, so they compare with `comms`
exactly (`*_bytes_per_step`); `remote_*` leaves out what a rank sends itself (what crosses the
network). A policy's predicted step time (`timing`) is the measured one (analyses.network's
baseline rule) less the baseline exchange's time plus the policy's: each all-to-all α + β · its
busiest link's bytes (scaled with its remote bytes), the sync's collectives and bytes, and the
rank-side work the calibration measured (SCARS's t_iter = t_compute + t_comm, no overlap); α and β
are fitted from the run's own calls (analyses.network). `sync_choice` is the one rule for dense or
sparse sync, used by every policy that replicates.

Under hybrid replication of a hot set H (papers §7, SCARS step 5), as the trainer does it
(tracekit/dlrm/sharding.py): a hot id is looked up where its sample is, so its id leaves the
input all-to-all; a pooled bag (source q, sample, table; all its owners' partial bags in a
row-wise table) whose ids are all in H leaves the output all-to-all (its returned rows, forward
and backward); a mixed bag sends its cold ids and gets its pooled rows back; a sequence lookup of
a hot row leaves (id and row). Bags with no ids are kept. The lengths exchange keeps its size
under every policy (a bag served locally is sent as −1). The replicas are synchronised every
step, the cheaper of

    dense   2(W−1) · Σ_{i∈H} rb_i                                   (ring all-reduce, §1.3)
    sparse  W(W−1) · 8  +  Σ_r (W−1) · id_bytes · u_r  +  2(W−1) · Σ_{i∈H∩touched} rb_i

with u_r the hot rows rank r's samples touched: an all-gather of each rank's count (int64), the
ids to the W−1 other ranks, then the ring all-reduce over the union of hot rows touched that step. Expected values (i.i.d. samples,
SCARS): per-sample inclusion probability p_i = samples containing row i / samples; per device
batch b, E[U] = Σ_i 1 − (1 − p_i)^b distinct rows, expected remote rows E[U]·(W−1)/W, and
E[union] = Σ_{i∈H} 1 − (1 − p_i)^{bW}. A sequence table's ids are not placed in samples
(analyses.sources), so there p_i = 1 − (1 − π_i)^L (π_i: share of the table's lookups, L: its
lookups per sample; papers §1.2). The SCARS row-fetch layout (`dedup_fetch`, model B of §1.2)
fetches each distinct remote row once per device: id_bytes + 2·rb per row.

`lookups` are recorded every `collector_settings.lookup_every` steps: every per-step figure of a
replay is an average over those sampled steps; `accesses` (every step) are not needed here.
Source ranks come from analyses.sources.

`compute(ctx, policies)` (after the policies: it reads what they derived) writes two tables:
- `costmodel`: policy (baseline, dedup_fetch, replication, tiers, schedule), collective, method
  (replay | expected), bytes_per_step, remote_bytes_per_step, time_s;
- `costmodel_check`: check, subject, predicted, measured, diff, rel_diff — `bytes_out` per
  collective (the replayed baseline against `comms` on the sampled steps: diff 0 when the
  attribution and the layout hold), `distinct_rows` and `remote_rows` per table (E[U] against the
  replay's mean per device batch), `replication_a2a_remote` and `replication_union_rows` (the
  formulas against the replay at the chosen hot set);
and a summary (baseline bytes and time, the network model's fit, baseline_matches_comms,
distinct_rows_max_rel_diff, source_attribution_exact).

    result = compute(ctx)      # tables costmodel, costmodel_check; summary
    setup(ctx)                 # the shared temp tables and per-run constants (cached)
    comms_replay(ctx)          # per (step, rank, collective): replayed and recorded bytes and splits
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import polars as pl

from analyses import network, sources
from analyses.context import Context, Result

COLLECTIVES = ("input_lengths", "input_ids", "output_fwd", "output_bwd")
TRAINER_TAGS = {"input_lengths": "ShardedEmbeddings._input_dist", "input_ids": "ShardedEmbeddings._input_dist",
                "output_fwd": "_AllToAll.forward", "output_bwd": "_AllToAll.backward"}
A2A = "all_to_all_single"
WIRE_ERROR = 0.1  # the share of a change in wire time the α–β fit may be off by
COUNT_BYTES = 8  # the sparse sync's per-rank count of touched replica rows, int64
ALL_REDUCE = "all_reduce"


@dataclass
class Setup:
    """Per-run constants and the replay's temp tables (tk_x, tk_pairs, tk_rows) on ctx.con."""

    world: int
    len_bytes: int
    id_bytes: int
    sampled_steps: int  # training steps with lookups
    samples: int  # samples over those steps, all ranks
    batch: float  # mean per-device batch b
    lookups_per_rank: float  # ids of sharded tables a rank's samples look up per step
    base: dict[str, tuple[float, float]]  # collective -> (bytes_out, remote) per step, replayed
    busiest: dict[str, float]  # collective -> wire bytes per step on its busiest link (analyses.network)
    cost: dict[str, float]  # collective -> seconds per step it holds the ranks, waits included (measured)
    step_time_s: float | None  # measured: analyses.network's baseline rule
    attribution: sources.Attribution
    notes: list[str] = field(default_factory=list)

    @property
    def base_out(self) -> float:
        return sum(v[0] for v in self.base.values())

    @property
    def base_remote(self) -> float:
        return sum(v[1] for v in self.base.values())


_setups: weakref.WeakKeyDictionary[Context, Setup] = weakref.WeakKeyDictionary()


# the shared replay ---------------------------------------------------------------------------

def setup(ctx: Context) -> Setup:
    """Attribute sources, then build tk_x (attributed lookups of sharded tables, with a bag key),
    tk_pairs (the baseline replay per step and rank pair) and tk_rows (per row)."""
    if ctx in _setups:
        return _setups[ctx]
    attribution = sources.attributed(ctx)
    world = ctx.model.world_size
    len_bytes, id_bytes = _elem(ctx, 1, 4), _elem(ctx, 2, 8)
    n_tables = max(len(ctx.model.tables), 1)
    ctx.sql("""CREATE OR REPLACE TEMP TABLE tk_onehot AS
               SELECT tid, max(pos) = 0 AND NOT bool_or(seq) AS onehot FROM tk_src GROUP BY tid""")
    ctx.sql(f"""CREATE OR REPLACE TEMP VIEW tk_x AS
               SELECT l.step, l.owner, l.src, l.tid, l.seq, l.sample, l."row", l.gid, h.onehot,
                      CASE WHEN NOT l.seq THEN l.gid * {n_tables} + l.tid END AS bag
               FROM tk_src l JOIN tk_names n USING (tid) JOIN tk_onehot h USING (tid)
               WHERE n.sharded AND l.src IS NOT NULL""")
    ctx.sql("""CREATE OR REPLACE TEMP TABLE tk_tshards AS
               SELECT n.tid, s.rank AS src, n.rb, n.n_shards,
                      n.n_shards - CAST(EXISTS (SELECT 1 FROM tk_shards h WHERE h.tid = n.tid AND h.rank = s.rank)
                                        AS INTEGER) AS n_remote_shards
               FROM tk_names n CROSS JOIN (SELECT DISTINCT src AS rank FROM tk_batches
                                           UNION SELECT DISTINCT rank FROM tk_shards) s""")
    _pairs(ctx, len_bytes, id_bytes)
    steps, samples = ctx.sql("""SELECT count(DISTINCT s.step), coalesce(sum(b.b), 0)::BIGINT
                                FROM tk_steps s LEFT JOIN tk_batches b USING (step)""").fetchall()[0]
    _rows(ctx, max(steps, 1), len_bytes, id_bytes)
    base = _baseline(ctx, max(steps, 1))
    batch = samples / (steps * world) if steps else 0.0
    lookups = ctx.sql("SELECT count(*) FROM tk_x").fetchall()[0][0] / max(steps * world, 1)
    result = Setup(world, len_bytes, id_bytes, steps, samples, batch, lookups, base, _busiest(ctx, max(steps, 1)),
                   _cost(ctx),
                   network.step_time(ctx).median_s, attribution, list(attribution.notes))
    _setups[ctx] = result
    return result


def _elem(ctx: Context, k: int, default: int) -> int:
    rows = ctx.sql(f"SELECT mode(dtype) FROM tk_a2a WHERE k = {k}").fetchall()
    return sources.elem_bytes(rows[0][0]) if rows and rows[0][0] else default


def _pairs(ctx: Context, len_bytes: int, id_bytes: int) -> None:
    """tk_pairs (step, collective, sender, receiver, bytes): the baseline exchange on sampled steps."""
    ctx.sql("""CREATE OR REPLACE TEMP TABLE tk_owner_consts AS
               SELECT s.rank AS owner, sum(n.n_features) AS n_tables,
                      coalesce(sum(n.rb * n.n_features) FILTER (WHERE n.kind = 'pooled'), 0)::BIGINT AS pooled_rb
               FROM tk_shards s JOIN tk_names n USING (tid) WHERE n.sharded GROUP BY s.rank""")
    ctx.sql(f"""CREATE OR REPLACE TEMP TABLE tk_pairs AS
        WITH counts AS (
            SELECT l.step, l.owner, l.src, count(*) AS ids,
                   coalesce(sum(n.rb) FILTER (WHERE l.seq), 0)::BIGINT AS seq_rb
            FROM tk_x l JOIN tk_names n USING (tid) GROUP BY ALL),
        p AS (
            SELECT b.step, b.src, b.owner, b.b, c.n_tables, c.pooled_rb,
                   coalesce(n.ids, 0) AS ids, coalesce(n.seq_rb, 0) AS seq_rb
            FROM tk_bounds b JOIN tk_steps USING (step) JOIN tk_owner_consts c USING (owner)
            LEFT JOIN counts n USING (step, owner, src))
        SELECT step, 'input_lengths' AS collective, src AS sender, owner AS receiver,
               {len_bytes} * n_tables * b AS bytes FROM p
        UNION ALL SELECT step, 'input_ids', src, owner, {id_bytes} * ids FROM p
        UNION ALL SELECT step, 'output_fwd', owner, src, pooled_rb * b + seq_rb FROM p
        UNION ALL SELECT step, 'output_bwd', src, owner, pooled_rb * b + seq_rb FROM p""")


def item_bytes_sql(len_bytes: int, id_bytes: int) -> str:
    """Columns of the bytes an item moves on each collective, from n_ids, n_remote (ids looked
    up on another rank than src), n_shards, n_remote_shards, rb and `seq` (a sequence lookup)."""
    return f"""CASE WHEN seq THEN 0 ELSE {len_bytes} * n_shards END AS len_out,
               CASE WHEN seq THEN 0 ELSE {len_bytes} * n_remote_shards END AS len_rem,
               {id_bytes} * n_ids AS ids_out, {id_bytes} * n_remote AS ids_rem,
               CASE WHEN seq THEN rb ELSE rb * n_shards END AS row_out,
               CASE WHEN seq THEN rb * n_remote ELSE rb * n_remote_shards END AS row_rem"""


def items_sql(ctx: Context, order: str) -> str:
    """SQL: what replicating a prefix of an ordering table (tid, row, pos) frees, as items with the
    bytes each frees from every collective and its `maxpos`, the position from which on it is freed
    (null: never): per id, its id (at its row's position); per pooled bag, its returned rows (at
    the last position of its ids, null if one is outside the ordering); per sequence lookup, its id
    and row. Lengths never leave (module docstring)."""
    s = setup(ctx)
    columns = f"""0 AS len_out, 0 AS len_rem, {s.id_bytes} * n_ids AS ids_out, {s.id_bytes} * n_remote AS ids_rem,
                  CASE WHEN seq THEN rb ELSE rb * n_shards END AS row_out,
                  CASE WHEN seq THEN rb * n_remote ELSE rb * n_remote_shards END AS row_rem"""
    return f"""
        SELECT step, src, tid, maxpos, n_ids, {columns} FROM (
            SELECT l.step, l.src, l.tid, false AS seq, 1 AS n_ids, CAST(l.owner <> l.src AS INTEGER) AS n_remote,
                   o.pos AS maxpos, t.rb, t.n_shards, t.n_remote_shards
            FROM tk_x l JOIN tk_tshards t USING (tid, src) LEFT JOIN {order} o USING (tid, "row")
            WHERE l.onehot AND l.bag IS NOT NULL)
        UNION ALL
        SELECT l.step, l.src, l.tid, o.pos AS maxpos, 1 AS n_ids, 0 AS len_out, 0 AS len_rem,
               {s.id_bytes} AS ids_out, {s.id_bytes} * CAST(l.owner <> l.src AS INTEGER) AS ids_rem,
               0 AS row_out, 0 AS row_rem
        FROM tk_x l LEFT JOIN {order} o USING (tid, "row") WHERE NOT l.onehot AND l.bag IS NOT NULL
        UNION ALL
        SELECT step, src, tid, maxpos, n_ids, 0 AS len_out, 0 AS len_rem, 0 AS ids_out, 0 AS ids_rem,
               rb * n_shards AS row_out, rb * n_remote_shards AS row_rem FROM (
            SELECT m.*, t.rb, t.n_shards, t.n_remote_shards FROM (
                SELECT any_value(l.step) AS step, any_value(l.src) AS src, any_value(l.tid) AS tid,
                       count(*) AS n_ids,
                       CASE WHEN count(o.pos) = count(*) THEN max(o.pos) END AS maxpos
                FROM tk_x l LEFT JOIN {order} o USING (tid, "row")
                WHERE NOT l.onehot AND l.bag IS NOT NULL GROUP BY l.bag) m
            JOIN tk_tshards t USING (tid, src))
        UNION ALL
        SELECT step, src, tid, maxpos, n_ids, {columns} FROM (
            SELECT l.step, l.src, l.tid, o.pos AS maxpos, 1 AS n_ids, CAST(l.owner <> l.src AS INTEGER) AS n_remote,
                   n.rb, 1 AS n_shards, 0 AS n_remote_shards, true AS seq
            FROM tk_x l JOIN tk_names n USING (tid) LEFT JOIN {order} o USING (tid, "row")
            WHERE l.seq)"""


def _rows(ctx: Context, steps: int, len_b: int, id_b: int) -> None:
    """tk_rows: per (tid, row) its lookups, remote lookups, the steps and (step, source) pairs that
    touched it, the samples holding it, and the all-to-all bytes per step its lookups would free
    (benefit_out, and benefit_rem off the network): a sequence lookup's id and row, a pooled
    lookup's id and its bag's returned rows shared equally among the bag's ids (exact for one-hot
    bags); lengths never leave."""
    ctx.sql("""CREATE OR REPLACE TEMP TABLE tk_bags AS
               SELECT bag, count(*) AS n_ids, count(*) FILTER (WHERE owner <> src) AS n_remote
               FROM tk_x WHERE NOT onehot AND bag IS NOT NULL GROUP BY bag""")
    remote = "CAST(l.owner <> l.src AS INTEGER)"
    ctx.sql(f"""CREATE OR REPLACE TEMP TABLE tk_rows AS
        WITH onehot AS (
            SELECT l.tid, l."row", l.step, l.src, count(*) AS n, sum({remote}) AS n_remote,
                   count(*) AS samples, count(gid) AS placed,
                   count(*) * ({id_b} + 2 * any_value(t.rb) * any_value(t.n_shards)) AS share_out,
                   count(*) * 2 * any_value(t.rb) * any_value(t.n_remote_shards) + {id_b} * sum({remote})
                       AS share_rem
            FROM tk_x l JOIN tk_tshards t USING (tid, src) WHERE l.onehot GROUP BY ALL),
        shares AS (
            SELECT l.tid, l."row", l.step, l.src, l.gid, l.owner,
                   CASE WHEN l.seq THEN {id_b} + 2 * t.rb
                        ELSE {id_b} + 2 * t.rb * t.n_shards / x.n_ids
                   END AS share_out,
                   CASE WHEN l.seq THEN {remote} * ({id_b} + 2 * t.rb)
                        ELSE {id_b} * {remote} + 2 * t.rb * t.n_remote_shards / x.n_ids END AS share_rem
            FROM tk_x l JOIN tk_tshards t USING (tid, src) LEFT JOIN tk_bags x USING (bag)
            WHERE NOT l.onehot AND (l.bag IS NOT NULL OR l.seq)),
        multi AS (
            SELECT tid, "row", step, src, count(*) AS n, count(*) FILTER (WHERE owner <> src) AS n_remote,
                   count(DISTINCT gid) AS samples, count(gid) AS placed,
                   sum(share_out) AS share_out, sum(share_rem) AS share_rem
            FROM shares GROUP BY ALL),
        per_src AS (SELECT * FROM onehot UNION ALL BY NAME SELECT * FROM multi)
        SELECT r.tid, r."row", n.rb, n.kind, sum(r.n)::BIGINT AS lookups, sum(r.n_remote)::BIGINT AS remote_lookups,
               count(DISTINCT r.step) AS steps, count(*) AS src_steps, sum(r.samples)::BIGINT AS samples,
               sum(r.placed)::BIGINT AS placed,
               sum(r.share_out)::DOUBLE / {steps} AS benefit_out, sum(r.share_rem)::DOUBLE / {steps} AS benefit_rem
        FROM per_src r JOIN tk_names n USING (tid) GROUP BY r.tid, r."row", n.rb, n.kind""")


def _baseline(ctx: Context, steps: int) -> dict[str, tuple[float, float]]:
    rows = ctx.sql(f"""SELECT collective, sum(bytes)::DOUBLE / {steps},
                              coalesce(sum(bytes) FILTER (WHERE sender <> receiver), 0)::DOUBLE / {steps}
                       FROM tk_pairs GROUP BY collective""").fetchall()
    found = {c: (out, rem) for c, out, rem in rows}
    return {c: found.get(c, (0.0, 0.0)) for c in COLLECTIVES}


def _cost(ctx: Context) -> dict[str, float]:
    """Per collective of the exchange, the seconds per step it holds the ranks (analyses.network.
    exposed: waits included), from the k-th all-to-all of each rank's step; empty without timings."""
    cases = " ".join(f"WHEN {k} THEN '{c}'" for k, c in enumerate(COLLECTIVES, 1))
    ctx.sql(f"""CREATE OR REPLACE TEMP VIEW tk_a2a_k AS SELECT rank, step, seq, CASE k {cases} END AS collective
                FROM tk_a2a WHERE k <= {len(COLLECTIVES)}""")
    found = network.exposed(ctx, "EXISTS (SELECT 1 FROM tk_a2a_k a WHERE a.rank = train_comms.rank "
                                 "AND a.step = train_comms.step AND a.seq = train_comms.seq)")
    if not found:
        return {}
    rows = ctx.sql(f"""
        WITH per AS (SELECT a.collective, c.step, c.rank, (c.t_end_ns - c.t_start_ns) / 1e9 AS d
                     FROM train_comms c JOIN tk_a2a_k a USING (rank, step, seq) WHERE c.t_end_ns > c.t_start_ns),
             steps AS (SELECT collective, step, avg(d) AS d FROM per GROUP BY ALL)
        SELECT collective, median(d) FROM steps
        WHERE step >= (SELECT min(step) FROM per) + {network.warmup_steps(ctx.train_steps())} GROUP BY ALL""").fetchall()
    return {c: float(d) for c, d in rows}


def _busiest(ctx: Context, steps: int) -> dict[str, float]:
    """Per collective, the replayed remote bytes on its busiest link per step: over ranks, the
    larger of what a rank sends and receives (analyses.network's wire size of an all-to-all)."""
    rows = ctx.sql(f"""
        WITH r AS (SELECT step, collective, sender AS rank, sum(bytes) AS b FROM tk_pairs
                   WHERE sender <> receiver GROUP BY ALL
                   UNION ALL SELECT step, collective, receiver, sum(bytes) FROM tk_pairs
                   WHERE sender <> receiver GROUP BY ALL)
        SELECT collective, sum(m)::DOUBLE / {steps} FROM (SELECT step, collective, max(b) AS m FROM r GROUP BY ALL)
        GROUP BY collective""").fetchall()
    found = dict(rows)
    return {c: float(found.get(c, 0.0)) for c in COLLECTIVES}


# time ------------------------------------------------------------------------------------------

def once(cache: "weakref.WeakKeyDictionary[Context, Any]", ctx: Context, derive: Callable[[Context], Any]) -> Any:
    """derive(ctx), computed once per context (kept in `cache`): the policies build on each other
    and `analyze` asks for each once more."""
    if ctx not in cache:
        cache[ctx] = derive(ctx)
    return cache[ctx]


@dataclass
class Timing:
    """A policy's predicted step (arrays over a curve's K, or floats): seconds."""

    comm_s: Any
    work_s: Any
    step_s: Any  # None without a measured step time
    error_s: Any


def sync_choice(ctx: Context, s: Setup, remote: dict[str, Any], dense: Any, sparse: Any, hot_ids: Any,
                union_rows: Any, rows: Any) -> Any:
    """The one rule for a replica sync: sparse (True) or dense, whichever predicts less time
    (collectives, bytes and calibrated rank work: `timing`), or fewer bytes under `--objective
    bytes`. Arrays broadcast."""
    if ctx.options.objective == "bytes":
        return np.asarray(sparse) <= np.asarray(dense)
    t_sparse = timing(ctx, s, remote, True, sparse, hot_ids, union_rows)
    t_dense = timing(ctx, s, remote, False, dense, hot_ids, rows)
    return t_sparse.comm_s + t_sparse.work_s <= t_dense.comm_s + t_dense.work_s


def timing(ctx: Context, s: Setup, remote: dict[str, Any], sparse: Any, sync_bytes: Any, hot_ids: Any,
           rows: Any, skipped_calls: Any = 0.0) -> Timing:
    """The predicted step of a policy that leaves `remote[c]` remote bytes per step on each
    collective c of the exchange (its busiest link scaled alike), syncs `sync_bytes` per step
    (sparse where `sparse`), serves `hot_ids` lookups per rank and step from replicas and syncs
    `rows` replica rows per step; `skipped_calls`: exchange calls per step it no longer makes.
    step = measured step − the baseline exchange's time + the policy's (exchange, sync, rank work);
    error: analyses.network's (each changed call's residual, a tenth of the wire time changed, the
    calibration's residual, the baseline's drift)."""
    net = network.network(ctx)
    beta, alpha = net.fit.beta_s_per_byte, net.alpha(network.A2A)
    # each collective: α + β · its busiest link's bytes (the transfer, scaled with its remote bytes),
    # and what it measurably held the ranks beyond that (waits for a rank late from the link's
    # previous transfers), scaled with the step's transfer time; on a link whose bytes cost nothing
    # (β ≈ 0: loopback) the waits stay as they are
    transfer = {c: beta * s.busiest[c] for c in COLLECTIVES}
    waits = sum(max(s.cost.get(c, 0.0) - alpha - transfer[c], 0.0) for c in COLLECTIVES)
    ratio = {c: np.asarray(remote[c], dtype=np.float64) / s.base[c][1] if s.base[c][1] else 0.0 for c in COLLECTIVES}
    base_transfer = sum(transfer.values())
    new_transfer = sum(transfer[c] * ratio[c] for c in COLLECTIVES)
    sync_bytes = np.asarray(sync_bytes, dtype=np.float64)
    sparse = np.asarray(sparse, dtype=bool)
    syncing = sync_bytes > 0
    calls = np.where(syncing, np.where(sparse, len(network.SPARSE_SYNC_OPS), 1), 0)
    sync_alpha = np.where(sparse, sum(net.alpha(op) for op in network.SPARSE_SYNC_OPS), net.alpha(network.ALL_REDUCE))
    sync = np.where(syncing, sync_alpha + beta * sync_bytes / max(s.world, 1), 0.0)
    link = new_transfer + beta * sync_bytes / max(s.world, 1)
    held = waits * (link / base_transfer if base_transfer > 0 else 1.0)
    exchange = (len(COLLECTIVES) - np.asarray(skipped_calls, dtype=np.float64)) * alpha + new_transfer + held
    ids = s.lookups_per_rank
    work_sparse = net.work("replication.sparse_allreduce", ids=ids, hot=hot_ids, rows=rows)
    work_dense = net.work("replication.dense_allreduce", ids=ids, hot=hot_ids, rows=rows)
    work = (np.zeros_like(sync) if work_sparse is None or work_dense is None
            else np.where(syncing, np.where(sparse, work_sparse, work_dense), 0.0))
    comm = exchange + sync
    base_comm = len(COLLECTIVES) * alpha + base_transfer + waits
    step = None if s.step_time_s is None else np.maximum(0.0, s.step_time_s - base_comm + comm + work)
    changed = calls + np.asarray(skipped_calls, dtype=np.float64)
    wire_change = np.abs(new_transfer + held - base_transfer - waits) + beta * sync_bytes / max(s.world, 1)
    work_residual = np.where(sparse, net.work_residual("replication.sparse_allreduce"),
                             net.work_residual("replication.dense_allreduce")) * syncing
    error = (np.sqrt(changed * net.fit.residual_s ** 2 + (wire_change * WIRE_ERROR) ** 2 + work_residual ** 2)
             + net.step.spread_s)
    return Timing(comm, work, step, error)


# the formulas ----------------------------------------------------------------------------------

def expected_distinct(p: np.ndarray, b: float) -> float:
    """SCARS E[U] = Σ_i 1 − (1 − p_i)^b: distinct rows a batch of b i.i.d. samples holds."""
    p = np.asarray(p, dtype=np.float64)
    if not len(p) or b <= 0:
        return 0.0
    certain = p >= 1.0  # in every sample: log1p(-1) is -inf, the row is simply there
    rest = np.clip(p[~certain], 0.0, 1.0)
    return float(np.count_nonzero(certain) + np.sum(-np.expm1(b * np.log1p(-rest))))


def sync_bytes(world: int, id_bytes: int, rb: np.ndarray, steps_touched: np.ndarray,
               src_steps: np.ndarray, steps: int) -> tuple[np.ndarray, np.ndarray]:
    """Cumulative (over rows in the given order) dense and sparse replica sync bytes per step,
    summed over ranks (module docstring)."""
    w1 = max(world - 1, 0)
    dense = 2 * w1 * np.cumsum(rb, dtype=np.float64)
    sparse = (w1 * id_bytes * np.cumsum(src_steps, dtype=np.float64)
              + 2 * w1 * np.cumsum(rb * steps_touched, dtype=np.float64)) / max(steps, 1) + count_exchange(world)
    return dense, sparse


def count_exchange(world: int) -> float:
    """Bytes per step of the sparse sync's all-gather of each rank's touched-row count (int64)."""
    return float(world * max(world - 1, 0) * COUNT_BYTES)


def hot_curve(ctx: Context, order: str, n: int) -> dict[str, np.ndarray]:
    """Bytes per step freed from each collective when the first K rows of the ordering `order`
    (a table: tid, row, pos 0..n-1) are replicated, for K = 0..n, exactly (an item leaves
    at K > maxpos). Keys: '<collective>_out' and '<collective>_rem' cumulative arrays of n + 1."""
    s = setup(ctx)
    hist = ctx.frame(f"""SELECT maxpos, sum(len_out)::DOUBLE AS len_out, sum(len_rem)::DOUBLE AS len_rem,
                                sum(ids_out)::DOUBLE AS ids_out, sum(ids_rem)::DOUBLE AS ids_rem,
                                sum(row_out)::DOUBLE AS row_out, sum(row_rem)::DOUBLE AS row_rem
                         FROM ({items_sql(ctx, order)}) WHERE maxpos IS NOT NULL GROUP BY maxpos""")
    out = {}
    pos = hist["maxpos"].to_numpy().astype(np.int64) if len(hist) else np.zeros(0, np.int64)
    for col, collectives in (("len", ("input_lengths",)), ("ids", ("input_ids",)),
                             ("row", ("output_fwd", "output_bwd"))):
        for kind in ("out", "rem"):
            per = np.zeros(n + 1)
            if len(hist):
                np.add.at(per, pos + 1, hist[f"{col}_{kind}"].to_numpy())
            cum = np.cumsum(per) / max(s.sampled_steps, 1)
            for c in collectives:
                out[f"{c}_{kind}"] = cum
    return out


def step_interval(ctx: Context, s: Setup, order: str, k: int, z: float = 2.0) -> dict[str, list[float]]:
    """[low, high] of the all-to-all bytes per step left at K = k (the first k rows of `order`),
    when they come from n sampled steps of N: per sampled step the bytes left, mean ± z·sd/√n·
    √(1 − n/N). Empty where every training step was sampled (the replay is then exact)."""
    total = ctx.train_steps()
    n = s.sampled_steps
    if n < 2 or n >= total:
        return {}
    frame = ctx.frame(f"""
        WITH freed AS (SELECT step, sum(len_out + ids_out + 2 * row_out)::DOUBLE AS f_out,
                              sum(len_rem + ids_rem + 2 * row_rem)::DOUBLE AS f_rem
                       FROM ({items_sql(ctx, order)}) WHERE maxpos < {k} GROUP BY step),
             base AS (SELECT step, sum(bytes)::DOUBLE AS b_out,
                             coalesce(sum(bytes) FILTER (WHERE sender <> receiver), 0)::DOUBLE AS b_rem
                      FROM tk_pairs GROUP BY step)
        SELECT b_out - coalesce(f_out, 0) AS a2a_bytes_per_step, b_rem - coalesce(f_rem, 0) AS a2a_remote_bytes_per_step
        FROM base LEFT JOIN freed USING (step)""")
    finite = (1 - n / total) ** 0.5
    out = {}
    for name in frame.columns:
        values = frame[name].to_numpy()
        half = z * float(values.std(ddof=1)) / len(values) ** 0.5 * finite
        out[name] = [float(values.mean() - half), float(values.mean() + half)]
    return out


def curve_totals(s: Setup, saved: dict[str, np.ndarray], k: int | np.ndarray) -> tuple:
    """(a2a bytes_out, a2a remote) per step after freeing saved[...][k]."""
    out = s.base_out - sum(saved[f"{c}_out"][k] for c in COLLECTIVES)
    rem = s.base_remote - sum(saved[f"{c}_rem"][k] for c in COLLECTIVES)
    return out, rem


# compute ---------------------------------------------------------------------------------------

def compute(ctx: Context, policies: dict[str, Any] | None = None) -> Result:
    """Tables `costmodel` (bytes and time per step per policy and collective, expected and replayed)
    and `costmodel_check` (formula vs replay, replay vs comms), and the summary. `policies`: the
    embedding policies analyze derived (name -> PolicyResult), read rather than derived here."""
    result = Result()
    if not ctx.has("lookups"):
        result.notes.append("no lookups in this run: the cost model needs the sampled per-sample lookups "
                            "(record with --lookup-every N > 0)")
        return result
    if not any(t.placement in (None, "sharded") and t.shards for t in ctx.model.tables):
        result.notes.append("no sharded table (every table data-parallel or rank-local, e.g. TorchRec's "
                            "data_parallel plan): no embedding exchange to model")
        return result
    s = setup(ctx)
    net = network.network(ctx)
    result.notes.extend(s.notes)
    policy_rows, policy_checks = _policy_rows(ctx, s, policies or {})
    extra = _diffs(pl.DataFrame(policy_checks, schema={"check": pl.String, "subject": pl.String,
                                                       "predicted": pl.Float64, "measured": pl.Float64}))
    check = pl.concat([_comms_check(ctx), _distinct_check(ctx, s), extra], how="vertical_relaxed")
    rows = _baseline_rows(s, net) + _dedup_rows(ctx, s, net) + policy_rows
    table = pl.DataFrame(rows, schema={"policy": pl.String, "collective": pl.String, "method": pl.String,
                                       "bytes_per_step": pl.Float64, "remote_bytes_per_step": pl.Float64,
                                       "time_s": pl.Float64})
    result.tables = {"costmodel": table, "costmodel_check": check}
    bytes_check = check.filter(pl.col("check").str.starts_with("bytes"))
    result.summary = {
        "sampled_steps": s.sampled_steps, "world_size": s.world, "batch_per_device": s.batch,
        "baseline_a2a_bytes_per_step": s.base_out, "baseline_a2a_remote_bytes_per_step": s.base_remote,
        "baseline_comm_time_s": float(sum(r["time_s"] for r in _baseline_rows(s, net))),
        "step_time_s": s.step_time_s, "network": net.summary(),
        "baseline_matches_comms": bool(len(bytes_check) and (bytes_check["diff"] == 0).all()),
        "distinct_rows_max_rel_diff": _max_rel(check, "distinct_rows"),
        "source_attribution_exact": s.attribution.exact,
    }
    return result


def _max_rel(check: pl.DataFrame, name: str) -> float | None:
    part = check.filter(pl.col("check") == name)["rel_diff"].drop_nulls()
    return float(part.abs().max()) if len(part) else None


def _seconds(net: network.Network, remote: float, world: int) -> float:
    """One all-to-all call moving `remote` bytes per step, spread evenly over the ranks."""
    return net.call(network.A2A, remote / max(world, 1))


def _baseline_rows(s: Setup, net: network.Network) -> list[dict]:
    return [_row("baseline", c, "replay", out, rem, net.call(network.A2A, s.busiest[c]))
            for c, (out, rem) in s.base.items()]


def _dedup_rows(ctx: Context, s: Setup, net: network.Network) -> list[dict]:
    """SCARS row fetch (model B): each device fetches each distinct remote row once per step."""
    measured = ctx.sql("""SELECT count(*)::DOUBLE FROM (SELECT DISTINCT step, src, tid, "row" FROM tk_x
                          WHERE owner <> src)""").fetchall()[0][0] / max(s.sampled_steps, 1)
    expected = _expected_remote_total(ctx, s) * s.world
    rows = []
    for method, per_step in (("replay", measured), ("expected", expected)):
        for collective, size in (("input_ids", s.id_bytes), ("output_fwd", None), ("output_bwd", None)):
            b = per_step * (size if size else _mean_rb(ctx))
            rows.append({"policy": "dedup_fetch", "collective": collective, "method": method,
                         "bytes_per_step": b, "remote_bytes_per_step": b, "time_s": _seconds(net, b, s.world)})
    return rows


def _mean_rb(ctx: Context) -> float:
    rows = ctx.sql("SELECT sum(rb * lookups)::DOUBLE / nullif(sum(lookups), 0) FROM tk_rows").fetchall()
    return float(rows[0][0] or 0)


def _policy_rows(ctx: Context, s: Setup, policies: dict[str, Any]) -> tuple[list[dict], list[dict]]:
    """Each derived embedding policy's replayed all-to-all and sync bytes per step, and for
    replication the SCARS expectation beside it; and the checks (expected vs replayed)."""
    net = network.network(ctx)
    rows, checks = [], []
    for name in ("replication", "tiers", "schedule"):
        derived = policies.get(name)
        if derived is None or derived.section is None:
            continue
        p = derived.section["predicted"]
        a2a = p["a2a_bytes_per_step"]
        remote = p.get("a2a_remote_bytes_per_step", a2a)
        per_collective = derived.evidence.get("collectives") or {"all_to_all": {"bytes_per_step": a2a,
                                                                               "remote_bytes_per_step": remote}}
        for collective, b in per_collective.items():
            rows.append(_row(derived.name, collective, "replay", b["bytes_per_step"], b["remote_bytes_per_step"],
                             _seconds(net, b["remote_bytes_per_step"], s.world)))
        sync = p["sync_bytes_per_step"]
        kind = derived.section.get("sync") or derived.section.get("tier1_sync") or "sparse_allreduce"
        rows.append(_row(derived.name, "sync", "replay", sync, sync, net.sync(kind, sync)))
        if derived.name == "replication":
            expected = _replication_expected(ctx, s, int(p["hot_rows"]))
            sync_e = expected["sparse"] if kind == "sparse_allreduce" else sync
            rows.append(_row("replication", "all_to_all", "expected", None, expected["a2a_remote"],
                             _seconds(net, expected["a2a_remote"], s.world)))
            rows.append(_row("replication", "sync", "expected", sync_e, sync_e, net.sync(kind, sync_e)))
            checks.append({"check": "replication_a2a_remote", "subject": "replication",
                           "predicted": expected["a2a_remote"], "measured": float(remote)})
            checks.append({"check": "replication_union_rows", "subject": "replication", "predicted": expected["union"],
                           "measured": float(derived.evidence["union_hot_rows_per_step"])})
    return rows, checks


def _row(policy: str, collective: str, method: str, out: float | None, remote: float | None,
         time: float | None) -> dict:
    return {"policy": policy, "collective": collective, "method": method,
            "bytes_per_step": None if out is None else float(out),
            "remote_bytes_per_step": None if remote is None else float(remote),
            "time_s": None if time is None else float(time)}


def _replication_expected(ctx: Context, s: Setup, k: int) -> dict[str, float]:
    """SCARS expectations for the first k rows of replication's order: remote a2a bytes left
    (Σ over the rest of each row's share), union of hot rows touched per step
    Σ 1 − (1 − p_i)^{bW}, and the sparse sync they imply."""
    p = inclusion(ctx, s).join(ctx.frame(f"""SELECT tid, "row", rb, benefit_rem FROM tk_order_replication
                                             WHERE pos < {k}"""), on=["tid", "row"])
    left = s.base_remote - float(p["benefit_rem"].sum())
    if p.height == 0:
        return {"a2a_remote": left, "union": 0.0, "sparse": 0.0}
    probability = np.clip(p["p"].to_numpy(), 0, 1)
    rb = p["rb"].to_numpy().astype(np.float64)
    global_batch, device_batch = s.batch * s.world, s.batch
    touched = -np.expm1(global_batch * np.log1p(-np.minimum(probability, 1 - 1e-12)))
    per_rank = -np.expm1(device_batch * np.log1p(-np.minimum(probability, 1 - 1e-12)))
    w1 = s.world - 1
    sparse = (w1 * s.id_bytes * s.world * float(per_rank.sum()) + 2 * w1 * float((rb * touched).sum())
              + count_exchange(s.world))
    return {"a2a_remote": left, "union": float(touched.sum()), "sparse": sparse}


# checks ----------------------------------------------------------------------------------------

def comms_replay(ctx: Context) -> pl.DataFrame:
    """Per (step, rank, collective) on sampled steps: the replayed baseline beside `comms` —
    bytes_out, bytes_in, splits_out, splits_in of each (`*_pred` and `*_comms`)."""
    setup(ctx)
    ordinal = " ".join(f"WHEN {k} THEN '{c}'" for k, c in enumerate(COLLECTIVES, 1))
    return ctx.frame(f"""
        WITH pred AS (
            SELECT p.step, r.rank, p.collective,
                   sum(p.bytes) FILTER (WHERE p.sender = r.rank)::BIGINT AS bytes_out_pred,
                   sum(p.bytes) FILTER (WHERE p.receiver = r.rank)::BIGINT AS bytes_in_pred,
                   list(p.bytes ORDER BY p.receiver) FILTER (WHERE p.sender = r.rank) AS splits_out_pred,
                   list(p.bytes ORDER BY p.sender) FILTER (WHERE p.receiver = r.rank) AS splits_in_pred
            FROM tk_pairs p JOIN (SELECT DISTINCT owner AS rank FROM tk_bounds) r
              ON p.sender = r.rank OR p.receiver = r.rank
            GROUP BY ALL),
        rec AS (
            SELECT step, rank, CASE k {ordinal} END AS collective, tag, bytes_out AS bytes_out_comms,
                   bytes_in AS bytes_in_comms, splits_out AS splits_out_comms, splits_in AS splits_in_comms
            FROM tk_a2a JOIN tk_steps USING (step) WHERE k <= 4)
        SELECT * FROM pred FULL JOIN rec USING (step, rank, collective) ORDER BY step, rank, collective""")


def _comms_check(ctx: Context) -> pl.DataFrame:
    frame = comms_replay(ctx)
    return (frame.group_by("collective")
            .agg(pl.col("bytes_out_pred").sum().cast(pl.Float64).alias("predicted"),
                 pl.col("bytes_out_comms").sum().cast(pl.Float64).alias("measured"))
            .with_columns(pl.lit("bytes_out").alias("check"), pl.col("collective").alias("subject"))
            .pipe(_diffs).sort("subject"))


def _diffs(frame: pl.DataFrame) -> pl.DataFrame:
    return frame.select("check", "subject", "predicted", "measured").with_columns(
        (pl.col("predicted") - pl.col("measured")).alias("diff"),
        ((pl.col("predicted") - pl.col("measured")) / pl.col("measured")).alias("rel_diff"))


def inclusion(ctx: Context, s: Setup) -> pl.DataFrame:
    """Per (tid, row): table_name and p, the per-sample inclusion probability (module docstring)."""
    return ctx.frame(f"""
        WITH t AS (SELECT tid, sum(lookups)::DOUBLE AS lookups, sum(placed) AS placed FROM tk_rows GROUP BY ALL)
        SELECT r.tid, n.table_name, r."row",
               CASE WHEN t.placed = t.lookups THEN r.samples::DOUBLE / {max(s.samples, 1)}
                    ELSE 1 - pow(1 - r.lookups / t.lookups, t.lookups / {max(s.samples, 1)}) END AS p
        FROM tk_rows r JOIN t USING (tid) JOIN tk_names n USING (tid)""")


def _expected_remote_total(ctx: Context, s: Setup) -> float:
    """Σ over tables of E[U] · (W−1)/W: distinct remote rows per device batch."""
    p = inclusion(ctx, s)
    total = sum(expected_distinct(g["p"].to_numpy(), s.batch) for _, g in p.group_by("tid"))
    return total * (s.world - 1) / max(s.world, 1)


def _distinct_check(ctx: Context, s: Setup) -> pl.DataFrame:
    """Per table: E[U] and expected remote rows per device batch against the replay's mean."""
    p = inclusion(ctx, s)
    expected = {name: expected_distinct(g["p"].to_numpy(), s.batch) for (name,), g in p.group_by("table_name")}
    measured = ctx.frame("""
        WITH u AS (SELECT step, src, tid, count(DISTINCT "row") AS u,
                          count(DISTINCT "row") FILTER (WHERE owner <> src) AS u_rem
                   FROM tk_x GROUP BY ALL),
             cells AS (SELECT b.step, b.src, t.tid FROM tk_batches b JOIN tk_steps USING (step)
                       CROSS JOIN (SELECT DISTINCT tid FROM tk_x) t WHERE b.b > 0)
        SELECT n.table_name, avg(coalesce(u.u, 0)) AS u, avg(coalesce(u.u_rem, 0)) AS u_rem
        FROM cells c LEFT JOIN u USING (step, src, tid) JOIN tk_names n USING (tid) GROUP BY n.table_name""")
    frac = (s.world - 1) / max(s.world, 1)
    rows = []
    for name, u, u_rem in measured.iter_rows():
        e = expected.get(name, 0.0)
        rows.append({"check": "distinct_rows", "subject": name, "predicted": e, "measured": float(u)})
        rows.append({"check": "remote_rows", "subject": name, "predicted": e * frac, "measured": float(u_rem)})
    frame = pl.DataFrame(rows, schema={"check": pl.String, "subject": pl.String, "predicted": pl.Float64,
                                       "measured": pl.Float64})
    return _diffs(frame).sort("check", "subject")


def log_points(n: int, count: int = 30) -> list[int]:
    """0, then about `count` log-spaced positions in 1..n, n included."""
    if n <= 0:
        return [0]
    return sorted({0, n, *(int(round(x)) for x in np.geomspace(1, n, num=min(count, n)))})


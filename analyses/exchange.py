"""The replay of the embedding exchange: what each collective of the trainer's input and output
dist moves, per step and rank pair, under the recorded layout and with any set of rows replicated,
from the recorded `lookups` (their source ranks from analyses.attribution).

The exchange (DESIGN.md §4, tracekit/dlrm/sharding.py; TorchRec's input and output dist), per step,
from source rank q (b_q samples) to owner o (T_o tables with a shard on o, P_o of them pooled;
F_t the features looking table t up, 1 but for a TorchRec table: analyses.attribution.features):

    input_lengths  q -> o   len_bytes · Σ_{t on o} F_t · b_q   (one int32 per (feature, sample))
    input_ids      q -> o   id_bytes · n_qo                    (n_qo: ids of q's samples held by o)
    output_fwd     o -> q   Σ_pooled F_t · rb_t · b_q + Σ_seq rb_t · n_qot    (rb_t = dim · dtype bytes)
    output_bwd     q -> o   the same as output_fwd

Bytes are summed over ranks' `bytes_out`, self-splits included, so they compare with `comms`
exactly (`*_bytes_per_step`); `remote_*` leaves out what a rank sends itself (what crosses the
network). `ExchangeBaseline` also holds, per collective, its busiest link's bytes and what it
measurably held the ranks: analyses.exchange_timing prices a policy's step from them.

Under hybrid replication of a hot set H (papers §7, SCARS step 5), as the trainer does it
(tracekit/dlrm/sharding.py): a hot id is looked up where its sample is, so its id leaves the
input all-to-all; a pooled bag (source q, sample, table; all its owners' partial bags in a
row-wise table) whose ids are all in H leaves the output all-to-all (its returned rows, forward
and backward); a mixed bag sends its cold ids and gets its pooled rows back; a sequence lookup of
a hot row leaves (id and row). Bags with no ids are kept. The lengths exchange keeps its size
under every policy (a bag served locally is sent as −1). The replicas are synchronised every
step (`sync_bytes`), dense or sparse (analyses.exchange_timing.sync_choice picks):

    dense   2(W−1) · Σ_{i∈H} rb_i                                   (ring all-reduce, §1.3)
    sparse  W(W−1) · 8  +  Σ_r (W−1) · id_bytes · u_r  +  2(W−1) · Σ_{i∈H∩touched} rb_i

with u_r the hot rows rank r's samples touched: an all-gather of each rank's count (int64), the
ids to the W−1 other ranks, then the ring all-reduce over the union of hot rows touched that step.

`lookups` are recorded every `collector_settings.lookup_every` steps: every per-step figure of a
replay is an average over those sampled steps, with `step_interval` its interval where steps were
sampled (exact where every step was).

    s = baseline(ctx)                   # the replay's temp tables and per-run constants (once per context)
    saved = replication_savings(ctx, order, n)  # bytes freed per collective by every prefix of a row order
    comms_replay(ctx)                   # per (step, rank, collective): replayed and recorded bytes

The tables it leaves on the context's connection that other modules read, named by
`baseline(ctx).tables` (`ExchangeTables`, field: table; the attribution's are
`baseline(ctx).attribution.tables`):

    x           tk_x (a view): step, owner, src, tid, seq, sample, row, gid, onehot (the table's bags are
                one id at position 0), bag (a pooled bag's key, per sample, table and feature; null
                for sequence lookups): the
                attributed lookups of sharded tables
    tshards     tk_tshards: tid, src, rb, n_shards, n_remote_shards: per table and source rank, the shards a
                bag of its is split over, and those on another rank
    pairs       tk_pairs: step, collective, sender, receiver, bytes: the baseline exchange on sampled steps
    rows        tk_rows: tid, row, rb, kind, lookups, remote_lookups, steps, src_steps, samples, placed,
                benefit_out, benefit_rem: per row, its lookups and the bytes per step they would free

tk_onehot, tk_owner_consts, tk_bags and tk_a2a_k are its own steps.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import polars as pl

from analyses import attribution, network
from analyses.context import Context
from tracekit import tags

COLLECTIVES = tags.EXCHANGE


TRAINER_TAGS = {c: c for c in COLLECTIVES}
"""The tag the reference trainer gives each collective of its plain exchange: the collective's name
(through a codec the outputs carry tracekit.tags.OUTPUT_FWD_CODED, OUTPUT_BWD_CODED; a run recorded
before the trainer labelled them, tags.LEGACY_*: analyses.roles reads each as its role)."""


COUNT_BYTES = 8  # the sparse sync's per-rank count of touched replica rows, int64


@dataclass(frozen=True)
class ExchangeTables:
    """The tables `baseline` leaves on the context's connection for other analyses, by what they
    hold (their columns in the module docstring)."""

    x: str = "tk_x"
    tshards: str = "tk_tshards"
    pairs: str = "tk_pairs"
    rows: str = "tk_rows"


TABLES = ExchangeTables()


@dataclass
class ExchangeBaseline:
    """The recorded exchange, replayed: per-run constants and, per collective, its bytes, its
    busiest link's and what it held the ranks, with the replay's temp tables (module docstring)
    on ctx.con."""

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
    attribution: attribution.Attribution
    notes: list[str] = field(default_factory=list)
    tables: ExchangeTables = TABLES

    @property
    def base_out(self) -> float:
        return sum(v[0] for v in self.base.values())

    @property
    def base_remote(self) -> float:
        return sum(v[1] for v in self.base.values())


def baseline(ctx: Context) -> ExchangeBaseline:
    """Attribute the lookups' sources, then build tk_x (attributed lookups of sharded tables, with
    a bag key), tk_pairs (the baseline replay per step and rank pair) and tk_rows (per row); once
    per context (ctx.memo)."""
    return ctx.memo(baseline, lambda: _replay_baseline(ctx))


def _replay_baseline(ctx: Context) -> ExchangeBaseline:
    attributed = attribution.attributed(ctx)
    a = attributed.tables
    world = ctx.model.world_size
    len_bytes, id_bytes = _elem(ctx, tags.INPUT_LENGTHS, 4), _elem(ctx, tags.INPUT_IDS, 8)
    n_tables = max(len(ctx.model.tables), 1)
    ctx.sql(f"""CREATE OR REPLACE TEMP TABLE tk_onehot AS
               SELECT tid, max(pos) = 0 AND NOT bool_or(seq) AS onehot FROM {a.lookups} GROUP BY tid""")
    features = max([*attribution.features(ctx).values(), 1])
    ctx.sql(f"""CREATE OR REPLACE TEMP VIEW tk_x AS
               SELECT l.step, l.owner, l.src, l.tid, l.seq, l.sample, l."row", l.gid, h.onehot,
                      CASE WHEN NOT l.seq THEN (l.gid * {n_tables} + l.tid) * {features} + l.feature END AS bag
               FROM {a.lookups} l JOIN {a.names} n USING (tid) JOIN tk_onehot h USING (tid)
               WHERE n.sharded AND l.src IS NOT NULL""")
    ctx.sql(f"""CREATE OR REPLACE TEMP TABLE tk_tshards AS
               SELECT n.tid, s.rank AS src, n.rb, n.n_shards,
                      n.n_shards - CAST(EXISTS (SELECT 1 FROM {a.shards} h WHERE h.tid = n.tid AND h.rank = s.rank)
                                        AS INTEGER) AS n_remote_shards
               FROM {a.names} n CROSS JOIN (SELECT DISTINCT src AS rank FROM {a.batches}
                                           UNION SELECT DISTINCT rank FROM {a.shards}) s""")
    _pairs(ctx, len_bytes, id_bytes)
    steps, samples = ctx.sql(f"""SELECT count(DISTINCT s.step), coalesce(sum(b.b), 0)::BIGINT
                                FROM {a.steps} s LEFT JOIN {a.batches} b USING (step)""").fetchall()[0]
    _rows(ctx, max(steps, 1), len_bytes, id_bytes)
    base = _base_bytes(ctx, max(steps, 1))
    batch = samples / (steps * world) if steps else 0.0
    lookups = ctx.sql("SELECT count(*) FROM tk_x").fetchall()[0][0] / max(steps * world, 1)
    return ExchangeBaseline(world, len_bytes, id_bytes, steps, samples, batch, lookups, base,
                            _busiest(ctx, max(steps, 1)), _cost(ctx), network.step_time(ctx).median_s, attributed,
                            list(attributed.notes))


def element_bytes(ctx: Context) -> tuple[int, int]:
    """The bytes of a bag length and of an id in the input dist, as the run sent them (int32, int64 unless
    its calls say otherwise)."""
    def elem(role: str, default: int) -> int:
        rows = ctx.sql("SELECT mode(dtype) FROM train_comms WHERE role = ?", [role]).fetchall() if ctx.has("comms") else []
        return attribution.elem_bytes(rows[0][0]) if rows and rows[0][0] else default
    return elem(tags.INPUT_LENGTHS, 4), elem(tags.INPUT_IDS, 8)


def _elem(ctx: Context, role: str, default: int) -> int:
    a = attribution.attributed(ctx).tables
    rows = ctx.sql(f"SELECT mode(dtype) FROM {a.a2a} WHERE role = '{role}'").fetchall()
    return attribution.elem_bytes(rows[0][0]) if rows and rows[0][0] else default


def _pairs(ctx: Context, len_bytes: int, id_bytes: int) -> None:
    """tk_pairs (step, collective, sender, receiver, bytes): the baseline exchange on sampled steps."""
    a = attribution.attributed(ctx).tables
    ctx.sql(f"""CREATE OR REPLACE TEMP TABLE tk_owner_consts AS
               SELECT s.rank AS owner, sum(n.n_features) AS n_tables,
                      coalesce(sum(n.rb * n.n_features) FILTER (WHERE n.kind = 'pooled'), 0)::BIGINT AS pooled_rb
               FROM {a.shards} s JOIN {a.names} n USING (tid) WHERE n.sharded GROUP BY s.rank""")
    ctx.sql(f"""CREATE OR REPLACE TEMP TABLE tk_pairs AS
        WITH counts AS (
            SELECT l.step, l.owner, l.src, count(*) AS ids,
                   coalesce(sum(n.rb) FILTER (WHERE l.seq), 0)::BIGINT AS seq_rb
            FROM tk_x l JOIN {a.names} n USING (tid) GROUP BY ALL),
        p AS (
            SELECT b.step, b.src, b.owner, b.b, c.n_tables, c.pooled_rb,
                   coalesce(n.ids, 0) AS ids, coalesce(n.seq_rb, 0) AS seq_rb
            FROM {a.bounds} b JOIN {a.steps} USING (step) JOIN tk_owner_consts c USING (owner)
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


def items_sql(ctx: Context, order: str, per_node: int = 1) -> str:
    """SQL: what replicating a prefix of an ordering table (tid, row, pos) frees, as items with the
    bytes each frees from every collective and its `maxpos`, the position from which on it is freed
    (null: never): per id, its id (at its row's position); per pooled bag, its returned rows (at
    the last position of its ids, null if one is outside the ordering); per sequence lookup, its id
    and row. Lengths never leave (module docstring). `*_rem`: bytes between ranks on different
    nodes of `per_node` ranks (rank // per_node; 1: between different ranks)."""
    s = baseline(ctx)
    a, g = s.attribution.tables, per_node
    remote = "CAST(l.owner <> l.src AS INTEGER)" if g == 1 else f"CAST(l.owner // {g} <> l.src // {g} AS INTEGER)"
    tshards = "tk_tshards" if g == 1 else f"""(
        SELECT t.tid, t.src, t.rb, t.n_shards,
               t.n_shards - (SELECT count(*) FROM {a.shards} h WHERE h.tid = t.tid AND h.rank // {g} = t.src // {g})
                   AS n_remote_shards
        FROM tk_tshards t)"""
    columns = f"""0 AS len_out, 0 AS len_rem, {s.id_bytes} * n_ids AS ids_out, {s.id_bytes} * n_remote AS ids_rem,
                  CASE WHEN seq THEN rb ELSE rb * n_shards END AS row_out,
                  CASE WHEN seq THEN rb * n_remote ELSE rb * n_remote_shards END AS row_rem"""
    return f"""
        SELECT step, src, tid, maxpos, n_ids, {columns} FROM (
            SELECT l.step, l.src, l.tid, false AS seq, 1 AS n_ids, {remote} AS n_remote,
                   o.pos AS maxpos, t.rb, t.n_shards, t.n_remote_shards
            FROM tk_x l JOIN {tshards} t USING (tid, src) LEFT JOIN {order} o USING (tid, "row")
            WHERE l.onehot AND l.bag IS NOT NULL)
        UNION ALL
        SELECT l.step, l.src, l.tid, o.pos AS maxpos, 1 AS n_ids, 0 AS len_out, 0 AS len_rem,
               {s.id_bytes} AS ids_out, {s.id_bytes} * {remote} AS ids_rem,
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
            JOIN {tshards} t USING (tid, src))
        UNION ALL
        SELECT step, src, tid, maxpos, n_ids, {columns} FROM (
            SELECT l.step, l.src, l.tid, o.pos AS maxpos, 1 AS n_ids, {remote} AS n_remote,
                   n.rb, 1 AS n_shards, 0 AS n_remote_shards, true AS seq
            FROM tk_x l JOIN {a.names} n USING (tid) LEFT JOIN {order} o USING (tid, "row")
            WHERE l.seq)"""


def _rows(ctx: Context, steps: int, len_b: int, id_b: int) -> None:
    """tk_rows: per (tid, row) its lookups, remote lookups, the steps and (step, source) pairs that
    touched it, the samples holding it, and the all-to-all bytes per step its lookups would free
    (benefit_out, and benefit_rem off the network): a sequence lookup's id and row, a pooled
    lookup's id and its bag's returned rows shared equally among the bag's ids (exact for one-hot
    bags); lengths never leave."""
    a = attribution.attributed(ctx).tables
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
        FROM per_src r JOIN {a.names} n USING (tid) GROUP BY r.tid, r."row", n.rb, n.kind""")


def _base_bytes(ctx: Context, steps: int) -> dict[str, tuple[float, float]]:
    rows = ctx.sql(f"""SELECT collective, sum(bytes)::DOUBLE / {steps},
                              coalesce(sum(bytes) FILTER (WHERE sender <> receiver), 0)::DOUBLE / {steps}
                       FROM tk_pairs GROUP BY collective""").fetchall()
    found = {c: (out, rem) for c, out, rem in rows}
    return {c: found.get(c, (0.0, 0.0)) for c in COLLECTIVES}


def _cost(ctx: Context) -> dict[str, float]:
    """Per collective of the exchange, the seconds per step it holds the ranks (analyses.network.
    exposed: waits included), from each rank's all-to-all of that role; empty without timings."""
    a = attribution.attributed(ctx).tables
    ctx.sql(f"CREATE OR REPLACE TEMP VIEW tk_a2a_k AS SELECT rank, step, seq, role AS collective FROM {a.a2a}")
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


def replication_savings(ctx: Context, order: str, n: int, per_node: int = 1) -> dict[str, np.ndarray]:
    """Bytes per step freed from each collective when the first K rows of the ordering `order`
    (a table: tid, row, pos 0..n-1) are replicated, for K = 0..n, exactly (an item leaves
    at K > maxpos). Keys: '<collective>_out' and '<collective>_rem' cumulative arrays of n + 1;
    `_rem` between nodes of `per_node` ranks (`items_sql`; 1: between ranks)."""
    s = baseline(ctx)
    hist = ctx.frame(f"""SELECT maxpos, sum(len_out)::DOUBLE AS len_out, sum(len_rem)::DOUBLE AS len_rem,
                                sum(ids_out)::DOUBLE AS ids_out, sum(ids_rem)::DOUBLE AS ids_rem,
                                sum(row_out)::DOUBLE AS row_out, sum(row_rem)::DOUBLE AS row_rem
                         FROM ({items_sql(ctx, order, per_node)}) WHERE maxpos IS NOT NULL GROUP BY maxpos""")
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


def step_interval(ctx: Context, s: ExchangeBaseline, order: str, k: int,
                  z: float = 2.0) -> dict[str, list[float]]:
    """[low, high] of the all-to-all bytes per step left at K = k (the first k rows of `order`),
    when they come from n sampled steps of N: per sampled step the bytes left, mean ± z·sd/√n·
    √(1 − n/N). Empty where every training step was sampled (the replay is then exact)."""
    total = ctx.train_steps()
    n = s.sampled_steps
    if n < 2 or n >= total:
        return {}
    prefix = f"(SELECT * FROM {order} WHERE pos < {int(k)})"  # joined, not filtered after: a smaller hash table
    frame = ctx.frame(f"""
        WITH freed AS (SELECT step, sum(len_out + ids_out + 2 * row_out)::DOUBLE AS f_out,
                              sum(len_rem + ids_rem + 2 * row_rem)::DOUBLE AS f_rem
                       FROM ({items_sql(ctx, prefix)}) WHERE maxpos IS NOT NULL GROUP BY step),
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


def curve_totals(s: ExchangeBaseline, saved: dict[str, np.ndarray], k: int | np.ndarray) -> tuple:
    """(a2a bytes_out, a2a remote) per step after freeing saved[...][k]."""
    out = s.base_out - sum(saved[f"{c}_out"][k] for c in COLLECTIVES)
    rem = s.base_remote - sum(saved[f"{c}_rem"][k] for c in COLLECTIVES)
    return out, rem


# shared by the policies ---------------------------------------------------------------------

def log_points(n: int, count: int = 30) -> list[int]:
    """0, then about `count` log-spaced positions in 1..n, n included."""
    if n <= 0:
        return [0]
    return sorted({0, n, *(int(round(x)) for x in np.geomspace(1, n, num=min(count, n)))})


def comms_replay(ctx: Context) -> pl.DataFrame:
    """Per (step, rank, collective) on sampled steps: the replayed baseline beside `comms` —
    bytes_out, bytes_in, splits_out, splits_in of each (`*_pred` and `*_comms`)."""
    a = baseline(ctx).attribution.tables
    return ctx.frame(f"""
        WITH pred AS (
            SELECT p.step, r.rank, p.collective,
                   sum(p.bytes) FILTER (WHERE p.sender = r.rank)::BIGINT AS bytes_out_pred,
                   sum(p.bytes) FILTER (WHERE p.receiver = r.rank)::BIGINT AS bytes_in_pred,
                   list(p.bytes ORDER BY p.receiver) FILTER (WHERE p.sender = r.rank) AS splits_out_pred,
                   list(p.bytes ORDER BY p.sender) FILTER (WHERE p.receiver = r.rank) AS splits_in_pred
            FROM tk_pairs p JOIN (SELECT DISTINCT owner AS rank FROM {a.bounds}) r
              ON p.sender = r.rank OR p.receiver = r.rank
            GROUP BY ALL),
        rec AS (
            SELECT step, rank, role AS collective, tag, bytes_out AS bytes_out_comms,
                   bytes_in AS bytes_in_comms, splits_out AS splits_out_comms, splits_in AS splits_in_comms
            FROM {a.a2a} JOIN {a.steps} USING (step))
        SELECT * FROM pred FULL JOIN rec USING (step, rank, collective) ORDER BY step, rank, collective""")

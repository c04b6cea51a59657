"""Where each lookup came from: the source rank of every recorded lookup, from the input dist.

`lookups` are written where the lookup runs, at the table's owner after the input dist, so their
`sample` is a position in the owner's received batch. Every embedding policy needs the rank the
sample lives on (`src`): a bag looked up on its own rank never crossed the network, and SCARS's
E[U] is per device batch. The rule:

- Where the lookup has a recorded `src` (the program declared its sources with `tracekit.sources`,
  as the reference trainer does from schema 1.7), it is the source, and `src_sample` (null for a
  sequence table's ids) its sample there: attribution is a join. Exact.
- Else, from the input dist (DESIGN.md §4 layout, TorchRec's input dist), for old runs, TorchRec
  jobs and programs that declare nothing:

  - The owner's input-lengths all-to-all of a training step (phase 'train'; the call whose
    comms.role is input_lengths, analyses.roles) carries the bag lengths: `F_o × b_q` elements
    from each source q, F_o the features looked up in the tables with a shard on the owner o
    (manifest `shards`), so `b_q = splits_in[q] / elem_bytes / F_o` is q's local batch. A
    reference-trainer table is one feature; a TorchRec table may serve several (`features`).
    The owner concatenates each table's bags by source, so a *pooled* bag at owner position
    `sample` came from the q with `B_q <= sample < B_q + b_q`, `B_q = sum_{q' < q} b_q'`, and is
    sample `sample - B_q` of q's batch. Exact.
  - The owner's input-ids all-to-all carries the ids: `n_q = splits_in[q] / id_bytes` from q. A
    *sequence* table's `sample` is the i-th id of the owner's call (a 1-D nn.Embedding input),
    concatenated by source, so the sequence ids from q not yet attributed (recorded sequence ids
    count as attributed) number `S_q = n_q - (attributed ids from q)`. With one such sequence
    table on the owner its ids from q are positions [C_q, C_q + S_q), C_q the running sum:
    exact. With several, only their sum per source is on record; each table's ids are split in
    proportion, `C_{q,j} = round(N_j · sum_{q'<q} S_q' / sum S)` (N_j: table j's ids that step),
    and the attribution is marked approximate. Which of q's samples a sequence id belongs to is
    not on record (sequence lengths never reach `comms`): `src_sample` is null.
  - Tables that are not sharded (data-parallel replicas, rank-local tables) and runs of one rank:
    the lookup ran on the sample's own rank, `src = rank`, `src_sample = sample`.

The check: replaying the exchange from the attributed lookups gives every split of every
input-dist and output-dist all-to-all in `comms` byte for byte (analyses.exchange,
`costmodel_check`); tests/test_attribution.py holds the attribution against the samples the
trainer consumed on 2-rank runs (table- and row-wise, pooled and sequence).

`attributed(ctx)` attributes once per context (ctx.memo; DuckDB passes over `train_lookups`, no
Python loop over rows) and returns the attributed lookups as a relation with table names, and
the rule's bookkeeping (which tables were attributed how). `batches(ctx)` is every rank's local
batch at every training step, from the same all-to-all. Lookups of a step without such an
all-to-all keep `src` null.

The tables it leaves on the context's connection that other modules read, named by
`attributed(ctx).tables` (`AttributedTables`, field: table):

    names     tk_names: tid (the table's index in the manifest), table_name, kind, sharded, n_shards,
                         rb (row bytes), n_features
    shards    tk_shards: tid, rank: each rank holding a shard of the table
    a2a       tk_a2a: rank, step, seq, tag, dtype, bytes_out, bytes_in, splits_out, splits_in, role: the
                training all-to-alls of the exchange with their role (analyses.roles)
    batches   tk_batches: step, src, b: every rank's local batch at every training step
    bounds    tk_bounds: step, owner, src, b, lo: each source's bag range in each owner's received batch
    steps     tk_steps: step, si: the sampled steps (with lookups) and their index
    lookups   tk_src: step, owner, tid, seq (a sequence table), sample, pos, row, feature (of a table several
                features look up, which one: trace-format.md), src, src_sample (null where the sample is
                unknown), gid: a global sample id `(si · W + src) · max batch + src_sample` naming a
                sample across tables and owners

The others (tk_owner_tables, tk_lengths, tk_ids, tk_lookups, tk_bmax, tk_uniform, tk_seq_bounds,
tk_src_bags, tk_src_seq, tk_seq_lookups, tk_recorded) are its own steps.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import duckdb
import polars as pl

from analyses.context import Context
from tracekit import tags
from tracekit.manifest import DTYPE_BYTES, dtype_bytes


@dataclass(frozen=True)
class AttributedTables:
    """The tables `attributed` leaves on the context's connection for other analyses, by what they
    hold (their columns in the module docstring). A reader takes a name from here, so it cannot
    read a table without the call that builds it."""

    names: str = "tk_names"
    shards: str = "tk_shards"
    a2a: str = "tk_a2a"
    batches: str = "tk_batches"
    bounds: str = "tk_bounds"
    steps: str = "tk_steps"
    lookups: str = "tk_src"


TABLES = AttributedTables()


@dataclass
class Attribution:
    """`tk_src` and `tk_batches` are ready on the context's connection; `relation` is tk_src with
    table names; `methods` says per (owner, table_name) how lookups were attributed: 'recorded'
    (every lookup's `src` on record, exact), else by the positional rule: 'bags' (pooled, exact),
    'ids' (one sequence table on the owner, exact), 'ids-proportional' (several, approximate),
    'own-rank' (not sharded, or one rank); `notes` what could not be done."""

    relation: duckdb.DuckDBPyRelation
    methods: pl.DataFrame
    exact: bool
    notes: list[str] = field(default_factory=list)
    tables: AttributedTables = TABLES


def elem_bytes(dtype: str) -> int:
    """Bytes per element of a comms `dtype` ('torch.int32') or a manifest dtype ('float32')."""
    return dtype_bytes(dtype)


def table_ids(ctx: Context) -> pl.DataFrame:
    """One row per manifest table: tid (its index), table_name, kind, sharded (placement
    'sharded'), n_shards, rb (row bytes), n_features (`features`)."""
    per_table = features(ctx)
    rows = [{"tid": i, "table_name": t.name, "kind": t.kind, "sharded": t.placement in (None, "sharded"),
             "n_shards": len(t.shards), "rb": t.row_bytes, "n_features": per_table.get(t.name, 1)}
            for i, t in enumerate(ctx.model.tables)]
    return pl.DataFrame(rows, schema={"tid": pl.Int32, "table_name": pl.String, "kind": pl.String,
                                      "sharded": pl.Boolean, "n_shards": pl.Int64, "rb": pl.Int64,
                                      "n_features": pl.Int64})


def features(ctx: Context) -> dict[str, int]:
    """Per table, the features (bags per sample) that look it up. A reference-trainer table is one
    feature. A TorchRec table (manifest `sharding_type`) may be looked up by several (`t0` by `f0`
    and `f1`), whose lookups share `sample`, a bag's index within its feature (collectors/
    torchrec_tables.py), and since schema 1.4 carry the feature's order among them (`feature`).
    Before, the most ids at one (step, rank, sample, pos) is how many features fed it: a lower
    bound, exact once one sample had an id at one position in every feature."""
    torchrec = [t.name for t in ctx.manifest.tables or () if t.sharding_type]
    if not torchrec or not ctx.has("lookups"):
        return {}
    names = ", ".join(f"'{name}'" for name in torchrec)
    rows = ctx.sql(f"""SELECT table_name, greatest(max(n), max(features))::INTEGER FROM (
                           SELECT table_name, count(*) AS n, max(feature) + 1 AS features FROM train_lookups
                           WHERE table_name IN ({names}) GROUP BY step, rank, table_name, sample, pos)
                       GROUP BY table_name""").fetchall()
    return dict(rows)


def shards(ctx: Context) -> pl.DataFrame:
    """One row per (table, rank holding a shard): tid, rank."""
    rows = [{"tid": i, "rank": s.rank} for i, t in enumerate(ctx.model.tables) for s in t.shards]
    return pl.DataFrame(rows, schema={"tid": pl.Int32, "rank": pl.Int64})


def attributed(ctx: Context) -> Attribution:
    """The training lookups with their source rank (module docstring), attributed once per context."""
    return ctx.memo(attributed, lambda: _attribute(ctx))


def _attribute(ctx: Context) -> Attribution:
    notes: list[str] = []
    ctx.con.register("tk_names_frame", table_ids(ctx))
    ctx.con.register("tk_shards_frame", shards(ctx))
    ctx.sql("CREATE OR REPLACE TEMP TABLE tk_names AS SELECT * FROM tk_names_frame")
    ctx.sql("CREATE OR REPLACE TEMP TABLE tk_shards AS SELECT * FROM tk_shards_frame")
    _a2a(ctx)
    _batches(ctx, notes)
    if ctx.has("lookups"):
        _lookups(ctx)
        used, recorded = ctx.sql("""SELECT (SELECT count(*) FROM tk_lookup_steps),
                                           (SELECT count(DISTINCT step) FROM train_lookups)""").fetchall()[0]
        if used < recorded:
            notes.append(f"the exchange replays use {used} of the {recorded} steps with recorded lookups, evenly "
                         f"spaced (--replay-steps {ctx.options.replay_steps}; 0 replays all)")
        _pooled_and_local(ctx)
        _sequence(ctx)
        ctx.sql("INSERT INTO tk_src_bags BY NAME SELECT * FROM tk_src_seq")  # not a union: no copy of the bags
        ctx.sql("DROP TABLE IF EXISTS tk_src; ALTER TABLE tk_src_bags RENAME TO tk_src")
        ctx.sql("DROP TABLE tk_lookups; DROP TABLE tk_src_seq")
    else:
        notes.append("the run has no lookups")
        ctx.sql("""CREATE OR REPLACE TEMP TABLE tk_src (step BIGINT, owner BIGINT, tid INTEGER, seq BOOLEAN,
                   sample INTEGER, pos INTEGER, "row" BIGINT, feature SMALLINT, src BIGINT, src_sample BIGINT,
                   gid BIGINT)""")
        ctx.sql("CREATE OR REPLACE TEMP TABLE tk_seq_bounds (owner BIGINT, tid INTEGER, method VARCHAR)")
        ctx.sql("CREATE OR REPLACE TEMP TABLE tk_recorded (owner BIGINT, tid INTEGER, recorded BOOLEAN)")
    methods = ctx.frame(f"""
        SELECT owner, table_name, method FROM (
            SELECT owner, tid, 'recorded' AS method FROM tk_recorded WHERE recorded
            UNION ALL
            SELECT owner, tid, any_value(method) AS method FROM tk_seq_bounds GROUP BY ALL
            UNION ALL
            SELECT DISTINCT owner, tid, CASE WHEN sharded AND {ctx.model.world_size} > 1 AND NOT seq
                                             THEN 'bags' ELSE 'own-rank' END
            FROM tk_src JOIN tk_names USING (tid) ANTI JOIN (FROM tk_recorded WHERE recorded) USING (owner, tid)
            WHERE NOT seq OR NOT sharded OR {ctx.model.world_size} = 1)
        JOIN tk_names USING (tid) ORDER BY owner, tid""")
    unknown = ctx.sql("SELECT count(*) FROM tk_src WHERE src IS NULL").fetchall()[0][0]
    if unknown:
        notes.append(f"{unknown} lookups on steps without an input-dist all-to-all have no source rank")
    approximate = bool((methods["method"] == "ids-proportional").any())
    if approximate:
        notes.append("owners holding several sequence tables: only their ids per source are on record, "
                     "each table's share is apportioned (approximate source ranks)")
    relation = ctx.sql("""SELECT l.step, l.owner, n.table_name, n.kind, l.sample, l.pos, l."row", l.src,
                                 l.src_sample, l.gid
                          FROM tk_src l JOIN tk_names n USING (tid)""")
    return Attribution(relation, methods, not approximate and not unknown, notes)


def batches(ctx: Context) -> pl.DataFrame:
    """(step, src, b): every rank's local batch at every training step, from the input dist."""
    return ctx.frame(f"SELECT step, src, b FROM {attributed(ctx).tables.batches} ORDER BY step, src")


def _a2a(ctx: Context) -> None:
    """tk_a2a: every training all-to-all of the exchange with its role (comms.role)."""
    if not ctx.has("comms"):
        ctx.sql("""CREATE OR REPLACE TEMP TABLE tk_a2a (rank BIGINT, step BIGINT, seq BIGINT, tag VARCHAR,
                   dtype VARCHAR, bytes_out BIGINT, bytes_in BIGINT, splits_out BIGINT[], splits_in BIGINT[],
                   role VARCHAR)""")
        return
    ctx.sql("""CREATE OR REPLACE TEMP TABLE tk_a2a AS
               SELECT rank, step, seq, tag, dtype, bytes_out, bytes_in, splits_out, splits_in, role
               FROM train_comms WHERE role IS NOT NULL""")


def _split_counts(role: str, per: str) -> str:
    """SQL: (step, owner, src, n, rest) with n = splits_in[src] / elem / `per` of each owner's `role` a2a."""
    elem = "CASE replace(dtype, 'torch.', '') " + " ".join(
        f"WHEN '{name}' THEN {size}" for name, size in DTYPE_BYTES.items()) + " ELSE 1 END"
    return f"""SELECT step, owner, src, bytes // ({elem}) // {per} AS n, bytes % (({elem}) * {per}) AS rest
               FROM (SELECT a.step, a.rank AS owner, a.dtype, o.n_features,
                            unnest(a.splits_in) AS bytes, unnest(generate_series(0, len(a.splits_in) - 1)) AS src
                     FROM tk_a2a a JOIN tk_owner_tables o ON o.rank = a.rank WHERE a.role = '{role}')"""


def _batches(ctx: Context, notes: list[str]) -> None:
    """tk_batches (step, src, b) and tk_bounds (step, owner, src, b, lo): each source's bag range
    in each owner's received batch; tk_ids (step, owner, src, n) ids received from each source."""
    ctx.sql("""CREATE OR REPLACE TEMP TABLE tk_owner_tables AS
               SELECT s.rank, sum(n.n_features) AS n_features FROM tk_shards s JOIN tk_names n USING (tid)
               WHERE n.sharded GROUP BY s.rank""")
    ctx.sql(f"CREATE OR REPLACE TEMP TABLE tk_lengths AS {_split_counts(tags.INPUT_LENGTHS, 'n_features')}")
    ctx.sql(f"CREATE OR REPLACE TEMP TABLE tk_ids AS {_split_counts(tags.INPUT_IDS, '1')}")
    odd = ctx.sql("SELECT count(*) FROM tk_lengths WHERE rest <> 0").fetchall()[0][0]
    if odd:
        notes.append(f"{odd} input-dist splits are not a whole number of bags per table: "
                     "the all-to-all taken for the lengths of those steps is not the lengths exchange")
    ctx.sql("""CREATE OR REPLACE TEMP TABLE tk_bounds AS
               SELECT step, owner, src, n AS b,
                      CAST(coalesce(sum(n) OVER (PARTITION BY step, owner ORDER BY src
                                                 ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING), 0) AS BIGINT) AS lo
               FROM tk_lengths""")
    disagree = ctx.sql("""SELECT count(*) FROM (SELECT step, src FROM tk_bounds GROUP BY ALL
                          HAVING count(DISTINCT b) > 1)""").fetchall()[0][0]
    if disagree:
        notes.append(f"{disagree} (step, rank) batch sizes differ between owners; the smallest owner rank's is used")
    ctx.sql("""CREATE OR REPLACE TEMP TABLE tk_batches AS
               SELECT step, src, arg_min(b, owner) AS b FROM tk_bounds GROUP BY step, src""")


def _lookups(ctx: Context) -> None:
    """tk_lookups: training lookups of manifest tables with their table id, on at most
    Options.replay_steps of the recorded steps (every k-th, k the least that fits: the replays'
    cost stays bounded as a run grows, and what the sample leaves uncertain is stated where a
    figure rests on it, exchange.step_interval); tk_steps: those steps with their index si;
    tk_bmax: the largest local batch (for global sample ids); tk_recorded: per (owner, table) whether
    every lookup's source is on record (`recorded`)."""
    cap = ctx.options.replay_steps
    ctx.sql(f"""CREATE OR REPLACE TEMP TABLE tk_lookup_steps AS
                SELECT step FROM (SELECT step, row_number() OVER (ORDER BY step) - 1 AS i, count(*) OVER () AS n
                                  FROM (SELECT DISTINCT step FROM train_lookups))
                WHERE {cap} = 0 OR n <= {cap} OR i % ((n + {cap} - 1) // {cap}) = 0""")
    ctx.sql("""CREATE OR REPLACE TEMP TABLE tk_lookups AS
               SELECT l.step, l.rank AS owner, n.tid, n.kind = 'sequence' AS seq,
                      n.sharded AND n.n_shards > 0 AS via_a2a, n.n_shards, l.sample, l.pos, l."row", l.feature,
                      l.src AS rsrc, l.src_sample AS rsrc_sample
               FROM train_lookups l JOIN tk_names n USING (table_name) SEMI JOIN tk_lookup_steps USING (step)""")
    ctx.sql("""CREATE OR REPLACE TEMP TABLE tk_recorded AS
               SELECT owner, tid, bool_and(rsrc IS NOT NULL) AS recorded FROM tk_lookups GROUP BY ALL""")
    ctx.sql("""CREATE OR REPLACE TEMP TABLE tk_steps AS
               SELECT step, (row_number() OVER (ORDER BY step) - 1)::BIGINT AS si
               FROM (SELECT DISTINCT step FROM tk_lookups)""")
    bmax = ctx.sql("""SELECT greatest(coalesce(max(b), 0), coalesce((SELECT max(sample) + 1 FROM tk_lookups), 0))
                      FROM tk_batches""").fetchall()[0][0]
    ctx.sql(f"CREATE OR REPLACE TEMP TABLE tk_bmax AS SELECT {int(bmax or 1)}::BIGINT AS bmax")


def _gid(world: int) -> str:
    """SQL: the global sample id, from the sampled step's index si, src and src_sample."""
    return f"(st.si * {world} + src) * (SELECT bmax FROM tk_bmax) + src_sample"


def _pooled_and_local(ctx: Context) -> None:
    """tk_src_bags: lookups with a recorded source, as recorded (sequence ones too); the others of
    pooled sharded tables by bag range, of unsharded tables (or one rank) the rank itself. Where
    every source sent the same batch (all but a last partial step) the range is arithmetic;
    elsewhere an ASOF join finds it."""
    world = ctx.model.world_size
    ctx.sql("""CREATE OR REPLACE TEMP TABLE tk_uniform AS
               SELECT step, owner, CASE WHEN min(b) = max(b) AND min(b) > 0 THEN min(b) END AS ub,
                      sum(b) AS total FROM tk_bounds GROUP BY ALL""")
    pooled = f"SELECT * FROM tk_lookups WHERE rsrc IS NULL AND (NOT seq OR NOT via_a2a OR {world} = 1)"
    columns = f"""step, owner, tid, seq, sample, pos, "row", feature,
                  CASE WHEN src_sample IS NOT NULL THEN src END AS src, src_sample, {_gid(world)} AS gid"""
    ctx.sql(f"""CREATE OR REPLACE TEMP TABLE tk_src_bags AS
        SELECT {columns} FROM (
            SELECT l.step, l.owner, l.tid, l.seq, l.sample, l.pos, l."row", l.feature,
                   CASE WHEN l.via_a2a AND {world} > 1 THEN l.sample // u.ub ELSE l.owner END AS src,
                   CASE WHEN NOT l.via_a2a OR {world} = 1 THEN l.sample
                        WHEN l.sample < u.total THEN l.sample % u.ub END AS src_sample
            FROM ({pooled}) l LEFT JOIN tk_uniform u USING (step, owner)
            WHERE u.ub IS NOT NULL OR NOT l.via_a2a OR {world} = 1) x
        JOIN tk_steps st USING (step)""")
    ctx.sql(f"""INSERT INTO tk_src_bags
        SELECT {columns} FROM (
            SELECT l.step, l.owner, l.tid, l.seq, l.sample, l.pos, l."row", l.feature, b.src,
                   CASE WHEN l.sample - b.lo < b.b THEN l.sample - b.lo END AS src_sample
            FROM (SELECT l.* FROM ({pooled}) l LEFT JOIN tk_uniform u USING (step, owner)
                  WHERE u.ub IS NULL AND l.via_a2a AND {world} > 1) l
            ASOF LEFT JOIN (SELECT * FROM tk_bounds WHERE b > 0) b
              ON l.step = b.step AND l.owner = b.owner AND l.sample >= b.lo) x
        JOIN tk_steps st USING (step)""")
    ctx.sql(f"""INSERT INTO tk_src_bags BY NAME
        SELECT step, owner, tid, seq, sample, pos, "row", feature, src, src_sample, {_gid(world)} AS gid
        FROM (SELECT step, owner, tid, seq, sample, pos, "row", feature, rsrc::BIGINT AS src,
                     rsrc_sample::BIGINT AS src_sample FROM tk_lookups WHERE rsrc IS NOT NULL) x
        JOIN tk_steps st USING (step)""")


def _sequence(ctx: Context) -> None:
    """tk_src_seq: lookups of sharded sequence tables with no recorded source, by id range (module
    docstring)."""
    world = ctx.model.world_size
    ctx.sql(f"""CREATE OR REPLACE TEMP TABLE tk_seq_lookups AS
                SELECT * FROM tk_lookups WHERE seq AND via_a2a AND {world} > 1 AND rsrc IS NULL""")
    ctx.sql("""CREATE OR REPLACE TEMP TABLE tk_seq_bounds AS
        WITH pooled AS (SELECT step, owner, src, count(*) AS n FROM tk_src_bags JOIN tk_names USING (tid)
                        WHERE sharded AND src IS NOT NULL GROUP BY ALL),  -- pooled, and recorded sequence ids
             seq_per_src AS (SELECT i.step, i.owner, i.src, i.n - coalesce(p.n, 0) AS s
                             FROM tk_ids i LEFT JOIN pooled p USING (step, owner, src)),
             per_table AS (SELECT step, owner, tid, any_value(n_shards) AS n_shards, count(*) AS n
                           FROM tk_seq_lookups GROUP BY ALL),
             cum AS (SELECT step, owner, src, s,
                            CAST(coalesce(sum(s) OVER (PARTITION BY step, owner ORDER BY src
                                 ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING), 0) AS BIGINT) AS before,
                            CAST(sum(s) OVER (PARTITION BY step, owner) AS BIGINT) AS total
                     FROM seq_per_src),
             tables_on AS (SELECT step, owner, count(*) AS n_seq FROM per_table GROUP BY ALL)
        SELECT t.step, t.owner, t.tid, c.src, t.n_shards, b.b,
               CASE WHEN o.n_seq = 1 THEN c.before
                    ELSE CAST(round(t.n * c.before / nullif(c.total, 0)) AS BIGINT) END AS lo,
               CASE WHEN o.n_seq = 1 THEN c.s
                    ELSE CAST(round(t.n * (c.before + c.s) / nullif(c.total, 0)) AS BIGINT)
                         - CAST(round(t.n * c.before / nullif(c.total, 0)) AS BIGINT) END AS n,
               CASE WHEN o.n_seq = 1 THEN 'ids' ELSE 'ids-proportional' END AS method
        FROM per_table t JOIN tables_on o USING (step, owner) JOIN cum c USING (step, owner)
        LEFT JOIN tk_bounds b ON b.step = t.step AND b.owner = t.owner AND b.src = c.src""")
    ctx.sql(f"""CREATE OR REPLACE TEMP TABLE tk_src_seq AS
        SELECT step, owner, tid, seq, sample, pos, "row", feature, src, src_sample,
               {_gid(world)} AS gid
        FROM (SELECT l.step, l.owner, l.tid, l.seq, l.sample, l.pos, l."row", l.feature,
                     CASE WHEN l.sample < b.lo + b.n THEN b.src END AS src,
                     NULL::BIGINT AS src_sample
              FROM tk_seq_lookups l ASOF LEFT JOIN (SELECT * FROM tk_seq_bounds WHERE n > 0) b
                ON l.step = b.step AND l.owner = b.owner AND l.tid = b.tid AND l.sample >= b.lo) x
        JOIN tk_steps st USING (step)""")
    ctx.sql("DROP TABLE tk_seq_lookups")

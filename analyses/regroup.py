"""The recorded samples regrouped onto another world size and batch: which target rank and step each
recorded lookup falls to, in the order the reference trainer hands samples to ranks.

The trainer's step s takes global samples [s·W·b, (s+1)·W·b) and rank r the r-th slice of b of them
(tracekit/dlrm/schedule.py). The recorded lookups, attributed to their source rank and sample
(analyses.attribution), are numbered in that order over the sampled steps: g = 0, 1, ... n − 1. On W'
ranks of b' samples, sample g is on rank (g // b') mod W' at target step g // (W'·b'). A recording of
n samples covers n / (W'·b') target steps; the partial one at its end is left out. Where it covers
less than one, its n samples are spread over the W' ranks in the same order (about n / W' each), and
every per-step figure is of those samples scaled to b' a rank: `Regrouped.per_step`, said in a note.

A sequence table's ids carry no sample (attribution's `src_sample` is null): the k-th of the n ids a
source rank sent the table in a step is given sample ⌊k·b_q / n⌋ of its b_q (approximate, in a note).

    looked = recorded_lookups(ctx)             # once per context: the arrays below
    on = regroup(looked, world=64, batch=512)  # per lookup: target rank; per rank: its samples
    on.steps, on.covered                       # target steps the figures average over; False: < 1
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from analyses import attribution
from analyses.context import Context


@dataclass(frozen=True)
class Lookups:
    """The recorded lookups of sharded tables in the trainer's sample order (a bag's ids together): per
    lookup its global sample `g`, table index `tid` (the manifest's), `row` and `feature` (a bag's
    feature, 0 but for TorchRec tables); `samples` the n samples they come from, over `steps` steps;
    `sequence[tid]` whether the table is a sequence (unpooled) one."""

    g: np.ndarray
    tid: np.ndarray
    row: np.ndarray
    feature: np.ndarray
    samples: int
    steps: int  # the recorded steps they come from
    sequence: np.ndarray
    notes: tuple[str, ...] = ()

    @property
    def key(self) -> np.ndarray:
        """A row's key across tables: tid · 2^40 + row."""
        return self.tid.astype(np.int64) << 40 | self.row


@dataclass
class Regrouped:
    """The lookups on `world` ranks of `batch` samples: per lookup its target `rank` (−1: in the partial
    step left out), per rank its `samples`; `steps` the target steps they make (a fraction where the
    recording covers less than one: `covered` False)."""

    world: int
    batch: int
    rank: np.ndarray
    step: np.ndarray  # per lookup, its target step
    samples: np.ndarray
    steps: float
    covered: bool
    notes: list[str] = field(default_factory=list)

    @property
    def kept(self) -> np.ndarray:
        return self.rank >= 0


def recorded_lookups(ctx: Context) -> Lookups:
    """The run's attributed lookups as arrays in the trainer's sample order (module docstring), once
    per context."""
    return ctx.memo(recorded_lookups, lambda: _load(ctx))


def _load(ctx: Context) -> Lookups:
    """The lookups in sample order: read as recorded where every one of a sharded table carries its source
    (the reference trainer's, schema 1.7: tracekit.sources), else through analyses.attribution."""
    tables = ctx.model.tables
    sequence = np.array([t.kind == "sequence" for t in tables] or [False])
    any_sequence = bool(sequence.any())
    k = ("row_number() OVER (PARTITION BY l.step, l.src, l.tid ORDER BY l.owner, l.sample, l.pos) - 1"
         if any_sequence else "0")
    n = "count(*) OVER (PARTITION BY l.step, l.src, l.tid)" if any_sequence else "1"
    recorded = _recorded(ctx)
    if recorded is not None:
        lookups, batches = recorded
    else:
        a = attribution.attributed(ctx).tables
        lookups = f"""SELECT l.step, l.owner, l.src, l.tid, l.sample, l.pos, l."row", l.feature, l.src_sample
                      FROM {a.lookups} l JOIN {a.names} t USING (tid) WHERE t.sharded AND l.src IS NOT NULL"""
        batches = f"SELECT step, src, b FROM {a.batches} SEMI JOIN {a.steps} USING (step)"
    frame = ctx.frame(f"""
        WITH b AS (SELECT step, src, b, sum(b) OVER (ORDER BY step, src ROWS UNBOUNDED PRECEDING) - b AS base
                   FROM ({batches})),
        l AS (SELECT l.step, l.src, l.tid, l."row", l.feature, l.src_sample, {k} AS k, {n} AS n FROM ({lookups}) l)
        SELECT (b.base + coalesce(l.src_sample, (l.k * b.b) // l.n))::BIGINT AS g, l.tid::INTEGER AS tid,
               l."row"::BIGINT AS "row", coalesce(l.feature, 0)::SMALLINT AS feature
        FROM l JOIN b USING (step, src) ORDER BY g, tid, feature""")
    samples, steps = ctx.sql(f"SELECT coalesce(sum(b), 0)::BIGINT, count(DISTINCT step) FROM ({batches})").fetchall()[0]
    notes = []
    if any_sequence:
        notes.append("sequence tables: an id's sample within its rank's batch is not on record, so the k-th of a "
                     "rank's n ids of a table in a step is given sample ⌊k·b/n⌋ (approximate)")
    return Lookups(frame["g"].to_numpy(), frame["tid"].to_numpy(), frame["row"].to_numpy(),
                   frame["feature"].to_numpy(), int(samples), int(steps), sequence, tuple(notes))


def _recorded(ctx: Context) -> tuple[str, str] | None:
    """SQL of the lookups of sharded tables (step, owner, src, tid, sample, pos, row, feature, src_sample) and
    of each source's batch (step, src, b) on the steps with lookups, read as recorded; None where some lookup
    of a sharded table carries no source, or the run has no steps table."""
    if not ctx.has("steps"):
        return None
    sharded = [i for i, t in enumerate(ctx.model.tables) if t.placement in (None, "sharded")]
    if not sharded:
        return None
    ids = ", ".join(f"({i}, ?)" for i in sharded)
    names = [ctx.model.tables[i].name for i in sharded]
    ctx.con.execute("CREATE OR REPLACE TEMP TABLE tk_regroup_tables (tid INTEGER, table_name VARCHAR)")
    ctx.con.execute(f"INSERT INTO tk_regroup_tables VALUES {ids}", names)
    missing, steps = ctx.sql("""SELECT count(*) FILTER (WHERE src IS NULL), count(DISTINCT step)
                                FROM train_lookups JOIN tk_regroup_tables USING (table_name)""").fetchall()[0]
    if missing or not steps:
        return None
    lookups = """SELECT l.step, l.rank AS owner, l.src, t.tid, l.sample, l.pos, l."row", l.feature, l.src_sample
                 FROM train_lookups l JOIN tk_regroup_tables t USING (table_name)"""
    batches = """SELECT step, rank AS src, samples AS b FROM steps
                 WHERE step IN (SELECT DISTINCT step FROM train_lookups)"""
    return lookups, batches


def regroup(looked: Lookups, world: int, batch: int) -> Regrouped:
    """`looked` on `world` ranks of `batch` samples (module docstring)."""
    if world < 1 or batch < 1:
        raise ValueError(f"a target needs at least one rank and one sample a rank, got {world} × {batch}")
    n, per_step = looked.samples, world * batch
    full = n // per_step
    if full >= 1:
        g = looked.g
        rank = np.where(g < full * per_step, (g // batch) % world, -1)
        samples = np.full(world, full * batch, dtype=np.int64)
        notes = [f"the recording's {n:,} samples cover {n / per_step:.2f} target steps of {world} × {batch}"
                 + (f"; the last {n - full * per_step:,} samples (a partial step) left out" if n > full * per_step else "")]
        return Regrouped(world, batch, rank.astype(np.int32), g // per_step, samples, float(full), True, notes)
    sample_rank = (np.arange(n, dtype=np.int64) * world) // max(n, 1)
    rank = (looked.g * world) // max(n, 1)
    samples = np.bincount(sample_rank, minlength=world)
    notes = [f"the recording's {n:,} samples cover {n / per_step:.3f} of one target step of {world} × {batch}: spread "
             f"over the {world} ranks in the trainer's order (about {n / world:.0f} each) and every figure scaled to "
             f"{batch} a rank; bytes that depend on the ids are an estimate"]
    return Regrouped(world, batch, rank.astype(np.int32), np.zeros(len(rank), dtype=np.int64), samples, n / per_step,
                     False, notes)

"""Measure one recorded run for `compare` (analyses.compare): its step times, samples, bytes per
training step by collective and by what the policies change, hot/cold split and quality metrics.

    m = measure(ctx, skip_steps=None)   # None: analyses.network's warm-up rule
    m.figures["a2a_remote_bytes_per_step"], m.figures["step_time_s"]

Every figure comes from training rows: `comms` with phase = 'train' and the `steps` table (training
steps). Bytes are exact and use every training step; times skip the first `skip_steps` (warm-up;
by default analyses.network.warmup_steps of the run's steps, the rule analyze's baseline uses).

Per run:
- step_time_s (median) and step_time_p90_s: per step the slowest rank's t_end_ns − t_start_ns (as
  analyses.network), over the steps after the first `skip_steps` (all of them, with a warning, where
  the run has no more). samples_per_s = Σ global samples / Σ step time over those steps; a step's
  global samples are steps.samples summed over ranks or, where the trainer leaves that 0 (unknown),
  the batches of the input dist's lengths all-to-all (analyses.attribution.batches; `samples_source`).
- bytes per training step by (op, tag), N = training steps (analyses.traffic.training_steps); a run
  recorded before the trainer labelled its exchange shows each call under today's label
  (analyses.roles.label_sql), so old and new runs line up:
      bytes_out_per_step  = Σ_ranks bytes_out / N          (policy.json's and `traffic`'s convention)
      wire_bytes_per_step = Σ_ranks wire / N, per call on a rank in a group of n ranks:
          all_to_all(_single)              bytes_out − splits_out[own group rank]  (remote bytes only)
          all_reduce                       2(n−1)/n · bytes_out   (ring; nccl-tests bus bytes)
          all_gather(_into_tensor/_single) (n−1) · bytes_out      (each rank's input to n−1 peers)
          any other op                     bytes_out
- embedding bytes per step (what the policies change), comparable with policy.json's `predicted`:
      exchange  training all-to-alls not tagged as sync or as a DDP bucket (the reference trainer's
                exchange calls have a `role`, analyses.roles; its tier-2 exchange and a user's labels count too)
      sync      calls whose tag starts with replica_sync or tier2_sync (tracekit.tags.SYNC_TAGS, the
                trainer's labels for replica and FlexShard tier-2 synchronisation)
      a2a_bytes_per_step          Σ exchange bytes_out, self splits included
      a2a_remote_bytes_per_step   Σ exchange wire (self splits left out)
      sync_bytes_per_step         Σ sync wire: a ring all-reduce of n bytes per rank is 2(W−1)·n over
                                  the ranks, an index all-gather (W−1)·ids (counted as sent)
      total_bytes_per_step        a2a + sync;   total_remote_bytes_per_step  a2a_remote + sync
      intra_bytes_per_step, inter_bytes_per_step   on a run of several nodes (manifest `topology`,
                                  tracekit.topology: rank r on node r // ranks_per_node), the exchange's
                                  remote bytes between ranks of one node and between nodes (a subgroup's
                                  split j goes to the j-th of its sorted ranks)
      dp_bytes_per_step           Σ bytes_out of the data-parallel gradient exchange: calls tagged
                                  ddp_bucket*, _sum_allreduce_hook or dct_dp* (tracekit.tags.DP_TAGS)
- hot/cold, where steps has a `schedule` column ('hot' | 'cold'; schema 1.2): steps, bytes and
  embedding bytes per step of each kind.
- quality: manifest `metrics` (eval_auc, eval_logloss, train_loss, samples_per_s; null where absent)
  and steps.loss (mean over ranks per step, analyses.run_diff compares it with BASE's).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import duckdb
import polars as pl

from analyses import attribution, network, traffic
from analyses.context import Context
from analyses.traffic import A2A_OPS, GATHER_OPS, sql_list
from analyses.roles import label_sql
from tracekit.errors import TracekitError
from tracekit.figures import (A2A_BYTES, A2A_REMOTE_BYTES, ALLREDUCE_BYTES, DP_BYTES, INTER_BYTES, INTRA_BYTES,
                              STEP_TIME, SYNC_BYTES)
from tracekit.tags import DDP_BUCKET, DP_TAGS, SYNC_TAGS
from tracekit.topology import Topology
from tracekit.manifest import Manifest

DDP_TAGS = (DDP_BUCKET,)
EMBEDDING = (A2A_BYTES, A2A_REMOTE_BYTES, SYNC_BYTES, "total_bytes_per_step",
             "total_remote_bytes_per_step")
METRICS = ("eval_auc", "eval_logloss", "train_loss", "samples_per_s")


def _starts(prefixes: tuple[str, ...]) -> str:
    return " OR ".join(f"starts_with(tag, '{p}')" for p in prefixes)


_CALLS = f"""
    WITH members AS (SELECT "group", list_sort(list(DISTINCT rank)) AS ranks FROM comms GROUP BY ALL),
    c AS (SELECT c.step, c.op, {label_sql()} AS tag, c.bytes_out, c.group_size, c.splits_out,
                 CASE WHEN c.group_size = {{world}} THEN c.rank ELSE list_position(m.ranks, c.rank) - 1 END AS me
          FROM train_comms c JOIN members m USING ("group"))
    SELECT step, op, tag,
           CASE WHEN {_starts(SYNC_TAGS)} THEN 'sync'
                WHEN op IN ({sql_list(A2A_OPS)}) AND NOT ({_starts(DDP_TAGS)}) THEN 'exchange'
                ELSE 'other' END AS kind,
           count(*) AS calls, sum(bytes_out)::BIGINT AS bytes_out,
           sum(CASE WHEN op IN ({sql_list(A2A_OPS)}) THEN bytes_out - coalesce(splits_out[me + 1], 0)
                    WHEN op = 'all_reduce' THEN 2.0 * (group_size - 1) / group_size * bytes_out
                    WHEN op IN ({sql_list(GATHER_OPS)}) THEN (group_size - 1) * bytes_out
                    ELSE bytes_out END)::DOUBLE AS wire_bytes
    FROM c GROUP BY ALL ORDER BY step, op, tag"""
_NODE_BYTES = f"""
    WITH members AS (SELECT "group", list_sort(list(DISTINCT rank)) AS ranks FROM comms GROUP BY ALL),
    c AS (SELECT c.rank, c.group_size, m.ranks, unnest(c.splits_out) AS bytes,
                 generate_subscripts(c.splits_out, 1) AS i
          FROM train_comms c JOIN members m USING ("group")
          WHERE c.op IN ({sql_list(A2A_OPS)}) AND NOT ({_starts(SYNC_TAGS)}) AND NOT ({_starts(DDP_TAGS)})),
    pairs AS (SELECT rank AS sender, CASE WHEN group_size = {{world}} THEN i - 1 ELSE ranks[i] END AS receiver, bytes
              FROM c)
    SELECT coalesce(sum(bytes) FILTER (sender // {{per_node}} = receiver // {{per_node}}), 0)::DOUBLE,
           coalesce(sum(bytes) FILTER (sender // {{per_node}} <> receiver // {{per_node}}), 0)::DOUBLE
    FROM pairs WHERE sender <> receiver"""
_STEPS_SCHEMA = {"step": pl.Int64, STEP_TIME: pl.Float64, "samples": pl.Int64, "loss": pl.Float64,
                 "schedule": pl.String}
_CALLS_SCHEMA = {"step": pl.Int64, "op": pl.String, "tag": pl.String, "kind": pl.String, "calls": pl.Int64,
                 "bytes_out": pl.Int64, "wire_bytes": pl.Float64}


@dataclass
class Measured:
    """One run's figures (JSON-able) and the per-step frames they come from."""

    name: str
    manifest: Manifest
    figures: dict[str, Any]
    steps: pl.DataFrame  # step, step_time_s, samples (global), loss (mean over ranks), schedule
    calls: pl.DataFrame  # step, op, tag, kind, calls, bytes_out, wire_bytes (training comms)
    notes: list[str] = field(default_factory=list)

def measure(ctx: Context, skip_steps: int | None) -> Measured:
    """The figures of one run (module docstring); `skip_steps` None: analyses.network's warm-up rule."""
    name, manifest, notes = str(ctx.path), ctx.manifest, []
    steps, samples_source = step_frame(ctx, notes)
    if skip_steps is None:
        skip_steps = network.warmup_steps(steps.height)
    calls = (ctx.frame(_CALLS.format(world=ctx.model.world_size)) if ctx.has("comms")
             else pl.DataFrame(schema=_CALLS_SCHEMA))
    n = traffic.training_steps(ctx)
    kept = steps.slice(skip_steps) if steps.height > skip_steps else steps
    if 0 < steps.height <= skip_steps:
        notes.append(f"{name}: {steps.height} training steps, not more than --skip-steps {skip_steps}: "
                     "times are over every step")
    samples_known = kept.height > 0 and kept["samples"].null_count() == 0
    figures: dict[str, Any] = {
        "run": name, "status": manifest.status, "exit_code": manifest.exit_code,
        "where": where(manifest), "world_size": ctx.model.world_size, "steps": n, "timed_steps": kept.height,
        "skip_steps": skip_steps,
        STEP_TIME: kept[STEP_TIME].median(),
        "step_time_p90_s": kept[STEP_TIME].quantile(0.9, "linear"),
        "samples_per_step": steps["samples"].mean() if samples_known else None,
        "samples_per_s": kept["samples"].sum() / kept[STEP_TIME].sum() if samples_known else None,
        "samples_source": samples_source if samples_known else None,
        "timed_makespan_s": timed_makespan(ctx, int(kept["step"].min())) if kept.height else None,
        **bytes_figures(calls, n),
        **node_bytes(ctx, n),
        "metrics": {k: (manifest.metrics or {}).get(k) for k in METRICS},
        "by_op_tag": by_op_tag(calls, n).to_dicts(),
        "schedule": schedule_split(steps, calls).to_dicts() or None,
        "ratios": None, "loss_max_abs_diff": None, "policy": None,
    }
    return Measured(name, manifest, figures, steps, calls, notes)


def timed_makespan(ctx: Context, first: int) -> float | None:
    """The slowest rank's time from the start of step `first` (the first timed one) to the end of its
    last step: the makespan BLS's lag section predicts (analyses/policies/lag.py replays the steps
    after the warm-up)."""
    if not ctx.has("steps"):
        return None
    (value,) = ctx.sql(f"""SELECT max(span) FROM (SELECT rank, (max(t_end_ns) - min(t_start_ns)) / 1e9 AS span
                           FROM steps WHERE step >= {first} GROUP BY rank)""").fetchall()[0]
    return value


def step_frame(ctx: Context, notes: list[str]) -> tuple[pl.DataFrame, str]:
    """Per training step: the slowest rank's time (analyses.network.step_frame) with the global samples
    (null where unknown), mean loss and schedule kind (null where the run has no such column) over all
    of the step's rows; and where the samples came from."""
    if not ctx.has("steps"):
        notes.append(f"{ctx.path}: no steps table: no step times, samples or loss")
        return pl.DataFrame(schema=_STEPS_SCHEMA), "steps"
    schedule = "mode(schedule)" if "schedule" in ctx.sql("SELECT * FROM steps LIMIT 0").columns else "NULL"
    steps = network.step_frame(ctx).join(ctx.frame(f"""
        SELECT step, sum(samples)::BIGINT AS samples, avg(loss) AS loss, {schedule}::VARCHAR AS schedule
        FROM steps GROUP BY step"""), on="step", how="left")
    if steps.height and (steps["samples"] > 0).all():
        return steps, "steps"
    steps = steps.drop("samples").join(input_dist_samples(ctx), on="step", how="left")
    if steps["samples"].null_count():
        notes.append(f"{ctx.path}: samples per step are not on record (steps.samples is 0 and the input "
                     "dist does not cover every step): no samples/s")
    return steps.select(*_STEPS_SCHEMA), "input dist"


def input_dist_samples(ctx: Context) -> pl.DataFrame:
    """(step, samples): global batch per training step from the input dist's lengths all-to-all."""
    try:
        batches = attribution.batches(ctx)
    except (duckdb.Error, TracekitError, KeyError):
        return pl.DataFrame(schema={"step": pl.Int64, "samples": pl.Int64})
    return batches.group_by("step").agg(pl.col("b").sum().cast(pl.Int64).alias("samples"))


def bytes_figures(calls: pl.DataFrame, n: int) -> dict[str, float | None]:
    """Bytes per training step over all ops and the embedding figures (module docstring)."""
    def per_step(expr: pl.Expr) -> float | None:
        return float(calls.select(expr.sum()).item()) / n if n else None

    exchange, sync = pl.col("kind") == "exchange", pl.col("kind") == "sync"
    out = {"bytes_per_step": per_step(pl.col("bytes_out")), "wire_bytes_per_step": per_step(pl.col("wire_bytes")),
           A2A_BYTES: per_step(pl.col("bytes_out").filter(exchange)),
           A2A_REMOTE_BYTES: per_step(pl.col("wire_bytes").filter(exchange)),
           SYNC_BYTES: per_step(pl.col("wire_bytes").filter(sync)),
           ALLREDUCE_BYTES: per_step(pl.col("bytes_out").filter(pl.col("op") == "all_reduce")),
           DP_BYTES: per_step(pl.col("bytes_out").filter(
               pl.any_horizontal(pl.col("tag").str.starts_with(t) for t in DP_TAGS)))}
    if n:
        out["total_bytes_per_step"] = out[A2A_BYTES] + out[SYNC_BYTES]
        out["total_remote_bytes_per_step"] = out[A2A_REMOTE_BYTES] + out[SYNC_BYTES]
    else:
        out["total_bytes_per_step"] = out["total_remote_bytes_per_step"] = None
    return out


def node_bytes(ctx: Context, n: int) -> dict[str, float]:
    """The exchange's remote bytes per training step within and between nodes, on a run recorded on
    several nodes (module docstring); nothing on one node."""
    shape = Topology.of_run(ctx.manifest, ctx.model.world_size)
    if shape.nodes < 2 or not n or not ctx.has("comms"):
        return {}
    intra, inter = ctx.sql(_NODE_BYTES.format(world=ctx.model.world_size, per_node=shape.ranks_per_node)).fetchall()[0]
    return {INTRA_BYTES: intra / n, INTER_BYTES: inter / n}


def _embedding_bytes() -> pl.Expr:
    """A call's embedding bytes: bytes_out of the exchange, wire bytes of sync."""
    return (pl.when(pl.col("kind") == "exchange").then(pl.col("bytes_out").cast(pl.Float64))
            .when(pl.col("kind") == "sync").then(pl.col("wire_bytes")).otherwise(0.0))


def by_op_tag(calls: pl.DataFrame, n: int) -> pl.DataFrame:
    return (calls.group_by("op", "tag", "kind")
            .agg(pl.col("calls").sum(), (pl.col("bytes_out").sum() / max(n, 1)).alias("bytes_out_per_step"),
                 (pl.col("wire_bytes").sum() / max(n, 1)).alias("wire_bytes_per_step"))
            .sort("bytes_out_per_step", "op", "tag", descending=[True, False, False]))


def schedule_split(steps: pl.DataFrame, calls: pl.DataFrame) -> pl.DataFrame:
    """Per schedule kind: steps, bytes_out and embedding bytes per step (empty without a schedule)."""
    kinds = steps.filter(pl.col("schedule").is_not_null()).select("step", "schedule")
    per_kind = kinds.group_by("schedule").agg(pl.len().alias("steps"))
    moved = (calls.join(kinds, on="step").group_by("schedule")
             .agg(pl.col("bytes_out").sum().cast(pl.Float64).alias("bytes"), _embedding_bytes().sum().alias("emb")))
    return (per_kind.join(moved, on="schedule", how="left").fill_null(0.0)
            .select("schedule", pl.col("steps").cast(pl.Int64),
                    (pl.col("bytes") / pl.col("steps")).alias("bytes_per_step"),
                    (pl.col("emb") / pl.col("steps")).alias("embedding_bytes_per_step"))
            .sort("schedule", descending=True))


def where(manifest: Manifest) -> str:
    """Device, backend, world size and cores of a run, as every timing must say (DESIGN.md §7)."""
    devices = manifest.devices or {}
    gpus = (manifest.gpu or {}).get("devices") or []
    used = ", ".join(str(g) for g in gpus) if (manifest.gpu or {}).get("samples") else devices.get("cpu", "?")
    return (f"{used}, {manifest.backend or '?'}, world {manifest.world_size or '?'}, "
            f"{devices.get('cores', '?')} cores")


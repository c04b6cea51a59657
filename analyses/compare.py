"""Compare: recorded runs against a base run, and each against the policy it applied (DESIGN.md §6).

    result = compare("runs/base", ["runs/hybrid"])   # skip_steps: analyses.network's warm-up rule
    result.summary["runs"][1]["ratios"]["step_time_s"]   # hybrid's median step time / base's
    result.tables["compare_policy"]   # run | section | figure | unit | kind | predicted | predicted_low | ...

Every figure comes from training rows: `comms` with phase = 'train' and the `steps` table (training
steps). Bytes are exact and use every training step; times skip the first `skip_steps` (warm-up;
by default analyses.network.warmup_steps of the run's steps, the rule analyze's baseline uses).

Per run:
- step_time_s (median) and step_time_p90_s: per step the slowest rank's t_end_ns − t_start_ns (as
  analyses.network), over the steps after the first `skip_steps` (all of them, with a warning, where
  the run has no more). samples_per_s = Σ global samples / Σ step time over those steps; a step's
  global samples are steps.samples summed over ranks or, where the trainer leaves that 0 (unknown),
  the batches of the input dist's lengths all-to-all (analyses.attribution.batches; `samples_source`).
- bytes per training step by (op, tag), N = training steps (analyses.traffic.training_steps):
      bytes_out_per_step  = Σ_ranks bytes_out / N          (policy.json's and `traffic`'s convention)
      wire_bytes_per_step = Σ_ranks wire / N, per call on a rank in a group of n ranks:
          all_to_all(_single)              bytes_out − splits_out[own group rank]  (remote bytes only)
          all_reduce                       2(n−1)/n · bytes_out   (ring; nccl-tests bus bytes)
          all_gather(_into_tensor/_single) (n−1) · bytes_out      (each rank's input to n−1 peers)
          any other op                     bytes_out
- embedding bytes per step (what the policies change), comparable with policy.json's `predicted`:
      exchange  training all-to-alls not tagged as sync or as a DDP bucket (the reference trainer's
                tags are the values of analyses.exchange.TRAINER_TAGS; a user's own labels count as well)
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
  and steps.loss (mean over ranks per step): loss_max_abs_diff, the largest |Δ| against BASE over
  the steps both have (an exact policy gives ~1e-6).
- ratios to BASE: run / base of each figure above (null where BASE's is 0 or unknown).

Policies. A run that applied one names it in manifest `policy` ({"path", "sha256", "applied",
"skipped"}; runs recorded before the trainer named its sections applied every section present). The
file is loaded with tracekit.policy.load_policy; a missing file, another sha256, an invalid file or
one for another model is a warning, and what can be compared still is. Each section the run applied
(replication, tiers, schedule, compression.dp/.mp, lag) gives rows of predicted against measured for
the figures it predicts (a note names each section skipped, with why): a2a_bytes_per_step,
a2a_remote_bytes_per_step, sync_bytes_per_step, dp_bytes_per_step, total_bytes_per_step
(predicted: a2a + sync, sync 0 where the section predicts none), total_remote_bytes_per_step,
step_time_s, makespan_s (lag: the recurrence's over the steps after the warm-up, against the run's
`timed_makespan_s`, the slowest rank's time over the same steps from its `steps` rows),
eval_auc_change and eval_logloss_rel_change (a lossy section's, against the run's manifest
`metrics` less BASE's), and the savings against BASE's measured figures (the baseline used
throughout):

    saving         predicted 1 − predicted total / BASE total,  measured 1 − run total / BASE total
    remote_saving  the same with total_remote_bytes_per_step

diff = measured − predicted; diff_pct = diff / predicted (0 where both are 0, null where only the
prediction is). kind is `estimated` where the figure rests on a figure the section gives an interval
for (`intervals`), with predicted_low/predicted_high the same formulas at the intervals' ends; else
`exact`, with no interval. A run that applied several sections measures all of them at once against
each section's own prediction (a note says so), and against the policy's `combined` prediction, in
rows of section "combined", where that names exactly the sections applied. The policy's
`baseline` is shown as section "baseline" against BASE's measured figures: a check that the policy
was derived from a run like BASE. A predicted step time is the source run's median over every step
plus the change in communication time; the measured one skips the warm-up steps.

Refused with RunMismatch (naming both runs and what differs): runs of another model, i.e. manifest
`tables` (name, num_rows, dim) or world_size differ. Warned: a status other than completed, another
number of training steps or samples per step, a recorded command that differs other than in
`--policy X`, `-o/--out/--output X` and `--json`.

Tables (`compare(...).tables`): compare_runs (one row per run, the figures above), compare_bytes
(run, op, tag, kind, calls, bytes_out_per_step, wire_bytes_per_step), compare_schedule (run,
schedule, steps, bytes_per_step, embedding_bytes_per_step), compare_policy (run, section, figure,
unit, kind, predicted, predicted_low, predicted_high, measured, diff, diff_pct). The summary
(JSON-able): base, skip_steps, runs (each with its figures, ratios, by_op_tag, schedule, metrics,
policy: path, sha256, status, sections applied, skipped), rows, warnings, notes.
"""

from __future__ import annotations

import difflib
import hashlib
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import duckdb
import polars as pl

from analyses import attribution, quality, traffic
from analyses.context import Context, Result, open_context
from analyses.network import warmup_steps
from analyses.traffic import A2A_OPS, GATHER_OPS, sql_list
from tracekit.errors import PolicyMismatch, RunMismatch, TracekitError
from tracekit.figures import (A2A_BYTES, A2A_REMOTE_BYTES, ALLREDUCE_BYTES, AUC_CHANGE, DP_BYTES, HOT_STEP_FRACTION,
                              INTER_BYTES, INTRA_BYTES, LOGLOSS_CHANGE, STEP_TIME, SYNC_BYTES)
from analyses.verdict import verdict
from tracekit.policy import PolicyError, check_model, load_policy, sections
from tracekit.schema import STATUS_COMPLETED
from tracekit.tags import DDP_BUCKET, DP_TAGS, SYNC_TAGS
from tracekit.topology import Topology

DDP_TAGS = (DDP_BUCKET,)
EMBEDDING = (A2A_BYTES, A2A_REMOTE_BYTES, SYNC_BYTES, "total_bytes_per_step",
             "total_remote_bytes_per_step")
METRICS = ("eval_auc", "eval_logloss", "train_loss", "samples_per_s")
RATIOS = (STEP_TIME, "step_time_p90_s", "samples_per_s", "bytes_per_step", "wire_bytes_per_step", *EMBEDDING)
IGNORED_OPTIONS = {"--policy": True, "-o": True, "--out": True, "--output": True, "--json": False}
"""Options of a recorded command that may differ between compared runs (True: takes a value)."""



def _starts(prefixes: tuple[str, ...]) -> str:
    return " OR ".join(f"starts_with(tag, '{p}')" for p in prefixes)


_CALLS = f"""
    WITH members AS (SELECT "group", list_sort(list(DISTINCT rank)) AS ranks FROM comms GROUP BY ALL),
    c AS (SELECT c.step, c.op, c.tag, c.bytes_out, c.group_size, c.splits_out,
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
    manifest: dict
    figures: dict[str, Any]
    steps: pl.DataFrame  # step, step_time_s, samples (global), loss (mean over ranks), schedule
    calls: pl.DataFrame  # step, op, tag, kind, calls, bytes_out, wire_bytes (training comms)
    notes: list[str] = field(default_factory=list)


def compare(base: str | os.PathLike, runs: Sequence[str | os.PathLike], *, skip_steps: int | None = None) -> Result:
    """BASE and each of `runs` measured (module docstring), with ratios to BASE and each run's policy
    predictions against its measurements. TracekitError for a path that is not a run, RunMismatch
    for runs of another model."""
    measured: list[Measured] = []
    for path in (base, *runs):
        with open_context(path) as ctx:
            try:
                if measured:
                    check_same_model(measured[0], ctx)
                measured.append(measure(ctx, skip_steps))
            except duckdb.Error as err:
                raise TracekitError(f"{ctx.path}: cannot read the trace ({str(err).splitlines()[0]})") from None
    first = measured[0]
    result = Result()
    warnings: list[str] = []
    rows: list[dict] = []
    for m in measured:
        warnings += status_warnings(m)
        result.notes += m.notes
        if m is not first:
            warnings += difference_warnings(first, m)
            m.figures["ratios"] = ratios(first, m)
            m.figures["loss_max_abs_diff"] = loss_diff(first, m)
        policy, m.figures["policy"], problems = applied_policy(m)
        warnings += problems
        if policy is not None:
            rows += policy_rows(m, policy, first, result.notes)
        rows += plan_rows(m, first)
    result.tables = tables(measured, rows)
    result.summary = {"base": first.name, "skip_steps": max(m.figures["skip_steps"] for m in measured), "runs": [m.figures for m in measured],
                      "rows": rows, "warnings": warnings, "notes": result.notes}
    result.summary["verdict"] = [row.to_json() for row in verdict(_base_policy(Path(first.name)), result.summary)]
    return result


def _base_policy(run_dir: Path) -> dict | None:
    """BASE's policy.json, where analyze wrote a readable one: the verdict's sections."""
    try:
        return load_policy(run_dir / "policy.json") if (run_dir / "policy.json").is_file() else None
    except PolicyError:
        return None


# one run ----------------------------------------------------------------------------------------

def measure(ctx: Context, skip_steps: int | None) -> Measured:
    """The figures of one run (module docstring); `skip_steps` None: analyses.network's warm-up rule."""
    name, manifest, notes = str(ctx.path), ctx.manifest, []
    steps, samples_source = step_frame(ctx, notes)
    if skip_steps is None:
        skip_steps = warmup_steps(steps.height)
    calls = (ctx.frame(_CALLS.format(world=ctx.model.world_size)) if ctx.has("comms")
             else pl.DataFrame(schema=_CALLS_SCHEMA))
    n = traffic.training_steps(ctx)
    kept = steps.slice(skip_steps) if steps.height > skip_steps else steps
    if 0 < steps.height <= skip_steps:
        notes.append(f"{name}: {steps.height} training steps, not more than --skip-steps {skip_steps}: "
                     "times are over every step")
    samples_known = kept.height > 0 and kept["samples"].null_count() == 0
    figures: dict[str, Any] = {
        "run": name, "status": manifest.get("status"), "exit_code": manifest.get("exit_code"),
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
        "metrics": {k: (manifest.get("metrics") or {}).get(k) for k in METRICS},
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
    """Per training step: the slowest rank's time, global samples (null where unknown), mean loss and
    the schedule kind (null where the run has no such column); and where the samples came from."""
    if not ctx.has("steps"):
        notes.append(f"{ctx.path}: no steps table: no step times, samples or loss")
        return pl.DataFrame(schema=_STEPS_SCHEMA), "steps"
    schedule = "mode(schedule)" if "schedule" in ctx.sql("SELECT * FROM steps LIMIT 0").columns else "NULL"
    steps = ctx.frame(f"""SELECT step, max(t_end_ns - t_start_ns) / 1e9 AS step_time_s, sum(samples)::BIGINT AS samples,
                                 avg(loss) AS loss, {schedule}::VARCHAR AS schedule
                          FROM steps GROUP BY step ORDER BY step""")
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


def where(manifest: dict) -> str:
    """Device, backend, world size and cores of a run, as every timing must say (DESIGN.md §7)."""
    devices = manifest.get("devices") or {}
    gpus = (manifest.get("gpu") or {}).get("devices") or []
    used = ", ".join(str(g) for g in gpus) if (manifest.get("gpu") or {}).get("samples") else devices.get("cpu", "?")
    return (f"{used}, {manifest.get('backend', '?')}, world {manifest.get('world_size', '?')}, "
            f"{devices.get('cores', '?')} cores")


# against BASE -----------------------------------------------------------------------------------

def check_same_model(base: Measured, ctx: Context) -> None:
    """RunMismatch naming both runs and every difference in tables or world size."""
    ours = {t["name"]: t for t in base.manifest.get("tables") or []}
    theirs = {t["name"]: t for t in ctx.manifest.get("tables") or []}
    run = str(ctx.path)
    differences = [f"table {n} only in {base.name}" for n in sorted(set(ours) - set(theirs))]
    differences += [f"table {n} only in {run}" for n in sorted(set(theirs) - set(ours))]
    for name in sorted(set(ours) & set(theirs)):
        for key in ("num_rows", "dim"):
            if ours[name].get(key) != theirs[name].get(key):
                differences.append(f"table {name}: {key} {ours[name].get(key)} in {base.name}, "
                                   f"{theirs[name].get(key)} in {run}")
    if base.manifest.get("world_size") != ctx.manifest.get("world_size"):
        differences.append(f"world size {base.manifest.get('world_size')} in {base.name}, "
                           f"{ctx.manifest.get('world_size')} in {run}")
    if differences:
        raise RunMismatch(f"{run} and {base.name} were recorded from different models: {'; '.join(differences)}; "
                          "compare runs of one model and data (the same tables, rows, dim and world size)")


def status_warnings(m: Measured) -> list[str]:
    status = m.manifest.get("status")
    if status == STATUS_COMPLETED:
        return []
    return [f"{m.name} is {status} (exit code {m.manifest.get('exit_code')}): its figures cover what was recorded"]


def difference_warnings(base: Measured, m: Measured) -> list[str]:
    """Differences that leave runs comparable but worth knowing: steps, samples per step, command."""
    out = []
    steps, base_steps = m.figures["steps"], base.figures["steps"]
    if steps != base_steps:
        out.append(f"{m.name} ran {steps} training steps, {base.name} {base_steps}: per-step figures compare, "
                   "loss curves only over the steps both ran")
    samples, base_samples = m.figures["samples_per_step"], base.figures["samples_per_step"]
    if samples is not None and base_samples is not None and samples != base_samples:
        out.append(f"{m.name} has {samples:g} samples per step, {base.name} {base_samples:g}")
    changed = command_changes(base.manifest.get("command") or [], m.manifest.get("command") or [])
    if changed:
        out.append(f"{m.name}'s command differs from {base.name}'s beyond --policy, -o/--out and --json: "
                   + "; ".join(changed))
    return out


def normalised_command(argv: list[str]) -> list[str]:
    """`argv` without the options compared runs may differ in (IGNORED_OPTIONS)."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
            continue
        name = arg.split("=", 1)[0]
        if name in IGNORED_OPTIONS:
            skip = IGNORED_OPTIONS[name] and "=" not in arg
            continue
        out.append(arg)
    return out


def command_changes(base: list[str], run: list[str]) -> list[str]:
    """Each difference between two commands as `old` → `new`, with the option it belongs to."""
    a, b = normalised_command(base), normalised_command(run)
    changes = []
    for op, i1, i2, j1, j2 in difflib.SequenceMatcher(a=a, b=b, autojunk=False).get_opcodes():
        if op == "equal":
            continue
        if op == "replace" and i1 > 0 and a[i1 - 1].startswith("-") and j1 > 0 and b[j1 - 1] == a[i1 - 1]:
            i1, j1 = i1 - 1, j1 - 1  # show the option whose value changed
        changes.append(f"`{' '.join(a[i1:i2]) or '(nothing)'}` → `{' '.join(b[j1:j2]) or '(nothing)'}`")
    return changes


def ratios(base: Measured, m: Measured) -> dict[str, float | None]:
    def ratio(key: str) -> float | None:
        ours, theirs = m.figures.get(key), base.figures.get(key)
        return ours / theirs if ours is not None and theirs else None

    return {key: ratio(key) for key in RATIOS}


def loss_diff(base: Measured, m: Measured) -> float | None:
    """max |mean loss − BASE's| over the steps both ran with a loss; None without any."""
    both = (m.steps.select("step", "loss").join(base.steps.select("step", pl.col("loss").alias("base_loss")), on="step")
            .drop_nulls())
    return float((both["loss"] - both["base_loss"]).abs().max()) if both.height else None


# policies ---------------------------------------------------------------------------------------

def applied_policy(m: Measured) -> tuple[dict | None, dict | None, list[str]]:
    """(the policy file the run applied, or None; what the manifest says of it with a status;
    warnings). A changed file is still used; a missing, invalid or foreign one gives no predictions."""
    ref = m.manifest.get("policy")
    if not ref:
        return None, None, []
    path = Path(ref.get("path") or "")
    if not path.is_absolute():
        path = Path(m.manifest.get("cwd") or ".") / path
    info = {"path": str(path), "sha256": ref.get("sha256"), "status": "verified"}
    if not path.is_file():
        info["status"] = "missing"
        return None, info, [f"{m.name} applied the policy {path}, which is missing: no predictions to compare"]
    warnings = []
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if digest != ref.get("sha256"):
        info["status"] = "changed"
        warnings.append(f"{m.name} applied {path} with sha256 {str(ref.get('sha256'))[:12]}…, the file now has "
                        f"{digest[:12]}…: it was rewritten after the run; its predictions now are shown")
    try:
        policy = load_policy(path)
        check_model(policy, tables=m.manifest.get("tables") or [], world_size=int(m.manifest.get("world_size") or 1),
                    path=path)
    except PolicyMismatch as err:
        info["status"] = "another model"
        return None, info, [*warnings, f"{m.name}: {err}"]
    except PolicyError as err:
        info["status"] = "invalid"
        return None, info, [*warnings, f"{m.name}: {err}"]
    applied = ref.get("applied")  # None: recorded before the trainer named them, when it applied every one
    info["sections"] = list(applied) if applied is not None else [label for label, _ in sections(policy)]
    info["skipped"] = ref.get("skipped") or {}
    return policy, info, warnings


def policy_rows(m: Measured, policy: dict, base: Measured, notes: list[str]) -> list[dict]:
    """Predicted against measured for each section the run applied, their combination and the
    policy's baseline (module docstring)."""
    measured = {**{k: m.figures.get(k) for k in (*EMBEDDING, DP_BYTES, STEP_TIME, INTRA_BYTES, INTER_BYTES)},
                "makespan_s": m.figures["timed_makespan_s"],  # inference runs: the lag section's figure
                **savings(m.figures, base.figures),
                **quality.changes(m.figures["metrics"], base.figures["metrics"]),
                HOT_STEP_FRACTION: hot_step_fraction(m.steps)}
    bodies, applied = dict(sections(policy)), m.figures["policy"]["sections"]
    checked = [(label, bodies[label]) for label in applied if label in bodies]
    notes += [f"{m.name} skipped {label}: {why}" for label, why in m.figures["policy"]["skipped"].items()]
    if len(checked) > 1:
        combined = policy.get("combined")
        if combined is not None and sorted(combined["sections"]) == sorted(applied):
            checked.append(("combined", combined))
            joint = "; section combined is the policy's prediction for them together"
        else:
            joint = ("; the policy has no prediction for them together" if combined is None else
                     f"; the policy's combined prediction is for {', '.join(combined['sections'])}, not compared")
        notes.append(f"{m.name} applied {', '.join(applied)} together: each section's rows are its own prediction "
                     f"against the measurement of all of them{joint}")
    rows = []
    for label, body in checked:
        intervals = predicted_intervals(body, base.figures)
        rows += [row(m.name, label, figure, value, measured.get(figure), intervals.get(figure))
                 for figure, value in predicted_figures(body.get("predicted") or {}, base.figures).items()]
    baseline = {A2A_BYTES: A2A_BYTES, ALLREDUCE_BYTES: ALLREDUCE_BYTES,
                STEP_TIME: STEP_TIME}
    rows += [row(m.name, "baseline", key, policy["baseline"][key], base.figures.get(ours))
             for key, ours in baseline.items() if _number(policy.get("baseline", {}).get(key))]
    return rows


PLAN_FIGURES = (A2A_BYTES, A2A_REMOTE_BYTES, ALLREDUCE_BYTES, STEP_TIME)


def plan_rows(m: Measured, base: Measured) -> list[dict]:
    """Predicted against measured for a TorchRec plan the run was recorded with (`record --plan`; the
    manifest keeps the plan as it was read, analyses/torchrec_plans.py's predictions in it)."""
    plan = (m.manifest.get("torchrec_plan") or {}).get("plan") or {}
    predicted = plan.get("predicted") or {}
    intervals = plan.get("intervals") or {}
    section = "torchrec_plan.qcomms" if plan.get("qcomms") else "torchrec_plan"
    rows = [row(m.name, section, figure, float(predicted[figure]), m.figures.get(figure),
                tuple(intervals[figure]) if figure in intervals else None)
            for figure in PLAN_FIGURES if _number(predicted.get(figure))]
    rows += [row(m.name, section, f"{figure}_saving", 1 - float(predicted[figure]) / base.figures[figure],
                 1 - m.figures[figure] / base.figures[figure])
             for figure in (A2A_REMOTE_BYTES, STEP_TIME)
             if _number(predicted.get(figure)) and base.figures.get(figure) and m.figures.get(figure) is not None]
    return rows


def hot_step_fraction(steps: pl.DataFrame) -> float | None:
    """The share of a scheduled run's steps that were hot (FAE; None without a schedule column)."""
    kinds = steps["schedule"].drop_nulls()
    return float((kinds == "hot").mean()) if len(kinds) else None


def predicted_figures(predicted: dict, base: dict) -> dict[str, float]:
    """The figures a section predicts, with totals and savings derived as the module docstring says."""
    out = {k: float(predicted[k]) for k in (*EMBEDDING[:3], INTRA_BYTES, INTER_BYTES, DP_BYTES, STEP_TIME,
                                            "makespan_s", HOT_STEP_FRACTION, AUC_CHANGE, LOGLOSS_CHANGE)
           if _number(predicted.get(k))}
    sync = out.get(SYNC_BYTES, 0.0)
    if A2A_BYTES in out:
        out["total_bytes_per_step"] = out[A2A_BYTES] + sync
    if A2A_REMOTE_BYTES in out:
        out["total_remote_bytes_per_step"] = out[A2A_REMOTE_BYTES] + sync
    out.update(savings(out, base))
    return out


def predicted_intervals(body: dict, base: dict) -> dict[str, tuple[float, float]]:
    """(low, high) of each figure predicted_figures derives from `body` that rests on an estimate (a
    figure of its `intervals`): the same formulas at the intervals' low ends and at their high ends,
    ordered (every derived figure moves one way with all the estimates it sums). Figures left out are
    exact."""
    intervals = body.get("intervals") or {}
    predicted = body.get("predicted") or {}  # a hand-written section may predict nothing
    ends = [predicted_figures(predicted | {k: pair[i] for k, pair in intervals.items()}, base) for i in (0, 1)]
    unknown = predicted_figures(predicted | {k: math.nan for k in intervals}, base)
    return {k: (min(ends[0][k], ends[1][k]), max(ends[0][k], ends[1][k])) for k, v in unknown.items() if math.isnan(v)}


def savings(figures: dict, base: dict) -> dict[str, float]:
    """saving and remote_saving of `figures` against BASE's measured totals, where both exist."""
    out = {}
    for name, key in (("saving", "total_bytes_per_step"), ("remote_saving", "total_remote_bytes_per_step")):
        if _number(figures.get(key)) and base.get(key):
            out[name] = 1 - figures[key] / base[key]
    return out


def row(run: str, section: str, figure: str, predicted: float, measured: float | None,
        interval: tuple[float, float] | None = None) -> dict:
    unit = ("bytes" if figure.endswith("bytes_per_step") else "s" if figure.endswith("_s")
            else "auc" if figure == AUC_CHANGE else "relative" if figure == LOGLOSS_CHANGE else "fraction")
    diff = None if measured is None else measured - predicted
    diff_pct = None if diff is None else diff / predicted if predicted else 0.0 if diff == 0 else None
    low, high = interval or (None, None)
    return {"run": run, "section": section, "figure": figure, "unit": unit,
            "kind": "exact" if interval is None else "estimated", "predicted": predicted, "predicted_low": low,
            "predicted_high": high, "measured": measured, "diff": diff, "diff_pct": diff_pct}


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


# tables -----------------------------------------------------------------------------------------

def tables(measured: list[Measured], rows: list[dict]) -> dict[str, pl.DataFrame]:
    flat = [{k: v for k, v in m.figures.items() if not isinstance(v, (dict, list))}
            | {f"{k}_ratio": (m.figures["ratios"] or {}).get(k) for k in RATIOS}
            | {f"metric_{k}": v for k, v in m.figures["metrics"].items()}
            for m in measured]
    by_op = [by_op_tag(m.calls, m.figures["steps"]).with_columns(pl.lit(m.name).alias("run")) for m in measured]
    split = [schedule_split(m.steps, m.calls).with_columns(pl.lit(m.name).alias("run")) for m in measured]
    policy_schema = {"run": pl.String, "section": pl.String, "figure": pl.String, "unit": pl.String,
                     "kind": pl.String, "predicted": pl.Float64, "predicted_low": pl.Float64,
                     "predicted_high": pl.Float64, "measured": pl.Float64, "diff": pl.Float64, "diff_pct": pl.Float64}
    return {"compare_runs": pl.DataFrame(flat, infer_schema_length=None),
            "compare_bytes": pl.concat(by_op).select("run", pl.exclude("run")),
            "compare_schedule": pl.concat(split).select("run", pl.exclude("run")),
            "compare_policy": pl.DataFrame(rows, schema=policy_schema)}

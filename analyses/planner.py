"""TorchRec planner inputs per table, from the recorded training lookups: what a user pastes into
`EmbeddingShardingPlanner(constraints=...)` so it plans for the traffic the run showed.

Per table t (F_t the features looking it up, analyses.attribution.features; 1 for tracekit's trainer):

- pooling_factor = `ids_per_bag`: ids / bags, bags = samples · F_t, over the training steps with `lookups`
  (ids: every rank's lookups of t there; samples: the `steps` table's `samples`, else the input
  dist's batch per rank, analyses.attribution.batches, else, without an exchange (data-parallel
  tables, one rank), each rank's largest bag index + 1 in `lookups`), else over every training
  step from `accesses` (`pooling_source` says which). Empty bags count as 0 ids, as in TorchRec's mean
  ids per sample per feature. The trace holds no feature names: every feature of a table gets the
  table's mean, so `pooling_factors` is `[pooling_factor] * F_t`. (analyses.torchrec_cache_stats' `ids_per_sample`
  counts every feature of a table together: the same for one feature.)
- cache_load_factor at a target hit rate h (TARGET_HIT_RATES): the smallest simulated load factor
  whose LRU hit rate (1 − miss ratio of `cache_mrc`, analyses.cache.miss_ratio_curves: FBGEMM's per-rank cache of
  the rows a rank holds, so the fraction of each shard's rows, as TorchRec applies it) reaches h;
  where none does, the point where the line from the largest simulated load factor to TorchRec's
  convention of no misses at load factor 1 (analyses.torchrec_cache_stats' `expected_miss_rate`) reaches h
  (`cache_source` 'simulated' | 'interpolated'). `hit_rate` is what that load factor reaches.
  Both sources grow with h, so a higher target never asks for a smaller cache.

Table `planner`, a row per table and target: table_name, num_embeddings, embedding_dim,
n_features, pooling_factor, pooling_source, target_hit_rate, cache_load_factor, hit_rate,
cache_source. `analysis/torchrec_constraints.json` holds, per table, the fields of torchrec
1.8.0's `ParameterConstraints` (`pooling_factors`) and `CacheParams` (`load_factor`, at
DEFAULT_HIT_RATE); `snippet(path)` is the Python that loads it into a planner:

    result = compute(ctx)
    result.tables["planner"]                      # table_name | ... | cache_load_factor | hit_rate
    constraints(result.tables["planner"])         # {"t0": {"pooling_factors": [1.5, 1.5], "cache_params": {...}}}

    table_name  n_features  pooling_factor  target_hit_rate  cache_load_factor  hit_rate  cache_source
    t0          2           1.5             0.9              0.8                0.9       interpolated
    t0          2           1.5             0.99             0.98               0.99      interpolated
    t1          1           1.5             0.9              0.5                0.93      simulated
"""

from __future__ import annotations

import polars as pl

from analyses import attribution, cache
from analyses.context import Context, Result

TARGET_HIT_RATES = (0.9, 0.99)
DEFAULT_HIT_RATE = 0.9  # the target whose load factor goes into torchrec_constraints.json
CONSTRAINTS = "torchrec_constraints"  # analysis/torchrec_constraints.json
SCHEMA = {"table_name": pl.String, "num_embeddings": pl.Int64, "embedding_dim": pl.Int64, "n_features": pl.Int64,
          "pooling_factor": pl.Float64, "pooling_source": pl.String, "target_hit_rate": pl.Float64,
          "cache_load_factor": pl.Float64, "hit_rate": pl.Float64, "cache_source": pl.String}


def compute(ctx: Context) -> Result:
    """The `planner` table, analysis/torchrec_constraints.json and a summary per table."""
    result = Result()
    if not ctx.model.tables:
        result.notes.append("no embedding tables in the manifest: no planner inputs")
        return result
    features = attribution.features(ctx)
    pooling, pooling_source = ids_per_bag(ctx, features)
    mrc = cache.miss_ratio_curves(ctx)
    rows = []
    for table in ctx.model.tables:
        lru = mrc.filter(table_name=table.name, policy="lru").sort("load_factor")
        for target in TARGET_HIT_RATES:
            load_factor, hit_rate, how = load_factor_for(lru["load_factor"].to_list(),
                                                         (1 - lru["miss_ratio"]).to_list(), target)
            rows.append({"table_name": table.name, "num_embeddings": table.num_rows, "embedding_dim": table.dim,
                         "n_features": features.get(table.name, 1), "pooling_factor": pooling.get(table.name),
                         "pooling_source": pooling_source, "target_hit_rate": target,
                         "cache_load_factor": load_factor, "hit_rate": hit_rate, "cache_source": how})
    frame = pl.DataFrame(rows, schema=SCHEMA)
    result.tables["planner"] = frame
    done = cache.torchrec_stats(ctx)
    stats = {} if done is None else {name: entry["offload_stats"] for name, entry in done["tables"].items()}
    path = ctx.write_json(CONSTRAINTS, constraints(frame, stats=stats))
    result.summary = {"constraints": str(path), "default_hit_rate": DEFAULT_HIT_RATE,
                      "pooling_source": pooling_source, "tables": _per_table(frame)}
    if frame["cache_load_factor"].is_null().any():
        result.notes.append("no LRU curve for some tables (no training accesses): no cache load factor for them")
    result.notes.append(f"TorchRec planner inputs in {path} (`tracekit planner {ctx.path}` prints the snippet)")
    return result


def ids_per_bag(ctx: Context, features: dict[str, int]) -> tuple[dict[str, float], str]:
    """{table: mean ids per bag, a bag one feature's ids of one sample: TorchRec's pooling factor} and
    where the ids and samples came from (module docstring)."""
    if ctx.has("lookups"):
        ids = "SELECT step, table_name, count(*) AS ids FROM train_lookups GROUP BY ALL"
        where = "lookups of the sampled training steps"
    else:
        ids = "SELECT step, table_name, sum(count) AS ids FROM train_accesses GROUP BY ALL"
        where = "accesses of every training step"
    samples, per = _samples(ctx)
    if samples is None:
        return {}, "none: the run records no samples per step (steps.samples) and no input-dist all-to-all"
    ctx.con.register("tk_planner_samples", samples)
    rows = ctx.sql(f"""SELECT i.table_name, sum(i.ids)::DOUBLE / sum(s.samples)
                       FROM ({ids}) i JOIN tk_planner_samples s USING (step) GROUP BY i.table_name""").fetchall()
    ctx.con.unregister("tk_planner_samples")
    return {name: value / features.get(name, 1) for name, value in rows}, f"{where} / ({per} x features)"


def _samples(ctx: Context) -> tuple[pl.DataFrame | None, str]:
    """(step, samples) of every training step, all ranks together, and where they came from."""
    if ctx.has("steps"):
        frame = ctx.frame("SELECT step, sum(samples)::BIGINT AS samples FROM steps GROUP BY step HAVING sum(samples) > 0")
        if frame.height:
            return frame, "steps.samples"
    if ctx.has("comms") and ctx.model.world_size > 1:
        frame = attribution.batches(ctx).group_by("step").agg(pl.col("b").sum().cast(pl.Int64).alias("samples"))
        if frame.height:
            return frame, "the input dist's batch per rank"
    if ctx.has("lookups"):  # no exchange: every rank looks its own batch up, bags numbered from 0
        frame = ctx.frame("""SELECT step, sum(b)::BIGINT AS samples FROM (
                                 SELECT step, rank, max(sample) + 1 AS b FROM train_lookups GROUP BY ALL)
                             GROUP BY step""")
        if frame.height:
            return frame, "each rank's bags in lookups (a batch ending in empty bags counts short)"
    return None, ""


def load_factor_for(load_factors: list[float], hit_rates: list[float], target: float
                    ) -> tuple[float | None, float | None, str | None]:
    """(load factor, hit rate it reaches, 'simulated' | 'interpolated') for `target` on an LRU curve
    (module docstring); (None, None, None) without a curve.

    >>> load_factor_for([0.1, 0.5], [0.6, 0.8], 0.9)
    (0.75, 0.9, 'interpolated')
    """
    if not load_factors:
        return None, None, None
    for lf, hit in zip(load_factors, hit_rates):
        if hit >= target:
            return lf, hit, "simulated"
    lf, hit = load_factors[-1], hit_rates[-1]  # the line to (1.0, 1.0), TorchRec's no misses at clf 1
    return round(lf + (target - hit) / (1 - hit) * (1 - lf), 6), target, "interpolated"


def constraints(frame: pl.DataFrame, *, hit_rate: float = DEFAULT_HIT_RATE,
                stats: dict[str, dict] | None = None) -> dict[str, dict]:
    """{table: ParameterConstraints keyword arguments}, `cache_params` as CacheParams' (torchrec 1.8.0),
    its `stats` EmbeddingOffloadStats' arguments (analyses.torchrec_cache_stats.offload_stats) where given."""
    out = {}
    for row in frame.filter(pl.col("target_hit_rate") == hit_rate).iter_rows(named=True):
        entry: dict = {}
        if row["pooling_factor"] is not None:
            entry["pooling_factors"] = [round(row["pooling_factor"], 6)] * row["n_features"]
        entry["cache_params"] = {"load_factor": row["cache_load_factor"]}  # null: CacheParams' default
        if (stats or {}).get(row["table_name"]):
            entry["cache_params"]["stats"] = stats[row["table_name"]]
        out[row["table_name"]] = entry
    return out


def snippet(path: str) -> str:
    """Python that turns `path` (torchrec_constraints.json) into the planner's constraints."""
    return f'''import json, torch
from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints
from torchrec.distributed.planner.shard_estimators import EmbeddingOffloadStats
from torchrec.distributed.types import CacheParams

def cache_params(c):  # the trace's LRU curve as the planner's cache statistics
    stats = c.get("stats")
    if stats:
        stats = EmbeddingOffloadStats(**{{**stats, "mrc_hist_counts": torch.tensor(stats["mrc_hist_counts"])}})
    return CacheParams(**{{**c, "stats": stats}})

constraints = {{name: ParameterConstraints(**{{**c, "cache_params": cache_params(c["cache_params"])}})
               for name, c in json.load(open("{path}")).items()}}
# cache_params act where compute_kernels allow "fused_uvm_caching" (CUDA)
planner = EmbeddingShardingPlanner(topology=topology, constraints=constraints)  # your Topology'''


def _per_table(frame: pl.DataFrame) -> dict[str, dict]:
    out: dict[str, dict] = {}
    for row in frame.iter_rows(named=True):
        entry = out.setdefault(row["table_name"], {
            "num_embeddings": row["num_embeddings"], "embedding_dim": row["embedding_dim"],
            "n_features": row["n_features"], "pooling_factor": row["pooling_factor"], "cache_load_factor": {}})
        entry["cache_load_factor"][str(row["target_hit_rate"])] = {
            "load_factor": row["cache_load_factor"], "hit_rate": row["hit_rate"], "source": row["cache_source"]}
    return out


"""The bytes a TorchRec sharding plan moves per step, exactly, from the trace: per collective of the
input and output dist, from each sender to each receiver. analyses.torchrec_plans prices them and
searches the plans over them.

    L = loads(ctx, len_bytes, id_bytes)
    pairs = pairs_of(L, plan["tables"])     # collective -> [W, W] bytes per step (sender, receiver)
    figures(L, plan["tables"])["a2a_remote_bytes_per_step"]

The loads (`loads`, from the baseline's attributed lookups, analyses.attribution): per table t its
rows, dim, features F_t, whether pooled, and per source rank q the ids n_tq its samples look up per
step and q's batch b_q (means over the sampled steps). Under a plan, TorchRec's input and output
dist move, per step (sharding groups apart, the same sums; the splits all-to-all left out, as in
analyses.exchange):

    each shard s of t on rank o (table_wise: one, all D_t columns; column_wise: k of D_t / k
    columns; row_wise and table_row_wise are not planned here):
        input_lengths  q -> o   len_bytes · F_t · b_q
        input_ids      q -> o   id_bytes · n_tq
        output_fwd     o -> q   F_t · b_q · c_s · eb      (pooled; a sequence table: n_tq · c_s · eb)
        output_bwd     q -> o   the same
    a data_parallel table: no exchange; DDP all-reduces its gradient, rows · D_t · eb per rank

with eb the element bytes of a row (rb_t / D_t). Applied to the recorded plan this is the replay
of analyses.exchange (tested equal to `comms`); applied to another plan it is that plan's bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from analyses import attribution
from analyses.context import Context

COLLECTIVES = ("input_lengths", "input_ids", "output_fwd", "output_bwd")
QCOMM_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2}  # bytes of an element on the wire (TorchRec's QCommsConfig)


@dataclass
class Loads:
    """What a plan's bytes depend on, per table (index t) and source rank (index q)."""

    world: int
    names: list[str]
    rows: np.ndarray  # [T]
    dims: np.ndarray  # [T]
    eb: np.ndarray  # [T] bytes per row element (4: float32)
    features: np.ndarray  # [T] F_t
    pooled: np.ndarray  # [T] bool
    ids: np.ndarray  # [T, W] ids per step the samples of q look up in t
    batch: np.ndarray  # [W] b_q, samples per step
    len_bytes: int
    id_bytes: int
    sampled_steps: int


def loads(ctx: Context, len_bytes: int, id_bytes: int) -> Loads:
    """The loads of the run in `ctx` (its lookups attributed to their source ranks)."""
    a = attribution.attributed(ctx).tables
    world = ctx.model.world_size
    names = ctx.sql(f"SELECT tid, table_name, rb, n_features, kind FROM {a.names} ORDER BY tid").fetchall()
    steps = max(ctx.sql(f"SELECT count(*) FROM {a.steps}").fetchall()[0][0], 1)
    ids = np.zeros((len(names), world))
    for tid, src, n in ctx.sql(f"""SELECT tid, src, count(*) FROM {a.lookups} WHERE src IS NOT NULL
                                   GROUP BY ALL""").fetchall():
        ids[tid, src] = n / steps
    batch = np.zeros(world)
    for src, b in ctx.sql(f"SELECT src, sum(b) FROM {a.batches} JOIN {a.steps} USING (step) GROUP BY src").fetchall():
        batch[src] = b / steps
    tables = {t.name: t for t in ctx.model.tables}
    dims = np.array([tables[name].dim for _, name, *_ in names], dtype=np.int64)
    return Loads(world, [name for _, name, *_ in names],
                 np.array([tables[name].num_rows for _, name, *_ in names], dtype=np.int64), dims,
                 np.array([rb for _, _, rb, *_ in names], dtype=np.float64) / dims,
                 np.array([f for *_, f, _ in names], dtype=np.float64),
                 np.array([kind == "pooled" for *_, kind in names]), ids, batch, len_bytes, id_bytes, steps)


def shards(table: dict, dim: int) -> list[tuple[int, int]]:
    """(rank, columns) of each shard of a plan file's `table` whose exchange is all-to-all; none
    for a data-parallel one."""
    kind, ranks = table["sharding_type"], table["ranks"]
    if kind == "data_parallel":
        return []
    if kind == "table_wise":
        return [(ranks[0], dim)]
    if kind == "column_wise":
        return [(r, dim // len(ranks)) for r in ranks]
    raise ValueError(f"{kind} tables are not planned here")


def pairs_of(L: Loads, tables: dict[str, dict], qcomms: dict | None = None) -> dict[str, np.ndarray]:
    """Per collective, bytes per step from each sender to each receiver ([W, W]) under the plan's
    `tables` (a table left out moves nothing), the output dist's rows at `qcomms`'s precisions (a plan
    file's "qcomms": {"forward": "fp16", "backward": "bf16"}); and "dp_allreduce": each rank's
    all-reduce bytes_out ([W]) for its data-parallel tables."""
    W = L.world
    pairs = {c: np.zeros((W, W)) for c in COLLECTIVES}
    dp = np.zeros(W)
    for t, name in enumerate(L.names):
        table = tables.get(name)
        if table is None:  # not placed yet (derive)
            continue
        if table["sharding_type"] == "data_parallel":
            dp += L.rows[t] * L.dims[t] * L.eb[t]
            continue
        fwd, bwd = ((QCOMM_BYTES[qcomms.get("forward", "fp32")], QCOMM_BYTES[qcomms.get("backward", "fp32")])
                    if qcomms else (L.eb[t], L.eb[t]))
        for owner, cols in shards(table, int(L.dims[t])):
            elements = (L.features[t] * L.batch if L.pooled[t] else L.ids[t]) * cols  # to each source rank
            pairs["input_lengths"][:, owner] += L.len_bytes * L.features[t] * L.batch
            pairs["input_ids"][:, owner] += L.id_bytes * L.ids[t]
            pairs["output_fwd"][owner, :] += elements * fwd
            pairs["output_bwd"][:, owner] += elements * bwd
    return {**pairs, "dp_allreduce": dp}


def figures(L: Loads, tables: dict[str, dict], qcomms: dict | None = None) -> dict[str, float]:
    """A plan's bytes per step (all ranks' bytes_out, as `comms` sums them): the exchange's, its
    part that crosses ranks, the data-parallel tables' all-reduce; and per collective its busiest
    rank's remote bytes (`busiest_<collective>`)."""
    pairs = pairs_of(L, tables, qcomms)
    off = ~np.eye(L.world, dtype=bool)
    out = {"a2a_bytes_per_step": float(sum(pairs[c].sum() for c in COLLECTIVES)),
           "a2a_remote_bytes_per_step": float(sum(pairs[c][off].sum() for c in COLLECTIVES)),
           "dp_allreduce_bytes_per_step": float(pairs["dp_allreduce"].sum())}
    for c in COLLECTIVES:
        remote = np.where(off, pairs[c], 0.0)
        out[f"busiest_{c}"] = float(np.maximum(remote.sum(axis=1), remote.sum(axis=0)).max())
    return out

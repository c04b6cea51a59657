"""The embedding exchange of a target world, to the byte: the recorded lookups regrouped onto W' ranks
(analyses.regroup), the tables placed by the reference trainer's own planner at W'
(tracekit.placement), and every collective of its input and output dist counted as the trainer's
routing (tracekit/dlrm/sharding.py `route`) sends it, with any set of rows replicated.

Per target step, from rank q (b_q samples) to owner o (F_t the features looking table t up, 1 but for a
TorchRec table; rb_t = dim · 4 the bytes of a row):

    input_lengths  q -> o   len_bytes · b_q · Σ_{t on o} F_t       (row-wise: every table is on every o)
    input_ids      q -> o   id_bytes · (ids of q's samples in rows held by o, replicated ones left out)
    output_fwd     o -> q   Σ_{pooled t on o} rb_t · (F_t · b_q − q's bags of t whose ids are all replicated)
                            + Σ_{sequence t on o} rb_t · (q's ids of t held by o, replicated ones left out)
    output_bwd     q -> o   output_fwd transposed

A replicated row's id is looked up where its sample is; a pooled bag whose ids are all replicated is
sent as −1 and no row comes back (analyses.exchange's rules, at another world). The replicas' sync
(tracekit/dlrm/replicas.py), per step:

    dense   one all-reduce of S = Σ_{i∈H} rb_i a rank                       wire 2(W'−1)·S
    sparse  an all-gather of each rank's count (8 bytes), an all-to-all of the u_r ids rank r touched
            to every other rank, an all-reduce over the union U of rows touched
                                                   wire W'(W'−1)·8 + (W'−1)·8·Σ_r u_r + 2(W'−1)·Σ_{i∈U} rb_i

    routed = route(looked, on, plan, tables)           # once per target: owners, bags, rows
    x = exchange(routed, hot=None)                     # the baseline: TargetExchange
    x = exchange(routed, hot=routed.rows_in(keys))     # with the rows `keys` replicated
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from analyses.regroup import Lookups, Regrouped
from tracekit import tags
from tracekit.placement import ShardingPlan

COUNT_BYTES = 8  # the sparse sync's count of touched replica rows a rank, int64
EXCHANGE = (tags.INPUT_LENGTHS, tags.INPUT_IDS, tags.OUTPUT_FWD, tags.OUTPUT_BWD)
DENSE, SPARSE = "dense_allreduce", "sparse_allreduce"


@dataclass(frozen=True)
class TableBytes:
    """Per table (by tid): its row bytes, features, whether pooled and whether sharded."""

    rb: np.ndarray
    features: np.ndarray
    pooled: np.ndarray
    sharded: np.ndarray


@dataclass
class Routed:
    """The regrouped lookups routed on the target's plan: per kept lookup its target step, rank, owner and
    row index (into `keys`, the distinct rows), and per pooled bag its lookups."""

    on: Regrouped
    plan: ShardingPlan
    tables: TableBytes
    len_bytes: int
    id_bytes: int
    step: np.ndarray
    rank: np.ndarray
    owner: np.ndarray
    tid: np.ndarray
    row_index: np.ndarray  # into keys
    keys: np.ndarray  # distinct rows touched, tid << 40 | row, sorted
    bag: np.ndarray  # per pooled lookup its bag, −1 for a sequence lookup
    bag_rank: np.ndarray  # per bag
    bag_tid: np.ndarray
    sample: np.ndarray  # per lookup its sample, 0 ... n − 1
    pair: np.ndarray  # per lookup rank · W' + owner
    pooled: np.ndarray  # the pooled lookups' indices
    sequence: np.ndarray  # the sequence lookups' indices
    _orders: dict = field(default_factory=dict)

    def by(self, what: str) -> tuple[np.ndarray, np.ndarray]:
        """The lookups ordered by (step, rank, row) (`what` "rank") or (step, row) ("step"): the order and
        the sorted keys, once."""
        if what not in self._orders:
            k = len(self.keys)
            key = (self.step * self.world + self.rank) * k + self.row_index if what == "rank" else self.step * k + self.row_index
            order = np.argsort(key, kind="stable")
            self._orders[what] = (order, key[order])
        return self._orders[what]

    @property
    def world(self) -> int:
        return self.on.world

    def rows_in(self, keys: np.ndarray) -> np.ndarray:
        """A mask over `self.keys`: the rows of `keys` (tid << 40 | row) among those touched."""
        return np.isin(self.keys, keys)


@dataclass
class Sync:
    """A replica sync's collectives a step: the all-reduce's bytes a rank and, sparse, the count's
    all-gather and the ids' all-to-all (bytes from rank to rank); `wire` its bytes on the wire, all ranks."""

    kind: str
    allreduce_bytes: float
    ids: np.ndarray | None = None
    wire: float = 0.0
    replica_bytes: float = 0.0  # Σ rb of the replicated rows: each rank's copy


@dataclass
class TargetExchange:
    """The exchange of one target step: per collective the bytes from rank to rank (W' × W'), and the
    replicas' sync (None: no replicas)."""

    world: int
    pairs: dict[str, np.ndarray]
    syncs: dict[str, Sync] = field(default_factory=dict)  # by kind: the dense and the sparse one

    @property
    def total(self) -> np.ndarray:
        return sum(self.pairs.values(), np.zeros((self.world, self.world)))

    @property
    def bytes_out(self) -> float:
        """Σ ranks' bytes_out, self-splits included: `comms`' convention."""
        return float(sum(m.sum() for m in self.pairs.values()))

    @property
    def remote(self) -> float:
        return float(sum(m.sum() - np.trace(m) for m in self.pairs.values()))


def route(looked: Lookups, on: Regrouped, plan: ShardingPlan, tables: TableBytes, len_bytes: int,
          id_bytes: int) -> Routed:
    """The kept lookups of `on` with their owners on `plan` (table-wise: the table's rank; row-wise: the
    row's block), their rows indexed and their pooled bags numbered (lookups come a bag together)."""
    kept = on.kept
    tid, row, feature, g = looked.tid[kept], looked.row[kept], looked.feature[kept], looked.g[kept]
    rank, step = on.rank[kept].astype(np.int64), on.step[kept]
    if plan.kind == "table":
        owner = np.asarray(plan.owners, dtype=np.int64)[tid]
    else:
        blocks = np.array([plan.block_rows(t) for t in range(len(plan.tables))], dtype=np.int64)
        owner = row // blocks[tid]
    keys, row_index = _row_index(tid, row, plan)
    pooled = tables.pooled[tid]
    starts = np.ones(len(tid), dtype=bool)
    if len(tid):
        starts[1:] = (g[1:] != g[:-1]) | (tid[1:] != tid[:-1]) | (feature[1:] != feature[:-1])
    bag_all = np.cumsum(starts) - 1
    first = np.flatnonzero(starts & pooled)
    bag_id = np.full(int(bag_all[-1]) + 1 if len(tid) else 0, -1, dtype=np.int64)
    bag_id[bag_all[first]] = np.arange(len(first))
    bag = np.where(pooled, bag_id[bag_all], -1)
    return Routed(on, plan, tables, len_bytes, id_bytes, step, rank, owner, tid.astype(np.int64),
                  row_index, keys, bag, rank[first], tid[first].astype(np.int64), g, rank * on.world + owner,
                  np.flatnonzero(pooled), np.flatnonzero(~pooled))


def _row_index(tid: np.ndarray, row: np.ndarray, plan: ShardingPlan) -> tuple[np.ndarray, np.ndarray]:
    """Each lookup's row as an index into the rows' keys (tid << 40 | row, sorted): every row of every table
    where they are no more than the lookups several times over (an offset a table), else those touched."""
    rows = np.array([t.rows for t in plan.tables], dtype=np.int64)
    if rows.sum() <= 4 * max(len(row), 1) and (row < rows[tid]).all():
        offsets = np.concatenate([[0], np.cumsum(rows)[:-1]])
        keys = np.repeat(np.arange(len(rows), dtype=np.int64) << 40, rows) | (
            np.arange(rows.sum(), dtype=np.int64) - np.repeat(offsets, rows))
        return keys, offsets[tid] + row
    return np.unique(tid.astype(np.int64) << 40 | row, return_inverse=True)


def _distinct(by: tuple[np.ndarray, np.ndarray], mask: np.ndarray) -> np.ndarray:
    """The distinct keys of `by`'s lookups where `mask` holds (the sorted keys, each once)."""
    order, keys = by
    picked = keys[mask[order]]
    if not len(picked):
        return picked
    first = np.ones(len(picked), dtype=bool)
    first[1:] = picked[1:] != picked[:-1]
    return picked[first]


def exchange(r: Routed, hot: np.ndarray | None = None, syncs: tuple[str, ...] = (DENSE, SPARSE)) -> TargetExchange:
    """The exchange of one target step with the rows `hot` (a mask over r.keys; None: none) replicated,
    and, where some are, their sync of each kind in `syncs` (module docstring)."""
    w, t = r.world, r.tables
    steps = r.on.steps
    n_tables = len(t.rb)
    looked_hot = np.zeros(len(r.rank), dtype=bool) if hot is None else hot[r.row_index]
    cold = ~looked_hot
    ids = np.bincount(r.pair, weights=cold, minlength=w * w).reshape(w, w) * float(r.id_bytes)
    on_owner = np.zeros((n_tables, w), dtype=bool)  # table t has a shard on rank o
    for o in range(w) if r.plan.kind == "table" else ():
        on_owner[r.plan.tables_on(o), o] = True
    if r.plan.kind == "row":
        on_owner[:] = True
    on_owner &= t.sharded[:, None]
    feats = np.where(t.sharded, t.features, 0).astype(np.float64)
    samples = r.on.samples.astype(np.float64)
    lengths = np.outer(samples, feats @ on_owner) * float(r.len_bytes)
    # pooled bags: F_t · b_q a (rank, table), less those whose ids are all replicated
    bags = np.outer(samples, np.where(t.pooled, feats, 0.0))  # q × t
    if hot is not None and len(r.bag_rank):
        cold_in_bag = np.bincount(r.bag[r.pooled], weights=cold[r.pooled], minlength=len(r.bag_rank))
        all_hot = cold_in_bag == 0
        bags -= np.bincount(r.bag_rank[all_hot] * n_tables + r.bag_tid[all_hot],
                            minlength=w * n_tables).reshape(w, n_tables)
    rows_back = (bags * t.rb) @ on_owner  # q × o: pooled rows o returns q
    if len(r.sequence):
        seq = r.sequence[cold[r.sequence]]
        rows_back = rows_back + np.bincount(r.pair[seq], weights=t.rb[r.tid[seq]], minlength=w * w).reshape(w, w)
    pairs = {tags.INPUT_LENGTHS: lengths / steps, tags.INPUT_IDS: ids / steps,
             tags.OUTPUT_FWD: rows_back.T / steps, tags.OUTPUT_BWD: rows_back / steps}
    out = TargetExchange(w, pairs)
    if hot is not None and hot.any() and w > 1:
        replica = float(t.rb[(r.keys[hot] >> 40)].sum())
        for kind in syncs:
            out.syncs[kind] = _sync(r, kind, looked_hot, replica)
    return out


def hot_samples(r: Routed, hot: np.ndarray) -> float:
    """The share of the kept samples whose every id (of the sharded tables) is replicated: FAE's hot
    samples."""
    n = int(r.on.samples.sum())
    cold = ~hot[r.row_index]
    with_cold = int(np.count_nonzero(np.bincount(r.sample[cold], minlength=1)))
    return 1.0 - with_cold / n if n else 0.0


def _sync(r: Routed, kind: str, looked_hot: np.ndarray, replica: float) -> Sync:
    w, steps = r.world, r.on.steps
    if kind == DENSE:
        return Sync(DENSE, replica, None, 2 * (w - 1) * replica, replica)
    k = len(r.keys)
    u = np.bincount((_distinct(r.by("rank"), looked_hot) // k) % w, minlength=w) / steps  # rows a rank touched, a step
    union = _distinct(r.by("step"), looked_hot) % k
    touched = float(r.tables.rb[r.keys[union] >> 40].sum()) / steps
    ids = np.repeat(u[:, None] * COUNT_BYTES, w, axis=1)
    np.fill_diagonal(ids, 0.0)
    wire = w * (w - 1) * COUNT_BYTES + float(ids.sum()) + 2 * (w - 1) * touched
    return Sync(SPARSE, touched, ids, wire, replica)

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
    """The regrouped lookups routed on the target's plan, ordered by row: per kept lookup its target step,
    rank, owner and row index (into `keys`), its pooled bag (numbered in sample order; per bag its rank and
    table), its sample."""

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
    _cache: dict = field(default_factory=dict)
    multi_bags: np.ndarray | None = None  # the bags of several ids (_bag_sizes)

    def once(self, name: str, build):
        if name not in self._cache:
            self._cache[name] = build()
        return self._cache[name]

    def looked_up(self, hot: np.ndarray) -> np.ndarray:
        """The indices of the lookups of the rows `hot` (a mask over keys): runs of the lookups, which are
        ordered by row, so the work is the hot lookups', not every lookup's."""
        last = self._cache.get("looked_up")
        if last is not None and last[0] is hot:
            return last[1]
        offsets = self.once("offsets", lambda: np.concatenate(
            [[0], np.cumsum(np.bincount(self.row_index, minlength=len(self.keys)))]))
        rows = np.flatnonzero(hot)
        starts, counts = offsets[rows], offsets[rows + 1] - offsets[rows]
        idx = np.arange(int(counts.sum())) + np.repeat(starts - (np.cumsum(counts) - counts), counts)
        self._cache["looked_up"] = (hot, idx)
        return idx

    def distinct(self, what: str) -> tuple[np.ndarray, np.ndarray]:
        """The distinct (step, rank, row) of the lookups (`what` "rank": their rank and row) or (step, row)
        ("step": their row, and an empty array), once."""
        def build():
            k, step, row = len(self.keys), self.step.astype(np.int64), self.row_index.astype(np.int64)
            key = np.sort((step * self.world + self.rank) * k + row if what == "rank" else step * k + row)
            key = key[np.concatenate([[True], key[1:] != key[:-1]])] if len(key) else key
            return ((key // k) % self.world, key % k) if what == "rank" else (np.zeros(0, dtype=np.int64), key % k)
        return self.once(f"distinct_{what}", build)

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
    whole = bool(kept.all())
    def take(a: np.ndarray) -> np.ndarray:
        return a if whole else a[kept]
    tid, row, feature, g = take(looked.tid), take(looked.row), take(looked.feature), take(looked.g)
    rank, step = take(on.rank).astype(np.int32), take(on.step).astype(np.int32)
    if plan.kind == "table":
        owner = np.asarray(plan.owners, dtype=np.int32)[tid]
    else:
        blocks = np.array([plan.block_rows(t) for t in range(len(plan.tables))], dtype=np.int64)
        owner = (row // blocks[tid]).astype(np.int32)
    keys, row_index = _row_index(tid, row, plan)
    pooled = tables.pooled[tid]
    starts = np.ones(len(tid), dtype=bool)
    if len(tid):
        starts[1:] = (g[1:] != g[:-1]) | (tid[1:] != tid[:-1]) | (feature[1:] != feature[:-1])
    bag_all = np.cumsum(starts) - 1
    first = np.flatnonzero(starts & pooled)
    bag_id = np.full(int(bag_all[-1]) + 1 if len(tid) else 0, -1, dtype=np.int64)
    bag_id[bag_all[first]] = np.arange(len(first))
    bag = np.where(pooled, bag_id[bag_all], -1).astype(np.int32)
    bag_rank, bag_tid = rank[first], tid[first].astype(np.int32)
    del bag_all, bag_id, starts, first
    # the lookups by row from here on: a row's lookups together, so those of a set of rows are runs
    by_row = np.argsort(row_index, kind="stable")
    small = np.int32 if len(keys) < 2**31 else np.int64
    step, rank, owner, tid, bag = step[by_row], rank[by_row], owner[by_row], tid[by_row].astype(np.int32), bag[by_row]
    row_index, g = row_index[by_row].astype(small), g[by_row].astype(np.int32 if looked.samples < 2**31 else np.int64)
    return Routed(on, plan, tables, len_bytes, id_bytes, step, rank, owner, tid, row_index, keys, bag, bag_rank,
                  bag_tid, g, rank * np.int32(on.world) + owner, np.flatnonzero(bag >= 0), np.flatnonzero(bag < 0))


def _bag_sizes(r: Routed) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per lookup whether its pooled bag holds it alone, and its index among the bags of several ids (−1
    for others); per such bag its size. Sets r.multi_bags: those bags' ids."""
    size = np.bincount(r.bag[r.pooled], minlength=len(r.bag_rank))
    single = np.zeros(len(r.bag), dtype=bool)
    single[r.pooled] = size[r.bag[r.pooled]] == 1
    r.multi_bags = np.flatnonzero(size > 1)
    compact = np.full(len(size), -1, dtype=np.int64)
    compact[r.multi_bags] = np.arange(len(r.multi_bags))
    multi = np.where(r.bag >= 0, compact[np.maximum(r.bag, 0)], -1)
    return single, multi, size[r.multi_bags]


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


def exchange(r: Routed, hot: np.ndarray | None = None, syncs: tuple[str, ...] = (DENSE, SPARSE)) -> TargetExchange:
    """The exchange of one target step with the rows `hot` (a mask over r.keys; None: none) replicated,
    and, where some are, their sync of each kind in `syncs` (module docstring)."""
    w, t = r.world, r.tables
    steps = r.on.steps
    n_tables = len(t.rb)
    hot_idx = r.looked_up(hot) if hot is not None else np.zeros(0, dtype=np.int64)
    ids = (r.once("ids", lambda: np.bincount(r.pair, minlength=w * w))
           - np.bincount(r.pair[hot_idx], minlength=w * w)).reshape(w, w) * float(r.id_bytes)
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
    hot_bag = r.bag[hot_idx]
    if len(r.bag_rank) and len(hot_idx):  # a bag is served where its sample is once all its ids are hot
        single, multi, size = r.once("bags", lambda: _bag_sizes(r))
        alone = single[hot_idx]  # a bag of one id: all hot with it
        all_hot = hot_bag[alone]
        if len(size):
            in_bag = np.bincount(multi[hot_idx[~alone & (hot_bag >= 0)]], minlength=len(size))
            all_hot = np.concatenate([all_hot, r.multi_bags[np.flatnonzero(in_bag == size)]])
        bags -= np.bincount(r.bag_rank[all_hot] * n_tables + r.bag_tid[all_hot],
                            minlength=w * n_tables).reshape(w, n_tables)
    rows_back = (bags * t.rb) @ on_owner  # q × o: pooled rows o returns q
    if len(r.sequence):
        def rows_of(idx: np.ndarray) -> np.ndarray:
            return np.bincount(r.pair[idx], weights=t.rb[r.tid[idx]], minlength=w * w).reshape(w, w)
        hot_seq = hot_idx[hot_bag < 0]
        rows_back = rows_back + r.once("seq_rows", lambda: rows_of(r.sequence)) - rows_of(hot_seq)
    pairs = {tags.INPUT_LENGTHS: lengths / steps, tags.INPUT_IDS: ids / steps,
             tags.OUTPUT_FWD: rows_back.T / steps, tags.OUTPUT_BWD: rows_back / steps}
    out = TargetExchange(w, pairs)
    if hot is not None and hot.any() and w > 1:
        replica = float(t.rb[(r.keys[hot] >> 40)].sum())
        for kind in syncs:
            out.syncs[kind] = _sync(r, kind, hot, replica)
    return out


def hot_samples(r: Routed, hot: np.ndarray) -> float:
    """The share of the kept samples whose every id (of the sharded tables) is replicated: FAE's hot
    samples."""
    n = int(r.on.samples.sum())
    if not n:
        return 0.0
    total = r.once("per_sample", lambda: np.bincount(r.sample))
    hot_in = np.bincount(r.sample[r.looked_up(hot)], minlength=len(total))
    return 1.0 - int(np.count_nonzero(hot_in < total)) / n


def _sync(r: Routed, kind: str, hot: np.ndarray, replica: float) -> Sync:
    w, steps = r.world, r.on.steps
    if kind == DENSE:
        return Sync(DENSE, replica, None, 2 * (w - 1) * replica, replica)
    rank, row = r.distinct("rank")
    u = np.bincount(rank[hot[row]], minlength=w) / steps  # hot rows a rank touched, a step
    _, union = r.distinct("step")
    touched = float(r.tables.rb[r.keys[union[hot[union]]] >> 40].sum()) / steps
    ids = np.repeat(u[:, None] * COUNT_BYTES, w, axis=1)
    np.fill_diagonal(ids, 0.0)
    wire = w * (w - 1) * COUNT_BYTES + float(ids.sum()) + 2 * (w - 1) * touched
    return Sync(SPARSE, touched, ids, wire, replica)

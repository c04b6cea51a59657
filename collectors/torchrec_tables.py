"""The embedding collector's TorchRec / FBGEMM source: rows looked up by table-batched embeddings.

TorchRec's sharded tables are not `nn.EmbeddingBag`s: each rank looks its shards up in FBGEMM's
table-batched embedding modules (TBE: `SplitTableBatchedEmbeddingBagsCodegen` for the fused kernel,
`DenseTableBatchedEmbeddingBagsCodegen` for the dense one, pooled or sequence), which TorchRec's
`BatchedFusedEmbeddingBag`, `BatchedDenseEmbeddingBag`, `BatchedFusedEmbedding`, ... hold as
`_emb_module`. `install(tables)` adds them to the embedding collector `tables`
(collectors/embedding.py), whose `record_tables` keeps each lookup for the writer: same steps, phases,
`accesses` and `lookups` as an `nn.EmbeddingBag`'s.

Lazily: install only watches for the import of FBGEMM's TBE module and TorchRec's kernels and
collections; a process that never imports them pays nothing, and nothing here imports them. Once
imported, a global buffer-registration hook spots each TBE as it is built (it registers buffers in
`__init__`) and gives it a forward pre-hook of its own; a module-registration hook notes which
TorchRec kernel owns it, the sharding plan of each sharded collection, and the tables of an
unsharded `EmbeddingBagCollection` / `EmbeddingCollection`.

What a TBE call holds: `indices` of all its features, one after the other, and `offsets` of
`T * B + 1` bag boundaries for `T` features of `B` bags each (variable batch per feature: the sum
of `batch_size_per_feature_per_rank[f]` bags for feature `f`); feature `f` looks up table
`feature_table_map[f]`. Each feature's ids are kept as one call of its table, and a bag's index
within the feature is the lookup's `sample`. On the rank owning a shard, after TorchRec's input
all-to-all, the bags are ordered by source rank, as in tracekit's own trainer.

Ids are shard rows; a table is named by its TorchRec config name (the logical table) and its rows
are written as global rows, from the shard's offsets in the plan (`ShardMetadata.shard_offsets`):

| sharding type | a shard holds | row written | which shard counts a lookup |
|---|---|---|---|
| table_wise | every row and column | id | the one shard |
| row_wise, table_row_wise | rows [r0, r0 + n) | r0 + id | the one holding the row |
| column_wise, table_column_wise | every row, columns [c0, c0 + k) | id | the shard at column 0 |
| data_parallel | all of it, on every rank | id | each rank its own batch ("replicated") |

so one table recorded under two plans gives the same `accesses`. An unsharded TorchRec collection
looks up `nn.EmbeddingBag` / `nn.Embedding` modules, which the embedding collector records itself;
they are named by the table config's name too (`t0`, not `embedding_bags.t0`), and an
`EmbeddingCollection`'s forward pre-hook hands the collector each feature's bags, which its 1-D
`nn.Embedding` call of all the feature's ids does not show.

Per TBE call the training thread reads T + 1 offsets (on CUDA, a sync), copies the call's ids once
(and its offsets, on sampled steps) and keeps the call whole: about 25 µs for 4 features of 1,024
bags on one core of this project's CPU, against a TBE forward of 0.3 ms. Splitting it into the
features' calls and counting are left to the writer thread (`EmbeddingHandle.record_tables`).

Each TBE table shard adds one entry to the manifest's `tables` at its TBE's first call, with the
embedding collector's keys plus `sharding_type`, `compute_kernel`, `first_col` and `num_cols`.
A call whose offsets do not split into its features is skipped, its ids counted as dropped
`accesses`.

A row-wise shard receives only the ids of a bag that fall in its rows, so a lookup's `pos` counts
those (as in tracekit's own trainer); `sample` and `row` are the bag's and the table's.

Checked on torchrec 1.8.0 and fbgemm-gpu-cpu 1.8.0, CPU, with every plan above
(tests/test_torchrec_record.py; row_wise and table_row_wise from a hand-built plan, which the
planner refuses on CPU). The private attributes read (`_config`, `_feature_table_map`,
`_emb_module`) are read in `_torchrec_shards` and `_adopt_existing` only.

    handle = torchrec_tables.install(embedding_handle)
    ...
    handle.uninstall()
"""

from __future__ import annotations

import gc
import sys
import weakref
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn
from torch.nn.modules import module as torch_module

from collectors import phase
from collectors.counting import Table
from collectors.embedding import EmbeddingHandle
from collectors.guard import Guard
from collectors.imports import ImportWatcher

TBE_MODULE = "fbgemm_gpu.split_table_batched_embeddings_ops_training"
TBE_CLASSES = ("SplitTableBatchedEmbeddingBagsCodegen", "DenseTableBatchedEmbeddingBagsCodegen")
KERNEL_MODULE = "torchrec.distributed.batched_embedding_kernel"
KERNEL_CLASSES = ("BaseBatchedEmbedding", "BaseBatchedEmbeddingBag")
COLLECTIONS_MODULE = "torchrec.modules.embedding_modules"
COLLECTIONS = ("EmbeddingBagCollection", "EmbeddingCollection")
COLLECTION_TABLES = ("embedding_bags", "embeddings")  # their ModuleDict of tables, by table name
WATCHED = (TBE_MODULE, KERNEL_MODULE, COLLECTIONS_MODULE)
DTYPES = {"FP32": "float32", "FP16": "float16", "BF16": "bfloat16", "INT8": "int8", "INT4": "int4", "INT2": "int2"}


@dataclass(frozen=True)
class TableShard:
    """One table of a TBE: which rows and columns of which logical table it holds."""

    table: str
    table_rows: int
    dim: int
    first_row: int
    num_rows: int
    first_col: int
    num_cols: int
    dtype: str
    sharding_type: str
    compute_kernel: str


def _classes(module_name: str, names: tuple[str, ...]) -> tuple[type, ...]:
    """The classes `names` of an imported module (none if it is not imported)."""
    module = sys.modules.get(module_name)
    return tuple(c for c in (getattr(module, n, None) for n in names) if isinstance(c, type))


def feature_bounds(offsets: torch.Tensor, features: int, batch_sizes: list[list[int]] | None) -> list[int] | None:
    """Bag index at which each of `features` features starts, then the number of bags; None where
    `offsets` do not split so. Fixed batch: feature f holds bags [f * B, (f + 1) * B), B the bags over
    `features`; variable batch: feature f holds sum(batch_sizes[f]) bags (one count per source rank).

    >>> feature_bounds(torch.tensor([0, 1, 3, 3, 4, 6, 7]), 2, None)   # 2 features x 3 bags
    [0, 3, 6]
    >>> feature_bounds(torch.tensor([0, 1, 3, 3, 4, 6, 7]), 2, [[1, 1], [2, 2]])   # 2 bags, then 4
    [0, 2, 6]
    """
    bags = offsets.numel() - 1
    if batch_sizes is None:
        if features == 0 or bags % features:
            return None
        per_feature = [bags // features] * features
    else:
        per_feature = [sum(ranks) for ranks in batch_sizes]
    bounds = [0]
    for n in per_feature:
        bounds.append(bounds[-1] + n)
    return bounds if len(per_feature) == features and bounds[-1] == bags else None


def infer_sharding_type(shard: TableShard, *, sharded: bool) -> str:
    """The sharding type a shard's geometry shows, where no plan names it (table_row_wise and
    table_column_wise look like row_wise and column_wise)."""
    if not sharded:
        return "data_parallel"
    if shard.num_cols < shard.dim:
        return "column_wise"
    return "row_wise" if shard.num_rows < shard.table_rows else "table_wise"


def _torchrec_shards(kernel: nn.Module, plans: dict[str, Any]) -> tuple[list[TableShard], list[int]]:
    """The table shards a TorchRec batched-embedding kernel holds, and its feature -> table map.
    Reads torchrec 1.8.0's `_config.embedding_tables` (ShardedEmbeddingTable) and `_feature_table_map`."""
    shards = []
    for cfg in kernel._config.embedding_tables:
        offsets = list(cfg.local_metadata.shard_offsets) if cfg.local_metadata is not None else [0, 0]
        shard = TableShard(table=cfg.name, table_rows=int(cfg.num_embeddings), dim=int(cfg.embedding_dim),
                           first_row=int(offsets[0]), num_rows=int(cfg.local_rows or cfg.num_embeddings),
                           first_col=int(offsets[1]) if len(offsets) > 1 else 0,
                           num_cols=int(cfg.local_cols or cfg.embedding_dim),
                           dtype=DTYPES.get(cfg.data_type.value, cfg.data_type.value.lower()),
                           sharding_type="", compute_kernel=str(getattr(cfg.compute_kernel, "value", cfg.compute_kernel)))
        plan = plans.get(cfg.name)
        if plan is not None:
            shard = replace(shard, sharding_type=str(plan.sharding_type), compute_kernel=str(plan.compute_kernel))
        else:
            shard = replace(shard, sharding_type=infer_sharding_type(shard, sharded=cfg.local_metadata is not None))
        shards.append(shard)
    return shards, list(kernel._feature_table_map)


def _tbe_shards(tbe: nn.Module, name: str) -> tuple[list[TableShard], list[int]]:
    """The tables of a TBE no TorchRec kernel owns: whole tables, named by the TBE's `table_names`
    or `<module path>.<t>`."""
    specs = tbe.embedding_specs  # (rows, dim, ...) per table
    names = getattr(tbe, "table_names", None) or [f"{name}.{t}" for t in range(len(specs))]
    dtype = str(getattr(tbe, "weights_precision", "")).rsplit(".", 1)[-1]
    shards = [TableShard(table=names[t], table_rows=int(s[0]), dim=int(s[1]), first_row=0, num_rows=int(s[0]),
                         first_col=0, num_cols=int(s[1]), dtype=DTYPES.get(dtype, dtype.lower()),
                         sharding_type="table_wise", compute_kernel=type(tbe).__name__)
              for t, s in enumerate(specs)]
    feature_table_map = getattr(tbe, "feature_table_map", None)
    return shards, list(range(len(specs)) if feature_table_map is None else feature_table_map)


class TorchRecHandle:
    """The installed TorchRec/FBGEMM source of `tables`; `uninstall()` removes every hook and the
    import watcher. The calls already kept stay with `tables`, which writes them."""

    def __init__(self, tables: EmbeddingHandle) -> None:
        self.tables = tables
        self.guard = Guard("torchrec")
        self._watcher = ImportWatcher(WATCHED, lambda name: self.guard.run(self._on_import))
        self._hooks: list[Any] = []  # the global registration hooks, once a watched module is imported
        self._tbe_hooks: weakref.WeakKeyDictionary[nn.Module, Any] = weakref.WeakKeyDictionary()
        self._owners: weakref.WeakKeyDictionary[nn.Module, weakref.ref] = weakref.WeakKeyDictionary()
        self._features: weakref.WeakKeyDictionary[nn.Module, list[Table | None]] = weakref.WeakKeyDictionary()
        self._collection_dicts: weakref.WeakSet[nn.Module] = weakref.WeakSet()
        self._collection_hooks: weakref.WeakKeyDictionary[nn.Module, Any] = weakref.WeakKeyDictionary()
        self._plans: dict[str, Any] = {}  # table name -> ParameterSharding, from the sharded collections
        self._tbe_types: tuple[type, ...] = ()
        self._kernel_types: tuple[type, ...] = ()
        self._collection_types: tuple[type, ...] = ()
        if any(name in sys.modules for name in WATCHED):
            self.guard.run(self._on_import)
            self.guard.run(self._adopt_existing)
        sys.meta_path.insert(0, self._watcher)

    def uninstall(self) -> None:
        global _installed
        if self._watcher in sys.meta_path:
            sys.meta_path.remove(self._watcher)
        for hook in [*self._hooks, *self._tbe_hooks.values(), *self._collection_hooks.values()]:
            hook.remove()
        self._hooks = []
        self._tbe_hooks = weakref.WeakKeyDictionary()
        self._collection_hooks = weakref.WeakKeyDictionary()
        if _installed is self:
            _installed = None

    def _on_import(self) -> None:
        self._tbe_types = _classes(TBE_MODULE, TBE_CLASSES)
        self._kernel_types = _classes(KERNEL_MODULE, KERNEL_CLASSES)
        self._collection_types = _classes(COLLECTIONS_MODULE, COLLECTIONS)
        if not self._hooks:
            self._hooks = [torch_module.register_module_buffer_registration_hook(self._on_buffer),
                           torch_module.register_module_module_registration_hook(self._on_register)]

    def _adopt_existing(self) -> None:
        """Modules built before install (torchrec imported first): hook them as if seen being built."""
        for obj in gc.get_objects():
            if issubclass(type(obj), self._tbe_types):  # type(): isinstance would read __class__ properties
                self._hook(obj)
            elif issubclass(type(obj), self._kernel_types) and isinstance(getattr(obj, "_emb_module", None), nn.Module):
                self._owners[obj._emb_module] = weakref.ref(obj)
            elif issubclass(type(obj), self._collection_types):
                tables = next(getattr(obj, a) for a in COLLECTION_TABLES if hasattr(obj, a))
                self._collection(obj, tables)
                for table, module in tables.items():
                    self.tables.name_table(module, table)

    # --- registration hooks: they return None, so nothing registered changes ---

    def _on_buffer(self, module: nn.Module, name: str, buffer: Any) -> None:
        if isinstance(module, self._tbe_types) and module not in self._tbe_hooks:
            self.guard.run(self._hook, module)

    def _on_register(self, parent: nn.Module, attr: str, child: nn.Module | None) -> None:
        self.guard.run(self._note, parent, attr, child)

    def _note(self, parent: nn.Module, attr: str, child: nn.Module | None) -> None:
        if child is None:
            return
        if isinstance(child, self._tbe_types) and isinstance(parent, self._kernel_types):
            self._owners[child] = weakref.ref(parent)
        elif isinstance(parent, self._collection_types) and attr in COLLECTION_TABLES:
            self._collection(parent, child)
        elif parent in self._collection_dicts and isinstance(child, (nn.Embedding, nn.EmbeddingBag)):
            self.tables.name_table(child, attr)
        elif type(child).__module__.startswith("torchrec.distributed"):
            plan = getattr(child, "module_sharding_plan", None)  # ShardedEmbedding(Bag)Collection's
            if isinstance(plan, dict):
                self._plans.update(plan)
                if child not in self._collection_hooks:
                    self._collection_hooks[child] = child.register_forward_pre_hook(self._on_sharded_forward,
                                                                                    with_kwargs=True)

    # --- forward pre-hooks of the collections: they return None, so the inputs are unchanged ---

    def _on_sharded_forward(self, collection: nn.Module, args: tuple, kwargs: dict) -> None:
        self.guard.run(self._count_samples, collection, args, kwargs)

    def _on_collection_forward(self, collection: nn.Module, args: tuple, kwargs: dict) -> None:
        self.guard.run(self._count_samples, collection, args, kwargs)
        if hasattr(collection, "embedding_configs"):
            self.guard.run(self._expect_bags, collection, args, kwargs)

    def _count_samples(self, collection: nn.Module, args: tuple, kwargs: dict) -> None:
        """The step's samples on this rank, for `steps.samples`: the batch of the features the first
        training call of the step passes a collection (before the input all-to-all), unless the
        program named them."""
        features = args[0] if args else kwargs.get("features")
        clock = self.tables.clock
        if clock.samples is None and hasattr(features, "stride") and phase.of_call(collection) == "train":
            clock.samples = int(features.stride())

    def _expect_bags(self, collection: nn.Module, args: tuple, kwargs: dict) -> None:
        """An unsharded EmbeddingCollection looks each feature up as one 1-D `nn.Embedding` call of
        all its ids: tell the embedding collector the feature's bags (fixed batch only)."""
        features = args[0] if args else kwargs["features"]
        if not hasattr(features, "offsets") or features.variable_stride_per_key():
            return  # a TensorDict, or a variable batch: the lookups' `sample` stays the id's index
        offsets, batch = features.offsets(), features.stride()
        index = {key: i for i, key in enumerate(features.keys())}
        tables = collection.embeddings
        for config in collection.embedding_configs():
            bags = [offsets[index[f] * batch:(index[f] + 1) * batch + 1] for f in config.feature_names]
            self.tables.expect_bags(tables[config.name], bags)

    def _collection(self, collection: nn.Module, tables: nn.Module) -> None:
        """Note an unsharded collection and the ModuleDict of its tables, keyed by table name, and
        give it a forward pre-hook (its batch; an EmbeddingCollection's features' bags)."""
        self._collection_dicts.add(tables)
        if collection not in self._collection_hooks:
            self._collection_hooks[collection] = collection.register_forward_pre_hook(self._on_collection_forward,
                                                                                      with_kwargs=True)

    def _hook(self, tbe: nn.Module) -> None:
        self._tbe_hooks[tbe] = tbe.register_forward_pre_hook(self._on_forward, with_kwargs=True)

    # --- the lookup path ---

    def _on_forward(self, tbe: nn.Module, args: tuple, kwargs: dict) -> None:
        self.guard.run(self._record, tbe, args, kwargs)  # returns None: the inputs are unchanged

    def _record(self, tbe: nn.Module, args: tuple, kwargs: dict) -> None:
        features = self._features.get(tbe)
        if features is None:
            features = self._first_call(tbe)
        indices = args[0] if args else kwargs["indices"]
        offsets = args[1] if len(args) > 1 else kwargs["offsets"]
        batch_sizes = args[4] if len(args) > 4 else kwargs.get("batch_size_per_feature_per_rank")
        bounds = feature_bounds(offsets, len(features), batch_sizes)
        if bounds is None:
            self.tables.writer.count_dropped("accesses", indices.numel())
            return
        # where each feature's ids start: T + 1 numbers (on CUDA, a sync; on CPU numpy indexes in 1.9 µs, torch 5.7)
        cuts = (offsets.numpy() if offsets.device.type == "cpu" else offsets)[bounds].tolist()
        self.tables.record_tables(features, cuts, indices.detach().clone(), offsets, bounds, phase.of_call(tbe))

    def _first_call(self, tbe: nn.Module) -> list[Table | None]:
        owner = self._owners.get(tbe)
        owner = owner() if owner is not None else None
        if owner is not None:
            shards, feature_table_map = _torchrec_shards(owner, self._plans)
        else:
            shards, feature_table_map = _tbe_shards(tbe, self.tables.names.module_name(tbe))
        kind = "sequence" if getattr(getattr(tbe, "pooling_mode", None), "name", "") == "NONE" else "pooled"
        tables = [self._add(shard, kind) for shard in shards]
        features = self._features[tbe] = [tables[t] for t in feature_table_map]
        return features

    def _add(self, shard: TableShard, kind: str) -> Table | None:
        """List a shard in the manifest; its Table, or None for a column shard past column 0 (the
        shard at column 0 counts the same lookups)."""
        entry = {"table": shard.table, "first_row": shard.first_row, "num_rows": shard.num_rows,
                 "table_rows": shard.table_rows, "dim": shard.dim, "dtype": shard.dtype, "kind": kind,
                 "padding_idx": None,
                 "placement": "replicated" if shard.sharding_type == "data_parallel" else "sharded",
                 "sharding_type": shard.sharding_type, "compute_kernel": shard.compute_kernel,
                 "first_col": shard.first_col, "num_cols": shard.num_cols}
        table = self.tables.add_table(entry, num_rows=shard.num_rows, first_row=shard.first_row)
        return table if shard.first_col == 0 else None


# The hooks are process-wide, so the record of them is too: one slot, set by install and cleared by
# uninstall, makes a second install a no-op.
_installed: TorchRecHandle | None = None


def install(tables: EmbeddingHandle) -> TorchRecHandle:
    """Record TorchRec's / FBGEMM's table-batched lookups through the embedding collector `tables`,
    once their modules are imported. A second call while installed returns the installed handle."""
    global _installed
    if _installed is None:
        _installed = TorchRecHandle(tables)
    return _installed

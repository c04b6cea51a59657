"""`tracekit record --plan FILE`: an unchanged TorchRec job sharded by the plan in FILE
(tracekit/torchrec_plan.py), not by the plan its code builds.

`install(path)` reads the plan (in the process, so a bad file stops nothing yet) and waits for the
import of `torchrec.distributed.model_parallel`; then it wraps `DistributedModelParallel.__init__`.
At construction the wrapper finds every unsharded `EmbeddingBagCollection` / `EmbeddingCollection`
in the module, checks the plan against their tables and the world size, and passes DMP a
`ShardingPlan` built with TorchRec's own helpers (`construct_module_sharding_plan` and the per-table
generators `table_wise`, `column_wise`, ...) in place of the program's plan; with `qcomms`, the
sharders of those collections carry TorchRec's quantized-comms codecs (`QCommsConfig`). Whatever
else the program passes (env, device, its other sharders) goes through unchanged.

A plan that does not fit (another world size, other tables, other sizes) stops the process with one
line naming what differs (SystemExit), before DMP shards anything or runs a collective of its own.
"""

from __future__ import annotations

import functools
import inspect
import sys
from typing import Any

from collectors.imports import ImportWatcher
from tracekit.torchrec_plan import PlanError, check_model, read_plan

MODULE = "torchrec.distributed.model_parallel"
applied = 0  # DistributedModelParallels built with the plan in this process (the rank report's torchrec_plan_applied)


def install(path: str) -> ImportWatcher | None:
    """Inject the plan in `path` into every DistributedModelParallel built from now on."""
    try:
        plan = read_plan(path)
    except PlanError as err:
        raise SystemExit(f"tracekit: --plan: {err}") from None
    if MODULE in sys.modules:
        _wrap(plan, path)
        return None
    watcher = ImportWatcher((MODULE,), lambda name: _wrap(plan, path))
    sys.meta_path.insert(0, watcher)
    return watcher


def _wrap(plan: dict, path: str) -> None:
    from torchrec.distributed.model_parallel import DistributedModelParallel

    original = DistributedModelParallel.__init__
    if getattr(original, "tracekit_plan", None):
        return
    signature = inspect.signature(original)

    @functools.wraps(original)
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        bound = signature.bind(self, *args, **kwargs)
        arguments = bound.arguments
        world_size = arguments["env"].world_size if arguments.get("env") is not None else _world_size()
        try:
            arguments["plan"], arguments["sharders"] = sharding(plan, path, arguments["module"], world_size,
                                                                arguments.get("sharders"))
        except PlanError as err:
            raise SystemExit(f"tracekit: --plan: {err}") from None
        original(*bound.args, **bound.kwargs)
        global applied
        applied += 1

    __init__.tracekit_plan = path
    DistributedModelParallel.__init__ = __init__


def _world_size() -> int:
    import torch.distributed as dist

    return dist.get_world_size()


def collections(module: Any) -> dict[str, Any]:
    """{path in `module`: collection} of its unsharded EmbeddingBagCollections and EmbeddingCollections."""
    from torchrec import EmbeddingBagCollection, EmbeddingCollection

    kinds = (EmbeddingBagCollection, EmbeddingCollection)
    return {name: m for name, m in module.named_modules() if isinstance(m, kinds)}


def sharding(plan: dict, path: str, module: Any, world_size: int, sharders: list | None) -> tuple[Any, list]:
    """(the ShardingPlan of `plan` for `module`'s collections, the sharders to go with it)."""
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan
    from torchrec.distributed.types import ShardingPlan

    found = collections(module)
    tables = {c.name: (c.num_embeddings, c.embedding_dim) for m in found.values() for c in _configs(m)}
    check_model(plan, tables, world_size, path)
    sharders = _sharders(plan, sharders)
    by_type = {s.module_type: s for s in sharders}
    modules = {}
    for name, m in found.items():
        sharder = next(s for t, s in by_type.items() if isinstance(m, t))
        generators = {c.name: _generator(plan["tables"][c.name]) for c in _configs(m)}
        modules[name] = construct_module_sharding_plan(m, generators, sharder=sharder, local_size=world_size,
                                                       world_size=world_size, device_type=_device_type(m))
    return ShardingPlan(modules), sharders


def _configs(collection: Any) -> list:
    configs = getattr(collection, "embedding_bag_configs", None) or collection.embedding_configs
    return list(configs())


def _device_type(collection: Any) -> str:
    device = getattr(collection, "_device", None)
    return "cpu" if device is None or device.type == "meta" else device.type


def _generator(table: dict) -> Any:
    from torchrec.distributed import sharding_plan as helpers

    kind, ranks, kernel = table["sharding_type"], table["ranks"], table.get("compute_kernel", "fused")
    if kind == "table_wise":
        return helpers.table_wise(rank=ranks[0], compute_kernel=kernel)
    if kind == "column_wise":
        return helpers.column_wise(ranks=ranks, compute_kernel=kernel)
    if kind == "row_wise":
        return helpers.row_wise(compute_kernel=kernel)
    if kind == "table_row_wise":  # the ranks of node h are h·L ... h·L + L − 1
        return helpers.table_row_wise(host_index=min(ranks) // len(ranks))
    return helpers.data_parallel()


def _sharders(plan: dict, given: list | None) -> list:
    """The program's sharders (TorchRec's defaults where it passed none), those of the two
    collections replaced by ones with quantized comms where the plan asks for them."""
    from torchrec.distributed.embedding import EmbeddingCollectionSharder
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.sharding_plan import get_default_sharders

    sharders = list(given) if given else list(get_default_sharders())
    qcomms = plan.get("qcomms")
    if not qcomms:
        return sharders
    from torchrec.distributed.fbgemm_qcomm_codec import CommType, QCommsConfig, get_qcomm_codecs_registry

    registry = get_qcomm_codecs_registry(QCommsConfig(
        forward_precision=CommType[qcomms.get("forward", "fp32").upper()],
        backward_precision=CommType[qcomms.get("backward", "fp32").upper()]))
    replaced = [EmbeddingBagCollectionSharder(qcomm_codecs_registry=registry),
                EmbeddingCollectionSharder(qcomm_codecs_registry=registry)]
    kept = [s for s in sharders if not any(s.module_type is r.module_type for r in replaced)]
    return [*kept, *replaced]

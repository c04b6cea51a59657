"""The TorchRec plan file: how each embedding table of a TorchRec job is sharded, for `tracekit
record --plan FILE` to run the job, unchanged, with it (collectors/torchrec_plan.py injects it at
`DistributedModelParallel` construction).

    {"schema": "tracekit.torchrec_plan/1", "world_size": 2, "source_run": "runs/base",
     "tables": {"t0": {"sharding_type": "table_wise", "ranks": [1], "compute_kernel": "fused",
                       "num_embeddings": 100000, "embedding_dim": 64},
                "t1": {"sharding_type": "column_wise", "ranks": [0, 1], ...},
                "t2": {"sharding_type": "data_parallel", "ranks": [0, 1], ...}},
     "qcomms": {"forward": "fp16", "backward": "bf16"},        # optional: TorchRec's QCommsConfig
     "predicted": {...}, "why": "..."}                          # optional, written by analyze

`ranks`: the rank of each shard, in TorchRec's order (table_wise: one; column_wise: one per column
shard, columns split evenly; row_wise and data_parallel: every rank; table_row_wise: the ranks of
the node whose rows they hold). `num_embeddings` and `embedding_dim` are checked against the
model's tables before anything is sharded. Nothing here imports torch.

    plan = read_plan("plan.json")          # PlanError naming the file and the field, if it is not one
    plan = from_manifest(manifest)         # the plan a recorded TorchRec run ran with
    write_plan("plan.json", plan)
"""

from __future__ import annotations

import json
import os
from typing import Any

from tracekit.errors import TracekitError
from tracekit.files import write_text

SCHEMA = "tracekit.torchrec_plan/1"
SHARDING_TYPES = ("table_wise", "column_wise", "row_wise", "table_row_wise", "data_parallel")
COMPUTE_KERNELS = ("fused", "dense", "fused_uvm_caching", "fused_uvm", "quant")
QCOMM_PRECISIONS = ("fp32", "fp16", "bf16")
PLAN_FILE = "torchrec_plan.json"
"""Where `analyze` writes a TorchRec run's derived plan, in the run directory."""
QCOMMS_PLAN_FILE = "torchrec_plan.qcomms.json"
"""... and the same plan with quantized comms."""
ENV = "TRACEKIT_TORCHREC_PLAN"
"""The variable `record --plan` sets to the plan file's absolute path, for the collectors."""


class PlanError(TracekitError):
    """A plan file that cannot be read, or that does not fit the model or the run."""


def read_plan(path: str | os.PathLike) -> dict[str, Any]:
    """The plan in `path`, validated; PlanError naming the file and what is wrong."""
    try:
        with open(path) as f:
            plan = json.load(f)
    except OSError as err:
        raise PlanError(f"{path}: cannot read the plan file ({err.strerror})") from None
    except ValueError as err:
        raise PlanError(f"{path}: not JSON ({err})") from None
    validate(plan, path)
    return plan


def write_plan(path: str | os.PathLike, plan: dict[str, Any]) -> None:
    validate(plan, path)
    write_text(path, json.dumps(plan, indent=2) + "\n")


def validate(plan: Any, path: str | os.PathLike = "plan.json") -> None:
    def fail(where: str, expected: str) -> None:
        raise PlanError(f"{path}: {where}: expected {expected}")

    if not isinstance(plan, dict) or plan.get("schema") != SCHEMA:
        fail("schema", f'a JSON object with "schema": "{SCHEMA}"')
    world = plan.get("world_size")
    if not _positive_int(world):
        fail("world_size", "a positive integer")
    tables = plan.get("tables")
    if not isinstance(tables, dict) or not tables:
        fail("tables", "an object of at least one table")
    for name, t in tables.items():
        where = f"tables.{name}"
        if not isinstance(t, dict):
            fail(where, "an object")
        if t.get("sharding_type") not in SHARDING_TYPES:
            fail(f"{where}.sharding_type", f"one of {', '.join(SHARDING_TYPES)}")
        if t.get("compute_kernel", "fused") not in COMPUTE_KERNELS:
            fail(f"{where}.compute_kernel", f"one of {', '.join(COMPUTE_KERNELS)}")
        for key in ("num_embeddings", "embedding_dim"):
            if not _positive_int(t.get(key)):
                fail(f"{where}.{key}", "a positive integer")
        ranks = t.get("ranks")
        if not isinstance(ranks, list) or not ranks or not all(isinstance(r, int) and 0 <= r < world for r in ranks):
            fail(f"{where}.ranks", f"a non-empty list of ranks below world_size {world}")
        if t["sharding_type"] == "table_wise" and len(ranks) != 1:
            fail(f"{where}.ranks", "one rank for a table_wise table")
        if t["sharding_type"] == "column_wise" and t["embedding_dim"] % len(ranks):
            fail(f"{where}.ranks", f"a number of column shards that divides embedding_dim {t['embedding_dim']}")
        if t["sharding_type"] in ("row_wise", "data_parallel") and sorted(ranks) != list(range(world)):
            fail(f"{where}.ranks", f"every rank 0..{world - 1} for a {t['sharding_type']} table")
    qcomms = plan.get("qcomms")
    if qcomms is not None and (not isinstance(qcomms, dict) or set(qcomms) - {"forward", "backward"}
                               or any(v not in QCOMM_PRECISIONS for v in qcomms.values())):
        fail("qcomms", f'null or {{"forward": P, "backward": P}} with P one of {", ".join(QCOMM_PRECISIONS)}')


def from_manifest(manifest: Manifest, source_run: str | None = None) -> dict[str, Any]:
    """The plan a recorded TorchRec run ran with, from its manifest's `tables`; PlanError if the
    run's tables were not sharded by TorchRec."""
    tables = {}
    for t in manifest.tables or ():
        if t.sharding_type is None:
            raise PlanError(f"table {t.name!r} of the run has no TorchRec sharding_type: not a TorchRec run")
        shards = sorted(t.shards, key=lambda s: (s.first_col or 0, s.first_row, s.rank))
        tables[t.name] = {"sharding_type": t.sharding_type, "ranks": [s.rank for s in shards],
                          "compute_kernel": t.compute_kernel or "fused",
                          "num_embeddings": t.num_rows, "embedding_dim": t.dim}
    if not tables:
        raise PlanError("the run's manifest lists no embedding tables")
    plan = {"schema": SCHEMA, "world_size": int(manifest.world_size or 1), "tables": tables}
    if source_run is not None:
        plan["source_run"] = source_run
    validate(plan, "the run's plan")
    return plan


def check_model(plan: dict[str, Any], tables: dict[str, tuple[int, int]], world_size: int,
                path: str | os.PathLike) -> None:
    """PlanError, one line naming what differs, unless `plan` is for `world_size` ranks and exactly
    the model's `tables` ({name: (num_embeddings, embedding_dim)})."""
    if plan["world_size"] != world_size:
        raise PlanError(f"{path}: the plan is for {plan['world_size']} ranks, the job runs {world_size}")
    missing, extra = sorted(set(tables) - set(plan["tables"])), sorted(set(plan["tables"]) - set(tables))
    if missing or extra:
        raise PlanError(f"{path}: the plan's tables are not the model's: " + "; ".join(
            part for part in (f"not in the plan: {', '.join(missing)}" if missing else "",
                              f"not in the model: {', '.join(extra)}" if extra else "") if part))
    for name, (rows, dim) in sorted(tables.items()):
        want = plan["tables"][name]
        if (want["num_embeddings"], want["embedding_dim"]) != (rows, dim):
            raise PlanError(f"{path}: table {name} is {rows} x {dim} in the model, "
                            f"{want['num_embeddings']} x {want['embedding_dim']} in the plan")


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0

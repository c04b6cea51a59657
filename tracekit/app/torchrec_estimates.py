"""What TorchRec's own planner estimates for a plan: run in the TorchRec job's Python (it imports
torchrec), `python -m tracekit.app.torchrec_estimates < request.json`, by analyses/torchrec_plans.py.

The request: {"world_size", "ranks_per_node", "batch_size" (a rank's), "link_bytes_per_s" (null: one
host), "tables": [{"name", "num_embeddings", "embedding_dim", "features", "pooling_factor"}],
"plans": {label: {table: {"sharding_type", "ranks", "compute_kernel"}}}}.

TorchRec's `EmbeddingEnumerator` enumerates each table's sharding options with the measured pooling
factors as constraints, on a `Topology` of the run's shape and link (bytes/ms, its unit); each
option's shards carry the `Perf` its `EmbeddingPerfEstimator` gives (forward and backward compute
and comms, the input dist; ms) and the `Storage` its storage estimator gives. For each plan the
option of each table's sharding type and kernel (and shard count) is taken, its shards placed on
the plan's ranks, and the terms summed per rank. The answer, on stdout: {label: {"ranks": [{term:
ms}, ...], "max_rank_ms": ..., "storage_bytes": [...]}} or {"error": "..."}.
"""

from __future__ import annotations

import json
import sys

TERMS = ("fwd_compute", "fwd_comms", "bwd_compute", "bwd_comms", "input_dist_comms")


def estimate(request: dict) -> dict:
    import torch
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.planner import ParameterConstraints, Topology
    from torchrec.distributed.planner.enumerators import EmbeddingEnumerator

    world = request["world_size"]
    link = request.get("link_bytes_per_s")
    topology = Topology(world_size=world, compute_device="cpu", local_world_size=request["ranks_per_node"],
                        **({"inter_host_bw": link / 1000} if link else {}))
    tables = request["tables"]
    configs = [EmbeddingBagConfig(name=t["name"], embedding_dim=t["embedding_dim"], num_embeddings=t["num_embeddings"],
                                  feature_names=[f"{t['name']}.f{i}" for i in range(t["features"])]) for t in tables]
    ebc = EmbeddingBagCollection(tables=configs, device=torch.device("meta"))
    constraints = {t["name"]: ParameterConstraints(pooling_factors=[float(t["pooling_factor"] or 1.0)] * t["features"])
                   for t in tables}
    options = EmbeddingEnumerator(topology=topology, batch_size=request["batch_size"], constraints=constraints
                                  ).enumerate(ebc, [EmbeddingBagCollectionSharder()])
    out = {}
    for label, plan in request["plans"].items():
        per_rank = [dict.fromkeys(TERMS, 0.0) for _ in range(world)]
        storage = [0] * world
        for name, placed in plan.items():
            kernel = placed.get("compute_kernel", "fused")
            match = [o for o in options if o.name == name and o.sharding_type == placed["sharding_type"]
                     and o.compute_kernel == kernel and (placed["sharding_type"] in ("data_parallel", "row_wise")
                                                         or len(o.shards) == len(placed["ranks"]))]
            if not match:
                return {"error": f"TorchRec offers no {placed['sharding_type']} / {kernel} option of "
                                 f"{len(placed['ranks'])} shard(s) for {name}"}
            for shard, rank in zip(match[0].shards, placed["ranks"]):
                for term in TERMS:
                    per_rank[rank][term] += float(getattr(shard.perf, term))
                storage[rank] += int(shard.storage.ddr + shard.storage.hbm)
        out[label] = {"ranks": per_rank, "max_rank_ms": max(sum(r.values()) for r in per_rank),
                      "storage_bytes": storage}
    return out


def main() -> None:
    try:
        answer = estimate(json.load(sys.stdin))
    except Exception as err:  # the caller notes it: TorchRec's API is not tracekit's to promise
        answer = {"error": f"{type(err).__name__}: {err}"}
    print(json.dumps(answer))


if __name__ == "__main__":
    main()

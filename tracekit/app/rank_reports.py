"""What each rank of a recorded run reported (ranks/rank=N.json, written by collectors/bootstrap.py as
it exits), merged into the parts of the manifest that `tracekit record` finalises (tracekit/app/
recording.py): the tables and their shards, the policy applied, the metrics, the GPU sampled and
the TorchRec plan applied.

    reports = [{**read_rank_report(path), "rank": r} for r, path in ...]
    merge_tables(reports)                 # the manifest's `tables`, as JSON
    merge_policy(reports, errors)         # its `policy`; a rank that disagrees is named in `errors`
"""

from __future__ import annotations

import json
from pathlib import Path


def plan_applied(plan: dict | None, applied: dict[str, int], errors: list[str]) -> dict | None:
    """The manifest's `torchrec_plan` with `applied`: per rank, the DistributedModelParallels built
    with it; named in `errors` where no rank built one (the plan then did nothing)."""
    if plan is None:
        return None
    if applied and not any(applied.values()):
        errors.append(f"torchrec_plan: no rank built a TorchRec DistributedModelParallel, so {plan['path']} was not "
                      "applied")
    return {**plan, "applied": applied}


def read_rank_report(path: Path) -> dict:
    report = json.loads(path.read_text())
    if not isinstance(report, dict):
        raise ValueError(f"expected a JSON object, got {type(report).__name__}")
    return report


PLAN_KEYS = ("sharding_type", "compute_kernel")  # a table's, where its collector knows them
SHARD_KEYS = ("first_row", "num_rows", "first_col", "num_cols")  # a shard's; the columns where known


def merge_tables(ranks: list[dict]) -> list[dict]:
    """The manifest's `tables`: one entry per logical table, from what each rank's embedding collector
    saw, with `shards` saying which rank holds which rows (a replicated table lists every copy).
    A TorchRec table (collectors/torchrec_tables.py) also carries its `sharding_type` and
    `compute_kernel`, and each shard its columns, `first_col` and `num_cols`."""
    seen: dict[str, list[dict]] = {}
    for report in ranks:
        for entry in report["tables"]:
            seen.setdefault(entry["table"], []).append({**entry, "rank": report["rank"]})
    tables = []
    for name, entries in sorted(seen.items()):
        entries.sort(key=lambda e: (e["first_row"], e.get("first_col", 0), e["rank"]))
        first = entries[0]
        plan = {k: first[k] for k in PLAN_KEYS if k in first}
        tables.append({"name": name, "num_rows": max(e["table_rows"] for e in entries), "dim": first["dim"],
                       "dtype": first["dtype"], "kind": first["kind"], "padding_idx": first["padding_idx"],
                       "placement": first.get("placement"), **plan,
                       "shards": [{k: e[k] for k in ("rank", *SHARD_KEYS) if k in e} for e in entries]})
    return tables


def merge_policy(ranks: list[dict], errors: list[str]) -> dict | None:
    """The manifest's `policy`: {"path", "sha256"} of the policy file that rank 0 (else the lowest rank
    that named one) applied, with the sections it `applied` and `skipped` ({label: why}) where the
    program named them; None if none did. A rank that applied another file (another path or other
    bytes) or other sections is named in `errors`."""
    named = [report for report in ranks if report["policy"] is not None]
    if not named:
        return None
    kept, first = named[0]["policy"], named[0]["rank"]
    for report in named[1:]:
        if report["policy"] != kept:
            errors.append(f"policy: rank {report['rank']} applied {report['policy']['path']} (sha256 "
                          f"{report['policy']['sha256']}), rank {first} {kept['path']} (sha256 {kept['sha256']}); "
                          f"the manifest keeps rank {first}'s")
    return kept


def merge_metrics(ranks: list[dict]) -> dict:
    """The manifest's `metrics`: rank 0's figures, and under the keys rank 0 did not give, those of the
    lowest rank that gave them; {} where no rank gave any."""
    merged: dict = {}
    for report in ranks:  # by rank
        for key, value in report["metrics"].items():
            merged.setdefault(key, value)
    return merged


def gpu_outcome(gpu: dict, ranks: list[dict], interval_s: float) -> dict:
    """The manifest's `gpu` once the ranks have reported: the NVML index of the GPU each rank sampled
    (`sampled_devices`), or why none was sampled."""
    sampled = {str(r["rank"]): r["gpu"]["device"] for r in ranks if r["written_rows"].get("gpu")}
    if sampled:
        return {**gpu, "samples": True, "interval_s": interval_s, "sampled_devices": sampled, "reason": None}
    why = [f"rank {r['rank']}: {r['gpu']['reason']}" for r in ranks if r["gpu"]["reason"]]
    return {**gpu, "reason": "; ".join(why)} if gpu["devices"] and why else gpu

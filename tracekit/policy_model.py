"""Whether a policy file was derived for the model it is applied to: the trainer, `compare` and
`simulate` refuse one written for other tables or another world size, naming every difference.

    check_model(read_policy("runs/base/policy.json"), tables=[{"name": "t0", "num_rows": 100000, "dim": 32}],
                world_size=2)          # PolicyMismatch where they differ; a policy naming no model passes
"""

from __future__ import annotations

import os

from tracekit.errors import PolicyMismatch
from tracekit.policy import Policy
from tracekit.run_dir import POLICY


def check_model(policy: Policy | dict, *, tables: list[dict], world_size: int,
                path: str | os.PathLike = POLICY) -> None:
    """Refuse (PolicyMismatch) a policy written for another model: every difference in tables (names,
    row counts, dims) or world size is named. A policy that names no model (hand-written) passes."""
    model = policy.model if isinstance(policy, Policy) else policy.get("model")
    if model is None:
        return
    differences = []
    ours = {t["name"]: t for t in tables}
    theirs = {t["name"]: t for t in model["tables"]}
    for name in sorted(set(theirs) - set(ours)):
        differences.append(f"table {name} is in the policy but not in the model")
    for name in sorted(set(ours) - set(theirs)):
        differences.append(f"table {name} is in the model but not in the policy")
    for name in sorted(set(ours) & set(theirs)):
        for key in ("num_rows", "dim"):
            if int(ours[name][key]) != int(theirs[name][key]):
                differences.append(f"table {name}: {key} {theirs[name][key]} in the policy, {ours[name][key]} in the model")
    if int(model["world_size"]) != world_size:
        differences.append(f"world size {model['world_size']} in the policy, {world_size} here")
    if differences:
        raise PolicyMismatch(f"{path} was derived for another model: " + "; ".join(differences))

"""`tracekit optimize`: the whole loop in one command (DESIGN.md §1).

    DIR/base            the command recorded as given (lookups on every step, so predictions are exact)
    DIR/base/policy.json and one file per recommended training section: policy.<section>.json
    DIR/<section>       the command re-run with `--policy DIR/base/policy.<section>.json`
    DIR/combined        ... with every one re-run together, where there are several (policy.combined.json,
                        which keeps policy.json's `combined` prediction for `compare` to check)

then `tracekit compare DIR/base DIR/<section> ... DIR/combined`. The command must take
`--policy PATH` as its last option (the reference trainer's train.py does). Each run's output goes
to DIR/<name>.log; a status line shows which run is going. With `--cluster NODESxRANKS --link RATE`
every run is `tracekit cluster --record` of the plain command on that emulated cluster.
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from tracekit.cluster import Topology
from tracekit.policy import SECTIONS, TRAINING, load_policy, nothing_to_apply, recommended, section_part, write_policy



@dataclass(frozen=True)
class Rerun:
    name: str  # a section, or "combined"
    policy: Path


def reruns(policy_path: Path, *, checked: bool = False) -> tuple[list[Rerun], list[str]]:
    """One policy file per recommended training section worth a run (beside policy.json, so row paths
    hold), and one for their combination; with notes on the sections left out and why. `checked`:
    re-run the sections analyze did not recommend as well (each alone, marked recommended in its own
    file, and all of them together), so that the measurement checks the decision."""
    written = policy = load_policy(policy_path)
    chosen, notes = [], []
    for name in TRAINING:
        body = section_part(policy, name)
        if body is None:
            continue
        reason = _why_not(name, body)
        if reason and checked and not recommended(body) and not _why_not(name, {**body, "recommended": True}):
            notes.append(f"{name} re-run although not recommended, to check the decision ({body['reason']})")
            section, _, part = name.partition(".")
            overridden = {**body, "recommended": True, "not_recommended_because": body["reason"]}
            overridden.pop("reason")
            policy = {**policy, section: {**policy[section], part: overridden} if part else overridden}
            reason = None
        if reason:
            notes.append(f"{name} not re-run: {reason}")
            continue
        chosen.append(name)
    if "lag" in policy:
        notes.append("lag not re-run: it applies to inference (train.py --inference --policy FILE), optimize re-runs training")
    plans = [Rerun(name, _write_sections(policy_path, policy, [name])) for name in chosen]
    together = chosen if checked else [name for name in chosen if recommended(section_part(written, name))]
    if len(together) > 1:
        plans.append(Rerun("combined", _write_sections(policy_path, policy, together, "combined")))
    return plans, notes


def _why_not(name: str, section: dict) -> str | None:
    if not recommended(section):
        return f"not recommended ({section['reason']})"
    if name == "tiers" and section.get("topology", {}).get("nodes", 1) == 1:
        return "one node: the tiers are the replication section"
    return nothing_to_apply(name, section)


def _write_sections(policy_path: Path, policy: dict, names: list[str], label: str | None = None) -> Path:
    """policy.<label>.json: the sections `names` of `policy`; its `combined` only in the combined file."""
    keep = {k: v for k, v in policy.items() if k not in (*SECTIONS, "combined")}
    if label == "combined" and "combined" in policy:
        keep["combined"] = policy["combined"]
    for name in names:
        section, _, part = name.partition(".")
        if part:
            keep.setdefault(section, {})[part] = policy[section][part]
        else:
            keep[section] = policy[section]
    target = policy_path.with_name(f"policy.{label or names[0]}.json")
    write_policy(target, keep)
    return target


def record(run_dir: Path, command: list[str], log: Path, *, lookup_every: int, cluster: Topology | None = None) -> int:
    """`tracekit record` of `command` into `run_dir`, its output into `log`; the exit code. With
    `cluster`, `tracekit cluster --record` instead: `command` (plain `python train.py ...`) runs on
    every rank of that emulated cluster."""
    if cluster is None:
        launcher = ["record", "-o", str(run_dir)]
    else:
        launcher = ["cluster", "--nodes", str(cluster.nodes), "--ranks-per-node", str(cluster.ranks_per_node),
                    "--link", cluster.link, "--record", str(run_dir)]
        if cluster.latency_ms is not None:
            launcher += ["--latency", str(cluster.latency_ms)]
    argv = [sys.executable, "-m", "tracekit", *launcher, "--force", "--lookup-every", str(lookup_every), "--", *command]
    with open(log, "w") as out:
        return subprocess.call(argv, stdout=out, stderr=subprocess.STDOUT)

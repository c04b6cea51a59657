"""What the trainer takes from `--policy policy.json` (DESIGN.md §5), checked before any process
group starts.

    applied = load("runs/base/policy.json", tables, world_size=2, local_world_size=2)
    applied.sections      # the labels it applies, e.g. ("replication", "compression.dp")
    applied.skipped       # each other section present, with why: {"lag": "inference-only (...)"}
    applied.lines()       # what the trainer prints once (rank 0): what applies, one line per section skipped
    applied.replicated_rows  # per table: the rows every rank holds a copy of (int64, sorted), or None
    applied.sync          # how the replicated rows' gradients are summed: sparse_allreduce | dense_allreduce
    applied.tier2_rows    # per table: tier-2 rows, one copy per node (tiers across nodes), or None
    applied.ranks_per_node, applied.tier2_sync  # the node size and the node copies' sync
    applied.fae_rows      # per table: FAE's rows, those that make a sample hot (also replicated), or None
    applied.dct_dp        # DCT-DP settings for DDP's comm hook (tracekit/dlrm/compression.py), or None
    applied.mp_keep_ratio # DCT-MP: the share of each embedding output row's values kept, or None
    applied.lag_bound     # BLS: --inference runs' bound, or None (synchronous collectives)

The file applies as written: a training run applies every recommended training section, an
`--inference` run the `lag` section if recommended, and each other section present is skipped with
its reason (not recommended, inference-only, training-only) and never read further. A section it
applies but cannot (a corrupt row list, a topology it does not fit) is refused with PolicyError, as
is a file for another model (PolicyMismatch). Where no section applies, the run goes on as it would
without `--policy`.

The sections: `replication` (its rows replicated), `tiers` (tier 1 replicated; tier 2 once per node,
tracekit/dlrm/node_tier.py, which on one node is the recorded sharding itself), `schedule` (FAE hot/cold
minibatches; its rows, those that make a sample hot, are replicated too, and serve cold batches as
well). Sections applied together replicate the union of their rows (`replicated_rows`), synchronised
the way the section with the most rows says. `compression.dp` (DCT-DP) hard-thresholds DDP's
gradient buckets, whatever else is applied; `compression.mp` (DCT-MP) keeps each embedding output
row's largest values in the output all-to-all, forward and backward (tracekit/dlrm/output_codec.py).
`lag` (BLS) bounds how far a rank runs ahead in `--inference` runs (tracekit/dlrm/inference.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pyarrow.parquet as pq
import torch

from tracekit.dlrm.compression import DctDp
from tracekit.dlrm.tables import TableSpec
from tracekit.policy import (INFERENCE_ONLY, REPLICATION_SYNCS, DctDp as DctDpSection, Policy, PolicyError, Tiers,
                             read_policy, row_path)
from tracekit.policy_model import check_model


@dataclass(frozen=True)
class AppliedPolicy:
    path: Path
    sections: tuple[str, ...]  # the labels applied (tracekit.policy.LABELS)
    skipped: dict[str, str] = field(default_factory=dict)  # label -> why it is not applied
    replicated_rows: list[torch.Tensor] | None = None  # per table, sorted; None: nothing replicated
    sync: str = "sparse_allreduce"  # the replicated rows' sync
    # per table, sorted: FAE's rows, all of whose ids make a sample hot; they are also in
    # `replicated_rows`. None: no FAE schedule
    fae_rows: list[torch.Tensor] | None = None
    dct_dp: DctDp | None = None  # None: DDP's gradients go uncompressed
    mp_keep_ratio: float | None = None  # DCT-MP on the output all-to-all; None: rows go whole
    tier2_rows: list[torch.Tensor] | None = None  # per table, sorted; None: no tier 2 across nodes
    ranks_per_node: int = 1
    tier2_sync: str = "sparse_allreduce"
    lag_bound: int | None = None  # BLS, inference runs only; None: synchronous collectives

    def lines(self) -> list[str]:
        """What applies, then one line per section skipped: for the run's log, printed once."""
        head = (f"policy {self.path}: applying {', '.join(self.sections)}" if self.sections else
                f"policy {self.path}: no section applies; the run goes on as it would without --policy")
        return [head, *(f"policy: skipped {label}: {why}" for label, why in self.skipped.items())]


def choose(policy: Policy, *, inference: bool) -> tuple[list[str], dict[str, str]]:
    """The labels of the sections a run applies (the recommended ones of its kind: training, or
    `--inference`), and each other section present with why it is skipped."""
    applied, skipped = [], {}
    for label, section in policy.sections.items():
        if not section.recommended:
            skipped[label] = f"not recommended ({section.reason})"
        elif label in INFERENCE_ONLY and not inference:
            skipped[label] = "inference-only (train.py --inference --policy FILE applies it)"
        elif label not in INFERENCE_ONLY and inference:
            skipped[label] = f"training-only (an --inference run applies only {', '.join(INFERENCE_ONLY)})"
        else:
            applied.append(label)
    return applied, skipped


def load(path: str | Path, tables: list[TableSpec], *, world_size: int, local_world_size: int,
         inference: bool = False) -> AppliedPolicy:
    """The policy at `path` as the trainer applies it (module docstring); PolicyError (or
    PolicyMismatch) saying what differs or what cannot be applied."""
    path = Path(path)
    policy = read_policy(path)
    check_model(policy, tables=[{"name": t.name, "num_rows": t.rows, "dim": t.dim} for t in tables],
                world_size=world_size, path=path)
    applied, skipped = choose(policy, inference=inference)
    chosen = {label: policy.sections[label] for label in applied}
    if inference:
        return AppliedPolicy(path, tuple(applied), skipped, lag_bound=chosen["lag"].bound if "lag" in chosen else None)
    by_section: list[tuple[torch.Tensor, str, str]] = []  # rows to replicate: (keys, sync, where the sync is named)
    if replication := chosen.get("replication"):
        by_section.append((_rows(path, replication.rows, tables), replication.sync, "replication.sync"))
    tier2 = None
    if tiers := chosen.get("tiers"):
        tier1, tier2 = _tier_rows(path, tiers, tables, world_size, local_world_size)
        by_section.append((tier1, tiers.tier1_sync, "tiers.tier1_sync"))
        if tiers.tier2_sync not in REPLICATION_SYNCS:
            raise PolicyError(f"{path}: tiers.tier2_sync: expected one of {', '.join(REPLICATION_SYNCS)}, got {tiers.tier2_sync!r}")
    fae_keys = None
    if schedule := chosen.get("schedule"):
        if schedule.kind != "fae":
            raise PolicyError(f"{path}: schedule.kind: expected \"fae\", got {schedule.kind!r}")
        fae_keys = _rows(path, schedule.hot_rows, tables)
        by_section.append((fae_keys, schedule.sync, "schedule.sync"))
    for _, sync, where in by_section:
        if sync not in REPLICATION_SYNCS:
            raise PolicyError(f"{path}: {where}: expected one of {', '.join(REPLICATION_SYNCS)}, got {sync!r}")
    replicated, sync, union = None, "sparse_allreduce", torch.empty(0, dtype=torch.int64)
    if by_section:
        union = torch.unique(torch.cat([keys for keys, _, _ in by_section]))
        replicated = _split(union, tables) if union.numel() else None
        sync = max(by_section, key=lambda r: r[0].numel())[1]
    if tier2 is not None:  # a row replicated by another section is tier 1: served, and kept, by the replicas
        tier2 = _split(tier2[~torch.isin(tier2, union)], tables)
    dct_dp = _dct_dp(path, chosen["compression.dp"]) if "compression.dp" in chosen else None
    mp = chosen.get("compression.mp")
    return AppliedPolicy(path, tuple(applied), skipped, replicated, sync,
                         None if fae_keys is None else _split(fae_keys, tables),
                         dct_dp, mp_keep_ratio=None if mp is None else float(mp.keep_ratio), tier2_rows=tier2,
                         ranks_per_node=local_world_size, tier2_sync=tiers.tier2_sync if tiers else "sparse_allreduce")


def _dct_dp(path: Path, section: DctDpSection) -> DctDp:
    settings = {"keep_ratio": section.keep_ratio, "refresh_every": section.refresh_every,
                "error_feedback": section.error_feedback}
    try:
        return DctDp(**{key: value for key, value in settings.items() if value is not None})
    except ValueError as err:
        raise PolicyError(f"{path}: compression.dp: {err}") from None


def _rows(policy_path: Path, relative: str, tables: list[TableSpec]) -> torch.Tensor:
    """The row list at `relative` as sorted global keys (table base + row); refused if a table is
    unknown or a row out of range."""
    file = row_path(policy_path, relative)
    try:
        frame = pq.read_table(file, columns=["table_name", "row"]).to_pydict()
    except Exception as err:  # noqa: BLE001 — any unreadable file is refused the same way
        raise PolicyError(f"{file}: not a row list (Parquet with table_name, row): {err}") from None
    return _keys(file, frame["table_name"], frame["row"], tables)


def _keys(file: Path, names: list, rows: list, tables: list[TableSpec]) -> torch.Tensor:
    index = {t.name: i for i, t in enumerate(tables)}
    base = [0]
    for t in tables:
        base.append(base[-1] + t.rows)
    keys = []
    for name, row in zip(names, rows):
        t = index.get(name)
        if t is None:
            raise PolicyError(f"{file}: table {name!r} is not in the model (tables: {', '.join(index)})")
        if row is None or not 0 <= row < tables[t].rows:
            raise PolicyError(f"{file}: row {row} of table {name} is out of range: the table has {tables[t].rows} rows")
        keys.append(base[t] + row)
    return torch.unique(torch.tensor(keys, dtype=torch.int64))


def _split(keys: torch.Tensor, tables: list[TableSpec]) -> list[torch.Tensor]:
    """Sorted global keys back to per-table sorted rows."""
    out, base = [], 0
    for t in tables:
        mine = keys[(keys >= base) & (keys < base + t.rows)]
        out.append(mine - base)
        base += t.rows
    return out


def _tier_rows(path: Path, section: Tiers, tables: list[TableSpec], world_size: int,
               local_world_size: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Tier-1 rows (replicated on every rank) as keys, and tier-2 rows as keys across nodes (None on
    one node, where tier 2 is the recorded sharding itself)."""
    nodes, per_node = int(section.topology.get("nodes", 1)), int(section.topology.get("ranks_per_node", world_size))
    if nodes * per_node != world_size or per_node != local_world_size:
        raise PolicyError(f"{path}: tiers.topology is {nodes} node(s) × {per_node} ranks, but this run has "
                          f"{world_size // max(local_world_size, 1)} node(s) × {local_world_size} ranks "
                          f"(WORLD_SIZE {world_size}, LOCAL_WORLD_SIZE {local_world_size})")
    file = row_path(path, section.rows)
    try:
        frame = pq.read_table(file, columns=["table_name", "row", "tier"]).to_pydict()
    except Exception as err:  # noqa: BLE001
        raise PolicyError(f"{file}: not a tier list (Parquet with table_name, row, tier): {err}") from None
    bad = sorted({t for t in frame["tier"] if t not in (1, 2)})
    if bad:
        raise PolicyError(f"{file}: tier must be 1 or 2 (unlisted rows are tier 3), got {bad[0]}")

    def keys(tier: int) -> torch.Tensor:
        chosen = [i for i, t in enumerate(frame["tier"]) if t == tier]
        return _keys(file, [frame["table_name"][i] for i in chosen], [frame["row"][i] for i in chosen], tables)

    return keys(1), keys(2) if nodes > 1 else None

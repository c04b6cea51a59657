"""The policy sections on a target cluster (`tracekit simulate`): what each one sends a step there, to the
byte where the recorded rows decide it, and the sections derived for the target itself.

A section on the target is a `Case`: the exchange of a step (analyses.target_exchange, its rows
replicated through the regrouped lookups), the replicas' sync it adds, the share of steps that make no
exchange (FAE's hot steps), DCT-MP's factor on the output rows and DCT-DP's gathers in place of the
dense gradients' all-reduce.

Derived for the target, as analyze derives them for the recorded run:
- replication: the rows by the bytes their lookups would free at W' (ids of remote lookups, and the
  rows back of the remote bags and sequence lookups they alone make), per byte of replica; the prefix,
  on a geometric grid within the replica budget (Options.budget_*), refined around its best point, and the sync (dense or sparse) whose
  replayed step is least (objective "time") or whose bytes are fewest (objective "bytes");
- schedule (FAE): the same candidate hot sets, each with its share of all-hot samples h: hot steps make
  no exchange, cold steps carry the cold samples' exchange (a rank's b' cold samples: the lookups'
  bytes over 1 − h of the samples), every step syncs the replicas; the hot set whose mean step is least;
- compression: DCT's settings as the run's analysis chose them within the quality its calibration
  measured (RUN/policy.json): DCT-MP's byte ratio on the output rows; DCT-DP's bytes a rank, gathered
  from every rank instead of the ring all-reduce, two gathers a bucket.
Tiers are not projected at another world yet: a note says so.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import polars as pl

from analyses.context import Context
from analyses.target_exchange import DENSE, SPARSE, Routed, TargetExchange, exchange, hot_samples
from analyses.target_time import Case, Source, TargetLinks, spaced, step_times
from tracekit.figures import (A2A_BYTES, A2A_REMOTE_BYTES, ALLREDUCE_BYTES, DP_BYTES, HOT_ROWS,
                              HOT_SAMPLE_FRACTION, STEP_TIME, SYNC_BYTES)
from tracekit.policy import (MIN_HOT_SAMPLES, Combined, DctDp, DctMp, Policy, Prediction, Replication, Schedule,
                             Section, read_policy, row_path, write_policy)
from tracekit.run_dir import RunDir

DERIVE_STEPS = 12  # recorded steps a candidate of a derivation replays
GRID_POINTS = 8  # candidate hot sets, geometrically spaced
REFINE_POINTS = 4  # ... and more between the best one's neighbours
RECOMMEND_GAIN = 0.05
"""A section derived for a target is recommended where its predicted step is this much faster: the
replay's error on held-out runs at the recorded scale (bench/RESULTS.md) is within it."""
ROW_LISTS = {"replication": ("hot_rows",), "schedule": ("fae_rows",)}
"""The row lists a derived section's file carries (policy/<name>.parquet)."""


def ranked_rows(r: Routed) -> np.ndarray:
    """Indices into r.keys, by the bytes a step their replication frees per byte of replica, best first;
    rows that free nothing left out."""
    remote = r.rank != r.owner
    bag_size = np.bincount(r.bag[r.bag >= 0], minlength=len(r.bag_rank)) if len(r.bag_rank) else np.zeros(0)
    alone = np.where(r.bag >= 0, bag_size[np.maximum(r.bag, 0)] == 1 if len(bag_size) else False, True)
    rb = r.tables.rb[r.tid]
    freed = np.where(remote, r.id_bytes + np.where(alone, 2 * rb, 0.0), 0.0)
    per_row = np.bincount(r.row_index, weights=freed, minlength=len(r.keys))
    per_byte = per_row / r.tables.rb[r.keys >> 40]
    order = np.argsort(-per_byte, kind="stable")
    return order[per_row[order] > 0]


def candidates(r: Routed, order: np.ndarray, budget: float | None) -> list[int]:
    """Prefix sizes of `order` to try: a geometric grid up to the budget (bytes of replica a rank)."""
    if not len(order):
        return []
    sizes = np.cumsum(r.tables.rb[r.keys[order] >> 40])
    most = len(order) if budget is None else int(np.searchsorted(sizes, budget, side="right"))
    if most < 1:
        return []
    grid = np.unique(np.round(np.geomspace(1, most, GRID_POINTS)).astype(int))
    return [int(k) for k in grid]


def replication(r: Routed, keys_mask: np.ndarray, name: str = "replication") -> Case:
    x = exchange(r, keys_mask)
    return Case(name, x, hot_keys=r.keys[keys_mask])


def schedule(r: Routed, keys_mask: np.ndarray, replicated: TargetExchange | None = None) -> Case:
    """FAE with the rows of `keys_mask` hot (module docstring); `replicated`: their replication's exchange."""
    x = replicated if replicated is not None else exchange(r, keys_mask)
    h = hot_samples(r, keys_mask)
    cold_share = max(1.0 - h, 1e-12)
    pairs = {c: (m if c == "input_lengths" else m / cold_share) for c, m in x.pairs.items()}
    cold = TargetExchange(x.world, pairs, x.syncs)
    return Case("schedule", x, hot_fraction=h, cold=cold, hot_keys=r.keys[keys_mask])


def with_sync(case: Case, kind: str | None) -> Case:
    return replace(case, sync=kind if kind in case.x.syncs else None)


def sync_kinds(case: Case) -> list[str | None]:
    return [kind for kind in (DENSE, SPARSE) if kind in case.x.syncs] or [None]


@dataclass
class Projection:
    """What `simulate` hands back beside its Result: the sections derived for the target, and their rows."""

    policy: Policy | None = None
    rows: dict[str, pl.DataFrame] = field(default_factory=dict)


def as_written(ctx: Context, src: Source, policy: Policy, policy_path, notes: list[str]) -> list[Case]:
    """The file's sections that change what is sent, on the target."""
    out = []
    r = src.routed
    for label, section in policy.sections.items():
        if isinstance(section, Replication):
            mask = r.rows_in(row_keys(ctx, row_path(policy_path, section.rows)))
            out.append(with_sync(replication(r, mask), section.sync))
        elif isinstance(section, Schedule):
            mask = r.rows_in(row_keys(ctx, row_path(policy_path, section.hot_rows)))
            out.append(with_sync(schedule(r, mask), section.sync))
        elif isinstance(section, DctMp):
            out.append(_mp(src, section))
        elif isinstance(section, DctDp):
            out.append(_dp(src, section, ctx.model.world_size))
        elif label == "tiers":
            notes.append("tiers: not projected onto another cluster yet (their node copies are the recorded "
                         "topology's); the other sections are")
        elif label == "lag":
            notes.append("lag: not projected (it applies to inference; its makespan is the lag section's)")
    return out


def row_keys(ctx: Context, path: Path) -> np.ndarray:
    frame = pl.read_parquet(path, columns=["table_name", "row"])
    tid = {t.name: i for i, t in enumerate(ctx.model.tables)}
    unknown = set(frame["table_name"].unique().to_list()) - set(tid)
    if unknown:
        raise ValueError(f"{path}: rows of tables the run does not have: {', '.join(sorted(unknown))}")
    tids = frame["table_name"].replace_strict(tid, return_dtype=pl.Int64).to_numpy()
    return tids << 40 | frame["row"].cast(pl.Int64).to_numpy()


def _mp(src: Source, section: DctMp) -> Case:
    ratio = float(section.prediction.figures.get("ratio") or 1.0)
    return Case("compression.mp", exchange(src.routed), output_ratio=ratio)


def _dp(src: Source, section: DctDp, recorded_world: int) -> Case:
    """DCT-DP: the bytes a rank sent a step where the run was analysed, gathered by every rank on the target."""
    sent = float(section.prediction.figures.get(DP_BYTES) or 0.0)
    return Case("compression.dp", exchange(src.routed), dp_part=sent / max(recorded_world, 1))


def combined_case(src: Source, cases: list[Case], policy: Policy | None) -> Case | None:
    """The recommended sections together (with a file: its recommended ones), as the trainer applies them:
    the union of replication's and the schedule's rows replicated (synchronised as the larger set says),
    the FAE schedule over that union where it is applied, DCT-MP on the outputs, DCT-DP on the dense
    gradients."""
    chosen = {c.name: c for c in cases[1:] if recommended(c, policy)}
    if len(chosen) < 2:
        return None
    holding = [c for c in (chosen.get("replication"), chosen.get("schedule")) if c is not None]
    out = replace(cases[0], name="combined", notes=[])
    if holding:
        r = src.routed
        mask = r.rows_in(np.concatenate([c.hot_keys for c in holding]))
        larger = max(holding, key=lambda c: len(c.hot_keys))
        out = replication(r, mask, "combined") if "schedule" not in chosen else schedule(r, mask)
        out = replace(with_sync(out, larger.sync), name="combined")
    if "compression.mp" in chosen:
        out = replace(out, output_ratio=chosen["compression.mp"].output_ratio)
    if "compression.dp" in chosen:
        out = replace(out, dp_part=chosen["compression.dp"].dp_part)
    return out


def recommended(case: Case, policy: Policy | None) -> bool:
    if policy is not None:
        section = policy.sections.get(case.name)
        return section is not None and section.recommended
    return "recommended" in case.notes


def derived(ctx: Context, src: Source, links: TargetLinks, base: Case,
             notes: list[str]) -> tuple[list[Case], Projection]:
    """Replication and the FAE schedule derived for the target, DCT's parts as the run's analysis set them
    (analyses.target_sections), each with the step the replay predicts."""
    r = src.routed
    probe = spaced(src.steps, DERIVE_STEPS)
    def mean_step(case: Case) -> float:
        return float(np.median(step_times(src, links, case, probe)))
    base_s = mean_step(base)
    budget = _budget(ctx)
    order = ranked_rows(r)
    objective = ctx.options.objective
    tried: dict[int, tuple] = {}  # k -> replication's best merit, FAE's [(merit, sync)]
    best_rep: tuple | None = None  # (merit, case, k): the one case kept (a case holds W' × W' matrices)

    def merit(case: Case) -> float:
        return mean_step(case) if objective == "time" else _bytes_of(case)

    def hot_set(k: int) -> np.ndarray:
        mask = np.zeros(len(r.keys), dtype=bool)
        mask[order[:k]] = True
        return mask

    def at(k: int) -> None:
        nonlocal best_rep
        if k in tried:
            return
        mask = hot_set(k)
        rep = replication(r, mask)
        reps = [(merit(c), c) for c in (with_sync(rep, kind) for kind in sync_kinds(rep))]
        hot = schedule(r, mask, rep.x)
        # a schedule with fewer all-hot samples is replication by another name (tracekit.policy.nothing_to_apply)
        faes = ([(merit(c), c.sync) for c in (with_sync(hot, kind) for kind in sync_kinds(hot))]
                if hot.hot_fraction >= MIN_HOT_SAMPLES else [])
        best = min(reps, key=lambda m: m[0])
        tried[k] = (best[0], faes)
        if best_rep is None or best[0] < best_rep[0]:
            best_rep = (*best, k)

    grid = candidates(r, order, budget)
    for k in grid:  # a coarse grid, then finer between the best point's neighbours
        at(k)
    if grid:
        i = min(range(len(grid)), key=lambda j: tried[grid[j]][0])
        lo, hi = grid[max(i - 1, 0)], grid[min(i + 1, len(grid) - 1)]
        for k in np.unique(np.round(np.geomspace(lo, hi, REFINE_POINTS + 2)).astype(int))[1:-1]:
            at(int(k))
    # without a budget FAE's hot set is held to replication's, as analyze holds it (replica_budget)
    most = max(tried, default=0) if budget is not None or best_rep is None else best_rep[2]
    fae = min(((m, sync, k) for k in tried if k <= most for m, sync in tried[k][1]), key=lambda m: m[0], default=None)
    best_fae = None if fae is None else (fae[0], with_sync(schedule(r, hot_set(fae[2])), fae[1]), fae[2])
    cases = []
    for best in (best_rep, best_fae):
        if best is not None:
            case = best[1]
            gain = base_s / mean_step(case) - 1
            case.notes.append("recommended" if gain >= RECOMMEND_GAIN else
                              f"not recommended: predicted {gain:+.1%} on the step, under {RECOMMEND_GAIN:.0%}")
            cases.append(case)
    if best_rep is None:
        notes.append("replication: no row's lookups cross ranks on the target (or none fits the budget)")
    run_policy = _run_policy(ctx)
    for label, make in (("compression.mp", _mp), ("compression.dp", _dp)):
        section = run_policy.sections.get(label) if run_policy is not None else None
        if section is None:
            continue
        case = make(src, section) if label == "compression.mp" else make(src, section, ctx.model.world_size)
        gain = base_s / mean_step(case) - 1
        if gain < RECOMMEND_GAIN:
            case.notes.append(f"not recommended: predicted {gain:+.1%} on the step, under {RECOMMEND_GAIN:.0%}")
        elif not section.recommended:  # the run's analysis refused it (its quality), which no cluster changes
            case.notes.append(f"not recommended: {section.reason}")
        else:
            case.notes.append("recommended")
        cases.append(case)
    if run_policy is None:
        notes.append("compression: the run has no policy.json (tracekit analyze writes it with DCT's settings "
                     "within the quality its calibration measured): not projected")
    return cases, _policy_for(ctx, src, cases, run_policy)


def _budget(ctx: Context) -> float | None:
    o = ctx.options
    if o.budget_bytes is not None:
        return float(o.budget_bytes)
    if o.budget_fraction is not None:
        return o.budget_fraction * ctx.model.embedding_bytes
    return None


def _bytes_of(case: Case) -> float:
    share = 1.0 - case.hot_fraction
    sync = case.x.syncs[case.sync].wire if case.sync is not None else 0.0
    return share * case.step_exchange().bytes_out + sync


def _run_policy(ctx: Context) -> Policy | None:
    path = RunDir.at(ctx.path).policy
    return read_policy(path) if path.is_file() else None


def _policy_for(ctx: Context, src: Source, cases: list[Case], run_policy: Policy | None) -> Projection:
    """The derived sections as a policy for the target's world (its predictions filled in by `_mark`)."""
    model = {"tables": ctx.model.policy_model()["tables"], "world_size": src.routed.world}
    sections: dict[str, Section] = {}
    rows: dict[str, pl.DataFrame] = {}
    names = [t.name for t in ctx.model.tables]
    for case in cases:
        recommended = "recommended" in case.notes
        reason = None if recommended else next((n.removeprefix("not recommended: ") for n in case.notes
                                                if n.startswith("not recommended")), None)
        decision = {"recommended": recommended, "reason": reason, "prediction": Prediction({}, "")}
        if case.name in ("replication", "schedule"):
            keys = case.hot_keys
            frame = pl.DataFrame({"table_name": [names[int(k >> 40)] for k in keys],
                                  "row": (keys & ((1 << 40) - 1)).astype(np.int64)})
            replica = int(case.x.syncs[case.sync].replica_bytes) if case.sync else 0
            if case.name == "replication":
                rows["hot_rows"] = frame
                sections["replication"] = Replication(kind="hybrid", rows="policy/hot_rows.parquet",
                                                      sync=case.sync or SPARSE, budget_bytes_per_rank=replica,
                                                      **decision)
            else:
                rows["fae_rows"] = frame
                sections["schedule"] = Schedule(hot_rows="policy/fae_rows.parquet", hot_sample_fraction=case.hot_fraction,
                                                sync=case.sync or SPARSE, budget_bytes_per_rank=replica, **decision)
        elif run_policy is not None and case.name in run_policy.sections:
            sections[case.name] = replace(run_policy.sections[case.name], **decision)
    policy = Policy(source_run=str(ctx.path), model=model, baseline={}, sections=sections)
    return Projection(policy, rows)


def mark(projection: Projection, rows: list[dict]) -> None:
    """The derived policy's predictions and baseline, from the projection's rows."""
    shown = (A2A_BYTES, A2A_REMOTE_BYTES, ALLREDUCE_BYTES, SYNC_BYTES, DP_BYTES, STEP_TIME, HOT_ROWS,
             HOT_SAMPLE_FRACTION)
    by_name = {row["policy"]: row for row in rows}
    why = "projected by tracekit simulate: bytes of the recorded samples regrouped on the target, time replayed on its links"
    policy = projection.policy
    sections = {label: replace(section, prediction=Prediction({k: by_name[label][k] for k in shown}, why))
                for label, section in policy.sections.items() if label in by_name}
    combined = None
    if "combined" in by_name:
        labels = tuple(label for label, s in sections.items() if s.recommended)
        combined = Combined(labels, Prediction({k: by_name["combined"][k] for k in shown}, why))
    base = {k: by_name["baseline"][k] for k in shown if k not in (HOT_ROWS, HOT_SAMPLE_FRACTION)}
    projection.policy = replace(policy, sections=sections, combined=combined, baseline=base)


def write_sections(directory: Path, projection: Projection) -> list[Path]:
    """As `tracekit optimize` writes them: DIR/policy.<section>.json, one a section, and
    DIR/policy.combined.json with the recommended ones, their row lists in DIR/policy/."""
    policy = projection.policy
    written = []
    for label, section in policy.sections.items():
        one = replace(policy, sections={label: replace(section, recommended=True, reason=None,
                                                       extra={**section.extra, **({"not_recommended_because":
                                                              section.reason} if section.reason else {})})},
                      combined=None)
        rows = {name: projection.rows[name] for name in ROW_LISTS.get(label, ())}
        written.append(write_policy(directory / f"policy.{label}.json", one, rows))
    if policy.combined is not None:
        kept = {label: s for label, s in policy.sections.items() if label in policy.combined.sections}
        written.append(write_policy(directory / "policy.combined.json", replace(policy, sections=kept), projection.rows))
    return written



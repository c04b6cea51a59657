"""How each compared run differs from BASE (analyses.compare): the differences that refuse the
comparison, those worth a warning, and the figures against BASE's.

    check_same_model(base, ctx)   # RunMismatch for a run of another model
    ratios(base, m)["step_time_s"]   # the run's median step time / BASE's

- ratios to BASE: run / base of each figure of analyses.measure in RATIOS (null where BASE's is 0 or
  unknown).
- loss_max_abs_diff: the largest |Δ| of the mean loss per step (steps.loss over ranks) against BASE
  over the steps both have (an exact policy gives ~1e-6).

Refused with RunMismatch (naming both runs and what differs): runs of another model, i.e. manifest
`tables` (name, num_rows, dim) or world_size differ. Warned: a status other than completed, another
number of training steps or samples per step, a recorded command that differs other than in
`--policy X`, `-o/--out/--output X` and `--json`.
"""

from __future__ import annotations

import difflib

import polars as pl

from analyses.context import Context
from analyses.measure import EMBEDDING, Measured
from tracekit.errors import RunMismatch
from tracekit.figures import STEP_TIME
from tracekit.schema import STATUS_COMPLETED

RATIOS = (STEP_TIME, "step_time_p90_s", "samples_per_s", "bytes_per_step", "wire_bytes_per_step", *EMBEDDING)
IGNORED_OPTIONS = {"--policy": True, "-o": True, "--out": True, "--output": True, "--json": False}
"""Options of a recorded command that may differ between compared runs (True: takes a value)."""


def check_same_model(base: Measured, ctx: Context) -> None:
    """RunMismatch naming both runs and every difference in tables or world size."""
    ours = {t.name: t for t in base.manifest.tables or ()}
    theirs = {t.name: t for t in ctx.manifest.tables or ()}
    run = str(ctx.path)
    differences = [f"table {n} only in {base.name}" for n in sorted(set(ours) - set(theirs))]
    differences += [f"table {n} only in {run}" for n in sorted(set(theirs) - set(ours))]
    for name in sorted(set(ours) & set(theirs)):
        for key in ("num_rows", "dim"):
            if getattr(ours[name], key) != getattr(theirs[name], key):
                differences.append(f"table {name}: {key} {getattr(ours[name], key)} in {base.name}, "
                                   f"{getattr(theirs[name], key)} in {run}")
    if base.manifest.world_size != ctx.manifest.world_size:
        differences.append(f"world size {base.manifest.world_size} in {base.name}, "
                           f"{ctx.manifest.world_size} in {run}")
    if differences:
        raise RunMismatch(f"{run} and {base.name} were recorded from different models: {'; '.join(differences)}; "
                          "compare runs of one model and data (the same tables, rows, dim and world size)")


def status_warnings(m: Measured) -> list[str]:
    status = m.manifest.status
    if status == STATUS_COMPLETED:
        return []
    return [f"{m.name} is {status} (exit code {m.manifest.exit_code}): its figures cover what was recorded"]


def difference_warnings(base: Measured, m: Measured) -> list[str]:
    """Differences that leave runs comparable but worth knowing: steps, samples per step, command."""
    out = []
    steps, base_steps = m.figures["steps"], base.figures["steps"]
    if steps != base_steps:
        out.append(f"{m.name} ran {steps} training steps, {base.name} {base_steps}: per-step figures compare, "
                   "loss curves only over the steps both ran")
    samples, base_samples = m.figures["samples_per_step"], base.figures["samples_per_step"]
    if samples is not None and base_samples is not None and samples != base_samples:
        out.append(f"{m.name} has {samples:g} samples per step, {base.name} {base_samples:g}")
    changed = command_changes(base.manifest.command or [], m.manifest.command or [])
    if changed:
        out.append(f"{m.name}'s command differs from {base.name}'s beyond --policy, -o/--out and --json: "
                   + "; ".join(changed))
    return out


def normalised_command(argv: list[str]) -> list[str]:
    """`argv` without the options compared runs may differ in (IGNORED_OPTIONS)."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
            continue
        name = arg.split("=", 1)[0]
        if name in IGNORED_OPTIONS:
            skip = IGNORED_OPTIONS[name] and "=" not in arg
            continue
        out.append(arg)
    return out


def command_changes(base: list[str], run: list[str]) -> list[str]:
    """Each difference between two commands as `old` → `new`, with the option it belongs to."""
    a, b = normalised_command(base), normalised_command(run)
    changes = []
    for op, i1, i2, j1, j2 in difflib.SequenceMatcher(a=a, b=b, autojunk=False).get_opcodes():
        if op == "equal":
            continue
        if op == "replace" and i1 > 0 and a[i1 - 1].startswith("-") and j1 > 0 and b[j1 - 1] == a[i1 - 1]:
            i1, j1 = i1 - 1, j1 - 1  # show the option whose value changed
        changes.append(f"`{' '.join(a[i1:i2]) or '(nothing)'}` → `{' '.join(b[j1:j2]) or '(nothing)'}`")
    return changes


def ratios(base: Measured, m: Measured) -> dict[str, float | None]:
    def ratio(key: str) -> float | None:
        ours, theirs = m.figures.get(key), base.figures.get(key)
        return ours / theirs if ours is not None and theirs else None

    return {key: ratio(key) for key in RATIOS}


def loss_diff(base: Measured, m: Measured) -> float | None:
    """max |mean loss − BASE's| over the steps both ran with a loss; None without any."""
    both = (m.steps.select("step", "loss").join(base.steps.select("step", pl.col("loss").alias("base_loss")), on="step")
            .drop_nulls())
    return float((both["loss"] - both["base_loss"]).abs().max()) if both.height else None


"""tracekit: trace-driven profiling and analysis of distributed recommendation-model training.

The optional API for traced programs (each call is a no-op when the process is not traced):

    import tracekit
    tracekit.step(samples=512, loss=loss)   # end a step, for loops without an optimizer
    with tracekit.label("emb_fwd"): ...     # tag the collectives issued inside
    with tracekit.phase("eval"): ...        # the lookups and collectives inside are evaluation
    tracekit.shard(emb, table="t0", first_row=start, num_rows=rows)  # emb holds t0's rows from start on
    with tracekit.sources([b0, b1]): ...    # the lookups inside take b0 items from rank 0, then b1 from rank 1
    tracekit.step_schedule("hot")           # the kind of the step now running (steps.schedule)
    tracekit.policy_applied("runs/base/policy.json", applied=["replication"])  # the manifest's policy
    tracekit.metrics(eval_auc=0.79, samples_per_s=5e4)  # the run's final figures (the manifest's metrics)
    run = tracekit.open_run("runs/base")    # read a recorded run (Polars / DuckDB)
"""

from __future__ import annotations

import math
import numbers
import os
import sys
from collections.abc import Mapping, Sequence

from tracekit.labels import label
from tracekit.phases import phase
from tracekit.shards import shard
from tracekit.sources import sources

__version__ = "0.1.0"
__all__ = ["label", "metrics", "open_run", "phase", "policy_applied", "shard", "sources", "step",
           "step_schedule"]


def _bootstrap():
    """collectors.bootstrap, loaded only in processes that `tracekit record` traces; else None."""
    return sys.modules.get("collectors.bootstrap")


def step(samples: int | None = None, loss: float | None = None) -> None:
    """End the current step of a traced process; does nothing when `tracekit record` is not tracing."""
    if (bootstrap := _bootstrap()) is not None:
        bootstrap.advance_step(samples, loss)


def step_schedule(kind: str | None, samples: int | None = None) -> None:
    """Name the kind of the step now running (e.g. FAE's "hot" or "cold"): the `schedule` of its `steps`
    row, null for steps never named; and, if given, its samples on this rank (`steps.samples`, else 0:
    unknown). Holds until the step ends."""
    if kind is not None and not isinstance(kind, str):
        raise TypeError(f"tracekit.step_schedule: expected a str such as \"hot\", got {type(kind).__name__} {kind!r}")
    if kind == "":
        raise ValueError("tracekit.step_schedule: expected a non-empty name such as \"hot\", got \"\"")
    if samples is not None and (isinstance(samples, bool) or not isinstance(samples, int) or samples < 0):
        raise TypeError(f"tracekit.step_schedule: samples must be a non-negative int, got {samples!r}")
    if (bootstrap := _bootstrap()) is not None:
        bootstrap.name_step(kind, samples)


def policy_applied(path: str | os.PathLike, *, applied: Sequence[str] | None = None,
                   skipped: Mapping[str, str] | None = None) -> None:
    """Say that the process applies the policy file at `path`: the manifest's `policy` gets its absolute
    path and the sha256 of its bytes as read now (rank 0's, where ranks name different files) and, where
    given, the sections `applied` (their labels, e.g. "compression.dp") and those `skipped`, each with why."""
    if (bootstrap := _bootstrap()) is not None:
        bootstrap.policy_applied(path, applied, skipped)


def metrics(**values: int | float | None) -> None:
    """Give final figures of the run, e.g. `metrics(eval_auc=0.79, train_loss=0.45)`: the manifest's
    `metrics` holds rank 0's, plus those other ranks gave under keys rank 0 did not. A key given again
    keeps its latest value; NaN and infinities are kept as None (JSON has no such numbers). TypeError
    naming the key for a value that is not a number or None."""
    kept = {}
    for key, value in values.items():
        if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Real)):
            raise TypeError(f"tracekit.metrics: `{key}` must be a number or None, got {type(value).__name__} "
                            f"{value!r}")
        if isinstance(value, numbers.Integral):
            kept[key] = int(value)
        else:
            kept[key] = None if value is None or not math.isfinite(value) else float(value)
    if (bootstrap := _bootstrap()) is not None:
        bootstrap.add_metrics(kept)


def open_run(path):
    """The run recorded at `path` (see tracekit.run.Run)."""
    from tracekit.run import open_run as _open_run

    return _open_run(path)

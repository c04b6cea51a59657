"""tracekit: trace-driven profiling and analysis of distributed recommendation-model training.

The optional API for traced programs (each call is a no-op when the process is not traced):

    import tracekit
    tracekit.step(samples=512, loss=loss)   # end a step, for loops without an optimizer
    with tracekit.label("emb_fwd"): ...     # tag the collectives issued inside
    with tracekit.phase("eval"): ...        # the lookups and collectives inside are evaluation
    tracekit.shard(emb, table="t0", first_row=start, num_rows=rows)  # emb holds t0's rows from start on
    run = tracekit.open_run("runs/base")    # read a recorded run (Polars / DuckDB)
"""

from __future__ import annotations

import sys

from tracekit.labels import label
from tracekit.phases import phase
from tracekit.shards import shard

__version__ = "0.1.0"
__all__ = ["label", "open_run", "phase", "shard", "step"]


def step(samples: int | None = None, loss: float | None = None) -> None:
    """End the current step of a traced process; does nothing when `tracekit record` is not tracing."""
    bootstrap = sys.modules.get("collectors.bootstrap")  # loaded only in traced processes
    if bootstrap is not None:
        bootstrap.advance_step(samples, loss)


def open_run(path):
    """The run recorded at `path` (see tracekit.run.Run)."""
    from tracekit.run import open_run as _open_run

    return _open_run(path)

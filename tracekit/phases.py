"""`tracekit.phase("eval")`: say which phase, `train` or `eval`, the lookups and collectives that
follow belong to, where the collectors cannot tell by themselves (collectors/phase.py says how they
decide otherwise).

The setting is process-wide (autograd runs backward on threads of its own) and lasts until changed:

    tracekit.phase("eval")          # from here on, eval
    tracekit.phase(None)            # back to deciding by itself
    with tracekit.phase("eval"):    # eval inside the block, the previous setting after it
        ...
"""

from __future__ import annotations

TRAIN = "train"
EVAL = "eval"
PHASES = (TRAIN, EVAL)

_forced: str | None = None


def forced() -> str | None:
    """The phase set with `phase()`, or None when the collectors decide."""
    return _forced


class phase:
    """Set the phase (`"train"`, `"eval"`, or None to let the collectors decide) until changed, or for
    a `with` block. Does nothing visible when the process is not traced."""

    def __init__(self, name: str | None) -> None:
        global _forced
        if name is not None and name not in PHASES:
            raise ValueError(f"tracekit.phase: expected one of {', '.join(PHASES)} or None, got {name!r}")
        self._previous, _forced = _forced, name

    def __enter__(self) -> "phase":
        return self

    def __exit__(self, *exc: object) -> None:
        global _forced
        _forced = self._previous

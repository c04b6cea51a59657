"""`tracekit.label(name)`: name the collectives issued inside a block (the `tag` of `comms`)."""

from __future__ import annotations

import contextlib
from contextvars import ContextVar
from typing import Iterator

current_label: ContextVar[str | None] = ContextVar("tracekit_label", default=None)


@contextlib.contextmanager
def label(name: str) -> Iterator[None]:
    """Tag every collective issued in this block, e.g. `with tracekit.label("emb_fwd"): ...`."""
    token = current_label.set(name)
    try:
        yield
    finally:
        current_label.reset(token)

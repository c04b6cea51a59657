"""The collectors' failure policy: a hook never raises into the traced program.

Every hook a collector registers runs its body through `Guard.run`. The first exception is logged
as one line on stderr, counted, and switches that collector off; later calls are counted in
`dropped` and do nothing, so the traced program behaves exactly as it would untraced.

    guard = Guard("embedding")
    guard.run(record, module, args)     # returns record's result, or None once switched off
"""

from __future__ import annotations

import sys
from typing import Any, Callable


class Guard:
    """Runs a collector's hook bodies; on the first exception, logs, counts and switches off.

    `errors` counts exceptions caught (at most one: the collector is off after it), `dropped`
    counts calls skipped because the collector was off, `enabled` says whether it still records.
    """

    def __init__(self, collector: str) -> None:
        self.collector = collector
        self.enabled = True
        self.errors = 0
        self.dropped = 0

    def fail(self, e: Exception) -> None:
        """Log and count `e`, raised by a hook body run without `run`, and switch the collector off."""
        self.errors += 1
        self.enabled = False
        print(f"tracekit: the {self.collector} collector failed ({type(e).__name__}: {e}); "
              "switching it off, the traced program carries on", file=sys.stderr)

    def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        if not self.enabled:
            self.dropped += 1
            return None
        try:
            return fn(*args)
        except Exception as e:  # a trace failure must never reach the traced program
            self.fail(e)
            return None

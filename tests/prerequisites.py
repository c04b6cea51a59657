"""What a test needs that a machine may lack: the TorchRec venv, the C++ sparse-update kernel, network
namespaces with tbf (the emulated cluster), headless Chromium, root for a tmpfs, a package index, the
Criteo sample beside the checkout, the right to lift a thread out of SCHED_IDLE.

On a developer's machine such a test skips, saying what is missing. Under STRICT (`.ci/run` sets
it) it fails instead, so that CI cannot go green by skipping what it was meant to check:

    needs(None if kernel_built() else "the C++ kernel is not built")   # a mark on a test
    missing("headless Chromium is missing: ...")                      # inside a test or fixture

The mark is read by conftest.py before the test runs.
"""

from __future__ import annotations

import os
from typing import NoReturn

import pytest

STRICT = "TRACEKIT_STRICT_PREREQUISITES"


def strict() -> bool:
    return os.environ.get(STRICT, "") not in ("", "0")


def missing(what: str) -> NoReturn:
    """Skip the running test because `what` is missing here; under STRICT, fail it."""
    if strict():
        pytest.fail(f"a prerequisite is missing ({STRICT} is set, as in CI): {what}", pytrace=False)
    pytest.skip(what)


def needs(absent: str | None) -> pytest.MarkDecorator:
    """A mark: where `absent` names what is missing, the test skips (fails under STRICT) saying so."""
    return pytest.mark.prerequisite(absent)

"""Pytest hooks of the suite: a test marked `prerequisite` (tests/prerequisites.py) skips, or fails
under TRACEKIT_STRICT_PREREQUISITES, where what it needs is missing."""

from __future__ import annotations

import pytest

from tests.prerequisites import missing


def pytest_runtest_setup(item: pytest.Item) -> None:
    for mark in item.iter_markers("prerequisite"):
        if mark.args and mark.args[0]:
            missing(mark.args[0])

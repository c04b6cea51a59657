"""Manifests as a test writes them by hand: a JSON object with just the fields the test needs, as an
older or a hand-made run has them, written and read back through tracekit/manifest.py."""

from __future__ import annotations

import os
from pathlib import Path

from tracekit import manifest
from tracekit.manifest import Manifest


def write_manifest(run_dir: str | os.PathLike, body: dict) -> Path:
    """Write `body` as `run_dir`'s manifest.json, with just its keys."""
    return manifest.write(run_dir, Manifest.from_json(body))


def read_manifest(run_dir: str | os.PathLike) -> dict:
    """`run_dir`'s manifest.json as the JSON object it holds."""
    return manifest.read(run_dir).to_json()

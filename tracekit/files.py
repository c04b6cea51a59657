"""Writing a file so that a reader never sees half of it: every file tracekit writes outside the
recorders' own Parquet parts (policy files, analysis tables, the manifest, reports) goes through here.

    with replacing(run / "analysis" / "skew.parquet") as tmp:   # written under a temporary name
        frame.write_parquet(tmp)                                  # renamed onto the target on success
    write_text(run / "policy.json", text)
"""

from __future__ import annotations

import os
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator


@contextmanager
def replacing(target: str | os.PathLike) -> Iterator[Path]:
    """A fresh temporary path beside `target` (its folder made if missing) to write to; renamed onto
    `target` when the block ends without an error, removed when it raises."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")  # made by the writer: umask's mode
    try:
        yield tmp
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)


def write_text(target: str | os.PathLike, text: str) -> Path:
    """Write `text` to `target` atomically; the target's path."""
    with replacing(target) as tmp:
        tmp.write_text(text)
    return Path(target)

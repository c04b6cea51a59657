"""Writing a file so that a reader never sees half of it: every file tracekit writes outside the
recorders' own Parquet parts (policy files, analysis tables, the manifest, reports) goes through here.

    with replacing(run / "analysis" / "skew.parquet") as tmp:   # written under a temporary name
        frame.write_parquet(tmp)                                  # renamed onto the target on success
    write_text(run / "policy.json", text)

A `Reserve` holds disk space back for what must be written at the end when the disk has filled
(the manifest, the ranks' reports): a file of real blocks, released just before those writes.
`read_json` reads a JSON file back, with an error that names the file where it holds no JSON.
"""

from __future__ import annotations

import json
import os
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator


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


class Reserve:
    """`size` bytes of disk held at `path` from `hold()` until `release()`. Never raises: where the
    space cannot be had, less (or nothing) is held."""

    CHUNK = 64 * 1024

    def __init__(self, path: str | os.PathLike, size: int) -> None:
        self.path, self.size = Path(path), size

    def hold(self) -> Reserve:
        try:
            with open(self.path, "wb") as f:  # zeros written, not a hole: the blocks are allocated
                for _ in range(0, self.size, self.CHUNK):
                    f.write(bytes(self.CHUNK))
        except OSError:
            pass
        return self

    def release(self) -> None:
        try:
            self.path.unlink(missing_ok=True)
        except OSError:
            pass


def read_json(path: Path, error: type[Exception]) -> Any:
    """The JSON value in the file at `path`; `error` naming the file where it holds no valid JSON."""
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise error(f"{path}: not valid JSON ({err})") from None

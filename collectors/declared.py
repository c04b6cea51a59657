"""What a traced program says about its run through tracekit's API, for the manifest: the policy
file it applied (`tracekit.policy_applied`) and its final figures (`tracekit.metrics`).

bootstrap keeps one `Declared` per traced process and writes it into the rank report at exit;
tracekit/app/rank_reports.py merges the ranks' (`merge_policy`, `merge_metrics`).

    declared = Declared()
    declared.policy_applied("runs/base/policy.json")   # the path made absolute, the bytes hashed now
    declared.policy_applied(path, ["replication"], {"lag": "inference-only"})  # and the sections, where named
    declared.add_metrics({"eval_auc": 0.71, "train_loss": 0.45})
    declared.policy, declared.metrics, declared.errors
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path


class Declared:
    """The policy file and metrics one process declared; `errors` names what could not be noted."""

    def __init__(self) -> None:
        # {"path": absolute path, "sha256": hex digest of its bytes or None, and where named "applied":
        # [section labels], "skipped": {label: why}}
        self.policy: dict | None = None
        self.metrics: dict[str, int | float | None] = {}
        self.errors: list[str] = []

    def policy_applied(self, path: str | os.PathLike, applied=None, skipped=None) -> None:
        """Note the policy file at `path`, hashed now: what the program read, even if the file changes
        later, with the sections `applied` and `skipped` where named. An unreadable file is noted with
        sha256 None and named in `errors`; never raises."""
        absolute = Path(path).resolve()
        try:
            with open(absolute, "rb") as f:
                digest = hashlib.file_digest(f, "sha256").hexdigest()
        except OSError as err:
            digest = None
            self.errors.append(f"policy_applied({str(path)!r}): cannot hash it: {type(err).__name__}: {err}")
        self.policy = {"path": str(absolute), "sha256": digest}
        if applied is not None or skipped is not None:
            self.policy |= {"applied": list(applied or ()), "skipped": dict(skipped or {})}

    def add_metrics(self, values: dict[str, int | float | None]) -> None:
        """Keep `values` (checked by tracekit.metrics); a key given again takes its latest value."""
        self.metrics.update(values)

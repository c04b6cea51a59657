"""The ranks' clocks on one time line. Times are each rank's `time.monotonic_ns()`. Ranks on one
host share that clock and are compared as recorded; ranks on several hosts (manifest `hosts`) are
put on one clock with their manifest `clock_anchors` (`monotonic_ns` and `wall_ns` read together):
t + (wall_ns − monotonic_ns) of the rank, less the smallest such offset, so hosts agree to within
their wall clocks' synchronisation (NTP: about a millisecond; PTP: microseconds).

    offsets, how = clock_offsets(run.manifest)   # {rank: ns to add}, a sentence for the notes
"""

from __future__ import annotations

from tracekit.manifest import Manifest


def clock_offsets(manifest: Manifest) -> tuple[dict[int, int], str]:
    """{rank: ns to add to its times} and how the clocks were aligned (see the module docstring)."""
    anchors = {int(rank): a for rank, a in (manifest.clock_anchors or {}).items()}
    if len(manifest.hosts or []) <= 1:
        return {rank: 0 for rank in anchors}, "one host: the ranks' monotonic clocks compared as recorded"
    if not anchors:
        return {}, "several hosts but no clock anchors in the manifest: clocks compared as recorded (unaligned)"
    raw = {rank: int(a["wall_ns"]) - int(a["monotonic_ns"]) for rank, a in anchors.items()}
    base = min(raw.values())
    offsets = {rank: value - base for rank, value in raw.items()}
    return offsets, "several hosts: aligned with the manifest's clock anchors"


def offset_sql(offsets: dict[int, int], rank: str = "rank") -> str:
    """A SQL expression of the ns to add to a row's times, given its `rank` column."""
    if not any(offsets.values()):
        return "0"
    cases = " ".join(f"WHEN {r} THEN {o}" for r, o in offsets.items())
    return f"(CASE {rank} {cases} ELSE 0 END)"

"""The shape of a cluster, nodes × ranks per node: the one type every part uses for it (analyze's
tiers and `--topology`, the emulated cluster, simulate's target). Global rank r sits on node
r // ranks_per_node, as torchrun numbers them.

    Topology.parse("2x4") == Topology(2, 4)        Topology(2, 4).world == 8, .name == "2x4"
    Topology.of_run(manifest, world_size=2)        # the cluster a run was recorded on, else one node
    tbf_params(12.5e6)                             # the token bucket `tracekit cluster` shapes a link with
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Topology:
    nodes: int
    ranks_per_node: int

    @property
    def world(self) -> int:
        return self.nodes * self.ranks_per_node

    @property
    def name(self) -> str:
        return f"{self.nodes}x{self.ranks_per_node}"

    @classmethod
    def parse(cls, text: str) -> Topology:
        """`2x4` as Topology(2, 4); ValueError naming the expected form."""
        nodes, _, ranks = text.lower().partition("x")
        if not (nodes.isdigit() and ranks.isdigit() and int(nodes) > 0 and int(ranks) > 0):
            raise ValueError(f"expected NODESxRANKS such as 2x4, got {text!r}")
        return cls(int(nodes), int(ranks))

    @classmethod
    def of_run(cls, manifest: Manifest, world_size: int) -> Topology:
        """The cluster a run was recorded on (manifest `topology`, written by `tracekit cluster`),
        else one node of its `world_size` ranks."""
        recorded = manifest.topology or {}
        if recorded.get("nodes") and recorded.get("ranks_per_node"):
            return cls(int(recorded["nodes"]), int(recorded["ranks_per_node"]))
        return cls(1, world_size)


def tbf_params(rate_bytes_per_s: float) -> dict[str, int]:
    """Bucket and queue of a tbf at this rate, in bytes: a burst of at least one 64 kB GSO segment
    and 4 ms of traffic (a kernel tick at HZ=250), and a queue of 50 ms of traffic (4 bursts at
    least), so TCP is neither starved by drops nor told the link is faster than it is."""
    burst = max(64 * 1024, int(rate_bytes_per_s / 250))
    return {"rate": int(rate_bytes_per_s), "burst": burst, "limit": max(4 * burst, int(rate_bytes_per_s * 0.05))}

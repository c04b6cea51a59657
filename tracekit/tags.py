"""The tags collectives of the reference trainer and of TorchRec carry in a trace (comms.tag), in
one place: analyses match on them to tell the embedding exchange, the replica sync and the dense
all-reduce apart.

Some are labels the trainer sets (`tracekit.label`), the others are the qualified name of the
function that called the collective, which the comm collector records where no label is open. So
renaming a trainer function changes a tag: tests/test_tags.py checks each name here against the
trainer's code, and fails instead of letting analysis results change silently.
"""

from __future__ import annotations

# the embedding exchange of the reference trainer (tracekit/dlrm/sharding.py), by the caller's name
INPUT_DIST = "ShardedEmbeddings._input_dist"  # ids and their lengths to the owning ranks
OUTPUT_FWD = "_AllToAll.forward"  # pooled rows back to the ranks that asked
OUTPUT_BWD = "_AllToAll.backward"  # their gradients to the owners

# labels the reference trainer sets
REPLICA_SYNC = "replica_sync"  # the replicated rows' gradient sync (tracekit/dlrm/replicas.py)
TIER2_SYNC = "tier2_sync"  # the per-node tier's sync across the node copies
# the per-node tier's exchange inside a node (tracekit/dlrm/node_tier.py)
TIER2_INPUT = "tier2_input_dist"  # tier-2 ids and their lengths to the node's rank holding them
TIER2_OUTPUT_FWD = "tier2_output_fwd"  # their rows back
TIER2_OUTPUT_BWD = "tier2_output_bwd"  # the rows' gradients to the node copy
DCT_DP = "dct_dp"  # DCT-DP's compressed all-reduce of the dense gradients (tracekit/dlrm/compression.py)

# the dense data-parallel all-reduce: DDP's buckets (named by the comm collector) or the trainer's hook
DDP_BUCKET = "ddp_bucket"  # ddp_bucket_<i>
DENSE_ALLREDUCE = "_sum_allreduce_hook"  # the reference trainer's DDP comm hook (tracekit/dlrm/train.py)

TORCHREC_SPLITS = "SplitsAllToAllAwaitable"  # TorchRec's all-to-all of the KJT exchange's split sizes (1.8.0)

TIER2_EXCHANGE = (TIER2_INPUT, TIER2_OUTPUT_FWD, TIER2_OUTPUT_BWD)
SYNC_TAGS = (REPLICA_SYNC, TIER2_SYNC)
"""Prefixes of the tags of a replica or tier sync."""
DP_TAGS = (DDP_BUCKET, DENSE_ALLREDUCE, DCT_DP)
"""Prefixes of the tags of the dense gradients' all-reduce, plain or compressed."""

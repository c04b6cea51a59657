"""The tags collectives of the reference trainer and of TorchRec carry in a trace (comms.tag), in
one place: analyses match on them to tell the embedding exchange, the replica sync and the dense
all-reduce apart.

Most are labels the trainer sets (`tracekit.label`), the others the qualified name of the function
that called the collective, which the comm collector records where no label is open: renaming such
a function changes its tag. tests/test_tags.py checks each name here against the trainer's code, and
fails instead of letting analysis results change silently.

The embedding exchange's four collectives carry their role as their label, the output dist's through
a codec a label of its own. A run recorded before the trainer labelled them carries the callers'
names (LEGACY_INPUT_DIST for both input-dist calls, LEGACY_OUTPUT's keys); analyses.roles names every
recorded call's role, from either.
"""

from __future__ import annotations

# the embedding exchange of the reference trainer (tracekit/dlrm/sharding.py), by role: the labels it sets
INPUT_LENGTHS = "input_lengths"  # the bags' lengths to the ranks owning their rows
INPUT_IDS = "input_ids"  # the ids to the same ranks
OUTPUT_FWD = "output_fwd"  # pooled rows back to the ranks that asked
OUTPUT_BWD = "output_bwd"  # their gradients to the owners
EXCHANGE = (INPUT_LENGTHS, INPUT_IDS, OUTPUT_FWD, OUTPUT_BWD)
"""The exchange's collectives, in the order a step issues them."""
# the output dist through a codec (tracekit/dlrm/output_codec.py): role output_fwd / output_bwd
OUTPUT_FWD_CODED = "output_fwd_coded"  # the encoded rows
OUTPUT_BWD_CODED = "output_bwd_coded"  # their encoded gradients

# the same calls in a run recorded before the trainer labelled them, by the caller's qualified name
LEGACY_INPUT_DIST = "ShardedEmbeddings._input_dist"  # the lengths, then the ids, of each (rank, step)
LEGACY_OUTPUT = {"_AllToAll.forward": OUTPUT_FWD, "_AllToAll.backward": OUTPUT_BWD,  # plain rows
                 "_CodedAllToAll.forward": OUTPUT_FWD_CODED, "_CodedAllToAll.backward": OUTPUT_BWD_CODED}
"""The output dist's tags in such a run, each with the label the trainer gives that call now."""

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

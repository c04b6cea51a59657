"""The names of the figures a policy predicts and `compare` measures, in one place: keys of a
section's `predicted` object in policy.json (and of `baseline`), per training step summed over
every rank unless the name says otherwise (`_per_rank`), bytes as `bytes_out`, times in seconds.
"""

from __future__ import annotations

A2A_BYTES = "a2a_bytes_per_step"  # the embedding exchange's all-to-alls
A2A_REMOTE_BYTES = "a2a_remote_bytes_per_step"  # ... of it, what crosses ranks
ALLREDUCE_BYTES = "allreduce_bytes_per_step"  # the dense gradients' all-reduce
SYNC_BYTES = "sync_bytes_per_step"  # a replica or tier sync (wire bytes)
DP_BYTES = "dp_bytes_per_step"  # DCT-DP's compressed all-reduce
OUTPUT_A2A_BYTES = "output_a2a_bytes_per_step"  # DCT-MP's output all-to-alls
INTRA_BYTES = "intra_bytes_per_step"  # within a node
INTER_BYTES = "inter_bytes_per_step"  # between nodes
STEP_TIME = "step_time_s"
COMM_TIME = "comm_time_s"
HOT_ROWS = "hot_rows"
HOT_SAMPLE_FRACTION = "hot_sample_fraction"
HOT_STEP_FRACTION = "hot_step_fraction"  # FAE: the share of steps batched from hot samples alone
GAIN = "gain"  # BLS: the share of the gap to the ideal makespan recovered
AUC_CHANGE = "eval_auc_change"  # a lossy section's eval AUC against the baseline's (analyses.quality)
LOGLOSS_CHANGE = "eval_logloss_rel_change"  # ... and its eval log loss, relative to the baseline's

SHOWN = (A2A_BYTES, ALLREDUCE_BYTES, A2A_REMOTE_BYTES, SYNC_BYTES, INTRA_BYTES, INTER_BYTES, DP_BYTES,
         OUTPUT_A2A_BYTES, HOT_SAMPLE_FRACTION, GAIN, STEP_TIME, AUC_CHANGE)
"""What `tracekit analyze` prints of each section's prediction, in this order."""

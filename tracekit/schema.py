"""The trace tables of DESIGN.md §3, defined once as Arrow schemas, with the schema version and the
manifest's status values (the run directory's file names are tracekit/run_dir.py's).

Writers (collectors, through `tracekit.store`), readers (`tracekit.run`) and tests import these
names; no other module spells a trace table's columns. Add columns freely; never change a column's
meaning. A change that old readers cannot follow bumps the major version.
"""

from __future__ import annotations

import pyarrow as pa

SCHEMA_VERSION = "1.7"
"""major.minor; readers accept any minor of a major they know. 1.1 added `phase` to accesses, lookups
and comms (readers show `train` for a 1.0 run); 1.2 added `schedule` to steps (readers show null for
an older run); 1.3 added the dct_replay table (absent from an older run); 1.4 added `feature` to
lookups (readers show 0 for an older run); 1.5 added the backward's times to steps (null for an older run); 1.6 added `t_wait_ns` to comms (null for
an older run); 1.7 added `src` and `src_sample` to lookups (null for an older run)."""

VERSION_KEY = b"tracekit.schema_version"
"""Parquet key-value metadata key holding SCHEMA_VERSION in every part file."""

TABLE_KEY = b"tracekit.table"
"""Parquet key-value metadata key holding the trace table's name in every part file."""

STATUS_RUNNING = "running"
STATUS_COMPLETED = "completed"
STATUS_FAILED = "failed"
STATUS_INTERRUPTED = "interrupted"
STATUSES = (STATUS_RUNNING, STATUS_COMPLETED, STATUS_FAILED, STATUS_INTERRUPTED)

CALIBRATION_SCHEMA = "tracekit.calibration/1"
"""`schema` of the rank-side cost calibration (tracekit/dlrm/calibrate.py documents its fields)."""

CALIBRATION_PATH = "analysis/calibration.json"
"""Where a run's calibration lives, relative to the run directory; analyses read only this file."""


def _required(name: str, type_: pa.DataType) -> pa.Field:
    return pa.field(name, type_, nullable=False)


_STEP = _required("step", pa.int64())
_TABLE_NAME = _required("table_name", pa.dictionary(pa.int32(), pa.string()))
_PHASE = _required("phase", pa.dictionary(pa.int8(), pa.string()))  # "train" | "eval" (collectors/phase.py)

ACCESSES = pa.schema([_STEP, _TABLE_NAME, _required("row", pa.int64()), _required("count", pa.int32()), _PHASE])

LOOKUPS = pa.schema(
    [
        _STEP,
        _TABLE_NAME,
        _required("sample", pa.int32()),  # position of the sample in the rank's local batch
        _required("pos", pa.int32()),  # position of the lookup in its bag or sequence
        _required("row", pa.int64()),
        _PHASE,
        _required("feature", pa.int16()),  # which of the features looking the table up (TorchRec), from 0
        pa.field("src", pa.int32(), nullable=True),  # global rank the lookup's item came from (`tracekit.sources`)
        pa.field("src_sample", pa.int32(), nullable=True),  # the item's index among those `src` sent
    ]
)

COMMS = pa.schema(
    [
        _STEP,
        _required("seq", pa.int64()),
        _required("op", pa.string()),
        _required("group", pa.string()),
        _required("group_size", pa.int16()),
        _required("dtype", pa.string()),
        _required("bytes_out", pa.int64()),
        _required("bytes_in", pa.int64()),
        _required("splits_out", pa.list_(pa.int64())),  # bytes sent to each peer, in group-rank order
        _required("splits_in", pa.list_(pa.int64())),  # bytes received from each peer
        _required("t_start_ns", pa.int64()),
        _required("t_end_ns", pa.int64()),  # completion (the Work finished), not the call's return
        _required("tag", pa.string()),
        _required("async", pa.bool_()),
        _PHASE,
        # an async call: when the rank first waited on its Work (`Work.wait()`: a TorchRec awaitable's wait);
        # null for a synchronous call and for a Work waited elsewhere (DDP's buckets, in its reducer)
        pa.field("t_wait_ns", pa.int64(), nullable=True),
    ]
)

STEPS = pa.schema(
    [
        _STEP,
        _required("t_start_ns", pa.int64()),
        _required("t_end_ns", pa.int64()),
        _required("samples", pa.int32()),
        pa.field("loss", pa.float64(), nullable=True),
        pa.field("schedule", pa.string(), nullable=True),  # the step's kind, from tracekit.step_schedule ("hot")
        # the step's (last) backward: when it was called, when its last gradient was computed (where DDP begins
        # to wait for its bucket all-reduces: the async calls' wait point), and when it returned; null if none
        pa.field("t_backward_ns", pa.int64(), nullable=True),
        pa.field("t_grads_ns", pa.int64(), nullable=True),
        pa.field("t_backward_end_ns", pa.int64(), nullable=True),
    ]
)

GRAD_QUANTILES = {"q50": 0.5, "q90": 0.9, "q99": 0.99, "q999": 0.999}
"""The quantile columns of `grads` and their q: quantiles of |g|, interpolated linearly between
order statistics (torch.quantile's and numpy's default definition)."""

KEEP_RATIOS = {"0_1pct": 0.001, "1pct": 0.01, "10pct": 0.1}
"""DCT keep ratios in `grads`, by the suffix of their columns `count_above_keep_<s>` and
`thr_keep_<s>`."""
DCT_WHOLE_BELOW = 128
"""DCT-DP sends a parameter of fewer entries than this whole (kraken's dct_emitter): the trainer's
hook does, and analyze's compression.dp counts it so."""

# count_above_keep_X counts elements of |g| above the threshold that keeps the top X of elements
# (DCT's keep ratio), the threshold being the one in force at that step: thr_keep_X, the (1 - X)
# quantile of |g| at the step it was last refreshed.
GRADS = pa.schema(
    [
        _STEP,
        _required("name", pa.string()),
        _required("numel", pa.int64()),
        _required("l2", pa.float64()),
        _required("absmax", pa.float64()),
        *[_required(column, pa.float64()) for column in GRAD_QUANTILES],
        *[_required(f"count_above_keep_{suffix}", pa.int64()) for suffix in KEEP_RATIOS],
        *[_required(f"thr_keep_{suffix}", pa.float64()) for suffix in KEEP_RATIOS],
    ]
)

# DCT-DP replayed with error feedback on every step's local gradients (collectors/dct_replay.py): per
# step, parameter, keep ratio and refresh period, `sent` of the `replayed` entries (all `numel` of
# them, or a fixed random subset) would be sent by the trainer's hook, `sent_first_half` of them are
# in the first half of the replayed entries (a random half of a subset); `position` is the order the
# rank's own gradient was taken in that step (-1: the all-reduced one was replayed), `refreshed`
# whether the thresholds were recomputed at that step.
DCT_REPLAY = pa.schema(
    [
        _STEP,
        _required("name", pa.string()),
        _required("numel", pa.int64()),
        _required("replayed", pa.int32()),
        _required("position", pa.int32()),
        _required("keep_ratio", pa.float64()),
        _required("refresh_every", pa.int32()),
        _required("sent", pa.int32()),
        _required("sent_first_half", pa.int32()),
        _required("refreshed", pa.bool_()),
    ]
)

# Units as NVML reports them: utilisation in percent, memory in bytes, PCIe throughput in KB/s;
# device is the NVML index. A metric is null where the GPU does not report it (collectors/gpu.py).
GPU = pa.schema(
    [
        _required("t_ns", pa.int64()),
        _required("device", pa.int16()),
        pa.field("util_gpu", pa.int16(), nullable=True),
        pa.field("util_mem", pa.int16(), nullable=True),
        pa.field("mem_used", pa.int64(), nullable=True),
        pa.field("power_mw", pa.int64(), nullable=True),
        pa.field("sm_clock_mhz", pa.int32(), nullable=True),
        pa.field("pcie_tx", pa.int64(), nullable=True),
        pa.field("pcie_rx", pa.int64(), nullable=True),
    ]
)

TABLES: dict[str, pa.Schema] = {
    "accesses": ACCESSES,
    "lookups": LOOKUPS,
    "comms": COMMS,
    "steps": STEPS,
    "grads": GRADS,
    "dct_replay": DCT_REPLAY,
    "gpu": GPU,
}


PHASED = ("accesses", "lookups", "comms")
"""The tables with a `phase` column (schema 1.1 on)."""


def file_metadata(table: str) -> dict[bytes, bytes]:
    """The key-value metadata stamped on every Parquet part file of `table`."""
    return {VERSION_KEY: SCHEMA_VERSION.encode(), TABLE_KEY: table.encode()}


def major(version: str) -> int | None:
    """The major number of a "major.minor" version string, or None if it is not one."""
    head, _, _ = version.partition(".")
    return int(head) if head.isdigit() else None

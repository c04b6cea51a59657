"""DCT-DP (research/papers.md §3, B.4): the data-parallel gradients hard-thresholded before they
cross the network, applied as a DDP communication hook (policy.json's `compression.dp`).

    state = DctDpState(DctDp(keep_ratio=0.005, refresh_every=1000, error_feedback=True))
    ddp.register_comm_hook(state, dct_dp_hook)
    ...train...
    state.log        # one BucketSend per bucket per step: kept entries, encoding, bytes sent

Per DDP bucket, on every rank, every step (kraken's dct_emitter, the paper's DP side):
  1. f = g + e: the bucket's local gradient plus the error-feedback residual (e = 0 at first, and
     always without error feedback);
  2. every `refresh_every` steps (the first included), each parameter's τ = the k-th largest |f| of
     its entries, k = ⌈keep_ratio · numel⌉: one threshold per dense tensor, as DCT and kraken set
     them, so every layer sends its share (one threshold per bucket starves the layers whose
     gradients are small). In between τ stays as it was (stale), so the entries sent per step drift
     around k. A parameter of fewer than DCT_WHOLE_BELOW entries is sent whole (kraken's bypass), and
     one first seen after a refresh gets its τ at once. Steps are counted at bucket 0, whose hook
     DDP calls first in every backward;
  3. send the entries with |f| ≥ τ (|f| > 0 when τ is 0: zeros add nothing);
  4. e = f where nothing was sent (error feedback), else e stays 0 and the unsent part is lost.
The bucket's result is the sum over ranks of what was sent, not divided: the reference trainer's
loss is already divided by the global batch (train.py's `_sum_allreduce_hook` sums the same way),
so at keep_ratio 1.0 the hook computes what the plain run computes.

Gloo has no sparse all-reduce, so the exchange is two collectives, both labelled `dct_dp` in
`comms`: an all-gather of each rank's count of entries sent (int32, 4 bytes a rank), then one
all-gather of each rank's entries padded to m, the largest count, in the encoding that sends the
fewest bytes for this bucket (n entries of `es` bytes; bytes_out per rank):
    int32   m·(4 + es)         int32 index, then the value
    int16   m·(2 + es) + 4·B   the index's offset in its block of 65,536 entries − 32768 as int16,
                               after each block's count (int32; B = ⌈n/65536⌉ blocks, none if 1)
    bitmap  ⌈n/8⌉ + m·es       one bit per entry, values in index order
    dense   n·es               an all-reduce of f with the unsent entries zeroed (no padding)
and none at all when no rank sends anything (m = 0). Every rank knows every count, so all choose
the same encoding. Values go first in the payload and indices (or the bitmap) after them, as bytes
(uint8), so one collective carries both. Two ranks, a bucket of n = 6, m = 2 (fp32): rank 0 sends
{1: 0.5, 4: -2.0}, rank 1 {4: 1.0}; int32 costs 16 bytes, int16 12, bitmap 9, dense 24: each rank
puts 9 bytes in (rank 1's second value is padding) and both get 0.5 at 1 and -1.0 at 4.

The counts make the hook block until every rank has the bucket ready; the payload's all-gather is
asynchronous (decoded in its future's callback), as DDP's own all-reduce is.
"""

# no `from __future__ import annotations`: DDP checks the hook's annotations as objects
import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

import tracekit
from tracekit import tags
from tracekit.schema import DCT_WHOLE_BELOW

LABEL = tags.DCT_DP
ENCODINGS = ("dense", "bitmap", "int16", "int32")  # ties go to the first
COUNT_BYTES = 4  # each rank's count, int32
BLOCK = 1 << 16  # int16 indices are offsets within blocks of this many entries


@dataclass(frozen=True)
class DctDp:
    """What policy.json's compression.dp says to apply."""

    keep_ratio: float
    """Fraction of each parameter's entries its threshold is set to send, in (0, 1]."""
    refresh_every: int = 1000
    """Calls of a bucket's hook (training steps) a threshold stays in force."""
    error_feedback: bool = True
    """Keep what is not sent and add it to the next step's gradient."""

    def __post_init__(self) -> None:
        if not (isinstance(self.keep_ratio, (int, float)) and 0 < self.keep_ratio <= 1):
            raise ValueError(f"keep_ratio must be in (0, 1], got {self.keep_ratio!r}")
        if not (isinstance(self.refresh_every, int) and self.refresh_every >= 1):
            raise ValueError(f"refresh_every must be a positive integer, got {self.refresh_every!r}")
        if not isinstance(self.error_feedback, bool):
            raise ValueError(f"error_feedback must be true or false, got {self.error_feedback!r}")


@dataclass(frozen=True)
class BucketSend:
    """What one rank sent for one bucket in one step."""

    step: int  # training steps before this one (backward passes through the hook)
    bucket: int  # DDP's bucket index
    numel: int
    kept: int  # entries this rank sent
    max_kept: int  # the largest count over ranks: what every rank's payload is padded to
    encoding: str  # one of ENCODINGS, or "none" when no rank sent anything
    bytes_out: int  # this rank's bytes_out over the hook's collectives (count and payload)
    dense_bytes: int  # the bucket's bytes: what a plain all-reduce puts out
    threshold: float  # the smallest of the bucket's thresholds
    refreshed: bool  # the thresholds were computed at this call


@dataclass
class DctDpState:
    """The hook's state on one rank: thresholds, residuals and the log of what was sent."""

    settings: DctDp
    group: dist.ProcessGroup | None = None  # None: the default group
    threshold: dict[int, float] = field(default_factory=dict)  # per parameter (by id)
    step: int = -1  # the step now in backward
    residual: dict[int, torch.Tensor] = field(default_factory=dict)  # per parameter (by id), flat
    log: list[BucketSend] = field(default_factory=list)

    @property
    def bytes_out(self) -> int:
        return sum(s.bytes_out for s in self.log)

    @property
    def dense_bytes(self) -> int:
        return sum(s.dense_bytes for s in self.log)


def encoded_bytes(encoding: str, numel: int, max_kept: int, value_bytes: int) -> int:
    """bytes_out of one rank's payload in `encoding` (the module docstring's table)."""
    if encoding == "dense":
        return numel * value_bytes
    if encoding == "bitmap":
        return math.ceil(numel / 8) + max_kept * value_bytes
    if encoding == "int16":
        return max_kept * (2 + value_bytes) + 4 * _blocks(numel)
    return max_kept * (4 + value_bytes)


def _blocks(numel: int) -> int:
    """The int16 encoding's per-block counts: one per 65,536 entries, none for a single block."""
    blocks = math.ceil(numel / BLOCK)
    return blocks if blocks > 1 else 0


def choose_encoding(numel: int, max_kept: int, value_bytes: int) -> str:
    """The encoding that sends the fewest bytes; "none" when nothing is sent."""
    if max_kept == 0:
        return "none"
    return min(ENCODINGS, key=lambda e: encoded_bytes(e, numel, max_kept, value_bytes))


def dct_dp_hook(state: DctDpState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: the bucket's gradients summed over ranks, only the entries above τ sent."""
    settings, index = state.settings, bucket.index()
    params = bucket.parameters()
    grad = bucket.buffer()
    n, es = grad.numel(), grad.element_size()
    f = grad + _residual(state, params, grad) if settings.error_feedback else grad

    if index == 0:
        state.step += 1
    step = state.step
    sizes = [p.numel() for p in params]
    refreshed = step % settings.refresh_every == 0 or any(id(p) not in state.threshold for p in params)
    magnitude = f.abs()
    if refreshed:
        for p, part in zip(params, magnitude.split(sizes)):
            state.threshold[id(p)] = _threshold(part, settings.keep_ratio)
    taus = [state.threshold[id(p)] for p in params]
    tau = torch.repeat_interleave(torch.tensor(taus, dtype=f.dtype, device=f.device),
                                  torch.tensor(sizes, device=f.device), output_size=n)
    mask = (magnitude >= tau) & (f != 0)  # zeros add nothing, whatever τ is
    kept = torch.nonzero(mask).flatten()
    values = f[kept]
    if settings.error_feedback:
        f[kept] = 0
        for p, part in zip(params, f.split(sizes)):
            state.residual[id(p)] = part  # views of f: what stays behind

    world = dist.get_world_size(state.group)
    with tracekit.label(LABEL):
        counts = torch.empty(world, dtype=torch.int32, device=grad.device)
        dist.all_gather_single(counts, torch.tensor([kept.numel()], dtype=torch.int32, device=grad.device),
                               group=state.group)
        counts = counts.tolist()
        m = max(counts)
        encoding = choose_encoding(n, m, es)
        payload = 0 if encoding == "none" else encoded_bytes(encoding, n, m, es)
        state.log.append(BucketSend(step=step, bucket=index, numel=n, kept=kept.numel(), max_kept=m,
                                    encoding=encoding, bytes_out=COUNT_BYTES + payload, dense_bytes=n * es,
                                    threshold=min(taus, default=0.0), refreshed=refreshed))
        if encoding == "none":
            done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
            done.set_result(torch.zeros_like(grad))
            return done
        if encoding == "dense":
            sent = torch.zeros_like(grad).index_put_((kept,), values)
            work = dist.all_reduce(sent, group=state.group, async_op=True)
            return work.get_future().then(lambda fut: fut.value()[0])
        out = torch.empty(world * payload, dtype=torch.uint8, device=grad.device)
        work = dist.all_gather_single(out, _encode(encoding, kept, values, n, m, payload), group=state.group,
                                      async_op=True)
    return work.get_future().then(lambda fut: _decode(encoding, out, counts, grad, payload))


def _threshold(magnitude: torch.Tensor, keep_ratio: float) -> float:
    """τ that keeps ⌈keep_ratio · n⌉ of these |f| (the k-th largest); 0, sending every entry even
    after τ goes stale, for a small tensor or a ratio that keeps them all."""
    n = magnitude.numel()
    k = max(1, math.ceil(keep_ratio * n))
    if n < DCT_WHOLE_BELOW or k >= n:
        return 0.0
    return float(magnitude.kthvalue(n - k + 1).values)


def _residual(state: DctDpState, params: list[torch.Tensor], grad: torch.Tensor) -> torch.Tensor:
    """The bucket's residual in its layout, from the per-parameter residuals (zeros where none)."""
    return torch.cat([state.residual.get(id(p), grad.new_zeros(p.numel())) for p in params])


def _encode(encoding: str, kept: torch.Tensor, values: torch.Tensor, n: int, m: int, size: int) -> torch.Tensor:
    """One rank's payload as bytes: the values padded to m, then their indices or the bitmap."""
    payload = torch.zeros(size, dtype=torch.uint8, device=values.device)
    es = values.element_size()
    padded = values.new_zeros(m)
    padded[:values.numel()] = values
    payload[:m * es] = padded.view(torch.uint8)
    if encoding == "bitmap":
        bits = torch.zeros(math.ceil(n / 8) * 8, dtype=torch.uint8, device=values.device)
        bits[kept] = 1
        weights = torch.tensor([1 << j for j in range(8)], dtype=torch.uint8, device=values.device)
        payload[m * es:] = (bits.view(-1, 8) * weights).sum(dim=1, dtype=torch.uint8)
    elif encoding == "int16":
        at, blocks = m * es, _blocks(n)
        if blocks:
            per_block = torch.bincount(kept // BLOCK, minlength=blocks).to(torch.int32)
            payload[at:at + 4 * blocks] = per_block.view(torch.uint8)
            at += 4 * blocks
        offsets = kept.new_zeros(m)
        offsets[:kept.numel()] = kept % BLOCK
        payload[at:] = (offsets - 32768).to(torch.int16).view(torch.uint8)
    else:
        index = kept.new_zeros(m)
        index[:kept.numel()] = kept
        payload[m * es:] = index.to(torch.int32).view(torch.uint8)
    return payload


def _decode(encoding: str, out: torch.Tensor, counts: list[int], grad: torch.Tensor, size: int) -> torch.Tensor:
    """The sum over ranks of the gathered payloads, in rank order, as a dense bucket."""
    n, es, m = grad.numel(), grad.element_size(), max(counts)
    result = torch.zeros_like(grad)
    for r, count in enumerate(counts):
        chunk = out[r * size:(r + 1) * size]
        values = chunk[:m * es].clone().view(grad.dtype)[:count]  # clone: a chunk may start unaligned
        tail = chunk[m * es:].clone()
        if encoding == "bitmap":
            bits = (tail.unsqueeze(1) >> torch.arange(8, dtype=torch.uint8, device=grad.device)) & 1
            index = torch.nonzero(bits.flatten()[:n]).flatten()
        elif encoding == "int16":
            blocks, base = _blocks(n), 0
            if blocks:
                per_block = tail[:4 * blocks].view(torch.int32).to(torch.int64)
                base = torch.repeat_interleave(torch.arange(blocks, device=grad.device) * BLOCK, per_block)
                tail = tail[4 * blocks:]
            index = tail.view(torch.int16)[:count].to(torch.int64) + 32768 + base
        else:
            index = tail.view(torch.int32)[:count].to(torch.int64)
        result.index_add_(0, index, values)
    return result

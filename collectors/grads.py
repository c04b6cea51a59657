"""The grads collector: magnitude statistics of every gradient an optimizer steps, on sampled steps,
for DCT's hard-threshold gradient compression (research/papers.md §3).

`install(writer, clock, grad_every=10)` registers three global torch hooks:

- an optimizer step pre-hook. There gradients are final (DDP has all-reduced them during backward)
  and not yet applied. On sampled steps (`step % grad_every == 0`; 0: never) each parameter of the
  stepping optimizer that has a dense `.grad` with elements gets one `grads` row; a parameter is
  written once per step, by the first optimizer that steps it. The step is the clock's when the
  optimizer steps: the clock advances when its optimizer (the first seen to step) finishes, so a
  second optimizer stepped after it in the same iteration (`opt_a.step(); opt_b.step()`) is counted
  in the next step, as the `steps` and `comms` tables time it;
- module and parameter registration hooks feeding `collectors.names.ModuleNames`, which names a
  parameter by its qualified name in its model (`top.0.weight`, with no `module.` from a DDP
  wrapper), or `param_<k>` for one registered before install.

Statistics of |g| per tensor, with |g| in float32 (exact for fp32, fp16 and bf16 gradients; fp64
ones are rounded):
- `l2` (summed in float64), `absmax`, and the quantiles `q50` .. `q999`, interpolated linearly
  between order statistics as torch.quantile does (which refuses tensors over 16M elements);
- `thr_keep_X`, DCT-DP's hard threshold for keep ratio X: the (1 - X) quantile of |g|, computed at
  the tensor's first sampled step and then left in force, stale, until a sampled step at least
  `refresh_every` steps later recomputes it (DCT's L);
- `count_above_keep_X`, how many elements of |g| exceed the threshold in force, so it drifts from
  X * numel between refreshes: DCT's actual compression at that step. There is no error feedback
  here: DCT's f = g + e is taken as f = g.

Beside them, on every step, `dct_replay` rows: DCT-DP replayed with error feedback on each rank's own
gradients, for the keep ratios 0.1%/1%/10% and the refresh periods of `refresh_ladder`, the entries
the trainer's hook would send (collectors/dct_replay.py); `grad_every` 0 turns them off too.

The statistics are computed on the gradients' device for many tensors at once, in a number of device
operations that does not grow with theirs: the |g| of up to BATCH_ELEMENTS elements are
concatenated and sorted together as int64 keys `tensor index << 31 | float32 bits of |g|` (a
non-negative float's bits order like its value), which sorts each tensor's values within its own
block. On CPU, where a loop over the tensors costs little, numpy partitions each tensor's |g| (as
the same float32 bits) around the few order statistics needed instead, and counts against each
threshold in one pass: TorchRec's DLRM's 338k gradients in half the time of the sort (bench/RESULTS.md
§19). The step's rows stay on the device until the step ends, and reach the host in one copy, made
by the writer thread (`RunWriter.add_source`), so the training thread never waits for the device.

    clock = StepClock()
    steps_handle = steps.install(writer, clock)
    handle = grads.install(writer, clock, grad_every=10)
    ...
    handle.uninstall(); steps_handle.uninstall()
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Any, Iterator

import numpy as np
import torch
from torch.nn.modules import module as torch_module
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.weak import WeakIdKeyDictionary

from collectors.dct_replay import REFRESH_LADDER, Replays
from collectors.guard import Guard
from collectors.names import ModuleNames
from collectors.steps import StepClock
from tracekit.schema import GRAD_QUANTILES, KEEP_RATIOS
from tracekit.store import RunWriter

REFRESH_EVERY = 1000
"""Steps a threshold stays in force: kraken's `life_span` default; the DCT paper updates it "only
once every few thousand iterations"."""

BATCH_ELEMENTS = 1 << 22
"""Gradient elements sorted together at most (unless one tensor alone is larger): each takes about
50 bytes of temporary device memory while they are (20 on CPU), so ~200 MB at most."""

# The quantiles each tensor needs: the q* columns, then the thresholds' (1 - keep ratio).
QS = (*GRAD_QUANTILES.values(), *(1 - keep for keep in KEEP_RATIOS.values()))
COUNTS = tuple(f"count_above_keep_{suffix}" for suffix in KEEP_RATIOS)
# The columns of a row of statistics, in the order `GradsHandle._stats` puts them.
STATS = ("l2", "absmax", *GRAD_QUANTILES, *COUNTS, *(f"thr_keep_{suffix}" for suffix in KEEP_RATIOS))
_BITS = (1 << 31) - 1  # the float32 bits of a sort key


@dataclass(frozen=True)
class Layout:
    """Where P tensors of given sizes lie in one flat buffer, on one device, and where the quantiles
    QS of each fall among its sorted values, as torch.quantile places them."""

    numel: int  # N, of all P tensors together
    split: tuple[int, ...]  # the P sizes
    sizes: torch.Tensor  # [P] int64, the same on the device
    ends: torch.Tensor  # [P] int64: where each tensor's block ends (exclusive)
    bases: torch.Tensor  # [P] int64: each tensor's index << 31, the high bits of its sort keys
    index: torch.Tensor  # [P, 2 len(QS) + 1] int64: flat positions below, above each quantile, and of the max
    weights: torch.Tensor  # [P, len(QS)] float64: the interpolation weights of `above`

    @staticmethod
    def of(sizes: tuple[int, ...], device: torch.device) -> Layout:
        n = torch.tensor(sizes, dtype=torch.int64)
        ends = n.cumsum(0)
        ranks = torch.tensor(QS, dtype=torch.float64) * (n[:, None] - 1)
        below = ranks.long()
        index = (ends - n)[:, None] + torch.cat([below, ranks.ceil().long(), (n - 1)[:, None]], dim=1)
        bases = torch.arange(len(sizes), device=device) << 31
        return Layout(int(ends[-1]), sizes, n.to(device), ends.to(device), bases, index.to(device),
                      (ranks - below).to(device))


def sort_keys(flat: torch.Tensor, layout: Layout) -> torch.Tensor:
    """The sort keys of `flat`, the |g| of the tensors of `layout` in float32 (module docstring), sorted."""
    keys = torch.repeat_interleave(layout.bases, layout.sizes, output_size=layout.numel)
    return keys.add_(flat.view(torch.int32)).sort().values


def partition_blocks(flat: torch.Tensor, layout: Layout) -> tuple[torch.Tensor, list[np.ndarray]]:
    """On CPU, where numpy's partition finds the few order statistics needed in about a third of a
    sort's time: the float32 bits of `flat` (ordered like the values, as in the sort keys) in blocks,
    one per tensor, each partitioned in place around its positions in `layout.index`, and the values
    there ([P, 2 len(QS) + 1] float64, what `key_values(sort_keys(...)[layout.index])` gives)."""
    bits, index = flat.numpy().view(np.int32), layout.index.numpy()
    starts = (layout.ends - layout.sizes).tolist()
    blocks, picked = [], np.empty(index.shape, dtype=np.float64)
    for i, (start, end) in enumerate(zip(starts, layout.ends.tolist())):
        block, at = bits[start:end], index[i] - start
        block.partition(np.unique(at))
        picked[i] = block[at].view(np.float32)
        blocks.append(block)
    return torch.from_numpy(picked), blocks


def key_values(keys: torch.Tensor) -> torch.Tensor:
    """The |g| of sort keys, as float64."""
    return (keys & _BITS).int().view(torch.float32).double()


def round_down(thresholds: torch.Tensor) -> torch.Tensor:
    """Each float64 threshold t as the largest float32 <= t: for a float32 x, x > t exactly when
    x > round_down(t), so a count against it is a count against the float64 threshold."""
    t = thresholds.float()
    return torch.where(t.double() > thresholds, torch.nextafter(t, torch.zeros_like(t)), t)


def count_above(keys: torch.Tensor, layout: Layout, thresholds: torch.Tensor) -> torch.Tensor:
    """How many |g| of each tensor exceed each of its thresholds ([P, R] float64), as [P, R] int64."""
    bounds = round_down(thresholds).view(torch.int32) + layout.bases[:, None]
    return layout.ends[:, None] - torch.searchsorted(keys, bounds, right=True)


def count_above_blocks(blocks: list[np.ndarray], thresholds: torch.Tensor) -> torch.Tensor:
    """`count_above` of the blocks of `partition_blocks`, one pass per threshold."""
    bounds = round_down(thresholds).numpy().view(np.int32)
    return torch.tensor([[np.count_nonzero(block > bound) for bound in row] for block, row in zip(blocks, bounds)],
                        dtype=torch.int64)


def batches(params: list[torch.Tensor], budget: int) -> Iterator[list[torch.Tensor]]:
    """`params` in order, cut into runs on one device of at most `budget` gradient elements (or one
    larger gradient alone)."""
    batch: list[torch.Tensor] = []
    size = 0
    for param in params:
        if batch and (param.grad.device != batch[0].grad.device or size + param.grad.numel() > budget):
            yield batch
            batch, size = [], 0
        batch.append(param)
        size += param.grad.numel()
    if batch:
        yield batch


class GradsHandle:
    """The installed grads collector; `uninstall()` removes every hook it registered."""

    def __init__(self, writer: RunWriter, clock: StepClock, grad_every: int, refresh_every: int,
                 refresh_ladder: tuple[int, ...]) -> None:
        self.writer = writer
        self.clock = clock
        self.grad_every = grad_every
        self.refresh_every = refresh_every
        self.guard = Guard("grads")
        self.names = ModuleNames()
        self.replays = Replays(self.names, refresh_ladder) if grad_every and refresh_ladder else None
        self._thresholds = WeakIdKeyDictionary()  # parameter -> (step computed, float64 [keep ratios])
        self._layouts: dict[tuple[tuple[int, ...], torch.device], Layout] = {}
        self._rows: list[tuple[list[str], list[int], torch.Tensor]] = []  # this step's, a batch at a time
        self._covered: set[int] = set()  # ids of the parameters written this step
        self._ended: collections.deque = collections.deque()  # (step, rows) of ended steps, for the writer
        self._hooks = [
            torch_module.register_module_module_registration_hook(self._on_module),
            torch_module.register_module_parameter_registration_hook(self._on_parameter),
            register_optimizer_step_pre_hook(self._on_optimizer_step),
        ]
        clock.add_listener(self)
        self._in_flight = 0  # rows of the step the writer is converting: lost if that fails
        writer.add_source(self.drain, in_flight=lambda: {"grads": self._in_flight})

    def uninstall(self) -> None:
        global _installed
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        if self.replays is not None:
            self.replays.uninstall()
        self.clock.remove_listener(self)
        self._rows, self._covered = [], set()
        if _installed is self:
            _installed = None

    def on_step_end(self, step: int) -> None:
        rows, self._rows, self._covered = self._rows, [], set()
        if rows:
            self._ended.append((step, rows))
        if self.replays is not None:
            self.replays.on_step_end(step)

    def _on_module(self, parent: torch.nn.Module, attr: str, child: torch.nn.Module | None) -> None:
        self.guard.run(self.names.on_module, parent, attr, child)  # returns None: child unchanged

    def _on_parameter(self, module: torch.nn.Module, attr: str, param: torch.nn.Parameter | None) -> None:
        self.guard.run(self.names.on_parameter, module, attr, param)  # returns None: param unchanged
        if self.replays is not None and param is not None:
            self.replays.watch(param)

    def _on_optimizer_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        step = self.clock.step
        if self.replays is not None:
            self.replays.on_optimizer_step(optimizer)  # returns None: the step's arguments unchanged
        if self.grad_every and step % self.grad_every == 0:
            self.guard.run(self._record, optimizer, step)  # returns None: the step's arguments unchanged

    def _record(self, optimizer: torch.optim.Optimizer, step: int) -> None:
        params = [p for group in optimizer.param_groups for p in group["params"]
                  if p.grad is not None and p.grad.layout == torch.strided and p.grad.numel()
                  and id(p) not in self._covered]
        self._covered.update(map(id, params))
        for batch in batches(params, BATCH_ELEMENTS):
            self._rows.append(([self.names.parameter_name(p) for p in batch], [p.grad.numel() for p in batch],
                               self._stats(batch, step)))

    def _stats(self, params: list[torch.Tensor], step: int) -> torch.Tensor:
        """The statistics of the gradients of `params` at `step`, one row each in STATS order,
        float64 on their device."""
        grads = [p.grad for p in params]
        key = (tuple(g.numel() for g in grads), grads[0].device)
        if key not in self._layouts:
            if len(self._layouts) > 64:  # parameter subsets that vary from step to step
                self._layouts.clear()
            self._layouts[key] = Layout.of(*key)
        layout = self._layouts[key]
        flat = torch.cat([g.detach().reshape(-1) for g in grads]).float().abs_()
        on_cpu = flat.device.type == "cpu"
        if on_cpu:
            picked, blocks = partition_blocks(flat, layout)
        else:
            keys = sort_keys(flat, layout)
            picked = key_values(keys[layout.index])
        k = len(QS)
        quantiles = picked[:, :k].lerp(picked[:, k:2 * k], layout.weights)
        fresh = quantiles[:, len(GRAD_QUANTILES):]
        in_force = [self._thresholds.get(p) for p in params]
        refresh = [f is None or step - f[0] >= self.refresh_every for f in in_force]
        thresholds = fresh if all(refresh) else torch.stack(
            [fresh[i] if r else f[1] for i, (r, f) in enumerate(zip(refresh, in_force))])
        for i, param in enumerate(params):
            if refresh[i]:
                self._thresholds[param] = (step, thresholds[i])
        # unsafe: skips checking that the lengths add up to flat's size (they do), a sync on CUDA
        l2 = torch.segment_reduce(flat.double().square_(), "sum", lengths=layout.sizes, unsafe=True).sqrt_()
        above = count_above_blocks(blocks, thresholds) if on_cpu else count_above(keys, layout, thresholds)
        return torch.cat([l2[:, None], picked[:, 2 * k:], quantiles[:, :len(GRAD_QUANTILES)], above.double(),
                          thresholds], dim=1)

    def drain(self, final: bool) -> Iterator[tuple[str, dict]]:
        """The rows of the steps ended since the last drain (called on the writer thread)."""
        for _ in range(len(self._ended)):
            step, rows = self._ended.popleft()
            self._in_flight = sum(len(names) for names, _, _ in rows)
            yield "grads", self._columns(step, rows)
        self._in_flight = 0
        if self.replays is not None:
            yield from self.replays.drain()

    @staticmethod
    def _columns(step: int, rows: list[tuple[list[str], list[int], torch.Tensor]]) -> dict:
        device = rows[0][2].device
        values = torch.cat([stats.to(device) for _, _, stats in rows]).T.contiguous().cpu()  # the step's one copy
        columns = {c: (v.long() if c in COUNTS else v).numpy() for c, v in zip(STATS, values)}
        names = [name for batch, _, _ in rows for name in batch]
        return {"step": [step] * len(names), "name": names,
                "numel": [n for _, numels, _ in rows for n in numels], **columns}


# The hooks are process-wide, so the record of them is too: one slot, set by install and cleared by
# uninstall, makes a second install a no-op.
_installed: GradsHandle | None = None


def install(writer: RunWriter, clock: StepClock, *, grad_every: int = 100,
            refresh_every: int = REFRESH_EVERY, refresh_ladder: tuple[int, ...] = REFRESH_LADDER) -> GradsHandle:
    """Write `grads` rows for every parameter an optimizer steps, every `grad_every`-th step (0:
    never), with DCT thresholds refreshed every `refresh_every` steps or more; and, unless
    grad_every is 0 or `refresh_ladder` empty, `dct_replay` rows every step for the refresh periods
    of `refresh_ladder` (collectors/dct_replay.py). A second call while installed returns the
    installed handle unchanged."""
    global _installed
    if grad_every < 0:
        raise ValueError(f"grad_every must be >= 0 (0 writes no grads), got {grad_every}")
    if refresh_every < 1 or any(r < 1 for r in refresh_ladder):
        raise ValueError(f"refresh periods must be >= 1, got {refresh_every} and {tuple(refresh_ladder)}")
    if _installed is None:
        _installed = GradsHandle(writer, clock, grad_every, refresh_every, tuple(refresh_ladder))
    return _installed

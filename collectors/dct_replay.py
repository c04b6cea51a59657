"""DCT-DP replayed on every training step's local gradients (research/papers.md §3, B.4): what the
trainer's compression.dp hook (tracekit/dlrm/compression.py) would send, with error feedback, at
each keep ratio X of KEEP_RATIOS and each refresh period R of REFRESH_LADDER. `analyze` chooses the
policy's (X, R) and predicts its bytes from it (analyses/policies/dct_dp.py).

Why a replay and not the `grads` statistics: with error feedback what a rank does not send stays
in a residual that is added to its next gradient, so the count above a stale threshold grows
between refreshes, and how fast depends on R itself (the residuals at a refresh set the next
threshold). On the criteo-kaggle preset, the entries sent in the first 20 steps after a refresh
are twice as many under R = 100 as under R = 20, and R = 1000 sends 88x the target on average; a replay on
the all-reduced gradient (what the optimizer steps) undercounts by 11-15% against one on each
rank's own gradient, which is what the hook thresholds (bench/RESULTS.md §21).

Per parameter of n entries, for every pair (X, R), on every optimizer step, as the hook computes it:

    f = g + e                g: this rank's gradient before DDP's all-reduce; e: the residual (0 at first)
    at replay steps 0, R, 2R, ...:  τ = the k-th largest |f|, k = ⌈X·n⌉  (0 for n < DCT_WHOLE_BELOW or k ≥ n)
    sent = #{|f| ≥ τ and f ≠ 0};   e = f where nothing was sent

in float32 (the hook's arithmetic for fp32 gradients, so the count is the hook's exactly when it
sees the same gradients; half-precision gradients are replayed in float32). Steps are counted from
the first replayed one, as the hook counts them from its first call.

Local gradients: a post-accumulate-grad hook on each parameter takes its replayed entries when
autograd has accumulated its gradient, before DDP's reducer (a post-hook of the same autograd node,
run after it) starts the all-reduce on it (checked on torch 2.13: tests/test_dct_dp.py fails otherwise). A
parameter without that hook at backward time (one registered before install, in its first step) is
replayed on the gradient the optimizer steps; its rows say so (`position` -1).

Cost: a parameter of more than SAMPLE entries is replayed on a fixed random subset of SAMPLE of them,
with τ the ⌈X·SAMPLE⌉-th largest of the subset (SAMPLE is a multiple of 1 / min X, so the subset's
threshold keeps the fraction X exactly): `replayed` says how many entries, and analyze scales the
count by numel / replayed. All pairs are rows of one [pairs, entries] tensor, a handful of tensor
operations a step (2.2 ms for the criteo-kaggle preset's 0.5 M dense parameters on one core of a
2-core Xeon VM, ~1.2% of its step); a refresh finds each parameter's k-th largest |f| by a numpy
partition on CPU, by one sort of keys `parameter << 31 | float32 bits of |f|` on an accelerator
(as collectors/grads.py does).

    replays = Replays(names, ladder=(1000, 100, 20, 5))   # what the grads collector calls:
    replays.watch(param)                    # as each parameter is registered
    replays.on_optimizer_step(optimizer)    # every step, before the optimizer updates
    replays.on_step_end(step); replays.drain()   # `dct_replay` rows, on the writer thread
    replays.uninstall()
"""

from __future__ import annotations

import collections
import math
import weakref
from typing import Iterator

import numpy as np
import torch
from torch.utils.weak import WeakIdKeyDictionary

from collectors.guard import Guard
from collectors.names import ModuleNames
from tracekit.schema import DCT_WHOLE_BELOW, KEEP_RATIOS

REFRESH_LADDER = (1000, 100, 20, 5)
"""Refresh periods replayed: kraken's `life_span` (the DCT paper's "once every few thousand
iterations" at the scale of a short run) down to 5 steps. Analyze's fallback, a threshold refreshed
every step (top-k every step), needs no replay: it sends exactly its target."""

SAMPLE = 8000
"""Entries of a parameter replayed at most (8 kept at keep 0.1%; ~100 kB of state per pair and
parameter). The count in the subset's first half beside the whole subset's (`sent_first_half`)
tells analyze how far the scaled count may be from the parameter's."""

_BITS = (1 << 31) - 1
_SMALLEST = 2.0 ** -149  # the smallest positive float32: |f| >= it exactly when f != 0


def subset(numel: int, sample: int = SAMPLE, device: torch.device | str = "cpu") -> torch.Tensor | None:
    """The positions of the entries replayed of a parameter of `numel` entries (None: all of them): a
    fixed random subset, in random order (so its first half is a random half too), that depends on
    numel alone, so it is known before the first step."""
    if numel <= sample:
        return None
    generator = torch.Generator().manual_seed(numel)
    return torch.randperm(numel, generator=generator)[:sample].to(device)


def entries(grad: torch.Tensor, index: torch.Tensor | None) -> torch.Tensor:
    """The replayed entries of `grad` (`index` from `subset`), flat."""
    flat = grad.detach().reshape(-1)
    return flat if index is None else flat.index_select(0, index.to(flat.device))


class Replay:
    """The replay of one optimizer's parameters on one device."""

    def __init__(self, numel: list[int], *, device: torch.device, ladder: tuple[int, ...] = REFRESH_LADDER,
                 sample: int = SAMPLE) -> None:
        self.numel = numel
        self.pairs = [(keep, refresh) for keep in KEEP_RATIOS.values() for refresh in ladder]
        self.index = [subset(n, sample, device) for n in numel]
        self.replayed = [min(n, sample) for n in numel]
        sizes = torch.tensor(self.replayed)
        ends = sizes.cumsum(0)
        self.sizes = sizes.to(device)
        self.offsets = (ends - sizes).tolist()
        self.last = (ends - 1).to(device)  # each parameter's last replayed entry
        self.middle = (ends - sizes + sizes // 2 - 1).clamp(min=0).to(device)  # the last of its first half
        self.halved = (sizes // 2 > 0).to(device)
        count = int(ends[-1])
        self.grad = torch.zeros(count, device=device)
        self.residual = torch.zeros(len(self.pairs), count, device=device)
        self.threshold = torch.zeros(len(self.pairs), count, device=device)
        self.bases = torch.repeat_interleave(torch.arange(len(numel), device=device) << 31, self.sizes,
                                             output_size=count)
        # per pair and parameter: where the k-th largest replayed |f| lies once sorted ascending, and
        # whether the hook sends the parameter whole (τ = 0)
        # (k as the hook computes it, float product included: tracekit/dlrm/compression.py's _threshold)
        k = torch.tensor([[max(1, math.ceil(keep * m)) for m in self.replayed] for keep, _ in self.pairs])
        self.at = (ends[None, :] - k).to(device)
        self.whole = torch.tensor([[n < DCT_WHOLE_BELOW or max(1, math.ceil(keep * n)) >= n for n in numel]
                                   for keep, _ in self.pairs], device=device)
        self.position = [-1] * len(numel)  # the order each local gradient was put in this step (-1: none)
        self.put_count = 0
        self.steps = 0

    def put(self, i: int, values: torch.Tensor, *, local: bool = True) -> None:
        """Parameter i's replayed gradient entries for this step (`entries`), local (before any
        all-reduce) or not."""
        self.grad[self.offsets[i]:self.offsets[i] + self.replayed[i]].copy_(values)
        self.position[i] = self.put_count if local else -1
        self.put_count += local

    def step(self, grads: list[torch.Tensor | None]) -> tuple[torch.Tensor, list[bool], list[int]]:
        """One step of every pair: per parameter the entries each would send and, of them, those in
        the first half of its replayed entries ([2, pairs, P] int32, on the device), which pairs
        refreshed their thresholds, and the order the local gradients were put in. `grads`: what the
        optimizer steps, for the parameters given no local gradient."""
        for i, grad in enumerate(grads):
            if self.position[i] < 0:
                if grad is None:
                    self.grad[self.offsets[i]:self.offsets[i] + self.replayed[i]].zero_()
                else:
                    self.put(i, entries(grad, self.index[i]), local=False)
        f = self.residual.add_(self.grad)
        magnitude = f.abs()
        refreshed = [self.steps % refresh == 0 for _, refresh in self.pairs]
        if any(refreshed):
            rows = torch.tensor([r for r, due in enumerate(refreshed) if due], device=f.device)
            tau = self._kth_largest(magnitude, rows)
            tau = tau.masked_fill(self.whole[rows], 0.0).clamp_(min=_SMALLEST)  # τ = 0 sends every f != 0
            self.threshold[rows] = torch.repeat_interleave(tau, self.sizes, dim=1, output_size=f.shape[1])
        sent = magnitude >= self.threshold
        running = sent.cumsum(1, dtype=torch.int32)
        ends = running[:, self.last]
        counts = torch.diff(ends, dim=1, prepend=torch.zeros_like(ends[:, :1]))
        first_half = (running[:, self.middle] - (ends - counts)) * self.halved
        f.masked_fill_(sent, 0.0)
        position, self.position, self.put_count = self.position, [-1] * len(self.numel), 0
        self.steps += 1
        return torch.stack([counts, first_half]), refreshed, position

    def _kth_largest(self, magnitude: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Per row of `rows` and parameter, its pair's k-th largest replayed |f| ([rows, P] float32).
        On CPU numpy partitions each parameter's entries around it, a third of a sort's time; on an
        accelerator one sort of keys `parameter << 31 | float32 bits` (which order like the values)."""
        return self._sorted(magnitude, rows) if magnitude.device.type != "cpu" else self._partitioned(magnitude, rows)

    def _sorted(self, magnitude: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        keys = (self.bases + magnitude[rows].view(torch.int32)).sort(dim=1).values
        return (keys.gather(1, self.at[rows]) & _BITS).int().view(torch.float32)

    def _partitioned(self, magnitude: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        values, at = magnitude[rows].numpy(), self.at[rows].numpy()
        tau = np.empty(at.shape, dtype=np.float32)
        for r in range(at.shape[0]):
            for i, start in enumerate(self.offsets):
                tau[r, i] = np.partition(values[r, start:start + self.replayed[i]], at[r, i] - start)[at[r, i] - start]
        return torch.from_numpy(tau)


class Replays:
    """The replays of one process (one per optimizer, built at its first step), fed each parameter's
    local gradient by a post-accumulate-grad hook, and their `dct_replay` rows for the writer. The
    grads collector owns it and calls it from its hooks; its own Guard switches the replay off
    alone on a failure, leaving the statistics on."""

    def __init__(self, names: ModuleNames, ladder: tuple[int, ...]) -> None:
        self.names = names
        self.ladder = ladder
        self.guard = Guard("grads (DCT-DP replay)")
        self._replays = weakref.WeakKeyDictionary()  # optimizer -> (Replay, its parameters, their names)
        self._slots = WeakIdKeyDictionary()  # parameter -> (Replay, its index there)
        self._hooks = WeakIdKeyDictionary()  # parameter -> the handle of its post-accumulate-grad hook
        self._early = WeakIdKeyDictionary()  # parameter in no replay yet -> (order, its entries) this step
        self._subsets: dict[tuple[int, torch.device], torch.Tensor | None] = {}
        self._done: set[int] = set()  # ids of the parameters replayed this step
        self._rows: list = []  # this step's (replay, names, counts, refreshed, positions)
        self._ended: collections.deque = collections.deque()  # (step, rows) of ended steps

    def watch(self, param: torch.Tensor) -> None:
        """Have `param`'s local gradient taken as autograd accumulates it (once per parameter)."""
        self.guard.run(self._watch, param)

    def _watch(self, param: torch.Tensor) -> None:
        if param.requires_grad and param.is_leaf and param not in self._hooks:
            self._hooks[param] = param.register_post_accumulate_grad_hook(self._on_gradient)

    def _on_gradient(self, param: torch.Tensor) -> None:
        # torch internals (checked on torch 2.13): a tensor's post-accumulate-grad hooks run inside its
        # AccumulateGrad node, before the node's post-hooks, where DDP's reducer marks the gradient
        # ready and may start the all-reduce on it: here `param.grad` is this rank's own gradient.
        # tests/test_dct_dp.py (the replay against the hook's own counts) fails if that stops being so.
        self.guard.run(self._take, param)  # returns None: the gradient unchanged

    def _take(self, param: torch.Tensor) -> None:
        grad = param.grad
        if grad is None or grad.layout != torch.strided or not grad.numel():
            return
        slot = self._slots.get(param)
        if slot is not None:
            replay, i = slot
            replay.put(i, entries(grad, replay.index[i]))
            return
        key = (grad.numel(), grad.device)  # no replay holds it yet (its optimizer has not stepped)
        if key not in self._subsets:
            self._subsets[key] = subset(grad.numel(), SAMPLE, grad.device)
        self._early[param] = (len(self._early), entries(grad, self._subsets[key]).clone())

    def on_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        self.guard.run(self._step, optimizer)

    def _step(self, optimizer: torch.optim.Optimizer) -> None:
        entry = self._replays.get(optimizer)
        if entry is None:
            params = [p for group in optimizer.param_groups for p in group["params"]
                      if p.grad is not None and p.grad.layout == torch.strided and p.grad.numel()
                      and id(p) not in self._done]
            if not params:
                return
            replay = Replay([p.numel() for p in params], device=params[0].grad.device, ladder=self.ladder)
            for i, p in enumerate(params):
                self._slots[p] = (replay, i)
                self._watch(p)
            for _, i in sorted((self._early[p][0], i) for i, p in enumerate(params) if p in self._early):
                replay.put(i, self._early[params[i]][1])  # this step's local gradients, in the order taken
            entry = self._replays[optimizer] = (replay, params, [self.names.parameter_name(p) for p in params])
        replay, params, names = entry
        counts, refreshed, positions = replay.step(
            [p.grad if p.grad is not None and p.grad.layout == torch.strided else None for p in params])
        self._done.update(map(id, params))
        self._rows.append((replay, names, counts, refreshed, positions))

    def on_step_end(self, step: int) -> None:
        rows, self._rows, self._done, self._early = self._rows, [], set(), WeakIdKeyDictionary()
        if rows:
            self._ended.append((step, rows))

    def drain(self) -> Iterator[tuple[str, dict]]:
        """The `dct_replay` rows of the steps ended since the last drain (on the writer thread)."""
        for _ in range(len(self._ended)):
            step, rows = self._ended.popleft()
            for replay, names, counts, refreshed, positions in rows:
                yield "dct_replay", columns(step, replay, names, counts, refreshed, positions)

    def uninstall(self) -> None:
        for hook in self._hooks.values():
            hook.remove()
        self._hooks, self._slots, self._early = WeakIdKeyDictionary(), WeakIdKeyDictionary(), WeakIdKeyDictionary()
        self._replays, self._rows = weakref.WeakKeyDictionary(), []


def columns(step: int, replay: Replay, names: list[str], counts: torch.Tensor, refreshed: list[bool],
            positions: list[int]) -> dict:
    """`dct_replay` rows of one replay step: one per (keep ratio, refresh period) pair and parameter."""
    pairs, params = len(replay.pairs), len(names)
    return {"step": np.full(pairs * params, step, dtype=np.int64), "name": names * pairs,
            "numel": np.tile(replay.numel, pairs), "replayed": np.tile(replay.replayed, pairs),
            "position": np.tile(positions, pairs),
            "keep_ratio": np.repeat([keep for keep, _ in replay.pairs], params),
            "refresh_every": np.repeat([refresh for _, refresh in replay.pairs], params),
            "sent": counts[0].cpu().numpy().reshape(-1), "sent_first_half": counts[1].cpu().numpy().reshape(-1),
            "refreshed": np.repeat(refreshed, params)}

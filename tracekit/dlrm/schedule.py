"""Which samples each step consumes on every rank, and a thread that builds them ahead.

Step s consumes global samples [s*B, (s+1)*B) of the training split (B = batch per rank x
world size), wrapping at the end of an epoch, and rank r takes its contiguous slice. The
last batch of an epoch may be short; it is split as evenly as possible (a rank may get none).

Under an FAE policy (papers.md §4) the training split is cut in two pools: hot samples, whose
every id is one of FAE's rows (`fae_rows`, which are replicated), and the rest. Each pool is
batched in sample order, and hot and cold batches are interleaved evenly over the epoch (hot step
k of n_h falls where k/n_h of the epoch has passed), so the model sees both throughout and every
sample once per epoch. A hot batch needs no embedding all-to-all: every id it holds is served from
the replicas.
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass

import torch

from tracekit.dlrm.config import TrainConfig
from tracekit.dlrm.data import Dataset


@dataclass(frozen=True)
class Schedule:
    """Which samples each step consumes, on every rank."""

    num_train: int
    global_batch: int
    world_size: int
    steps: int

    def global_range(self, step: int) -> tuple[int, int]:
        per_epoch = -(-self.num_train // self.global_batch)
        start = (step % per_epoch) * self.global_batch
        return start, min(start + self.global_batch, self.num_train)

    def local_sizes(self, start: int, stop: int) -> list[int]:
        n, W = stop - start, self.world_size
        return [n // W + (1 if r < n % W else 0) for r in range(W)]

    def global_size(self, step: int) -> int:
        start, stop = self.global_range(step)
        return stop - start

    def kind(self, step: int) -> str | None:
        """"hot" or "cold" under FAE; None for the plain schedule."""
        return None

    def local_batches(self, dataset: Dataset, rank: int, steps: range):
        """Per step: the global batch size, every rank's batch size, and this rank's batch."""
        for step in steps:
            start, stop = self.global_range(step)
            sizes = self.local_sizes(start, stop)
            lo = start + sum(sizes[:rank])
            yield stop - start, sizes, dataset.batch(lo, lo + sizes[rank])


@dataclass(frozen=True)
class FaeSchedule(Schedule):
    """Hot and cold batches interleaved (module docstring); `hot` and `cold` hold the training
    samples of each pool, in sample order."""

    hot: torch.Tensor = None
    cold: torch.Tensor = None

    @property
    def hot_batches(self) -> int:
        return -(-self.hot.numel() // self.global_batch)

    @property
    def per_epoch(self) -> int:
        return self.hot_batches + -(-self.cold.numel() // self.global_batch)

    def _place(self, step: int) -> tuple[bool, int]:
        """Whether `step` is hot, and its batch's index in its pool."""
        s, n, h = step % self.per_epoch, self.per_epoch, self.hot_batches
        hot_before = s * h // n
        if (s + 1) * h // n > hot_before:
            return True, hot_before
        return False, s - hot_before

    def samples(self, step: int) -> torch.Tensor:
        hot, k = self._place(step)
        pool = self.hot if hot else self.cold
        return pool[k * self.global_batch:(k + 1) * self.global_batch]

    def global_size(self, step: int) -> int:
        return self.samples(step).numel()

    def kind(self, step: int) -> str:
        return "hot" if self._place(step)[0] else "cold"

    def local_batches(self, dataset: Dataset, rank: int, steps: range):
        for step in steps:
            index = self.samples(step)
            sizes = self.local_sizes(0, index.numel())
            lo = sum(sizes[:rank])
            yield index.numel(), sizes, dataset.take(index[lo:lo + sizes[rank]])


def hot_samples(dataset: Dataset, num_train: int, fae_rows: list[torch.Tensor], chunk: int = 1 << 16) -> torch.Tensor:
    """Bool [num_train]: whether each training sample is hot, every id of it in `fae_rows[t]` of its table."""
    hot = torch.empty(num_train, dtype=torch.bool)
    for start in range(0, num_train, chunk):
        stop = min(start + chunk, num_train)
        batch = dataset.batch(start, stop)
        T, b = batch.lengths.shape
        cold = torch.zeros(b, dtype=torch.int64)
        offset = 0
        for t, n in enumerate(batch.lengths.sum(dim=1).tolist()):
            ids = batch.values[offset:offset + n]
            offset += n
            sample = torch.repeat_interleave(torch.arange(b), batch.lengths[t], output_size=n)
            cold += torch.bincount(sample[~torch.isin(ids, fae_rows[t])], minlength=b)
        hot[start:stop] = cold == 0
    return hot


def prefetched(items, depth: int):
    """Iterate `items` on a background thread, `depth` ahead, so batches are built while
    the main thread waits on collectives (torch ops release the GIL). Errors re-raise here.
    The thread ends once the consumer closes or drops the generator, after at most the item
    it is building then."""
    buffer: queue.Queue = queue.Queue(maxsize=depth)
    done = object()
    stop = threading.Event()

    def produce():
        try:
            for item in items:
                buffer.put(item)
                if stop.is_set():
                    return
            buffer.put(done)
        except BaseException as err:  # handed to the consumer, which re-raises it
            buffer.put(err)

    thread = threading.Thread(target=produce, name="tracekit-prefetch", daemon=True)
    thread.start()
    try:
        while (item := buffer.get()) is not done:
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()
        # emptied after `stop` is set, the buffer takes the producer's next put without blocking,
        # and after that put the producer sees `stop` or has nothing left to put
        while True:
            try:
                buffer.get_nowait()
            except queue.Empty:
                break


def make_schedule(cfg: TrainConfig, dataset: Dataset, world_size: int,
                  fae_rows: list[torch.Tensor] | None = None) -> Schedule:
    """The plain schedule, or FAE's hot/cold one when the policy names FAE's rows (per table: the
    rows that make a sample hot)."""
    num_eval = int(dataset.num_samples * cfg.eval_fraction)
    num_train = dataset.num_samples - num_eval
    global_batch = cfg.batch_size * world_size
    per_epoch = -(-num_train // global_batch)
    if fae_rows is not None:
        hot = hot_samples(dataset, num_train, fae_rows)
        pools = {"hot": hot.nonzero().flatten(), "cold": (~hot).nonzero().flatten()}
        per_epoch = sum(-(-pool.numel() // global_batch) for pool in pools.values())
    steps = cfg.epochs * per_epoch if cfg.steps is None else min(cfg.steps, cfg.epochs * per_epoch)
    if fae_rows is not None:
        return FaeSchedule(num_train, global_batch, world_size, steps, **pools)
    return Schedule(num_train, global_batch, world_size, steps)



"""Which samples each step consumes on every rank, and a thread that builds them ahead.

Step s consumes global samples [s*B, (s+1)*B) of the training split (B = batch per rank x
world size), wrapping at the end of an epoch, and rank r takes its contiguous slice. The
last batch of an epoch may be short; it is split as evenly as possible (a rank may get none).
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass

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

    def local_batches(self, dataset: Dataset, rank: int, steps: range):
        """Per step: the global sample range, every rank's batch size, and this rank's batch."""
        for step in steps:
            start, stop = self.global_range(step)
            sizes = self.local_sizes(start, stop)
            lo = start + sum(sizes[:rank])
            yield start, stop, sizes, dataset.batch(lo, lo + sizes[rank])


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


def make_schedule(cfg: TrainConfig, dataset: Dataset, world_size: int) -> Schedule:
    num_eval = int(dataset.num_samples * cfg.eval_fraction)
    num_train = dataset.num_samples - num_eval
    global_batch = cfg.batch_size * world_size
    per_epoch = -(-num_train // global_batch)
    steps = cfg.epochs * per_epoch if cfg.steps is None else min(cfg.steps, cfg.epochs * per_epoch)
    return Schedule(num_train, global_batch, world_size, steps)



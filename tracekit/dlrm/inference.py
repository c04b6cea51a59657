"""`train.py --inference`: the DLRM forward only, over `--steps` global batches, with the embedding
exchange either synchronous (the trainer's collectives) or bounded-lag (BLS, research/papers.md §6).

Inference reads the tables and never writes them, so iteration t's exchange does not depend on
anything computed before it. Under a lag bound L each rank runs the exchange on a thread of its
own: the trainer's collectives (lengths, ids, pooled rows), in a process group of their own, for
iteration t as soon as the rank's main thread has finished t − 1 − L, the rows handed to the main
thread when they arrive. A collective completes only once every rank has entered it, so exchange t
completes once every rank has finished t − 1 − L: a rank starts iteration t only then, and no
message of its own carries the bound. With c the rank's own work (its straggler delay and its
dense forward) and x the exchange's, analyses/policies/lag.py's recurrence, where the exchange
thread has a core (or a GPU's streams) of its own:

    E_{p,t} = max(E_{p,t−1}, max_q F_{q,t−1−L}) + x_{p,t}      (the rows of t have arrived)
    F_{p,t} = max(F_{p,t−1}, E_{p,t}) + c_{p,t}                 (iteration t finished)

and where it shares the rank's one core, F_{p,t} = max(F_{p,t−1}, max_q F_{q,t−1−L}) + c + x.
L = 0 is bulk-synchronous (F_{p,t} = max_q F_{q,t−1} + x + c): the collectives run on the main
thread then, as without a bound. The larger L, the more a slow iteration on one rank is hidden
behind the others' progress. The predictions do not depend on L: each sample meets the same rows
and the same dense weights. Traced, the exchange thread's lookups and collectives are booked to
the step the main thread is in when they run, up to L + 1 steps before their own iteration.
`--straggler PROB:DELAY_MS[:RANKS]` delays an iteration by DELAY_MS with probability PROB on each
listed rank (every rank by default), each rank drawing on its own, seeded, so runs repeat.

    result = run(cfg, dataset, rank=rank, world_size=world, device=device, bound=2)
    result.makespan_s, result.auc
"""

from __future__ import annotations

import random
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

import tracekit
from tracekit.dlrm.batch import Batch
from tracekit.dlrm.data import Dataset
from tracekit.dlrm.metrics import log_loss, roc_auc
from tracekit.dlrm.model import DenseArch
from tracekit.dlrm.optim import sparse_optimizer
from tracekit.dlrm.sharding import ShardedEmbeddings, ShardingPlan
from tracekit.errors import ConfigError
from tracekit.phases import TRAIN


@dataclass(frozen=True)
class Straggler:
    probability: float
    delay_s: float
    ranks: tuple[int, ...] | None  # None: every rank

    @staticmethod
    def parse(text: str) -> "Straggler":
        """PROB:DELAY_MS[:RANKS] with RANKS comma-separated, e.g. 0.1:20 or 0.1:20:1,3."""
        parts = text.split(":")
        try:
            if len(parts) not in (2, 3):
                raise ValueError
            probability, delay = float(parts[0]), float(parts[1]) / 1e3
            ranks = tuple(int(r) for r in parts[2].split(",")) if len(parts) == 3 else None
        except ValueError:
            raise ConfigError(f"--straggler: expected PROB:DELAY_MS[:RANKS] such as 0.1:20 or 0.1:20:1,3, "
                              f"got {text!r}") from None
        if not 0 <= probability <= 1 or delay < 0:
            raise ConfigError(f"--straggler {text}: PROB must be in [0, 1] and DELAY_MS at least 0")
        return Straggler(probability, delay, ranks)

    def delay(self, rng: random.Random, rank: int) -> float:
        if self.ranks is not None and rank not in self.ranks:
            return 0.0
        return self.delay_s if rng.random() < self.probability else 0.0


@dataclass
class InferenceResult:
    iterations: int
    samples: int
    makespan_s: float  # the slowest rank's time from the first iteration's start to the last's end
    auc: float | None
    logloss: float | None
    predictions: torch.Tensor  # this rank's logits, in sample order
    bound: int | None
    exchange_s: float | None = None  # bounded lag: time per iteration blocked on the exchange (mean of the ranks)


def run(cfg, dataset: Dataset, *, rank: int, world_size: int, device: torch.device, tables,
        bound: int | None, straggler: Straggler | None) -> InferenceResult:
    """Forward `cfg.steps` global batches (cfg.batch_size per rank); `bound` None: synchronous."""
    plan = ShardingPlan.build(tables, world_size, cfg.sharding)
    torch.manual_seed(cfg.seed)
    dense = DenseArch(dataset.num_dense, cfg.bottom_mlp, cfg.top_mlp, len(plan.tables)).to(device)
    group = dist.new_group() if world_size > 1 else None
    embeddings = ShardedEmbeddings(plan, rank, sparse_optimizer(cfg.optimizer, cfg.lr), seed=cfg.seed,
                                   device=device, group=group)
    b = cfg.batch_size
    steps = cfg.steps or max(1, dataset.num_samples // (b * world_size))
    if steps * b * world_size > dataset.num_samples:
        raise ConfigError(f"--steps {steps}: {steps * b * world_size} samples needed, the dataset has "
                          f"{dataset.num_samples}")
    sizes = [b] * world_size

    def batch_of(t: int) -> Batch:
        lo = t * b * world_size + rank * b
        return dataset.batch(lo, lo + b).to(device)

    # bound 0 is bulk-synchronous: the collectives on the main thread are that, without a thread's hand-offs
    exchange = _BoundedLag(embeddings, batch_of, sizes, bound, steps) if bound and world_size > 1 else None
    rng = random.Random(cfg.seed * 1_000_003 + rank)
    pauses = [straggler.delay(rng, rank) if straggler is not None else 0.0 for _ in range(steps)]
    logits, labels = [], []
    if world_size > 1:
        dist.barrier()
    start = time.perf_counter()
    if exchange is not None:
        exchange.start()
    # the iterations are this run's steps: book their lookups and collectives to them (phase
    # `train`; under no_grad the collectors would say `eval`), or the timeline sees no exchange
    # and no waiting in them and the lag recurrence takes the waits for work
    with torch.no_grad(), tracekit.phase(TRAIN):
        for t in range(steps):
            if exchange is None:
                if pauses[t]:
                    time.sleep(pauses[t])
                batch = batch_of(t)
                embedded = embeddings(batch.lengths, batch.values, sizes)
            else:
                batch, embedded = exchange.rows(t)
                if pauses[t]:
                    time.sleep(pauses[t])
            logits.append(dense(batch.dense, embedded))
            labels.append(batch.labels)
            if exchange is not None:
                exchange.finished(t)
            tracekit.step()
    elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    exchange_s = None
    if exchange is not None:
        exchange.close()
        # the main thread's time blocked on its rows per iteration, the ranks' mean (the first
        # iteration left out where there are others: start-up, as in the timeline)
        times = exchange.wait_s[1:] or exchange.wait_s
        per_rank = torch.tensor([statistics.fmean(times)], dtype=torch.float64)
        dist.all_reduce(per_rank)
        exchange_s = float(per_rank) / world_size
        tracekit.metrics(exchange_s=exchange_s)
    predictions, local_labels = torch.cat(logits), torch.cat(labels)
    both = torch.stack([predictions, local_labels]).float()
    if world_size > 1:
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        gathered = [torch.empty_like(both) for _ in range(world_size)]
        dist.all_gather(gathered, both)
        both = torch.cat(gathered, dim=1)
    auc, ll = roc_auc(both[0], both[1]), log_loss(both[0], both[1])
    return InferenceResult(steps, steps * b * world_size, float(elapsed), auc, ll, predictions, bound, exchange_s)


class _BoundedLag:
    """The exchange of `run` under a lag bound, on a thread of its own (module docstring): exchange t
    starts once the main thread has finished t − 1 − bound, and its rows wait, with their batch,
    until the main thread takes them. At most bound + 2 iterations' rows are held."""

    def __init__(self, embeddings: ShardedEmbeddings, batch_of: Callable[[int], Batch], sizes: list[int],
                 bound: int, steps: int) -> None:
        self.embeddings, self.batch_of, self.sizes, self.bound, self.steps = embeddings, batch_of, sizes, bound, steps
        self.ready: dict[int, tuple[Batch, torch.Tensor]] = {}
        self.finished_t = -1  # the last iteration the main thread finished
        self.changed = threading.Condition()
        self.errors: list[BaseException] = []
        self.wait_s: list[float] = []  # per iteration, the main thread's time blocked on its rows
        self.thread = threading.Thread(target=self._guard, name="tracekit-bls-exchange", daemon=True)

    def start(self) -> None:
        self.thread.start()

    # the main thread ------------------------------------------------------------------------

    def rows(self, t: int) -> tuple[Batch, torch.Tensor]:
        """Iteration t's batch and its embeddings [b, T, D], once the exchange has brought them."""
        began = time.perf_counter()
        with self.changed:
            while t not in self.ready and not self.errors:
                self.changed.wait(timeout=1.0)
            self._raise()
            item = self.ready.pop(t)
        self.wait_s.append(time.perf_counter() - began)
        return item

    def finished(self, t: int) -> None:
        with self.changed:
            self.finished_t = t
            self.changed.notify_all()

    def close(self) -> None:
        self.thread.join()
        self._raise()

    # the exchange thread --------------------------------------------------------------------

    def _exchange(self) -> None:
        with torch.no_grad():
            for t in range(self.steps):
                with self.changed:
                    while self.finished_t < t - 1 - self.bound:
                        self.changed.wait(timeout=1.0)
                batch = self.batch_of(t)
                rows = self.embeddings(batch.lengths, batch.values, self.sizes)
                with self.changed:
                    self.ready[t] = (batch, rows)
                    self.changed.notify_all()

    def _guard(self) -> None:
        try:
            self._exchange()
        except BaseException as err:  # surfaced on the main thread; never a silent hang
            with self.changed:
                self.errors.append(err)
                self.changed.notify_all()

    def _raise(self) -> None:
        if self.errors:
            raise RuntimeError(f"bounded-lag exchange failed: {self.errors[0]}") from self.errors[0]

"""`train.py --inference`: the DLRM forward only, over `--steps` global batches, with the embedding
exchange either synchronous (the trainer's collectives) or bounded-lag (BLS, research/papers.md §6).

Inference reads the tables and never writes them, so an owner can serve a peer's lookups for any
iteration at any time. Under a lag bound L the exchange is point to point: each rank sends every
owner its iteration-t ids (lengths, then ids, as the input dist orders them), a thread per peer on
the owner pools them and sends the rows back, and each rank, when it has its rows, finishes t and
tells every peer so. A rank starts iteration t only once every peer has finished t − 1 − L:

    S_{p,t} = max(F_{p,t−1}, max_q F_{q,t−1−L})         F_{p,t} = S_{p,t} + c_{p,t}

L = 0 is bulk-synchronous; the larger L, the more a slow iteration on one rank is hidden behind
the others' progress. The predictions do not depend on L: each sample meets the same rows and the
same dense weights. `--straggler PROB:DELAY_MS[:RANKS]` delays an iteration by DELAY_MS with
probability PROB on each listed rank (every rank by default), each rank drawing on its own,
seeded, so runs repeat.

    result = run(cfg, dataset, rank=rank, world_size=world, device=device, bound=2)
    result.makespan_s, result.auc
"""

from __future__ import annotations

import random
import threading
import time
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
    exchange = _BoundedLag(embeddings, rank, world_size, bound, steps, b) if bound is not None and world_size > 1 else None
    rng = random.Random(cfg.seed * 1_000_003 + rank)
    sizes = [b] * world_size
    logits, labels = [], []
    if world_size > 1:
        dist.barrier()
    start = time.perf_counter()
    with torch.no_grad():
        for t in range(steps):
            if exchange is not None:
                exchange.wait_for_peers(t)
            if straggler is not None and (pause := straggler.delay(rng, rank)):
                time.sleep(pause)
            lo = t * b * world_size + rank * b
            batch = dataset.batch(lo, lo + b).to(device)
            if exchange is None:
                embedded = embeddings(batch.lengths, batch.values, sizes)
            else:
                embedded = exchange.embed(t, batch)
            logits.append(dense(batch.dense, embedded))
            labels.append(batch.labels)
            if exchange is not None:
                exchange.finished(t)
            tracekit.step()
    elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    if exchange is not None:
        exchange.close()
    predictions, local_labels = torch.cat(logits), torch.cat(labels)
    both = torch.stack([predictions, local_labels]).float()
    if world_size > 1:
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        gathered = [torch.empty_like(both) for _ in range(world_size)]
        dist.all_gather(gathered, both)
        both = torch.cat(gathered, dim=1)
    auc, ll = roc_auc(both[0], both[1]), log_loss(both[0], both[1])
    return InferenceResult(steps, steps * b * world_size, float(elapsed), auc, ll, predictions, bound)


class _BoundedLag:
    """The point-to-point exchange of `run` under a lag bound (module docstring). Three groups keep
    the kinds of message apart: requests (lengths and ids), responses (rows), and `finished` notes."""

    def __init__(self, embeddings: ShardedEmbeddings, rank: int, world: int, bound: int, steps: int, b: int) -> None:
        self.embeddings, self.rank, self.world, self.bound, self.steps, self.b = embeddings, rank, world, bound, steps, b
        self.requests, self.responses, self.notes = dist.new_group(), dist.new_group(), dist.new_group()
        self.peers = [q for q in range(world) if q != rank]
        self.done = {q: -1 for q in self.peers}
        self.changed = threading.Condition()
        self.sends: list[dist.Work] = []
        self.errors: list[BaseException] = []
        self.threads = [threading.Thread(target=self._guard, args=(f, q), daemon=True)
                        for q in self.peers for f in (self._serve, self._listen)]
        for thread in self.threads:
            thread.start()

    # the main thread ------------------------------------------------------------------------

    def wait_for_peers(self, t: int) -> None:
        """Block until every peer has finished iteration t − 1 − bound."""
        need = t - 1 - self.bound
        with self.changed:
            while not self.errors and any(self.done[q] < need for q in self.peers):
                self.changed.wait(timeout=1.0)
        self._raise()

    def embed(self, t: int, batch: Batch) -> torch.Tensor:
        """This rank's embeddings [b, T, D] for iteration t, its lookups served by their owners."""
        e = self.embeddings
        T = batch.lengths.shape[0]
        routing = e._route(batch.lengths, batch.values, None)
        lengths = routing.lengths.split(routing.lengths_splits)
        values = routing.values.split(routing.values_splits)
        for q in self.peers:
            self.sends.append(dist.isend(lengths[q].contiguous(), q, group=self.requests))
            self.sends.append(dist.isend(values[q].contiguous(), q, group=self.requests))
        pieces = []
        for q in range(self.world):
            if q == self.rank:
                pieces.append(self._pool(self.rank, lengths[q], values[q]))
            else:
                rows = torch.empty(routing.rows_back[q], e.plan.tables[0].dim)
                dist.recv(rows, q, group=self.responses)
                pieces.append(rows)
        returned = torch.cat(pieces)
        out = returned.new_zeros(self.b * T, returned.shape[1]).index_add_(0, routing.slots_back, returned)
        return out.view(self.b, T, -1)

    def finished(self, t: int) -> None:
        for q in self.peers:
            self.sends.append(dist.isend(torch.tensor([t], dtype=torch.int64), q, group=self.notes))

    def close(self) -> None:
        for work in self.sends:
            work.wait()
        for thread in self.threads:
            thread.join()
        self._raise()

    # the peers' threads ---------------------------------------------------------------------

    def _serve(self, q: int) -> None:
        """Pool peer q's lookups of every iteration, in order, and send the rows back."""
        mine = len(self.embeddings.local_tables)
        for _ in range(self.steps):
            lengths = torch.empty(mine * self.b, dtype=torch.int32)
            dist.recv(lengths, q, group=self.requests)
            values = torch.empty(int(lengths.sum()), dtype=torch.int64)
            dist.recv(values, q, group=self.requests)
            dist.send(self._pool(q, lengths, values), q, group=self.responses)

    def _listen(self, q: int) -> None:
        note = torch.empty(1, dtype=torch.int64)
        for _ in range(self.steps):
            dist.recv(note, q, group=self.notes)
            with self.changed:
                self.done[q] = int(note)
                self.changed.notify_all()

    def _pool(self, source: int, lengths: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """The rows this rank returns for `source`'s lookups (its tables in order)."""
        sizes = [self.b if q == source else 0 for q in range(self.world)]
        with torch.no_grad():
            outputs, _ = self.embeddings._lookup(lengths, values, sizes)
        return torch.cat(outputs) if outputs else torch.empty(0, self.embeddings.plan.tables[0].dim)

    def _guard(self, target, q: int) -> None:
        try:
            target(q)
        except BaseException as err:  # surfaced on the main thread; never a silent hang
            with self.changed:
                self.errors.append(err)
                self.changed.notify_all()

    def _raise(self) -> None:
        if self.errors:
            raise RuntimeError(f"bounded-lag exchange failed: {self.errors[0]}") from self.errors[0]

"""`train.py --inference`: the DLRM forward only, over `--steps` global batches, with the embedding
exchange either synchronous (the trainer's collectives) or bounded-lag (BLS, research/papers.md §6).

Inference reads the tables and never writes them, so an owner can serve a peer's lookups for any
iteration at any time. Under a lag bound L the exchange is point to point: each rank sends every
owner one request for iteration t (lengths and ids together, with "I finished t − 1" in its
header), one serving thread per rank pools the requests of every peer and sends the rows back, and
each rank, once it has its rows, computes and finishes t. A rank starts iteration t only once
every peer has finished t − 1 − L. With c the rank's own work (compute, straggler delay) and x
the time its main thread spends on the exchange (posting requests, waiting for rows; the own
tables' lookup overlaps the transfer), analyses/policies/lag.py's recurrence:

    S_{p,t} = max(F_{p,t−1}, max_q F_{q,t−1−L})         F_{p,t} = S_{p,t} + c_{p,t} + x_{p,t}

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
import statistics
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
    exchange = _BoundedLag(embeddings, rank, world_size, bound, steps, b) if bound is not None and world_size > 1 else None
    rng = random.Random(cfg.seed * 1_000_003 + rank)
    pauses = [straggler.delay(rng, rank) if straggler is not None else 0.0 for _ in range(steps)]
    sizes = [b] * world_size
    logits, labels = [], []
    if world_size > 1:
        dist.barrier()
    start = time.perf_counter()
    # the iterations are this run's steps: book their lookups and collectives to them (phase
    # `train`; under no_grad the collectors would say `eval`), or the timeline sees no exchange
    # and no waiting in them and the lag recurrence takes the waits for work
    with torch.no_grad(), tracekit.phase(TRAIN):
        for t in range(steps):
            if exchange is not None:
                exchange.wait_for_peers(t)
            if pauses[t]:
                time.sleep(pauses[t])
            lo = t * b * world_size + rank * b
            batch = dataset.batch(lo, lo + b).to(device)
            if exchange is None:
                embedded = embeddings(batch.lengths, batch.values, sizes)
            else:
                embedded = exchange.embed(t, batch)
            logits.append(dense(batch.dense, embedded))
            labels.append(batch.labels)
            if exchange is not None:
                exchange.finished(t, next_delayed=t + 1 < steps and pauses[t + 1] > 0)
            tracekit.step()
    elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    exchange_s = None
    if exchange is not None:
        exchange.close()
        # the main thread's time on the exchange per iteration, the ranks' mean: the recurrence's x
        # (the first iteration left out where there are others: start-up, as in the timeline)
        times = exchange.exchange_s[1:] or exchange.exchange_s
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
    """The point-to-point exchange of `run` under a lag bound (module docstring).

    Per peer and iteration one request goes out and one response comes back:
    - request, owner ← rank: int64 [t, finished, n, lengths (owner's tables × b), ids (n)], where
      `finished` is the last iteration the sender finished (t − 1): the "finished" note rides on
      the next request. A note alone, [NOTE, finished, 0], goes out only when the next request
      would leave late (`finished` says when). A request longer than the owner's buffer (more
      than POOLING_CAPACITY ids a bag) sends its last ids in a second message.
    - response, owner → rank: the pooled rows, table by table (their count the rank knows from
      its routing).
    Requests and notes travel in one group, responses in another, so that one thread per rank,
    receiving from any peer, serves every peer and tracks how far each has finished.
    """

    def __init__(self, embeddings: ShardedEmbeddings, rank: int, world: int, bound: int, steps: int, b: int) -> None:
        self.embeddings, self.rank, self.world, self.bound, self.steps, self.b = embeddings, rank, world, bound, steps, b
        self.requests, self.responses = dist.new_group(), dist.new_group()
        self.peers = [q for q in range(world) if q != rank]
        self.done = {q: -1 for q in self.peers}  # the last iteration each peer finished, as far as we know
        self.finished_t = -1  # ours
        self.changed = threading.Condition()
        self.sending: list[tuple[dist.Work, torch.Tensor]] = []  # main thread: requests and notes in flight
        self.errors: list[BaseException] = []
        self.exchange_s: list[float] = []  # per iteration, the main thread's time posting requests and waiting for rows
        self.server = threading.Thread(target=self._guard, daemon=True)
        self.server.start()

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
        routing = e.route(batch.lengths, batch.values)
        lengths = routing.lengths.split(routing.lengths_splits)
        values = routing.values.split(routing.values_splits)
        began = time.perf_counter()
        rows = {q: torch.empty(routing.rows_back[q], e.plan.tables[0].dim) for q in self.peers}
        receiving = [dist.irecv(rows[q], q, group=self.responses) for q in self.peers]
        for q in self.peers:
            header = torch.tensor([t, self.finished_t, values[q].numel()], dtype=torch.int64)
            request = torch.cat([header, lengths[q].to(torch.int64), values[q]])
            cut = _capacity(len(e.plan.tables_on(q)), self.b)
            for piece in (request[:cut], request[cut:]):
                if piece.numel():
                    self._send(piece, q)
        posted = time.perf_counter()
        own = e.lookup_owned(lengths[self.rank], values[self.rank], source=self.rank, batch_size=self.b)
        waited = time.perf_counter()
        for work in receiving:
            work.wait()
        self.exchange_s.append((posted - began) + (time.perf_counter() - waited))
        returned = torch.cat([own if q == self.rank else rows[q] for q in range(self.world)])
        out = returned.new_zeros(self.b * T, returned.shape[1]).index_add_(0, routing.slots_back, returned)
        return out.view(self.b, T, -1)

    def finished(self, t: int, *, next_delayed: bool) -> None:
        """Iteration t is done. Its note rides on the next request when that leaves at once; a note
        goes to every peer now when it would not: the next iteration must wait for a peer (its
        gate is closed; with bound 0 the peers wait for this very note) or opens with a straggler
        delay (`next_delayed`). Nobody waits for the last iteration's note."""
        self.finished_t = t
        if t + 1 >= self.steps:
            return
        with self.changed:
            gate_open = all(self.done[q] >= t - self.bound for q in self.peers)
        if next_delayed or not gate_open:
            for q in self.peers:
                self._send(torch.tensor([NOTE, t, 0], dtype=torch.int64), q)

    def close(self) -> None:
        for work, _ in self.sending:
            work.wait()
        self.server.join()
        self._raise()

    def _send(self, tensor: torch.Tensor, q: int) -> None:
        self.sending.append((dist.isend(tensor, q, group=self.requests), tensor))
        if len(self.sending) > IN_FLIGHT * len(self.peers):  # keep the buffers of a few iterations alive, not all
            self.sending.pop(0)[0].wait()

    # the serving thread ---------------------------------------------------------------------

    def _serve(self) -> None:
        """Every peer's requests and notes, in arrival order: note how far the sender has finished,
        pool its lookups and send the rows back, until each peer has sent its `steps` requests."""
        mine = len(self.embeddings.local_tables)
        bags = mine * self.b
        buffer = torch.empty(_capacity(mine, self.b), dtype=torch.int64)
        left = {q: self.steps for q in self.peers}
        replies: list[tuple[dist.Work, torch.Tensor]] = []
        while any(left.values()):
            source = dist.recv(buffer, group=self.requests)  # from any peer
            t, finished, n = buffer[:HEADER].tolist()
            with self.changed:
                self.done[source] = max(self.done[source], finished)
                self.changed.notify_all()
            if t == NOTE:
                continue
            inline = min(n, buffer.numel() - HEADER - bags)
            lengths = buffer[HEADER:HEADER + bags].to(torch.int32)
            ids = buffer[HEADER + bags:HEADER + bags + inline].clone()
            if inline < n:
                rest = torch.empty(n - inline, dtype=torch.int64)
                dist.recv(rest, source, group=self.requests)
                ids = torch.cat([ids, rest])
            rows = self.embeddings.lookup_owned(lengths, ids, source=source, batch_size=self.b)
            replies.append((dist.isend(rows, source, group=self.responses), rows))
            if len(replies) > IN_FLIGHT * len(self.peers):
                replies.pop(0)[0].wait()
            left[source] -= 1
        for work, _ in replies:
            work.wait()

    def _guard(self) -> None:
        try:
            self._serve()
        except BaseException as err:  # surfaced on the main thread; never a silent hang
            with self.changed:
                self.errors.append(err)
                self.changed.notify_all()

    def _raise(self) -> None:
        if self.errors:
            raise RuntimeError(f"bounded-lag exchange failed: {self.errors[0]}") from self.errors[0]


HEADER = 3  # a request's iteration, the sender's last finished iteration, its number of ids
NOTE = -1  # the iteration field of a note: no lookups
POOLING_CAPACITY = 4  # ids per bag that one request message holds; longer requests take two messages
IN_FLIGHT = 4  # sends per peer kept in flight before the oldest is waited for


def _capacity(tables: int, b: int) -> int:
    """int64 elements of the first message of a request to an owner of `tables` tables."""
    return HEADER + tables * b * (1 + POOLING_CAPACITY)

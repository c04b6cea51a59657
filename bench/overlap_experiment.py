"""An experiment, not kept: the output all-to-all overlapped with the bottom MLP, forward and backward.

The reference trainer's output dist is synchronous: the forward waits for the pooled rows before
the dense part starts, and backward sends their gradients after the bottom MLP's backward, behind
DDP's bucket all-reduces. This script runs train.py with the exchange split in two autograd
functions: `_Start` launches the forward all-to-all asynchronously, the bottom MLP runs, and
`_Finish` waits and places the rows; in backward `_Finish` (created after the bottom MLP, so the
engine runs it first) launches the gradients' all-to-all, the bottom MLP's backward runs, and
`_Start` waits. Same arithmetic, so the same losses as train.py. Plain exchanges only (no replicas,
codec or FAE hot batches); anything else falls back to the trainer's own forward. Alternate it with
train.py to compare (bench/RESULTS.md §16):

    torchrun --standalone --nproc-per-node 2 bench/overlap_experiment.py --tables 8 --rows 100000 \\
        --dim 64 --bottom-mlp 512,256,64 --top-mlp 512,256,1 --batch-size 512 --pooling 1 \\
        --zipf 0 --eval-fraction 0 --steps 200
"""

import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tracekit.dlrm import model, train  # noqa: E402
from tracekit.dlrm.sharding import ShardedEmbeddings  # noqa: E402


class Exchange:
    """One step's output exchange: its group, splits and the works in flight."""

    def __init__(self, group, splits_out: list[int], splits_in: list[int]) -> None:
        self.group, self.splits_out, self.splits_in = group, splits_out, splits_in
        self.work = self.grad_work = self.grad_send = None


class _Start(torch.autograd.Function):
    @staticmethod
    def forward(ctx, send, ex: Exchange):
        ctx.ex = ex
        recv = send.new_empty(sum(ex.splits_in), *send.shape[1:])
        ex.work = dist.all_to_all_single(recv, send, ex.splits_in, ex.splits_out, group=ex.group, async_op=True)
        return recv

    @staticmethod
    def backward(ctx, grad_recv):
        ctx.ex.grad_work.wait()
        return ctx.ex.grad_send, None


class _Finish(torch.autograd.Function):
    @staticmethod
    def forward(ctx, recv, ex: Exchange, slots, rows: int):
        ex.work.wait()
        ctx.ex = ex
        ctx.save_for_backward(slots)
        return recv.new_zeros(rows, recv.shape[1]).index_add_(0, slots, recv)

    @staticmethod
    def backward(ctx, grad_out):
        ex, (slots,) = ctx.ex, ctx.saved_tensors
        grad_recv = grad_out.index_select(0, slots)
        ex.grad_send = grad_recv.new_empty(sum(ex.splits_out), grad_recv.shape[1])
        ex.grad_work = dist.all_to_all_single(ex.grad_send, grad_recv, ex.splits_out, ex.splits_in,
                                              group=ex.group, async_op=True)
        return grad_recv, None, None, None


class Deferred:
    """Embeddings still in flight: `finish()` waits for them."""

    def __init__(self, finish) -> None:
        self.finish = finish


def overlapped_forward(self, lengths, values, batch_sizes, local_only=False):
    if (self.replicas is not None or self.codec is not None or local_only or self.plan.world_size == 1
            or not torch.is_grad_enabled()):
        return synchronous_forward(self, lengths, values, batch_sizes, local_only)
    T, b = lengths.shape
    routing = self._route(lengths, values, None)
    pooled, rows_out = self._lookup(*self._input_dist(routing, batch_sizes), batch_sizes)
    W = self.plan.world_size
    pieces = [out.split(rows) for out, rows in zip(pooled, rows_out)]
    send = torch.cat([pieces[j][q] for q in range(W) for j in range(len(pooled))])
    ex = Exchange(self.group, [sum(rows[q] for rows in rows_out) for q in range(W)], routing.rows_back)
    recv = _Start.apply(send, ex)
    return Deferred(lambda: _Finish.apply(recv, ex, routing.slots_back, b * T).view(b, T, -1))


def overlapped_logits(self, dense, embedded):
    if not isinstance(embedded, Deferred):
        return synchronous_logits(self, dense, embedded)
    x = self.bottom(dense)  # while the pooled rows are on their way
    z = torch.cat([x.unsqueeze(1), embedded.finish().to(x.dtype)], dim=1)
    dots = model._Gram.apply(z).flatten(1).index_select(1, self.pairs)
    return self.top(torch.cat([x, dots], dim=1)).squeeze(1)


synchronous_forward, synchronous_logits = ShardedEmbeddings.forward, model.DenseArch._logits

if __name__ == "__main__":
    ShardedEmbeddings.forward = overlapped_forward
    model.DenseArch._logits = overlapped_logits
    sys.exit(train.main())

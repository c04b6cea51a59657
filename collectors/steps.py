"""The step clock, and the collector that advances it on every optimizer step.

`StepClock` holds the current step (0 first) for every collector of the process. `advance()` ends
the current step: it keeps one `steps` row for its writer (if it has one; the writer thread drains
them), tells the listeners (`on_step_end(step)`), then moves to the next step. A step runs from
the end of the previous one (or the clock's creation) to the `advance()` call, timed with
`time.monotonic_ns()`. `schedule` names the kind of the step now running (`tracekit.step_schedule`,
e.g. FAE's "hot" or "cold"); it is written with the step's row and cleared when the step ends.

`install(writer, clock)` attaches `writer` to the clock and registers a global optimizer-step
post hook that calls `clock.advance()`, with the step's loss: the last one-element tensor that a
`backward()` started from during the step (read by the writer thread, so never a sync point).
The step's row also holds its last backward's times: called, its last gradient computed, returned.
The middle one is where DDP begins to wait for its bucket all-reduces (the replay's wait point of
the step's async calls, analyses/replay/): a pre-hook on the backward's root node queues an engine
callback, which runs when the graph is done and before DDP's own (queued at its last bucket). Loops without an optimizer (inference) call
`clock.advance()` themselves; do not do both, or each step is counted twice.

    clock = StepClock()
    handle = steps.install(writer, clock)
    ...                                   # train: each optimizer.step() ends a step
    handle.uninstall()

With several optimizers, only the first one seen to step (while it lives) advances the clock, so
a dense plus a sparse optimizer still count one step per iteration; an optimizer stepped inside
another's step (TorchRec's CombinedOptimizer) does not count, so the step ends when the outermost
one is done.
"""

from __future__ import annotations

import collections
import functools
import time
import weakref
from typing import Any, Protocol

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from collectors.device_counting import side_stream
from collectors.guard import Guard
from tracekit.store import RunWriter
from tracekit.phases import EVAL


class StepListener(Protocol):
    def on_step_end(self, step: int) -> None:
        """Called once per step, before the clock moves on; must not raise."""


class StepClock:
    """The process's current step, and who to tell when it ends.

    Parameters
    ----------
    writer
        Where `advance` writes `steps` rows; None writes nothing (set by `install`).
    """

    def __init__(self, writer: RunWriter | None = None) -> None:
        self.step = 0
        self.schedule: str | None = None  # the kind of the step now running, where the program named it
        self.samples: int | None = None  # the samples of the step now running on this rank, where named
        self.writer: RunWriter | None = None
        self.guard = Guard("steps")
        self._listeners: list[StepListener] = []
        self._t_start_ns = time.monotonic_ns()
        self._rows: collections.deque[tuple] = collections.deque()  # appended here, popped by the writer
        self._drained_by: set[int] = set()  # ids of the writers this clock is a source of
        self._in_flight = 0  # rows the last drain took: lost if the writer fails to take them
        self._loss_streams: dict[torch.device, torch.cuda.Stream] = {}  # DeviceLoss's side stream per device
        self.backward_ns: list[int | None] = [None, None, None]  # the step's last backward: called, grads done, returned
        self.attach(writer)

    def attach(self, writer: RunWriter | None) -> None:
        """Write later steps' rows to `writer` (None: write nothing)."""
        if writer is not None and id(writer) not in self._drained_by:
            writer.add_source(self.drain, in_flight=lambda: {"steps": self._in_flight})
            self._drained_by.add(id(writer))
        self.writer = writer

    def add_listener(self, listener: StepListener) -> None:
        if listener not in self._listeners:
            self._listeners.append(listener)

    def remove_listener(self, listener: StepListener) -> None:
        if listener in self._listeners:
            self._listeners.remove(listener)

    def advance(self, samples: int | None = None, loss: float | torch.Tensor | None = None) -> None:
        """End the current step. `samples` defaults to 0 (unknown), `loss` to null; a tensor loss is
        read by the writer thread, not here."""
        t_end_ns = time.monotonic_ns()
        if self.writer is not None:
            self.guard.run(self._keep, t_end_ns, samples, loss)
        for listener in list(self._listeners):
            listener.on_step_end(self.step)
        self.step += 1
        self.schedule = None
        self.samples = None
        self.backward_ns = [None, None, None]
        self._t_start_ns = t_end_ns

    def phase_after_close(self, step: int, phase: str) -> str:
        """The phase of a call booked to `step`, once the process is done: `eval` for the step after
        the last one, which no step end followed (collectors/phase.py), else `phase`."""
        return EVAL if self.step > 0 and step == self.step else phase

    def _keep(self, t_end_ns: int, samples: int | None, loss: float | torch.Tensor | None) -> None:
        if isinstance(loss, torch.Tensor):
            loss = DeviceLoss(loss.detach(), self._loss_streams) if loss.is_cuda else loss.detach()
        samples = self.samples if samples is None else samples
        self._rows.append((self.step, self._t_start_ns, t_end_ns, 0 if samples is None else int(samples), loss,
                           self.schedule, *self.backward_ns))

    def drain(self, final: bool) -> list[tuple[str, dict]]:
        """The `steps` rows kept since the last drain (called on the writer thread)."""
        rows = []
        while self._rows and (final or not isinstance(self._rows[0][4], DeviceLoss) or self._rows[0][4].done()):
            rows.append(self._rows.popleft())  # in step order: a loss still on its way holds back the steps after it
        self._in_flight = len(rows)
        if not rows:
            return []
        step, t_start_ns, t_end_ns, samples, loss, schedule, backward, grads, backward_end = zip(*rows)
        loss = [None if x is None else float(x) for x in loss]
        return [("steps", {"step": step, "t_start_ns": t_start_ns, "t_end_ns": t_end_ns, "samples": samples,
                           "loss": loss, "schedule": schedule, "t_backward_ns": backward, "t_grads_ns": grads,
                           "t_backward_end_ns": backward_end})]


class DeviceLoss:
    """A loss on a CUDA device, copied to pinned host memory on a low-priority side stream once the
    training stream has computed it: `done()` polls the copy, `float()` reads it (waiting only at close).
    The training thread neither waits for the device nor makes it wait."""

    def __init__(self, loss: torch.Tensor, streams: dict[torch.device, torch.cuda.Stream]) -> None:
        stream = streams.get(loss.device)
        if stream is None:
            stream = streams[loss.device] = side_stream(loss.device)
        stream.wait_stream(torch.cuda.current_stream(loss.device))
        loss.record_stream(stream)
        self.host = torch.empty(loss.shape, dtype=loss.dtype, pin_memory=True)
        with torch.cuda.stream(stream):
            self.host.copy_(loss, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record(stream)

    def done(self) -> bool:
        return self.event.query()

    def __float__(self) -> float:
        self.event.synchronize()
        return float(self.host)


class StepsHandle:
    """The installed steps collector; `uninstall()` removes the hook and detaches the writer."""

    def __init__(self, writer: RunWriter, clock: StepClock) -> None:
        self.clock = clock
        self._previous_writer = clock.writer
        self._optimizer: weakref.ref | None = None  # the optimizer whose steps count
        self.guard = Guard("steps")  # the hook's own: a failed write (clock.guard) keeps the clock going
        self._depth = 0  # optimizer steps running, one inside another
        self._hooks = [register_optimizer_step_pre_hook(self._on_step_start),
                       register_optimizer_step_post_hook(self._on_optimizer_step)]
        self._loss: torch.Tensor | None = None  # of the step now running
        self._backward = torch.Tensor.backward
        torch.Tensor.backward = self._seeing_loss(self._backward)
        clock.attach(writer)

    def uninstall(self) -> None:
        global _installed
        if not self._hooks:
            return
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        torch.Tensor.backward = self._backward
        self.clock.attach(self._previous_writer)
        if _installed is self:
            _installed = None

    def _seeing_loss(self, backward: Any) -> Any:
        @functools.wraps(backward)
        def traced_backward(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if tensor.numel() == 1:
                self._loss = tensor
            times = self.clock.backward_ns = [time.monotonic_ns(), None, None]
            hook = self.guard.run(self._mark_grads, tensor, times)
            try:
                return backward(tensor, *args, **kwargs)
            finally:
                times[2] = time.monotonic_ns()
                if hook is not None:
                    hook.remove()

        return traced_backward

    @staticmethod
    def _mark_grads(tensor: torch.Tensor, times: list) -> Any:
        """A pre-hook on the backward's root node that queues the engine callback noting `times[1]`."""
        node = tensor.grad_fn
        if node is None:
            return None

        def done() -> None:
            times[1] = time.monotonic_ns()

        def queue(grad_outputs: Any) -> None:
            try:
                torch.autograd.Variable._execution_engine.queue_callback(done)
            except Exception:  # never the traced program's failure: the step's row says null
                pass

        return node.register_prehook(queue)

    def _on_step_start(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self._depth += 1

    def _on_optimizer_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self._depth = max(0, self._depth - 1)
        if self._depth == 0:
            self.guard.run(self._count, optimizer)

    def _count(self, optimizer: torch.optim.Optimizer) -> None:
        first = self._optimizer() if self._optimizer is not None else None
        if first is None:
            self._optimizer, first = weakref.ref(optimizer), optimizer
        if optimizer is first:
            loss, self._loss = self._loss, None
            self.clock.advance(loss=loss)


# The optimizer hook is process-wide, so the record of it is too: one slot, set by install and
# cleared by uninstall, makes a second install a no-op.
_installed: StepsHandle | None = None


def install(writer: RunWriter, clock: StepClock) -> StepsHandle:
    """Advance `clock` on every optimizer step and write its `steps` rows to `writer`. A second
    call while installed returns the installed handle unchanged (its writer and clock stay)."""
    global _installed
    if _installed is None:
        _installed = StepsHandle(writer, clock)
    return _installed

"""Which phase a lookup or collective belongs to: the `phase` column (`train` | `eval`) of
`accesses`, `lookups` and `comms`.

Decided at the call, without help from the traced program, in this order:
1. `tracekit.phase(...)` where the program set one;
2. `eval` under `torch.inference_mode()`, or for a table module in `.eval()` mode;
3. `train` while gradients are on, or inside a backward pass (DDP's bucket all-reduce, the
   backward of an autograd Function);
4. gradients off: `eval` under `torch.no_grad()`, except inside the forward of an autograd
   Function (which always runs with gradients off) entered with gradients on: `train`. To tell
   the two apart, `install()` wraps `torch.autograd.Function.apply` to note the gradient mode it
   was called in.

Once the run ends, calls booked to the step after the last one (no optimizer step, or
`tracekit.step()`, followed them, so they trained nothing: an evaluation pass at the end) are
`eval` too; the embedding and comm collectors apply that when they drain at close.

    handle = phase.install()
    phase.of_call(module)   # "train" | "eval"
    handle.uninstall()
"""

from __future__ import annotations

import functools
from contextvars import ContextVar

import torch
from torch.autograd.function import Function

from tracekit.phases import EVAL, TRAIN, forced

# Gradient mode outside the outermost autograd Function now running forward; None outside any.
_grad_outside: ContextVar[bool | None] = ContextVar("tracekit_grad_outside", default=None)


_inference_mode = torch.is_inference_mode_enabled
_grad_enabled = torch.is_grad_enabled
_graph_task = torch._C._current_graph_task_id


def of_call(module: torch.nn.Module | None = None) -> str:
    """The phase of a lookup by `module` (None for a collective) made now. Runs on every lookup, so
    it reads torch's state through module-level names."""
    name = forced()
    if name is not None:
        return name
    if _inference_mode() or (module is not None and not module.training):
        return EVAL
    if _grad_enabled() or _graph_task() != -1:
        return TRAIN
    return TRAIN if _grad_outside.get() else EVAL


class PhaseHandle:
    """The installed `Function.apply` wrapper; `uninstall()` puts the original back."""

    def __init__(self) -> None:
        self._original = Function.__dict__["apply"]
        apply = self._original.__func__

        @functools.wraps(apply)
        def traced_apply(cls, *args, **kwargs):
            outside = _grad_outside.get()
            token = _grad_outside.set(torch.is_grad_enabled() if outside is None else outside)
            try:
                return apply(cls, *args, **kwargs)
            finally:
                _grad_outside.reset(token)

        Function.apply = classmethod(traced_apply)

    def uninstall(self) -> None:
        global _installed
        Function.apply = self._original
        _installed = None


_installed: PhaseHandle | None = None  # Function.apply is process-wide, so is the record of wrapping it


def install() -> PhaseHandle:
    """Wrap `torch.autograd.Function.apply`; a second call returns the installed handle."""
    global _installed
    if _installed is None:
        _installed = PhaseHandle()
    return _installed

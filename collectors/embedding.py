"""The embedding collector: which rows of which table each step reads.

`install(writer, clock)` hooks every `nn.Embedding` / `nn.EmbeddingBag` instance, those that exist
and those created later (a global parameter-registration hook sees each one's `weight` arrive),
while the recorded window (`record --steps/--every`) is open, through their class's `forward`, wrapped
then and torch's own outside it (a module whose class has a forward of its own gets a forward hook
instead): no other module pays, and outside the window a lookup costs nothing. Each call's module is
named as a table of the trace at its first call (collectors/table_identity.py), and its ids are kept
for the writer thread (collectors/staging.py), which turns them into
- `accesses`: exact counts per (step, table_name, row), one sort per table per flush; ids equal to
  the module's `padding_idx` are not lookups and are left out, weighted lookups
  (`per_sample_weights`) count like any other;
- `lookups`, on sampled steps (`step % lookup_every == 0`): every lookup with its `sample` and `pos`
  (collectors/lookups.py; padding ids keep their position slot but write no row).

Lookups that go through no `nn.Embedding`/`nn.EmbeddingBag` come in through the handle: another
source lists a table with `add_table(entry, ...)` and keeps each call with `record_call(table, ids,
offsets, phase)`, or a call of several tables with `record_tables` (split into each table's calls by
the writer, so the training thread does no per-table work); `name_table(module, name)` names a
module's table, and `expect_bags(module, offsets)` gives the bags of the next calls of a module whose
1-D input holds several sequences (collectors/torchrec_tables.py does all of it for TorchRec and
FBGEMM).

Every call carries its `phase`, `train` or `eval`, decided at the call (collectors/phase.py).

    clock = StepClock()
    steps_handle = steps.install(writer, clock)
    handle = embedding.install(writer, clock, lookup_every=10)
    ...
    handle.uninstall(); steps_handle.uninstall()
"""

from __future__ import annotations

import collections
import functools
import gc
import weakref
from typing import Any

import torch
from torch import nn
from torch.nn.modules import module as torch_module

from collectors import phase
from collectors.counting import Table
from collectors.guard import Guard
from collectors.lookups import lookup_ids
from collectors.names import ModuleNames
from collectors.staging import Staging
from collectors.steps import StepClock
from collectors.table_identity import TableIdentity
from tracekit.store import RunWriter
from tracekit.window import Window

EMBEDDINGS = (nn.Embedding, nn.EmbeddingBag)
MAX_PENDING_IDS = 64_000_000  # ids held for the writer (512 MB of int64) before calls are dropped (TRACEKIT_MAX_PENDING_IDS)


class EmbeddingHandle:
    """The installed embedding collector; `uninstall()` removes every hook it registered. The writer
    keeps draining its kept calls until closed, so calls made before uninstall are still written."""

    def __init__(self, writer: RunWriter, clock: StepClock, lookup_every: int, window: Window = Window(),
                 max_pending_ids: int = MAX_PENDING_IDS) -> None:
        self.writer = writer
        self.clock = clock
        self.lookup_every = lookup_every
        self.window = window  # the steps recorded (tracekit/window.py); the others cost one check per call
        self.guard = Guard("embedding")
        self.names = ModuleNames()
        self.identity = TableIdentity(self.names)  # which table each module is (collectors/table_identity.py)
        # the calls kept for the writer (collectors/staging.py); `_stage`, bound once, is the hot path's call
        self.staging = Staging(writer, clock, self.identity.table_list, max_pending_ids)
        self._stage = self.staging.stage
        self._tables: dict[int, tuple[weakref.ref, Table]] = {}  # id(module) -> (the module, its table)
        self._bags: weakref.WeakKeyDictionary[nn.Module, collections.deque] = weakref.WeakKeyDictionary()
        self._expecting_bags = False  # whether `expect_bags` was ever called: the hot path reads this, not `_bags`
        self._sampled = lookup_every > 0 and clock.step % lookup_every == 0  # the step now running writes lookups
        self._module_hooks: weakref.WeakKeyDictionary[nn.Module, Any] = weakref.WeakKeyDictionary()
        self._modules: weakref.WeakSet[nn.Module] = weakref.WeakSet()  # table modules whose class overrides forward
        self._forwards = {cls: (cls.forward, self._recording_forward(cls.forward)) for cls in EMBEDDINGS}
        self._hooked = False  # whether the table classes record (their forward wrapped, instance hooks on) now
        self._record_from(window.on(clock.step))
        clock.add_listener(self)
        self._hooks = [
            torch_module.register_module_module_registration_hook(self._on_register),
            torch_module.register_module_parameter_registration_hook(self._on_parameter),
        ]
        for obj in gc.get_objects():  # tables created before install
            if issubclass(type(obj), EMBEDDINGS):  # type(): isinstance would read __class__ properties
                self._hook(obj)
        writer.add_source(self.staging.drain, in_flight=self.staging.in_flight)

    @property
    def tables(self) -> list[dict]:
        """What the manifest lists of each table seen, in first-call order (collectors/table_identity.py)."""
        return self.identity.tables

    def uninstall(self) -> None:
        global _installed
        self._record_from(False)
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        self._modules = weakref.WeakSet()
        self.clock.remove_listener(self)
        if _installed is self:
            _installed = None

    def _on_register(self, parent: nn.Module, attr: str, child: nn.Module | None) -> None:
        self.guard.run(self.names.on_module, parent, attr, child)  # returns None: child unchanged

    def _on_parameter(self, module: nn.Module, name: str, param: Any) -> None:
        if isinstance(module, EMBEDDINGS) and module not in self._modules:
            self.guard.run(self._hook, module)  # returns None: the parameter is unchanged

    def _hook(self, module: nn.Module) -> None:
        """A table module whose class overrides `forward` gets a forward hook of its own (the wrapped
        class forward does not record it: it may never call it, or call it for something else)."""
        if type(module).forward not in {f for pair in self._forwards.values() for f in pair}:
            self._modules.add(module)
            if self._hooked:
                self._module_hooks[module] = module.register_forward_hook(self._on_forward, with_kwargs=True)

    def _recording_forward(self, original: Any) -> Any:
        """`nn.Embedding.forward` (or EmbeddingBag's) that records the call after it, for the modules
        whose class does not override it: the module keeps torch's hook-free call path."""
        @functools.wraps(original)
        def forward(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
            output = original(module, *args, **kwargs)
            if type(module).forward is forward:
                self._on_forward(module, args, kwargs, output)
            return output

        return forward

    def _record_from(self, on: bool) -> None:
        """Record lookups from now on (wrap the table classes' forward, hook the other table modules),
        or stop: outside the recorded window a lookup costs nothing."""
        if on == self._hooked:
            return
        self._hooked = on
        for cls, (original, recording) in self._forwards.items():
            cls.forward = recording if on else original
        if on:
            for module in list(self._modules):
                self._module_hooks[module] = module.register_forward_hook(self._on_forward, with_kwargs=True)
        else:
            for hook in self._module_hooks.values():
                hook.remove()
            self._module_hooks = weakref.WeakKeyDictionary()

    def on_step_end(self, step: int) -> None:
        """Copy the step's ids out of the program's tensors, start the next step's count of ids, and
        record the next step or not, as the window says."""
        try:
            self.staging.end_step()
        except Exception as e:  # a trace failure must never reach the traced program
            self.guard.fail(e)
        self._sampled = self.lookup_every > 0 and (step + 1) % self.lookup_every == 0
        self._record_from(self.window.on(step + 1))

    def _on_forward(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        """Keep one lookup call: the training thread's whole share of recording it. Every µs here is
        ~0.4% of a 6.6 ms step of 26 lookups, with the trainer's work evicting this code and its objects
        from the caches between calls, so it reads as few objects as it can (bench/RESULTS.md §35)."""
        if not self.guard.enabled:
            self._count_lost(module, args, kwargs)
            return
        try:
            known = self._tables.get(id(module))
            table = known[1] if known is not None and known[0]() is module else self._first_call(module)
            ids = args[0] if args else kwargs["input"]
            offsets = None
            sampled = self._sampled
            if sampled or self._expecting_bags:  # the offsets are read
                ids, offsets = lookup_ids(module, args, kwargs)
                if offsets is None and self._bags:
                    expected = self._bags.get(module)
                    offsets = expected.popleft() if expected else None
            self._stage(table, ids, offsets, phase.of_call(module), sampled)
        except Exception as e:  # a trace failure must never reach the traced program
            self.guard.fail(e)

    def _count_lost(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        """A call the collector, switched off by an error, no longer records: its ids are counted as lost."""
        self.guard.dropped += 1
        try:
            self.writer.count_dropped("accesses", args[0].numel() if args else kwargs["input"].numel())
        except Exception:  # nothing to count it by: the error that switched the collector off is named already
            pass

    def sampled(self) -> bool:
        """Whether the step now running writes its lookups (those need `record_call`'s offsets)."""
        return self._sampled

    def record_call(self, table: Table, ids: torch.Tensor, offsets: torch.Tensor | None, call_phase: str) -> None:
        """Keep one lookup call of `table` made now: `ids` are module rows (below `table.num_rows`),
        `offsets` (bags of a 1-D `ids`, or None) are read on sampled steps only. Copies both, so the
        caller may reuse them."""
        if self.window.on(self.clock.step):
            self._stage(table, ids, offsets, call_phase, self.sampled(), copy=True)

    def record_tables(self, tables: list[Table | None], cuts: list[int], ids: torch.Tensor, offsets: torch.Tensor,
                      bounds: list[int], call_phase: str) -> None:
        """Keep one call looking up several tables made now (`Staging.keep_tables`), if the window
        records this step."""
        if self.window.on(self.clock.step):
            self.staging.keep_tables(tables, cuts, ids, offsets, bounds, call_phase, self.sampled())

    def add_table(self, entry: dict, *, num_rows: int, first_row: int, padding_idx: int | None = None) -> Table:
        """Another source's table, listed in `tables` (`TableIdentity.add_table`)."""
        return self.identity.add_table(entry, num_rows=num_rows, first_row=first_row, padding_idx=padding_idx)

    def expect_bags(self, module: nn.Module, offsets: list[torch.Tensor]) -> None:
        """The bags of `module`'s next calls, one offsets tensor each, where a 1-D input holds several
        samples' sequences (a TorchRec EmbeddingCollection's feature): their lookups get `sample` and
        `pos` from them. Replaces what was expected before."""
        self._bags[module] = collections.deque(offsets)
        self._expecting_bags = True

    def name_table(self, module: nn.Module, name: str) -> None:
        """Name `module`'s table `name` at its first call (`TableIdentity.name_table`)."""
        self.identity.name_table(module, name)

    def _first_call(self, module: nn.Module) -> Table:
        table = self.identity.first_call(module)
        self._tables[id(module)] = (weakref.ref(module), table)
        return table


# The hooks are process-wide, so the record of them is too: one slot, set by install and cleared by
# uninstall, makes a second install a no-op.
_installed: EmbeddingHandle | None = None


def install(writer: RunWriter, clock: StepClock, *, lookup_every: int = 10,
            window: Window = Window(), max_pending_ids: int = MAX_PENDING_IDS) -> EmbeddingHandle:
    """Count every embedding lookup per (step, table, row) into `accesses`, and write the raw
    lookups of every `lookup_every`-th step (0: never) into `lookups`, on the steps of `window`. A
    second call while installed returns the installed handle unchanged."""
    global _installed
    if lookup_every < 0:
        raise ValueError(f"lookup_every must be >= 0 (0 writes no lookups), got {lookup_every}")
    if _installed is None:
        _installed = EmbeddingHandle(writer, clock, lookup_every, window, max_pending_ids)
    return _installed

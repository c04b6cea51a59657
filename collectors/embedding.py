"""The embedding collector: which rows of which table each step reads.

`install(writer, clock)` hooks every `nn.Embedding` / `nn.EmbeddingBag` instance, those that exist
and those created later (a global parameter-registration hook sees each one's `weight` arrive),
while the recorded window (`record --steps/--every`) is open, through their class's `forward`, wrapped
then and torch's own outside it (a module whose class has a forward of its own gets a forward hook
instead): no other module pays, and outside the window a lookup costs nothing. On the host it notes
the call and keeps a reference to its ids until the step ends, when one copy per step takes the
step's ids out of the program's tensors (collectors/host_staging.py: ids rewritten in place before
then are counted as lost, never written wrong). On a CUDA device the references are counted on a
side stream (collectors/device_staging.py). The writer thread takes the calls of finished steps in
bulk at every flush (`RunWriter.add_source`), counts them in pieces (collectors/counting.py) and
turns them into
- `accesses`: exact counts per (step, table_name, row), one sort per table per flush; ids equal to
  the module's `padding_idx` are not lookups and are left out, weighted lookups
  (`per_sample_weights`) count like any other;
- `lookups`, on sampled steps (`step % lookup_every == 0`): every lookup with its `sample` (bag
  index of an EmbeddingBag, row of a 2-D [B, L] input, dim-0 index of an N-D input, i for the
  i-th id of a 1-D nn.Embedding input) and `pos` (position in the bag or sequence; padding ids
  keep their position slot but write no row).

A table is named by its dotted path from the outermost module seen (`collectors.names`), e.g.
`tables.a` for `model.tables = nn.ModuleDict({"a": ...})`, fixed at the table's first call. A table
registered before install, or in no module, is named `f"{type(m).__name__}_{k}"`, k counting from 0
in first-call order.

Identity across ranks, from what the process sees at the table's first call: a module tagged with
`tracekit.shard` is a shard of the table it names (`placement` "sharded"); an untagged module
inside a DistributedDataParallel or FSDP model is a data-parallel replica, the same table on every
rank ("replicated"); any other untagged module is the process's own table ("local"), named
`<path>@rank<R>` in a world of more than one rank: model-parallel tables kept in a rank-local
`ModuleList` share paths (`emb_l.0`) but not contents, so they never merge.

A module tagged with `tracekit.shard(m, table=..., first_row=...)` is named by its `table`, and
`first_row` is added to each of its ids, so `row` is the table's global row in both trace tables.
At each module's first call, `handle.tables` gets an entry with what the manifest lists of it:
`table`, `first_row`, `num_rows` (this module's rows), `table_rows` (the whole table's), `dim`,
`dtype`, `kind` ("pooled" for an EmbeddingBag, "sequence" for an Embedding), `padding_idx`
(a global row, or None) and `placement` (above).

Lookups that go through no `nn.Embedding`/`nn.EmbeddingBag` come in through the handle: another
source lists a table with `add_table(entry, ...)` and keeps each call with `record_call(table, ids,
offsets, phase)`, or a call of several tables with `record_tables` (split into each table's calls by
the writer, so the training thread does no per-table work); `name_table(module, name)` names a
module's table, and `expect_bags(module, offsets)` gives the bags of the next calls of a module whose
1-D input holds several sequences (collectors/torchrec_tables.py does all of it for TorchRec and
FBGEMM).

Every call carries its `phase`, `train` or `eval`, decided at the call (collectors/phase.py).
A step's calls are written once the clock has moved past it, so each (step, phase, table, row) is
one row; calls after the last step (an evaluation pass) are written at close under the step the
clock shows then, as `eval`. A step holding more than the writer's `flush_rows` ids is counted as
it comes and written once it has ended (collectors/counting.py).

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
import os
import weakref
from dataclasses import dataclass
from typing import Any, Iterator

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules import module as torch_module

from collectors import phase
from collectors.counting import PHASES, PIECE_IDS, Kept, Table, carried, columns, count_rows
from collectors.device_staging import DeviceStaging
from collectors.host_staging import HostStaging, version_of
from collectors.guard import Guard
from collectors.names import ModuleNames
from collectors.steps import StepClock
from tracekit.phases import EVAL
from tracekit.shards import Shard, shard_of
from tracekit.store import RunWriter
from tracekit.window import Window

EMBEDDINGS = (nn.Embedding, nn.EmbeddingBag)
MAX_PENDING_IDS = 64_000_000  # ids held for the writer (512 MB of int64) before calls are dropped (TRACEKIT_MAX_PENDING_IDS)


@dataclass
class Call:
    """One lookup call, as kept for the writer thread."""

    step: int
    phase: str  # "train" | "eval" (collectors/phase.py)
    table: Table
    ids: torch.Tensor
    offsets: torch.Tensor | None  # only on sampled steps, for the lookups' positions
    sampled: bool
    feature: int = 0  # a TBE's feature of a table several look up: its order among them (TablesCall)


@dataclass
class TablesCall:
    """One call looking up several tables at once (a TBE's features), kept whole on the training thread
    and split into one `Call` per table by the writer: feature f looks up `tables[f]` (None: not
    recorded) with ids[cuts[f]:cuts[f + 1]] in the bags offsets[bounds[f]:bounds[f + 1] + 1] (the
    offsets are kept on sampled steps only, so a call with offsets is a sampled one)."""

    step: int
    phase: str
    tables: list[Table | None]
    cuts: list[int]
    ids: torch.Tensor
    offsets: torch.Tensor | None
    bounds: list[int]

    def split(self) -> list[Call]:
        calls = []
        for f, table in enumerate(self.tables):
            start, end = self.cuts[f], self.cuts[f + 1]
            if table is not None and end > start:
                bags = None
                if self.offsets is not None:
                    bags = self.offsets[self.bounds[f]:self.bounds[f + 1] + 1]
                    bags = bags - bags[:1]
                feature = sum(t is table for t in self.tables[:f])
                calls.append(Call(self.step, self.phase, table, self.ids[start:end], bags, bags is not None, feature))
        return calls


def lookup_ids(module: nn.Module, args: tuple, kwargs: dict) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The ids tensor of an Embedding/EmbeddingBag call, and its offsets (None if not given)."""
    ids = args[0] if args else kwargs["input"]
    offsets = None
    if isinstance(module, nn.EmbeddingBag):
        offsets = args[1] if len(args) > 1 else kwargs.get("offsets")
    return ids, offsets  # integer ids: no autograd history to leave behind


def positions(ids: torch.Tensor, offsets: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(sample, pos) of each id of `ids.reshape(-1)`, as int64 tensors on the ids' device."""
    n, device = ids.numel(), ids.device
    if ids.dim() == 1 and offsets is not None:  # bags: ids[offsets[b]:offsets[b + 1]] is bag b
        index = torch.arange(n, device=device)
        offsets = offsets.to(device=device, dtype=torch.int64)
        sample = torch.searchsorted(offsets, index, right=True) - 1
        return sample, index - offsets[sample]
    if ids.dim() <= 1:  # one id per sample
        return torch.arange(n, device=device), torch.zeros(n, dtype=torch.int64, device=device)
    batch = ids.shape[0]
    length = n // batch if batch else 0
    sample = torch.arange(batch, device=device).repeat_interleave(length)
    return sample, torch.arange(length, device=device).repeat(batch)


def lookup_rows(calls: list[Call]) -> tuple[np.ndarray, ...]:
    """(step, sample, pos, row, feature) of every non-padding lookup of one table's sampled calls."""
    if all(c.ids.dim() == 1 and c.offsets is not None and c.ids.device.type == "cpu" for c in calls):
        return _bag_rows(calls)
    parts = []
    for c in calls:
        sample, pos = positions(c.ids, c.offsets)
        rows = c.ids.reshape(-1).to(torch.int64)
        if c.table.padding_idx is not None:
            keep = rows != c.table.padding_idx
            sample, pos, rows = sample[keep], pos[keep], rows[keep]
        parts.append((np.full(rows.numel(), c.step, dtype=np.int64), *(t.cpu().numpy() for t in (sample, pos)),
                      rows.cpu().numpy() + c.table.first_row, np.full(rows.numel(), c.feature, dtype=np.int16)))
    return tuple(np.concatenate(column) for column in zip(*parts))


def _bag_rows(calls: list[Call]) -> tuple[np.ndarray, ...]:
    """`lookup_rows` of CPU bag calls (1-D ids, offsets from 0), in one pass over all of them: the
    writer holds the GIL for a few numpy calls rather than for a few torch calls per call."""
    rows = np.concatenate([c.ids.numpy() for c in calls]).astype(np.int64, copy=False)
    sizes = np.array([c.ids.numel() for c in calls], dtype=np.int64)
    bags = np.array([c.offsets.numel() for c in calls], dtype=np.int64)
    id_base, bag_base = np.cumsum(sizes) - sizes, np.cumsum(bags) - bags
    offsets = np.concatenate([c.offsets.numpy() for c in calls]).astype(np.int64) + np.repeat(id_base, bags)
    index = np.arange(len(rows), dtype=np.int64)
    bag = np.searchsorted(offsets, index, side="right") - 1  # later calls' bags start at or after their first id
    pos = index - offsets[bag]
    sample = bag - np.repeat(bag_base, sizes)
    step = np.repeat(np.array([c.step for c in calls], dtype=np.int64), sizes)
    feature = np.repeat(np.array([c.feature for c in calls], dtype=np.int16), sizes)
    table = calls[0].table
    if table.padding_idx is not None:
        keep = rows != table.padding_idx
        step, sample, pos, rows, feature = step[keep], sample[keep], pos[keep], rows[keep], feature[keep]
    return step, sample, pos, rows + table.first_row, feature


def _rank_and_world() -> tuple[int, int]:
    """This process's rank and world size: the default process group's, else torchrun's variables."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def table_entry(module: nn.Module, shard: Shard) -> dict:
    """What the manifest lists of a table module, described in the module docstring."""
    padding = module.padding_idx
    return {"table": shard.table, "first_row": int(shard.first_row), "num_rows": int(module.num_embeddings),
            "table_rows": int(shard.num_rows), "dim": int(module.embedding_dim),
            "dtype": str(module.weight.dtype).removeprefix("torch."),
            "kind": "pooled" if isinstance(module, nn.EmbeddingBag) else "sequence",
            "padding_idx": None if padding is None else int(shard.first_row + padding)}


def _by_table(calls: list[Call]) -> dict[tuple[Table, str], list[Call]]:
    """Calls grouped by (table, phase)."""
    groups: dict[tuple[Table, str], list[Call]] = {}
    for call in calls:
        groups.setdefault((call.table, call.phase), []).append(call)
    return groups


class EmbeddingHandle:
    """The installed embedding collector; `uninstall()` removes every hook it registered. The writer
    keeps draining it until closed, so calls made before uninstall are still written."""

    def __init__(self, writer: RunWriter, clock: StepClock, lookup_every: int, window: Window = Window(),
                 max_pending_ids: int = MAX_PENDING_IDS) -> None:
        self.writer = writer
        self.max_pending_ids = max_pending_ids  # held for the writer before a call's ids are shed
        self.clock = clock
        self.lookup_every = lookup_every
        self.window = window  # the steps recorded (tracekit/window.py); the others cost one check per call
        self.guard = Guard("embedding")
        self.names = ModuleNames()
        self.tables: list[dict] = []  # one entry per module seen, in first-call order (module docstring)
        self._tables: dict[int, tuple[weakref.ref, Table]] = {}  # id(module) -> (the module, its table)
        self._names: weakref.WeakKeyDictionary[nn.Module, str] = weakref.WeakKeyDictionary()  # name_table()
        self._bags: weakref.WeakKeyDictionary[nn.Module, collections.deque] = weakref.WeakKeyDictionary()
        self._expecting_bags = False  # whether `expect_bags` was ever called: the hot path reads this, not `_bags`
        self._sampled = lookup_every > 0 and clock.step % lookup_every == 0  # the step now running writes lookups
        self._module_hooks: weakref.WeakKeyDictionary[nn.Module, Any] = weakref.WeakKeyDictionary()
        self._table_list: list[Table] = []  # by Table.index
        self._host = HostStaging(self.writer.count_dropped)  # the calls on the host (collectors/host_staging.py)
        self._tables_calls: collections.deque[TablesCall] = collections.deque()  # appended here, popped by the writer
        self._woken = False  # the writer was woken for held ids and has not drained since
        self._ids_added = 0  # written by the training thread only
        self._step_ids = 0  # ids kept in the step now running (training thread)
        self._ids_drained = 0  # written by the writer thread only
        self._carry: Kept | None = None  # counts of a step still running when a drain took its calls
        self._taken: list[Kept] = []  # what the running drain has taken and not handed over (in_flight)
        self._sampled_taken: list[Call] = []
        self._staging: dict[torch.device, DeviceStaging] = {}  # calls on CUDA devices, by device
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
        writer.add_source(self.drain, in_flight=self.in_flight)

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
            self._host.spill()
        except Exception as e:  # a trace failure must never reach the traced program
            self.guard.fail(e)
        self._step_ids = 0
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

    def _stage(self, table: Table, ids: torch.Tensor, offsets: torch.Tensor | None, call_phase: str,
               sampled: bool, copy: bool = False) -> None:
        """Note the call and keep its ids (a copy if `copy`, or where the program rewrote its id buffer
        in place within a step) for the host's or the device's staging."""
        n = ids.numel()
        if self._ids_added - self._ids_drained + n > self.max_pending_ids:
            self.writer.count_dropped("accesses", n)
            return
        if ids.is_cpu or not ids.is_cuda:
            if not ids.is_cpu:
                ids = ids.cpu()
            layout = (ids.shape, offsets.clone() if copy and offsets is not None else offsets,
                      None if copy else version_of(offsets)) if sampled else None
            self._host.keep(self.clock.step, table.index, call_phase, ids, n, layout,
                            copy or table.index in self._host.copying)
        else:
            layout = (ids.shape, offsets, version_of(offsets)) if sampled else None
            self._device_staging(ids.device).keep(self.clock.step, table.index, call_phase, ids, layout)
        self._ids_added += n
        self._step_ids += n
        if not self._woken and self._ids_added - self._ids_drained > self.writer.flush_rows:
            self._wake()

    def _device_staging(self, device: torch.device) -> DeviceStaging:
        """The staging of `device`'s calls (collectors/device_staging.py), made at its first call."""
        staging = self._staging.get(device)
        if staging is None:
            staging = self._staging[device] = DeviceStaging(device, self.writer.count_dropped, self._sampled_call)
            self.clock.add_listener(staging)
        return staging

    def _sampled_call(self, step: int, call_phase: str, table: int, ids: torch.Tensor,
                      offsets: torch.Tensor | None) -> Call:
        return Call(step, call_phase, self._table_list[table], ids, offsets, True)

    def record_tables(self, tables: list[Table | None], cuts: list[int], ids: torch.Tensor, offsets: torch.Tensor,
                      bounds: list[int], call_phase: str) -> None:
        """Keep one call looking up several tables made now (a `TablesCall`; `ids` already a copy of the
        collector's own): the per-table work is left to the writer."""
        if not self.window.on(self.clock.step) or self._held_full(ids.numel()):
            return
        self._tables_calls.append(TablesCall(self.clock.step, call_phase, tables, cuts, ids,
                                             offsets.clone() if self.sampled() else None, bounds))
        self._ids_added += ids.numel()
        self._step_ids += ids.numel()
        if not self._woken and self._ids_added - self._ids_drained > self.writer.flush_rows:
            self._wake()

    def _wake(self) -> None:
        """Wake the writer, once more than `flush_rows` ids wait, and not again until it has drained:
        a wake on every call while it has not run yet (under SCHED_IDLE, on a busy core) would hand
        it the GIL and a lock call by call (bench/RESULTS.md §30)."""
        self._woken = True
        self.writer.wake()

    def _held_full(self, n: int) -> bool:
        """Whether keeping `n` more ids would hold more than `max_pending_ids` for the writer: they are
        then counted as dropped `accesses` (inline in `_stage`, the hot path)."""
        if self._ids_added - self._ids_drained + n > self.max_pending_ids:
            self.writer.count_dropped("accesses", n)
            return True
        return False

    def add_table(self, entry: dict, *, num_rows: int, first_row: int, padding_idx: int | None = None) -> Table:
        """List `entry` (the keys of `table_entry`, `placement`, and any more) in `tables`, and return
        the `Table` whose calls `record_call` keeps: `num_rows` module rows holding the table's rows
        from `first_row` on."""
        self.tables.append(entry)
        table = Table(entry["table"], num_rows, padding_idx, first_row, len(self._table_list))
        self._table_list.append(table)
        return table

    def expect_bags(self, module: nn.Module, offsets: list[torch.Tensor]) -> None:
        """The bags of `module`'s next calls, one offsets tensor each, where a 1-D input holds several
        samples' sequences (a TorchRec EmbeddingCollection's feature): their lookups get `sample` and
        `pos` from them. Replaces what was expected before."""
        self._bags[module] = collections.deque(offsets)
        self._expecting_bags = True

    def name_table(self, module: nn.Module, name: str) -> None:
        """Name `module`'s table `name` instead of its module path (a TorchRec table config's name);
        called before its first lookup. Placement and the `@rank<R>` suffix still apply."""
        self._names[module] = name

    def _first_call(self, module: nn.Module) -> Table:
        rows = int(module.num_embeddings)
        shard, placement = shard_of(module), "sharded"
        if shard is None:
            name = self._names.get(module) or self.names.module_name(module)
            placement = "replicated" if self.names.is_replicated(module) else "local"
            rank, world_size = _rank_and_world()
            if placement == "local" and world_size > 1:
                name = f"{name}@rank{rank}"
            shard = Shard(name, 0, rows)
        entry = {**table_entry(module, shard), "placement": placement}
        table = self.add_table(entry, num_rows=rows, first_row=shard.first_row, padding_idx=module.padding_idx)
        self._tables[id(module)] = (weakref.ref(module), table)
        return table

    def drain(self, final: bool) -> Iterator[tuple[str, dict[str, Any]]]:
        """The calls of steps the clock has left (all of them if `final`) as `accesses` and `lookups`
        columns. Where the running step holds more than `flush_rows` ids, its calls are taken too and
        counted, but their counts are carried to the next drain (`counting.carried`): no (step, table,
        row) is written in two rows. While it runs, `in_flight()` says what it has taken and not yet
        handed over, so a drain that fails counts those as lost."""
        everything = final or self._step_ids > self.writer.flush_rows  # a step larger than a flush
        self._woken = False
        current = self.clock.step  # read first: the calls of steps before it are final
        if final:  # the calls since the last step's end (the training thread spills them at each step's end)
            self._host.spill()
        kept, sampled = self._take_calls(everything, current)
        for call in self._take_tables_calls(everything, current):
            kept.append(Kept.of_calls([call]))
            if call.sampled:
                sampled.append(call)
        if self._carry is not None:
            kept.append(self._carry)
            self._carry = None
        self._taken, self._sampled_taken = list(kept), list(sampled)
        for staging in list(self._staging.values()):
            for kind, value in staging.drain(final, self._table_list, self.clock.phase_after_close):
                if kind == "taken":
                    self._ids_drained += value
                elif kind == "counted":
                    yield "accesses", value.columns()
                else:
                    sampled += value
        if final:  # the calls after the last step, which no step end followed, are `eval`
            for k in kept:
                k.phase[(k.step == self.clock.step) & (self.clock.step > 0)] = PHASES.index(EVAL)
            for call in sampled:
                call.phase = self.clock.phase_after_close(call.step, call.phase)
        if kept:
            yield from self._counted(Kept.joined(kept), None if final else current)
        self._taken = []
        groups = _by_table(sampled)
        if groups:
            found = [lookup_rows(group_calls) for group_calls in groups.values()]
            step, sample, pos, row, feature = (np.concatenate(column) for column in zip(*found))
            yield "lookups", columns(list(groups), [len(f[0]) for f in found], step=step,
                                     sample=sample.astype(np.int32), pos=pos.astype(np.int32), row=row,
                                     feature=feature)
        self._sampled_taken = []

    def _counted(self, whole: Kept, running: int | None) -> Iterator[tuple[str, dict[str, Any]]]:
        """`accesses` columns of `whole`'s calls in pieces; those of step `running` and later (None:
        none) counted and carried to the next drain instead."""
        self._taken = [whole]
        if running is not None:
            whole, later = whole.split_at(running)
            self._taken = [whole, later]
            if len(later.size):
                self._carry = carried(count_rows(later, self._table_list))
        pieces = list(whole.pieces(PIECE_IDS))
        for i, piece in enumerate(pieces):
            self._taken = pieces[i:]
            yield "accesses", count_rows(piece, self._table_list).columns()

    def in_flight(self) -> dict[str, int]:
        """Lookups (padding ids left out) the drain running now has taken and not handed over, per
        trace table: the writer counts them as lost if the drain fails."""
        padding = np.array([-1 if t.padding_idx is None else t.padding_idx for t in self._table_list], dtype=np.int64)
        on_devices = sum(staging.pending_lookups() for staging in self._staging.values())
        return {"accesses": on_devices + sum(k.lookups - k.padding_lookups(padding) for k in self._taken),
                "lookups": sum(c.ids.numel() if c.table.padding_idx is None else int((c.ids != c.table.padding_idx).sum())
                               for c in self._sampled_taken)}

    def _take_calls(self, everything: bool, current: int) -> tuple[list[Kept], list[Call]]:
        """The host's calls of the steps before `current` (all if `everything`) as one `Kept`, and the
        sampled ones as `Call`s (collectors/host_staging.py)."""
        kept, sampled = self._host.take(everything, current, self._sampled_call)
        if kept is None:
            return [], []
        self._ids_drained += int(kept.size.sum())
        return [kept], sampled

    def _take_tables_calls(self, everything: bool, current: int) -> list[Call]:
        calls = []
        while self._tables_calls and (everything or self._tables_calls[0].step < current):
            taken = self._tables_calls.popleft()
            self._ids_drained += taken.ids.numel()  # as added: features of no recorded table too
            calls += taken.split()
        return calls


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

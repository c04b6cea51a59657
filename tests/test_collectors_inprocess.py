"""Tests for the in-process collectors: the step clock and the embedding collector, writing through
a real RunWriter and read back with open_run."""

from __future__ import annotations

import inspect
import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

import tracekit
from tests.manifests import write_manifest
from collectors import counting, embedding, lookups, staging, steps
from collectors.bootstrap import is_launcher
from collectors.steps import StepClock
import tracekit.store
from tracekit.run import open_run
from tracekit.store import RunWriter

REPO = Path(__file__).resolve().parents[1]


def global_hook_counts() -> dict[str, int]:
    """How many global hooks torch holds, by kind. Reads private torch attributes (checked on torch
    2.13): the public API can register these hooks but not list them."""
    import torch.nn.modules.module as m
    import torch.optim.optimizer as o

    return {
        "optimizer_pre": len(o._global_optimizer_pre_hooks),
        "optimizer_post": len(o._global_optimizer_post_hooks),
        "forward": len(m._global_forward_hooks),
        "forward_pre": len(m._global_forward_pre_hooks),
        "module_registration": len(m._global_module_registration_hooks),
        "parameter_registration": len(m._global_parameter_registration_hooks),
    }


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tables = nn.ModuleDict({"a": nn.EmbeddingBag(100, 4, mode="sum"), "b": nn.Embedding(50, 4, padding_idx=0)})
        self.head = nn.Linear(8, 1)

    def forward(self, a_ids, a_offsets, a_weights, b_ids):
        pooled = self.tables["a"](a_ids, a_offsets, per_sample_weights=a_weights)
        return self.head(torch.cat([pooled, self.tables["b"](b_ids).sum(1)], dim=1))


def make_batches(steps: int, batch: int = 4, seed: int = 0) -> list[tuple]:
    g = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(steps):
        lengths = torch.randint(0, 5, (batch,), generator=g)  # includes empty bags
        offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)[:-1]])
        a_ids = torch.randint(0, 100, (int(lengths.sum()),), generator=g)
        b_ids = torch.randint(0, 8, (batch, 3), generator=g)  # 0 is the padding id
        batches.append((a_ids, offsets, torch.rand(a_ids.numel(), generator=g), b_ids))
    return batches


def train(model: nn.Module, batches: list[tuple]) -> list[torch.Tensor]:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    outputs = []
    for batch in batches:
        optimizer.zero_grad()
        out = model(*batch)
        out.pow(2).mean().backward()
        optimizer.step()
        outputs.append(out.detach().clone())
    return outputs


def expected_rows(batches: list[tuple], lookup_every: int) -> tuple[Counter, list[tuple]]:
    """accesses as Counter[(step, table, row)] and lookups as sorted (step, table, sample, pos, row),
    from the fed ids with plain Python."""
    counts: Counter = Counter()
    lookups = []
    for step, (a_ids, offsets, _, b_ids) in enumerate(batches):
        ends = offsets.tolist()[1:] + [a_ids.numel()]
        for bag, (start, end) in enumerate(zip(offsets.tolist(), ends)):
            for pos in range(end - start):
                row = int(a_ids[start + pos])
                counts[(step, "tables.a", row)] += 1
                lookups.append((step, "tables.a", bag, pos, row))
        for sample, seq in enumerate(b_ids.tolist()):
            for pos, row in enumerate(seq):
                if row != 0:
                    counts[(step, "tables.b", row)] += 1
                    lookups.append((step, "tables.b", sample, pos, row))
    return counts, sorted(x for x in lookups if x[0] % lookup_every == 0)


@pytest.fixture
def recording(tmp_path):
    """A writer, a clock and both collectors installed (lookup_every=2); uninstalled afterwards."""
    writer = RunWriter(tmp_path, rank=0)
    clock = StepClock()
    handles = [steps.install(writer, clock), embedding.install(writer, clock, lookup_every=2)]
    yield writer, clock, handles
    for handle in reversed(handles):
        handle.uninstall()
    writer.close()


def read(run_dir: Path, table: str) -> list[tuple]:
    """`table`'s rows, sorted, without rank and phase; `lookups` without `feature` too, after checking
    it is 0 (each table here is looked up by one feature), and without `src` and `src_sample`, after
    checking they are null (no call here declares its sources: tests/test_sources.py)."""
    write_manifest(run_dir, {"status": "completed"})
    frame = open_run(run_dir).scan(table).drop("rank", "phase", strict=False).collect()
    if table == "lookups":
        assert set(frame["feature"]) <= {0}, frame["feature"].unique()
        assert frame["src"].null_count() == frame["src_sample"].null_count() == len(frame)
        frame = frame.drop("feature", "src", "src_sample")
    return sorted(frame.rows())


def test_accesses_and_steps_match_the_fed_ids(recording, tmp_path):
    writer, clock, _ = recording
    batches = make_batches(5)
    outputs = train(Model(), batches)
    writer.close()
    counts, _ = expected_rows(batches, lookup_every=2)
    accesses = read(tmp_path, "accesses")
    assert Counter({(s, t, r): c for s, t, r, c in accesses}) == counts
    assert len(accesses) == len(counts)  # one row per (step, table, row)
    steps_rows = read(tmp_path, "steps")
    assert [row[0] for row in steps_rows] == [0, 1, 2, 3, 4]
    assert [row[4] for row in steps_rows] == [out.pow(2).mean().item() for out in outputs]  # the loss backward ran from
    assert clock.step == 5


def test_a_step_is_written_once_it_has_ended_and_lookups_after_the_last_step_at_close(recording, tmp_path):
    writer, clock, _ = recording
    model = Model()
    train(model, make_batches(1))
    a_ids, offsets, weights, b_ids = make_batches(1, seed=1)[0]
    with torch.no_grad():
        model(a_ids, offsets, weights, b_ids)  # an evaluation pass: no optimizer step ends it
        writer.flush()
        assert {row[0] for row in read(tmp_path, "accesses")} == {0}
        model(a_ids, offsets, weights, b_ids)
    writer.close()
    after = Counter()
    for step, table, row, count in read(tmp_path, "accesses"):
        if step == 1:
            after[(table, row)] += count
    assert after == Counter({("tables.a", r): 2 * n for r, n in Counter(a_ids.tolist()).items()}) + Counter(
        {("tables.b", r): 2 * n for r, n in Counter(b_ids.flatten().tolist()).items() if r != 0})


def test_calls_across_many_flushes_counted_in_small_pieces_are_written_exactly(tmp_path, monkeypatch):
    """The training thread keeps references to the calls' ids; the writer reads them in bulk at each
    flush and counts each flush in pieces. Every access and lookup is still the fed ids'."""
    monkeypatch.setattr(staging, "PIECE_IDS", 16)  # flushes counted in several pieces
    writer = RunWriter(tmp_path, rank=0, flush_interval_s=3600)
    clock = StepClock()
    handles = [steps.install(writer, clock), embedding.install(writer, clock, lookup_every=2)]
    try:
        batches = make_batches(12)
        model = Model()
        for i in range(0, 12, 3):
            train(model, batches[i:i + 3])
            writer.flush()
    finally:
        for handle in reversed(handles):
            handle.uninstall()
        writer.close()
    counts, lookups = expected_rows(batches, lookup_every=2)
    accesses = read(tmp_path, "accesses")
    assert Counter({(s, t, r): c for s, t, r, c in accesses}) == counts and len(accesses) == len(counts)
    assert read(tmp_path, "lookups") == lookups


def test_a_program_rewriting_its_id_buffer_between_steps_loses_nothing(tmp_path):
    """A program that copies each batch's ids into one buffer: the step's ids are copied out of it at
    the step's end, before the next batch overwrites them, so every step is exact."""
    writer = RunWriter(tmp_path, rank=0, flush_interval_s=3600)
    clock = StepClock()
    table = nn.EmbeddingBag(50, 2, mode="sum")
    handles = [steps.install(writer, clock), embedding.install(writer, clock, lookup_every=0)]
    optimizer = torch.optim.SGD(table.parameters(), lr=0.1)
    buffer, g, fed = torch.zeros(12, dtype=torch.int64), torch.Generator().manual_seed(3), Counter()
    try:
        for step in range(5):
            buffer.copy_(torch.randint(0, 50, (12,), generator=g))
            fed.update((step, int(r)) for r in buffer)
            optimizer.zero_grad()
            table(buffer, torch.arange(0, 12, 3)).sum().backward()
            optimizer.step()
    finally:
        for handle in reversed(handles):
            handle.uninstall()
        writer.close()
    recorded = Counter()
    for step, _, row, count in read(tmp_path, "accesses"):
        recorded[(step, row)] += count
    assert recorded == fed and writer.dropped["accesses"] == 0 and writer.lost_lookups == 0


def test_a_program_rewriting_its_id_buffer_within_a_step_loses_only_what_it_overwrote_and_says_so(tmp_path):
    """An inference loop (no gradients, steps ended by the loop) where one buffer feeds two tables in
    each step: the first table's ids are rewritten before the step ends (counted as lost, never written
    as the other table's), and from the next step on that table's ids are copied at the call, so every
    later step is exact."""
    writer = RunWriter(tmp_path, rank=0, flush_interval_s=3600)
    clock = StepClock(writer)
    handles = [embedding.install(writer, clock, lookup_every=0)]
    model = nn.ModuleDict({"a": nn.EmbeddingBag(50, 2, mode="sum"), "b": nn.EmbeddingBag(50, 2, mode="sum")})
    buffer, g, fed = torch.zeros(12, dtype=torch.int64), torch.Generator().manual_seed(3), Counter()
    try:
        with torch.no_grad():
            for step in range(5):
                for name in ("a", "b"):
                    buffer.copy_(torch.randint(0, 50, (12,), generator=g))
                    fed.update((step, name, int(r)) for r in buffer)
                    model[name](buffer, torch.arange(0, 12, 3))
                clock.advance()
    finally:
        handles[0].uninstall()
        writer.close()
    recorded = Counter({(step, name, row): count for step, name, row, count in read(tmp_path, "accesses")})
    assert recorded == Counter({k: n for k, n in fed.items() if k[:2] != (0, "a")})
    assert writer.dropped["accesses"] == 12 and writer.lost_lookups == 12


def test_lookups_are_written_on_sampled_steps_only(recording, tmp_path):
    writer, _, _ = recording
    batches = make_batches(5)
    train(Model(), batches)
    writer.close()
    _, lookups = expected_rows(batches, lookup_every=2)
    rows = read(tmp_path, "lookups")
    assert {row[0] for row in rows} == {0, 2, 4}
    assert rows == lookups


def test_an_optimizer_stepped_inside_another_counts_with_it(tmp_path):
    inner = [torch.optim.SGD([nn.Parameter(torch.ones(1))], lr=0.1) for _ in range(2)]

    class Combined(torch.optim.Optimizer):  # steps its inner optimizers, as TorchRec's CombinedOptimizer
        def __init__(self):
            super().__init__([nn.Parameter(torch.ones(1))], {})

        def step(self, closure=None):
            for optimizer in inner:
                optimizer.step()

    writer = RunWriter(tmp_path, rank=0)
    clock = StepClock()
    handle = steps.install(writer, clock)
    seen = [[], []]
    for i, optimizer in enumerate(inner):
        optimizer.register_step_post_hook(lambda *args, i=i: seen[i].append(clock.step))
    try:
        combined = Combined()
        for _ in range(3):
            combined.step()
    finally:
        handle.uninstall()
        writer.close()
    assert seen == [[0, 1, 2], [0, 1, 2]] and clock.step == 3


def test_second_install_is_a_no_op_and_uninstall_restores(tmp_path):
    before = global_hook_counts()
    writer = RunWriter(tmp_path, rank=0)
    clock = StepClock()
    step_handle = steps.install(writer, clock)
    embedding_handle = embedding.install(writer, clock)
    installed = global_hook_counts()
    assert steps.install(writer, clock) is step_handle
    assert embedding.install(writer, clock) is embedding_handle
    assert global_hook_counts() == installed != before

    train(Model(), make_batches(2))
    embedding_handle.uninstall()
    step_handle.uninstall()
    assert global_hook_counts() == before
    train(Model(), make_batches(3))  # after uninstall: nothing more is written
    writer.close()
    assert [row[0] for row in read(tmp_path, "steps")] == [0, 1]
    assert {row[0] for row in read(tmp_path, "accesses")} == {0, 1}
    assert clock.step == 2


def test_importing_the_collectors_registers_nothing():
    # in a fresh interpreter: this test module has imported the collectors already
    code = inspect.getsource(global_hook_counts) + (
        "import json, torch\n"
        "before = global_hook_counts()\n"
        "import collectors.steps, collectors.embedding, collectors.grads\n"
        "print(json.dumps([before, global_hook_counts()]))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    before, after = json.loads(r.stdout)
    assert before == after


def test_a_failing_hook_or_write_does_not_change_training(tmp_path, monkeypatch, capsys):
    batches = make_batches(5)
    torch.manual_seed(0)
    untraced = train(Model(), batches)

    def fail(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(embedding, "lookup_ids", fail)  # the hook fails at its first call
    monkeypatch.setattr(tracekit.store, "write_part", fail)  # and every write fails
    writer = RunWriter(tmp_path, rank=0)
    clock = StepClock()
    handles = [steps.install(writer, clock), embedding.install(writer, clock, lookup_every=1)]
    try:
        torch.manual_seed(0)
        traced = train(Model(), batches)
    finally:
        for handle in reversed(handles):
            handle.uninstall()
        writer.close()

    assert all(torch.equal(a, b) for a, b in zip(traced, untraced))
    assert clock.step == 5  # the clock keeps counting
    assert handles[1].guard.errors == 1 and not handles[1].guard.enabled and handles[1].guard.dropped > 0
    assert writer.errors == 1 and writer.dropped["steps"] == 5 and not writer.written
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 2 and all("OSError: disk full" in line for line in lines), lines


def test_positions_of_bags_and_sequences():
    # 1-D ids with offsets (include_last_offset style, with an empty bag 1)
    sample, pos = lookups.positions(torch.tensor([5, 6, 7, 8]), torch.tensor([0, 2, 2, 4]))
    assert sample.tolist() == [0, 0, 2, 2] and pos.tolist() == [0, 1, 0, 1]
    sample, pos = lookups.positions(torch.tensor([[1, 2, 3], [4, 5, 6]]), None)  # [B, L]
    assert sample.tolist() == [0, 0, 0, 1, 1, 1] and pos.tolist() == [0, 1, 2, 0, 1, 2]
    sample, pos = lookups.positions(torch.tensor([9, 9]), None)  # 1-D nn.Embedding input
    assert sample.tolist() == [0, 1] and pos.tolist() == [0, 0]


@pytest.mark.parametrize("padding", [None, 3])
def test_bag_lookups_of_many_calls_at_once_equal_each_calls_positions(padding):
    """The writer's one pass over a table's sampled bag calls (`_bag_rows`) gives every lookup the
    step, sample and pos that `positions` gives it call by call: empty bags (first, inner, last),
    include_last_offset's closing offset, an empty call, int32 ids, padding left out, global rows."""
    table = counting.Table("t", 20, padding, 1000)
    g = torch.Generator().manual_seed(5)
    shapes = [(7, [0, 0, 3, 3, 7]), (0, [0]), (5, [0, 2, 5, 5]), (6, [0, 1, 6]), (4, [0, 4])]
    calls = [lookups.Call(step, "train", table, torch.randint(0, 20, (n,), generator=g, dtype=dtype),
                            torch.tensor(offsets), True)
             for step, ((n, offsets), dtype) in enumerate(zip(shapes, [torch.int64, torch.int32] * 3))]
    expected = []
    for c in calls:
        sample, pos = lookups.positions(c.ids, c.offsets)
        expected += [(c.step, s, p, int(i) + 1000) for s, p, i in zip(sample.tolist(), pos.tolist(), c.ids.tolist())
                     if int(i) != padding]
    *got, feature = lookups.lookup_rows(calls)
    assert list(zip(*(column.tolist() for column in got))) == expected
    assert all(column.dtype == np.int64 for column in got)
    assert feature.dtype == np.int16 and not feature.any()  # one feature looks the table up


@pytest.mark.parametrize("num_rows", [50, 2**40], ids=["int32 keys", "int64 keys"])
def test_one_count_of_many_tables_equals_counting_each_id(num_rows):
    """count_rows sorts every table's keys together: each table's (step, row, count) must still be
    exactly its own ids counted, padding left out, shard rows made global, dtypes as the schema."""
    g = torch.Generator().manual_seed(3)
    tables = [counting.Table("a", num_rows, None, 0, 0), counting.Table("b", 7, 2, 100, 1),
              counting.Table("c", num_rows, 0, 10**12, 2)]
    groups = [[lookups.Call(step, "train", t, torch.randint(0, min(t.num_rows, 50), (n,), generator=g,
                                                              dtype=dtype), None, False)
               for step, n in [(4, 30), (4, 5), (6, 0), (9, 40)]]
              for t, dtype in zip(tables, [torch.int64, torch.int32, torch.int64])]
    interleaved = [call for calls in zip(*groups) for call in calls]  # as kept: in step order, tables mixed
    counted = counting.count_rows(counting.Kept.of_calls(interleaved), tables)
    assert counted.groups == [(t, "train") for t in tables]
    cuts = np.cumsum([0, *counted.sizes])
    for j, (table, calls) in enumerate(zip(tables, groups)):
        step, row, count = (column[cuts[j]:cuts[j + 1]] for column in (counted.step, counted.row, counted.count))
        expected = Counter((c.step, int(i) + table.first_row) for c in calls for i in c.ids
                           if int(i) != table.padding_idx)
        assert list(zip(step.tolist(), row.tolist())) == sorted(expected)
        assert count.tolist() == [expected[k] for k in sorted(expected)]
        assert (step.dtype, row.dtype, count.dtype) == (np.int64, np.int64, np.int32)


def test_a_flush_counted_in_pieces_equals_one_count():
    """The writer counts a large flush in pieces (Kept.pieces): together they are the one count of
    the whole, no (step, table, row) in two pieces, steps in order or not (tests/test_counting.py
    varies the layouts)."""
    g = torch.Generator().manual_seed(7)
    tables = [counting.Table("a", 30, None, 0, 0), counting.Table("b", 30, 5, 0, 1)]
    calls = [lookups.Call(step, "train", tables[t], torch.randint(0, 30, (n,), generator=g), None, False)
             for step in range(40) for t, n in ((0, 7), (1, 3), (0, 0), (1, 11))]
    kept = counting.Kept.of_calls(calls)

    def rows(counted):
        names = np.repeat([t.name for t, _ in counted.groups], counted.sizes)
        return list(zip(names.tolist(), counted.step.tolist(), counted.row.tolist(), counted.count.tolist()))

    pieces = list(kept.pieces(50))
    assert len(pieces) > 5 and sum(int(p.size.sum()) for p in pieces) == int(kept.size.sum())
    together = [row for piece in pieces for row in rows(counting.count_rows(piece, tables))]
    assert sorted(together) == sorted(rows(counting.count_rows(kept, tables)))
    assert len({r[:3] for r in together}) == len(together)
    shuffled = counting.Kept.of_calls(calls[4:] + calls[:4])  # step 0 after the others
    together = [row for piece in shuffled.pieces(50) for row in rows(counting.count_rows(piece, tables))]
    assert sorted(together) == sorted(rows(counting.count_rows(kept, tables)))


def test_tables_outside_a_model_get_a_fallback_name(tmp_path):
    early = nn.Embedding(10, 2)  # created before install: its parent is never seen
    writer = RunWriter(tmp_path, rank=0)
    clock = StepClock(writer)
    handle = embedding.install(writer, clock, lookup_every=0)
    try:
        late = nn.EmbeddingBag(10, 2)
        early(torch.tensor([1, 1]))
        late(torch.tensor([[3, 4]]))
        clock.advance()
    finally:
        handle.uninstall()
    writer.close()
    assert read(tmp_path, "accesses") == [(0, "EmbeddingBag_1", 3, 1), (0, "EmbeddingBag_1", 4, 1),
                                          (0, "Embedding_0", 1, 2)]


def test_a_tagged_shard_is_named_by_its_table_and_writes_global_rows(recording, tmp_path):
    writer, clock, handles = recording
    shard = tracekit.shard(nn.Embedding(10, 4, padding_idx=0), table="big", first_row=100, num_rows=300)
    plain = nn.EmbeddingBag(5, 2)
    shard(torch.tensor([[0, 3], [3, 9]]))  # local ids; 0 is padding
    plain(torch.tensor([[1, 1]]))
    clock.advance()  # step 0: lookups are sampled too
    writer.close()
    assert read(tmp_path, "accesses") == [(0, "EmbeddingBag_0", 1, 2), (0, "big", 103, 2), (0, "big", 109, 1)]
    assert read(tmp_path, "lookups") == [(0, "EmbeddingBag_0", 0, 0, 1), (0, "EmbeddingBag_0", 0, 1, 1),
                                         (0, "big", 0, 1, 103), (0, "big", 1, 0, 103), (0, "big", 1, 1, 109)]
    assert handles[1].tables == [
        {"table": "big", "first_row": 100, "num_rows": 10, "table_rows": 300, "dim": 4, "dtype": "float32",
         "kind": "sequence", "padding_idx": 100, "placement": "sharded"},
        {"table": "EmbeddingBag_0", "first_row": 0, "num_rows": 5, "table_rows": 5, "dim": 2, "dtype": "float32",
         "kind": "pooled", "padding_idx": None, "placement": "local"},
    ]


@pytest.mark.parametrize(("orig_argv", "launcher"), [
    (["python", "-m", "torch.distributed.run", "--standalone", "train.py"], True),
    (["python", "-u", "-m", "torch.distributed.launch", "train.py"], True),
    (["python", "/venv/bin/torchrun", "--nproc-per-node", "2", "train.py"], True),
    (["python", "train.py", "-m", "torch.distributed.run"], False),  # the script's own arguments
    (["python", "-m", "pytest"], False),
    (["python", "-c", "import torch"], False),
])
def test_the_torchrun_launcher_is_recognised_from_the_original_command_line(orig_argv, launcher):
    assert is_launcher(orig_argv) is launcher


def test_table_classes_record_only_inside_the_window(tmp_path):
    """Outside `record --steps` a lookup costs nothing: `nn.Embedding` and `nn.EmbeddingBag` get back
    their own forward at the window's last step, and the recording one at its next first."""
    from tracekit.window import Window

    originals = (nn.Embedding.forward, nn.EmbeddingBag.forward)
    writer = RunWriter(tmp_path, rank=0)
    clock = StepClock()
    model = Model()
    window = Window(first=1, every=4, keep=2)  # steps 1, 4, 5
    handles = [steps.install(writer, clock), embedding.install(writer, clock, lookup_every=0, window=window)]
    recording = []
    try:
        for batch in make_batches(8):
            recording.append(nn.Embedding.forward is not originals[0] and nn.EmbeddingBag.forward is not originals[1])
            train(model, [batch])
    finally:
        for handle in reversed(handles):
            handle.uninstall()
        writer.close()
    assert recording == [window.on(step) for step in range(8)] and sum(recording) == 3
    assert {row[0] for row in read(tmp_path, "accesses")} == {1, 4, 5}
    assert (nn.Embedding.forward, nn.EmbeddingBag.forward) == originals


class Scaled(nn.Embedding):
    """A table class with a forward of its own, which calls the base's."""

    def forward(self, ids):
        return super().forward(ids) * 2


def test_a_table_class_with_its_own_forward_is_recorded_once_per_call(tmp_path):
    writer = RunWriter(tmp_path, rank=0)
    clock = StepClock()
    handles = [steps.install(writer, clock), embedding.install(writer, clock, lookup_every=0)]
    table = Scaled(40, 2)
    optimizer = torch.optim.SGD(table.parameters(), lr=0.1)
    ids = [torch.tensor([1, 2, 2, 39]), torch.tensor([5, 5, 5])]
    try:
        for step_ids in ids:
            optimizer.zero_grad()
            table(step_ids).sum().backward()
            optimizer.step()
    finally:
        for handle in reversed(handles):
            handle.uninstall()
        writer.close()
    assert table._forward_hooks == {}  # removed with the collector
    assert read(tmp_path, "accesses") == [(0, "Scaled_0", 1, 1), (0, "Scaled_0", 2, 2), (0, "Scaled_0", 39, 1),
                                         (1, "Scaled_0", 5, 3)]

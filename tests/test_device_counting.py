"""Counting kept calls on the device (collectors/device_counting.py): the fixed-size compaction against
np.unique, and the keys, sort, compaction and decoding against `count_rows` over random call layouts
(padding ids, int32 and int64 keys, empty calls), on CPU tensors; on a CUDA device (marked gpu:
`pytest -m gpu`), the counter end to end against `count_rows` with no sync on the calling thread, a
busy training stream, a full ring refusing, and `copy_to_host`."""

from __future__ import annotations

import contextlib
import time
from typing import Iterator

import numpy as np
import pytest
import torch

from collectors.counting import Counted, Kept, Table, count_rows
from collectors.device_counting import (ALIGN, DeviceCounter, HostBuffer, build_keys, compact_sorted, decode,
                                        key_layout)

TABLES = [Table("a", 30, None, 0, 0), Table("b", 50, 3, 100, 1), Table("c", 7, 0, 0, 2),
          Table("wide", 3 << 28, 5, 1 << 40, 3)]  # a few steps of "wide" take the keys past 2**31


def random_kept(rng: np.random.Generator, tables: list[Table]) -> Kept:
    """Calls of random steps (in order or not, repeated), tables, phases and sizes (0 included), a
    share of ids their table's padding row."""
    n = int(rng.integers(0, 40))
    step = np.sort(rng.integers(0, 6, n)) if rng.random() < 0.5 else rng.integers(0, 6, n)
    table = rng.integers(0, len(tables), n)
    size = rng.integers(0, 30, n) * (rng.random(n) < 0.85)
    parts = []
    for t, s in zip(table, size):
        ids = rng.integers(0, min(tables[t].num_rows, 40), s)  # few distinct rows: repeats to count
        if tables[t].padding_idx is not None:
            ids[rng.random(s) < 0.3] = tables[t].padding_idx
        parts.append(ids)
    ids = np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, dtype=np.int64)
    return Kept(ids, step.astype(np.int64), table.astype(np.int64), rng.integers(0, 2, n).astype(np.int64),
                size.astype(np.int64))


def assert_same(got: Counted, want: Counted) -> None:
    assert [(t.index, p) for t, p in got.groups] == [(t.index, p) for t, p in want.groups]
    assert all(a is b for (a, _), (b, _) in zip(got.groups, want.groups))
    for field in ("sizes", "step", "row", "count"):
        a, b = getattr(got, field), getattr(want, field)
        assert a.dtype == b.dtype, field
        np.testing.assert_array_equal(a, b, err_msg=field)


def counted_on(ids: torch.Tensor, kept: Kept, tables: list[Table]) -> Counted:
    """The device path's keys, sort and compaction run on `ids`' device, `u` read back at once."""
    layout = key_layout(kept, tables)
    keys = build_keys(ids, torch.from_numpy(layout.meta).to(ids.device), layout)
    assert keys.dtype == layout.dtype and keys.shape == ids.shape
    unique, counts, u = compact_sorted(torch.sort(keys).values)
    n = int(u[0])
    return decode(layout, unique[:n].cpu().numpy(), counts[:n].cpu().numpy())


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("seed", range(40))
def test_compaction_of_sorted_keys_is_np_unique(seed, dtype):
    rng = np.random.default_rng(seed)
    n = [0, 1, 2, int(rng.integers(3, 2000))][seed % 4]
    high = [1, 3, n + 1, 2**31 - 1][seed // 4 % 4]  # all equal, few runs, all distinct likely, sparse
    keys = np.sort(rng.integers(0, high, n)).astype(np.int64)
    if dtype == torch.int64:
        keys += 1 << 40
    unique, counts, u = compact_sorted(torch.from_numpy(keys).to(dtype))
    assert unique.shape == (n,) and counts.shape == (n,) and u.shape == (1,)
    assert unique.dtype == dtype and counts.dtype == torch.int32 and u.dtype == torch.int64
    want_unique, want_counts = np.unique(keys, return_counts=True)
    assert int(u[0]) == len(want_unique)
    np.testing.assert_array_equal(unique[:len(want_unique)].numpy(), want_unique)
    np.testing.assert_array_equal(counts[:len(want_unique)].numpy(), want_counts)


@pytest.mark.parametrize("seed", range(200))
def test_device_keys_count_what_count_rows_counts(seed):
    rng = np.random.default_rng(seed)
    tables = TABLES if seed % 2 else TABLES[:3]  # int64 keys where "wide" is looked up, int32 otherwise
    kept = random_kept(rng, tables)
    want = count_rows(kept, tables)
    assert_same(counted_on(torch.from_numpy(kept.ids), kept, tables), want)


def test_keys_are_int32_where_count_rows_takes_int32_and_the_sentinel_fits():
    layout = key_layout(random_kept(np.random.default_rng(0), TABLES[:3]), TABLES[:3])
    assert layout.dtype == torch.int32
    for padding, dtype in ((None, torch.int32), (7, torch.int64)):  # keys up to 2**31 - 1; the sentinel is 2**31
        tables = [Table("t", 2**31, padding, 0, 0)]
        ids = np.array([0, 2**31 - 1, 7, 7, 2**31 - 1, 5], dtype=np.int64)
        kept = Kept(ids, *(np.array([v], dtype=np.int64) for v in (0, 0, 0, len(ids))))
        assert key_layout(kept, tables).dtype == dtype
        assert_same(counted_on(torch.from_numpy(ids), kept, tables), count_rows(kept, tables))


def test_calls_of_no_ids_and_only_padding_ids():
    no_calls = Kept(np.zeros(0, dtype=np.int64), *(np.zeros(0, dtype=np.int64) for _ in range(4)))
    assert_same(counted_on(torch.zeros(0, dtype=torch.int64), no_calls, TABLES), count_rows(no_calls, TABLES))
    empty = Kept(np.zeros(0, dtype=np.int64), *(np.array(v, dtype=np.int64) for v in ([2, 2], [0, 1], [0, 1], [0, 0])))
    assert_same(counted_on(torch.zeros(0, dtype=torch.int64), empty, TABLES), count_rows(empty, TABLES))
    padding = Kept(np.full(4, 3, dtype=np.int64), *(np.array([v], dtype=np.int64) for v in (1, 1, 0, 4)))
    got = counted_on(torch.from_numpy(padding.ids), padding, TABLES)
    assert_same(got, count_rows(padding, TABLES))
    assert got.sizes.tolist() == [0]


def test_host_buffer_cuts_aligned_views_and_grows():
    buffer = HostBuffer(pin=False)
    views = buffer.views([(torch.int64, (3, 5)), (torch.bool, (7,)), (torch.float32, ()), (torch.int32, (0,))])
    assert [tuple(v.shape) for v in views] == [(3, 5), (7,), (), (0,)]
    assert [v.dtype for v in views] == [torch.int64, torch.bool, torch.float32, torch.int32]
    start = buffer.bytes.data_ptr()
    assert all((v.data_ptr() - start) % ALIGN == 0 for v in views[:3])
    views[1].fill_(False)
    views[0].fill_(-1)
    assert not views[1].any()  # no overlap
    small = buffer.bytes.numel()
    (big,) = buffer.views([(torch.int64, (small,))])
    assert buffer.bytes.numel() >= 8 * small and big.numel() == small


def test_the_counter_counts_on_cuda_only():
    with pytest.raises(ValueError, match="count_rows"):
        DeviceCounter("cpu")


# On a CUDA device


def step_end() -> torch.cuda.Event:
    event = torch.cuda.Event()
    event.record()
    return event


@contextlib.contextmanager
def no_sync() -> Iterator[None]:
    """Any call inside that waits for the device raises."""
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(0)


def drained(counter: DeviceCounter, expected: int, timeout_s: float = 30.0) -> list[Counted]:
    """Poll `ready()` until `expected` results have come out."""
    out, end = [], time.monotonic() + timeout_s
    while len(out) < expected and time.monotonic() < end:
        out += counter.ready()
        time.sleep(0.001)
    return out


def one_call(rng: np.random.Generator, table: Table, step: int) -> Kept:
    ids = rng.integers(0, 20, int(rng.integers(1, 50))).astype(np.int64)
    return Kept(ids, *(np.array([v], dtype=np.int64) for v in (step, table.index, 0, len(ids))))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_counter_on_cuda_equals_count_rows_with_no_sync_on_the_calling_thread():
    rng = np.random.default_rng(7)
    counter = DeviceCounter("cuda", slots=3)
    chunk = torch.zeros(1 << 16, dtype=torch.int64, device="cuda")  # a staging chunk: the ids are views of it
    want, got = [], []
    for i in range(60):
        tables = TABLES if i % 2 else TABLES[:3]
        kept = random_kept(rng, tables)
        n = len(kept.ids)
        at = int(rng.integers(0, chunk.numel() - n))
        chunk[at:at + n].copy_(torch.from_numpy(kept.ids).pin_memory(), non_blocking=True)
        on_device = Kept(chunk[at:at + n], kept.step, kept.table, kept.phase, kept.size)
        end = step_end()
        with no_sync():
            submitted = counter.submit(on_device, tables, end)
            while submitted is None:  # ring full: poll until a slot frees
                got += counter.ready()
                submitted = counter.submit(on_device, tables, end)
            while not submitted.ids_free():  # the chunk is written again only once the side stream has read it
                got += counter.ready()
            got += counter.ready()
        want.append(count_rows(kept, tables))
    got += drained(counter, len(want) - len(got))
    assert len(got) == len(want) and counter.pending_lookups() == 0
    for g, w in zip(got, want):
        assert_same(g, w)
    assert counter.close() == []


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_busy_training_stream_is_not_waited_for_and_a_full_ring_refuses():
    rng = np.random.default_rng(3)
    counter = DeviceCounter("cuda", slots=2)
    kept = [one_call(rng, TABLES[1], 4), one_call(rng, TABLES[3], 5), one_call(rng, TABLES[0], 6)]
    on_device = [Kept(torch.from_numpy(k.ids).cuda(), k.step, k.table, k.phase, k.size) for k in kept]
    for k in on_device:  # warm: the side stream's memory and the slots' host buffers taken once
        assert counter.submit(k, TABLES, None) is not None and len(drained(counter, 1)) == 1
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # about a second of the training stream
    end = step_end()
    started = time.monotonic()
    with no_sync():
        first = counter.submit(on_device[0], TABLES, end)
        second = counter.submit(on_device[1], TABLES, end)
        assert first is not None and second is not None
        assert counter.submit(on_device[2], TABLES, end) is None
        assert counter.copy_to_host([on_device[2].ids], end) is None
        assert counter.ready() == [] and not first.ids_free()
    assert counter.pending_lookups() == int(kept[0].size.sum() + kept[1].size.sum())
    assert time.monotonic() - started < 0.5
    got = counter.close()
    assert len(got) == 2
    for g, k in zip(got, kept):
        assert_same(g, count_rows(k, TABLES))
    assert counter.submit(on_device[2], TABLES, None) is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_copy_to_host_brings_tensors_back_in_their_shapes():
    counter = DeviceCounter(torch.cuda.current_device(), slots=1)
    tensors = [torch.arange(12, device="cuda").reshape(3, 4), torch.tensor(2.5, device="cuda"),
               torch.arange(10, device="cuda", dtype=torch.int32)[::2], torch.zeros(0, 5, device="cuda")]
    end = step_end()
    with no_sync():
        copy = counter.copy_to_host(tensors, end)
        assert copy is not None and counter.copy_to_host(tensors, None) is None  # one slot, held
        deadline = time.monotonic() + 30
        while not copy.done() and time.monotonic() < deadline:
            time.sleep(0.001)
    arrays = copy.arrays()
    for a, t in zip(arrays, tensors):
        assert a.shape == tuple(t.shape) and a.dtype == t.cpu().numpy().dtype
        np.testing.assert_array_equal(a, t.cpu().numpy())
    again = counter.copy_to_host(tensors[:1], None)  # the slot is back
    assert again is not None
    counter.close()

"""Every collective the comm collector wraps, run for real on spawned gloo ranks, sync and async,
written through a real RunWriter and read back with open_run.

Each rank runs `plan(rank, asynchronous)`: every op of `comm.OPS` with known, deliberately uneven
sizes where gloo allows them, each call checking the data that arrived. The expected row of each
call (dtype, bytes, bytes per peer) is written next to it from the sizes fed, not from the
collector's code. Across ranks, the k-th call of a step on every rank is the same exchange (a
send on one rank pairs with the receive on the other), so for every pair of ranks (i, j) what i
says it sent to j must be what j says it received from i.

Gloo (torch 2.13, CPU) cannot run the list `all_to_all` or `all_gather` with uneven sizes: those
two are run with even sizes, and the uneven call is made too, asserting gloo's refusal (and that a
failed call writes no row). Everything else in OPS, `reduce_scatter` included, runs on gloo. The
Work of gloo's `isend`/`irecv` (complete only inside `wait()`) and async reduce-scatters has no
future, so their rows have t_end_ns -1; the async completion check uses an all-reduce.
"""

from __future__ import annotations

import itertools
import time
import warnings
from pathlib import Path
from typing import Any, Callable, NamedTuple

import pytest
import torch
import torch.distributed as dist

from tests.manifests import write_manifest
from collectors import comm
from collectors.steps import StepClock
from tests.multiprocess import run_ranks
from tracekit.run import open_run
from tracekit.store import RunWriter

W = 2
NO_SPLITS = ("all_reduce", "barrier")  # ops whose exchange per peer depends on the algorithm: splits []
_PAIRED = {"recv": "send", "irecv": "isend"}  # a receive is the other end of a send
# gloo's Work of these, when async, has no future (get_future: "Work::getFuture not implemented")
GLOO_NO_FUTURE = ("isend", "irecv", "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single")
HOLD_S = 0.5  # how long the late rank keeps an async all-reduce from completing
SLEW_NS = 1_000_000  # CLOCK_MONOTONIC may be slewed by NTP (at most 0.05 %): 1 ms over the hold


class Call(NamedTuple):
    """One call of a rank, with the row it must write."""

    op: str
    run: Callable[[], None]  # issues the call through torch.distributed and checks what arrived
    dtype: str
    bytes_out: int
    bytes_in: int
    splits_out: list[int]
    splits_in: list[int]


def _go(op: str, *args: Any, asynchronous: bool, **kwargs: Any) -> None:
    """Call torch.distributed.<op> as a program would (looked up now, so the wrapped one), waiting
    for an async call's Work."""
    fn = getattr(dist, op)
    if op in ("isend", "irecv"):
        fn(*args, **kwargs).wait()
    elif asynchronous:
        work = fn(*args, async_op=True, **kwargs)
        work.wait()
    else:
        fn(*args, **kwargs)


def _size(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()


def plan(rank: int, asynchronous: bool) -> list[Call]:
    """This rank's calls of one step on W=2 ranks: every op in OPS, sizes differing between the sync
    (v=0) and async (v=1) variants. Expected bytes are element counts times element sizes."""
    v = int(asynchronous)
    go = lambda op, *a, **k: _go(op, *a, asynchronous=asynchronous, **k)  # noqa: E731
    me, peers = rank, range(W)
    one_hot = lambda at, n: [n if j == at else 0 for j in peers]  # noqa: E731
    calls: list[Call] = []  # each closure binds its sizes (default arguments): they run after plan returns

    # all_to_all_single, uneven: rows[i][j] rows of 3 float32 from rank i to rank j (zeros included)
    rows = ([[1, 3], [2, 5]], [[0, 4], [1, 0]])[v]
    f32 = _size(torch.float32)

    def a2a_single(rows=rows) -> None:
        send = torch.cat([torch.full((rows[me][j], 3), 10.0 * me + j) for j in peers])
        recv = torch.empty(sum(rows[i][me] for i in peers), 3)
        go("all_to_all_single", recv, send, [rows[i][me] for i in peers], rows[me])
        assert torch.equal(recv, torch.cat([torch.full((rows[i][me], 3), 10.0 * i + me) for i in peers]))

    out, inn = [rows[me][j] * 3 * f32 for j in peers], [rows[i][me] * 3 * f32 for i in peers]
    calls.append(Call("all_to_all_single", a2a_single, "torch.float32", sum(out), sum(inn), out, inn))

    # all_to_all_single without split sizes: even halves of a 2-D int64 tensor
    n = (4, 2)[v]

    def a2a_even(n=n) -> None:
        send = torch.arange(n * 3, dtype=torch.int64).reshape(n, 3) + 100 * me
        recv = torch.empty(n, 3, dtype=torch.int64)
        go("all_to_all_single", recv, send)
        half = n // W
        assert torch.equal(recv, torch.cat([torch.arange(n * 3).reshape(n, 3)[me * half:(me + 1) * half] + 100 * i
                                            for i in peers]))

    each = n // W * 3 * 8
    calls.append(Call("all_to_all_single", a2a_even, "torch.int64", n * 3 * 8, n * 3 * 8, [each] * W, [each] * W))

    # all_to_all, list form: gloo wants every tensor the same size
    shape = ((2, 3), (1, 1))[v]

    def a2a_list(shape=shape) -> None:
        send = [torch.full(shape, 10.0 * me + j, dtype=torch.float64) for j in peers]
        recv = [torch.empty(shape, dtype=torch.float64) for _ in peers]
        go("all_to_all", recv, send)
        assert all(torch.equal(recv[i], torch.full(shape, 10.0 * i + me, dtype=torch.float64)) for i in peers)

    each = shape[0] * shape[1] * 8
    calls.append(Call("all_to_all", a2a_list, "torch.float64", each * W, each * W, [each] * W, [each] * W))

    # all_gather (list): my tensor to every rank, each rank's tensor to me
    shape = ((2, 5), (1, 3))[v]

    def all_gather(shape=shape) -> None:
        got = [torch.empty(shape, dtype=torch.int32) for _ in peers]
        go("all_gather", got, torch.full(shape, me + 1, dtype=torch.int32))
        assert all(torch.equal(got[i], torch.full(shape, i + 1, dtype=torch.int32)) for i in peers)

    each = shape[0] * shape[1] * 4
    calls.append(Call("all_gather", all_gather, "torch.int32", each, each * W, [each] * W, [each] * W))

    # all_gather_into_tensor (deprecated, calls all_gather_single) and all_gather_single
    for op, dtype, numel in (("all_gather_into_tensor", torch.float64, (3, 4)[v]),
                             ("all_gather_single", torch.float32, (4, 2)[v])):
        def gather_single(op=op, dtype=dtype, numel=numel) -> None:
            got = torch.empty(numel * W, dtype=dtype)
            go(op, got, torch.full((numel,), me + 1.0, dtype=dtype))
            assert torch.equal(got, torch.cat([torch.full((numel,), i + 1.0, dtype=dtype) for i in peers]))

        each = numel * _size(dtype)
        calls.append(Call(op, gather_single, str(dtype), each, each * W, [each] * W, [each] * W))

    # reduce_scatter (list), uneven: rank j's result has sizes[j] floats; my input_list[j] goes to j
    sizes = ([2, 3], [1, 4])[v]

    def reduce_scatter(sizes=sizes) -> None:
        got = torch.empty(sizes[me])
        go("reduce_scatter", got, [torch.full((sizes[j],), me + 1.0) for j in peers])
        assert torch.equal(got, torch.full((sizes[me],), float(sum(i + 1 for i in peers))))

    out = [sizes[j] * f32 for j in peers]
    calls.append(Call("reduce_scatter", reduce_scatter, "torch.float32", sum(out), sizes[me] * f32, out,
                      [sizes[me] * f32] * W))

    # reduce_scatter_tensor (deprecated, calls reduce_scatter_single) and reduce_scatter_single:
    # chunk j of my input goes to rank j
    for op, dtype, chunk in (("reduce_scatter_tensor", torch.float64, ((2, 3), (1, 2))[v]),
                             ("reduce_scatter_single", torch.int64, ((3,), (5,))[v])):
        def scatter_single(op=op, dtype=dtype, chunk=chunk) -> None:
            got = torch.empty(chunk, dtype=dtype)
            full = torch.cat([torch.full(chunk, 10 * j + me, dtype=dtype) for j in peers])
            go(op, got, full)
            assert torch.equal(got, torch.full(chunk, sum(10 * me + i for i in peers), dtype=dtype))

        each = torch.Size(chunk).numel() * _size(dtype)
        calls.append(Call(op, scatter_single, str(dtype), each * W, each, [each] * W, [each] * W))

    # broadcast: the root's tensor to every rank
    root, numel = (1, 0)[v], (5, 2)[v]

    def broadcast(root=root, numel=numel) -> None:
        t = torch.full((numel,), me + 7, dtype=torch.int64)
        go("broadcast", t, src=root)
        assert torch.equal(t, torch.full((numel,), root + 7, dtype=torch.int64))

    n = numel * 8
    calls.append(Call("broadcast", broadcast, "torch.int64", n, n, [n] * W if me == root else [0] * W,
                      one_hot(root, n)))

    # reduce: every rank's tensor to the root
    root, shape = (0, 1)[v], ((3, 2), (4,))[v]

    def reduce(root=root, shape=shape) -> None:
        t = torch.full(shape, me + 1.0, dtype=torch.float16)
        go("reduce", t, dst=root)
        if me == root:
            assert torch.equal(t, torch.full(shape, float(sum(i + 1 for i in peers)), dtype=torch.float16))

    n = torch.Size(shape).numel() * 2
    calls.append(Call("reduce", reduce, "torch.float16", n, n, one_hot(root, n), [n] * W if me == root else [0] * W))

    # all_reduce and barrier: no split per peer
    numel = (7, 1)[v]

    def all_reduce(numel=numel) -> None:
        t = torch.full((numel,), me + 1.0)
        go("all_reduce", t)
        assert torch.equal(t, torch.full((numel,), float(sum(i + 1 for i in peers))))

    calls.append(Call("all_reduce", all_reduce, "torch.float32", numel * f32, numel * f32, [], []))
    calls.append(Call("barrier", lambda: go("barrier"), "", 0, 0, [], []))

    # point to point, both ways: 0 -> 1 by global rank, then 1 -> 0 by group rank (group_dst/src)
    send_op, recv_op = ("send", "recv") if not asynchronous else ("isend", "irecv")
    for sender, dtype, numel, by_group in ((0, torch.int32, (4, 6)[v], False), (1, torch.float64, (3, 2)[v], True)):
        receiver = 1 - sender
        n = numel * _size(dtype)
        if me == sender:
            def send(dtype=dtype, numel=numel, receiver=receiver, by_group=by_group) -> None:
                t = torch.arange(numel, dtype=dtype) + 3
                go(send_op, t, **({"group_dst": receiver} if by_group else {"dst": receiver}))

            calls.append(Call(send_op, send, str(dtype), n, 0, one_hot(receiver, n), [0] * W))
        else:
            def recv(dtype=dtype, numel=numel, sender=sender, by_group=by_group) -> None:
                t = torch.zeros(numel, dtype=dtype)
                go(recv_op, t, **({"group_src": sender} if by_group else {"src": sender}))
                assert torch.equal(t, torch.arange(numel, dtype=dtype) + 3)

            calls.append(Call(recv_op, recv, str(dtype), 0, n, [0] * W, one_hot(sender, n)))
    return calls


def _uneven_list_calls(rank: int) -> dict[str, Callable[[], None]]:
    """The list-form calls gloo refuses: sizes differing between the tensors of one call."""
    def all_to_all() -> None:
        dist.all_to_all([torch.empty(i + 1) for i in range(W)], [torch.ones(j + 1) for j in range(W)])

    def all_gather() -> None:
        dist.all_gather([torch.empty(i + 2) for i in range(W)], torch.ones(rank + 2))

    return {"all_to_all": all_to_all, "all_gather": all_gather}


def _record_every_op(rank: int, world: int, run_dir: str) -> dict:
    """In a gloo rank: the collector installed, step 0 every op sync, step 1 every op async, then
    the uneven list calls gloo refuses (they must write nothing)."""
    warnings.filterwarnings("ignore", message=".*is deprecated", category=FutureWarning)
    writer = RunWriter(run_dir, rank)
    clock = StepClock()
    handle = comm.install(writer, clock)
    refused = {}
    try:
        for asynchronous in (False, True):
            for call in plan(rank, asynchronous):
                call.run()
            clock.advance()
        for op, attempt in _uneven_list_calls(rank).items():
            try:
                attempt()
                refused[op] = None
            except RuntimeError as e:
                refused[op] = str(e)
    finally:
        handle.uninstall()
        writer.close()
    return {"refused": refused, "guard": (handle.guard.errors, handle.guard.dropped),
            "writer": (writer.errors, dict(writer.dropped)), "world": dist.group.WORLD.group_name}


def _rows(run_dir: Path) -> dict[int, list[dict]]:
    """Each rank's comms rows in seq order."""
    write_manifest(run_dir, {"status": "completed"})
    rows = open_run(run_dir).scan("comms").sort("rank", "seq").collect().to_dicts()
    by_rank: dict[int, list[dict]] = {}
    for row in rows:
        by_rank.setdefault(int(row["rank"]), []).append(row)
    return by_rank


def _check_pairs(calls: tuple[dict, ...]) -> None:
    """Calls matched across ranks (the same exchange): what i sent to j is what j got from i."""
    for i, j in itertools.product(range(len(calls)), repeat=2):
        assert calls[i]["splits_out"][j] == calls[j]["splits_in"][i], (i, j, calls[i]["op"], calls[j]["op"])


@pytest.mark.slow
def test_every_wrapped_op_writes_what_each_rank_sent_and_received(tmp_path: Path) -> None:
    results = run_ranks(W, _record_every_op, str(tmp_path))
    for result in results:
        assert result["guard"] == (0, 0) and result["writer"] == (0, {})  # nothing switched off or lost
        # the ops gloo lacks, each with gloo's own reason: only their uneven form
        assert "ProcessGroupGloo::alltoall: invalid tensor size" in result["refused"]["all_to_all"]
        assert "ProcessGroupGloo::allgather: invalid tensor size" in result["refused"]["all_gather"]

    rows = _rows(tmp_path)
    assert sorted(rows) == list(range(W))
    run = list(enumerate((False, True)))  # (step, asynchronous)
    ran = {call.op for rank in range(W) for _, a in run for call in plan(rank, a)}
    assert ran == set(comm.OPS)  # every wrapped op ran
    for rank in range(W):
        expected = [(step, call.op, call.dtype, call.bytes_out, call.bytes_in, call.splits_out, call.splits_in,
                     asynchronous, results[rank]["world"], W, "train")
                    for step, asynchronous in run for call in plan(rank, asynchronous)]
        got = [(r["step"], r["op"], r["dtype"], r["bytes_out"], r["bytes_in"], r["splits_out"], r["splits_in"],
                r["async"], r["group"], r["group_size"], r["phase"]) for r in rows[rank]]
        assert got == expected, rank
        assert [r["seq"] for r in rows[rank]] == list(range(len(expected)))
        for r in rows[rank]:
            assert r["t_start_ns"] > 0
            if r["async"] and r["op"] in GLOO_NO_FUTURE:  # completion unknown: its Work has no future
                assert r["t_end_ns"] == -1, r
            else:  # completed, not before it started
                assert r["t_start_ns"] <= r["t_end_ns"], r

    for step, _ in run:
        per_rank = [[r for r in rows[rank] if r["step"] == step] for rank in range(W)]
        assert len({len(calls) for calls in per_rank}) == 1
        for calls in zip(*per_rank):  # the k-th call of the step on every rank: one exchange
            assert len({_PAIRED.get(c["op"], c["op"]) for c in calls}) == 1
            if calls[0]["op"] in NO_SPLITS:
                assert all(c["splits_out"] == c["splits_in"] == [] for c in calls)
            else:
                assert all(len(c["splits_out"]) == len(c["splits_in"]) == W for c in calls)
                _check_pairs(calls)


def _hold_async_all_reduce(rank: int, world: int, run_dir: str) -> int | None:
    """Rank 0 issues an async all_reduce and notes when the call returned; rank 1 joins it HOLD_S
    after that return (a file rank 0 writes once its call returned). Returns rank 0's return time."""
    writer = RunWriter(run_dir, rank)
    handle = comm.install(writer, StepClock())
    returned_file = Path(run_dir) / "returned"
    returned = None
    try:
        t = torch.ones(3)
        if rank == 0:
            work = dist.all_reduce(t, async_op=True)
            returned = time.monotonic_ns()
            returned_file.write_text("returned")
            work.wait()
        else:
            deadline = time.monotonic() + 60
            while not returned_file.exists() and time.monotonic() < deadline:
                time.sleep(0.001)
            seen = returned_file.exists()
            time.sleep(HOLD_S)
            dist.all_reduce(t)  # joined even if rank 0's call never returned, so that rank 0 is not left waiting
            assert seen, "rank 0's async all_reduce did not return before rank 1 joined it"
        assert torch.equal(t, torch.full((3,), 2.0))
    finally:
        handle.uninstall()
        writer.close()
    return returned


@pytest.mark.slow
def test_an_async_call_ends_at_its_completion_not_at_its_return(tmp_path: Path) -> None:
    returned, _ = run_ranks(W, _hold_async_all_reduce, str(tmp_path))
    rows = _rows(tmp_path)
    [held], [late] = rows[0], rows[1]
    assert (held["op"], held["async"], late["op"], late["async"]) == ("all_reduce", True, "all_reduce", False)
    # rank 1 joined at least HOLD_S after rank 0's call returned, and the all-reduce cannot complete
    # before both joined: the recorded completion is that much after the measured return
    assert held["t_start_ns"] <= returned
    assert held["t_end_ns"] >= returned + int(HOLD_S * 1e9) - SLEW_NS
    assert held["t_end_ns"] - held["t_start_ns"] >= int(HOLD_S * 1e9) - SLEW_NS
    # rank 0 waited on the Work after its call returned and before the all-reduce could complete; rank 1's
    # synchronous call has no wait of its own
    assert returned <= held["t_wait_ns"] <= held["t_end_ns"]
    assert late["t_wait_ns"] is None


def _in_a_subgroup(rank: int, world: int, run_dir: str) -> str | None:
    """On 3 ranks, ranks 1 and 2 (group ranks 0 and 1 of `group`) exchange by global rank."""
    group = dist.new_group([1, 2])
    if rank == 0:
        return None
    writer = RunWriter(run_dir, rank)
    handle = comm.install(writer, StepClock())
    try:
        t = torch.full((3,), float(rank), dtype=torch.float64)
        dist.broadcast(t, src=2, group=group)
        assert torch.equal(t, torch.full((3,), 2.0, dtype=torch.float64))
        t = torch.full((2,), float(rank))
        dist.reduce(t, dst=2, group=group, async_op=True).wait()
        if rank == 2:
            assert torch.equal(t, torch.full((2,), 3.0))
        t = torch.arange(5, dtype=torch.int32)
        if rank == 1:
            dist.send(t, dst=2, group=group)
        else:
            dist.recv(t, src=1, group=group)
        rows = [[1, 2], [3, 0]]  # rows[i][j]: group rank i to group rank j, 1 float32 each
        me = rank - 1
        recv = torch.empty(sum(rows[i][me] for i in range(2)), 1)
        dist.all_to_all_single(recv, torch.full((sum(rows[me]), 1), float(me)), [rows[i][me] for i in range(2)],
                               rows[me], group=group)
        assert recv.flatten().tolist() == [float(i) for i in range(2) for _ in range(rows[i][me])]
    finally:
        handle.uninstall()
        writer.close()
    return group.group_name


@pytest.mark.slow
def test_peers_are_group_ranks_in_a_subgroup(tmp_path: Path) -> None:
    _, name, _ = run_ranks(3, _in_a_subgroup, str(tmp_path))
    rows = _rows(tmp_path)
    assert sorted(rows) == [1, 2]  # rank 0 made no call
    got = {rank: [(r["op"], r["group"], r["group_size"], r["splits_out"], r["splits_in"]) for r in rows[rank]]
           for rank in (1, 2)}
    assert got[1] == [("broadcast", name, 2, [0, 0], [0, 24]), ("reduce", name, 2, [0, 8], [0, 0]),
                      ("send", name, 2, [0, 20], [0, 0]), ("all_to_all_single", name, 2, [4, 8], [4, 12])]
    assert got[2] == [("broadcast", name, 2, [24, 24], [0, 24]), ("reduce", name, 2, [0, 8], [8, 8]),
                      ("recv", name, 2, [0, 0], [20, 0]), ("all_to_all_single", name, 2, [12, 0], [8, 0])]
    for calls in zip(rows[1], rows[2]):
        _check_pairs(calls)

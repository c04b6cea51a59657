"""Tests for the grads collector: every column of `grads` against statistics computed independently
(numpy, torch.quantile) from the gradients fed, written through a real RunWriter and read back; and
its DCT-DP replay (collectors/dct_replay.py) against the hook's rule written out step by step (that
it takes each rank's own gradient, before DDP's all-reduce, is tests/test_dct_dp.py's)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

from tests.manifests import write_manifest
from collectors import dct_replay, grads, steps
from collectors.steps import StepClock
from tests.test_collectors_inprocess import global_hook_counts, read
from tracekit.schema import GRAD_QUANTILES, KEEP_RATIOS
from tracekit.run import open_run
from tracekit.store import RunWriter, to_batch


def make_model() -> nn.Sequential:
    """Parameters 0.weight (200), 0.bias (40), 2.0.weight (1200), 2.0.bias (30)."""
    return nn.Sequential(nn.Linear(5, 40), nn.ReLU(), nn.Sequential(nn.Linear(40, 30)))


def feed(model: nn.Module, step: int, gen: torch.Generator, *, skip: tuple[str, ...] = ()) -> dict[str, torch.Tensor]:
    """Set gradients k * (step + 1) / 64 (random integers |k| <= 1000) on every parameter but those in
    `skip`, which get none. Dyadic values keep every statistic exact in float64; the growing scale
    makes a stale threshold visible. Returns the gradients set, by qualified name."""
    fed = {}
    for name, param in model.named_parameters():
        if name in skip:
            param.grad = None
            continue
        k = torch.randint(-1000, 1001, param.shape, generator=gen).float()
        param.grad = k.to(param.device) * (step + 1) / 64
        fed[name] = param.grad.cpu()
    return fed


def expected_rows(fed: list[tuple[int, str, torch.Tensor]], refresh_every: int) -> list[tuple]:
    """`grads` rows, in schema column order, for the (step, name, gradient) written in that order.
    A threshold is computed at a tensor's first row and replaced at its first row `refresh_every`
    or more steps later."""
    rows, in_force = [], {}
    for step, name, grad in fed:
        a = grad.double().abs().flatten()
        if name not in in_force or step - in_force[name][0] >= refresh_every:
            in_force[name] = (step, [torch.quantile(a, 1 - keep).item() for keep in KEEP_RATIOS.values()])
        thresholds = in_force[name][1]
        x = a.numpy()
        rows.append((step, name, x.size, float(np.sqrt(np.sum(x * x))), float(x.max()),
                     *[torch.quantile(a, q).item() for q in GRAD_QUANTILES.values()],
                     *[int(np.sum(x > t)) for t in thresholds], *thresholds))
    return sorted(rows)


@pytest.fixture
def clock_and_writer(tmp_path):
    """A writer and a clock advanced by every optimizer step; the steps collector uninstalled after."""
    writer = RunWriter(tmp_path, rank=0)
    clock = StepClock()
    handle = steps.install(writer, clock)
    yield clock, writer
    handle.uninstall()
    writer.close()


@pytest.fixture
def installed():
    """Uninstalls whatever grads handle the test installed."""
    yield
    if grads._installed is not None:
        grads._installed.uninstall()


@pytest.mark.parametrize("batch_elements", [grads.BATCH_ELEMENTS, 300])  # 300: a sort per tensor
def test_sampled_steps_match_independent_statistics(clock_and_writer, installed, tmp_path, monkeypatch,
                                                    batch_elements):
    monkeypatch.setattr(grads, "BATCH_ELEMENTS", batch_elements)
    clock, writer = clock_and_writer
    grads.install(writer, clock, grad_every=2, refresh_every=4)
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(0)
    fed = []
    for step in range(7):
        fed += [(step, name, g) for name, g in feed(model, step, gen, skip=("0.bias",)).items()]
        optimizer.step()
    writer.close()

    rows = read(tmp_path, "grads")
    assert rows == expected_rows([f for f in fed if f[0] % 2 == 0], refresh_every=4)
    assert {r[0] for r in rows} == {0, 2, 4, 6}  # sampled steps only
    assert {r[1] for r in rows} == {"0.weight", "2.0.weight", "2.0.bias"}  # 0.bias has no gradient
    # thresholds: computed at step 0, stale at 2, refreshed at 4 (4 - 0 >= refresh_every), stale at 6
    thr = {r[0]: r[-3:] for r in rows if r[1] == "2.0.weight"}
    assert thr[0] == thr[2] != thr[4] == thr[6]
    counts = {r[0]: r[-6:-3] for r in rows if r[1] == "2.0.weight"}
    assert counts[2] > counts[0]  # gradients grew: more of them exceed the stale threshold


def test_counts_compare_with_the_float64_threshold(clock_and_writer, installed, tmp_path):
    clock, writer = clock_and_writer
    grads.install(writer, clock, grad_every=1)
    model = nn.Linear(1112, 1, bias=False)
    # |g| sorted: 999 x 0.5, 1.0, 112 x the next float32 after 1.0. The 0.9 quantile (rank 999.9)
    # lies 0.9 of the way between 1.0 and the next float32: it rounds to that float32, above it.
    above_one = float(np.nextafter(np.float32(1), np.float32(2)))
    model.weight.grad = -torch.tensor([[0.5] * 999 + [1.0] + [above_one] * 112])
    fed = [(0, "weight", model.weight.grad.clone())]
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    writer.close()
    (row,), (expected,) = read(tmp_path, "grads"), expected_rows(fed, refresh_every=1)
    assert row[3] == pytest.approx(expected[3], rel=1e-15)  # l2: these squares are not exact in float64
    assert row[:3] + row[4:] == expected[:3] + expected[4:]
    assert row[-4] == 112  # count_above_keep_10pct: all elements above the float64 threshold


def test_no_grads_are_written_when_grad_every_is_0(clock_and_writer, installed, tmp_path):
    clock, writer = clock_and_writer
    handle = grads.install(writer, clock, grad_every=0)
    train(make_model(), None)  # the installed steps collector advances the clock
    writer.close()
    assert clock.step == 3 and handle.guard.errors == 0
    assert not (tmp_path / "grads").exists()


def test_each_optimizer_is_covered_in_the_step_it_runs_in(clock_and_writer, installed, tmp_path):
    clock, writer = clock_and_writer
    grads.install(writer, clock, grad_every=2)
    model = make_model()
    table = nn.Embedding(10, 3, sparse=True)
    first = torch.optim.SGD(model[0].parameters(), lr=0.1)  # the first to step: it advances the clock
    second = torch.optim.SGD([*model[2].parameters(), table.weight], lr=0.1)
    gen = torch.Generator().manual_seed(0)
    fed = []
    for iteration in range(5):
        grads_fed = feed(model, iteration, gen)
        table.weight.grad = torch.sparse_coo_tensor(torch.tensor([[1, 4]]), torch.ones(2, 3), (10, 3),
                                                    check_invariants=True)  # not dense: skipped
        first.step()
        # `second` steps after the clock moved on: its gradients of iteration i are in step i + 1
        fed += [(iteration + name.startswith("2."), name, g) for name, g in grads_fed.items()]
        second.step()
    writer.close()
    sampled = sorted((f for f in fed if f[0] % 2 == 0), key=lambda f: f[0])
    assert read(tmp_path, "grads") == expected_rows(sampled, refresh_every=grads.REFRESH_EVERY)


def test_a_parameter_is_written_once_per_step(clock_and_writer, installed, tmp_path):
    clock, writer = clock_and_writer
    grads.install(writer, clock, grad_every=1)
    model = make_model()
    inner = torch.optim.SGD(model[0].parameters(), lr=0.1)  # the first to step: it advances the clock
    whole = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(0)
    fed = [(0, name, g) for name, g in feed(model, 0, gen).items() if name.startswith("0.")]
    inner.step()  # step 0 ends
    fed += [(1, name, g) for name, g in feed(model, 1, gen).items()]
    whole.step()
    inner.step()  # its parameters are written already: step 1 ends with one row for each parameter
    writer.close()
    assert read(tmp_path, "grads") == expected_rows(fed, refresh_every=grads.REFRESH_EVERY)


def test_parameters_registered_before_install_get_fallback_names(clock_and_writer, installed, tmp_path):
    early = nn.Linear(2, 2)
    clock, writer = clock_and_writer
    grads.install(writer, clock, grad_every=1)
    late = nn.Linear(2, 2)
    optimizer = torch.optim.SGD([late.weight, early.weight, early.bias, late.bias], lr=0.1)
    for param in optimizer.param_groups[0]["params"]:
        param.grad = torch.ones_like(param)
    optimizer.step()
    writer.close()
    assert [r[1] for r in read(tmp_path, "grads")] == ["bias", "param_0", "param_1", "weight"]


def test_second_install_is_a_no_op_and_uninstall_restores(tmp_path):
    before = global_hook_counts()
    writer = RunWriter(tmp_path, rank=0)
    clock = StepClock(writer)
    handle = grads.install(writer, clock)
    installed = global_hook_counts()
    assert grads.install(writer, clock) is handle
    assert installed != before
    handle.uninstall()
    assert global_hook_counts() == before
    model = make_model()
    feed(model, 0, torch.Generator().manual_seed(0))
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    clock.advance()
    writer.close()
    assert not (tmp_path / "grads").exists()


def train(model: nn.Module, clock: StepClock | None) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        feed(model, step, gen)
        optimizer.step()
        if clock is not None:
            clock.advance()
    return [p.detach().clone() for p in model.parameters()]


def test_a_failing_hook_does_not_change_training(installed, monkeypatch, capsys):
    def fail(*args):
        raise OSError("disk full")

    torch.manual_seed(0)
    untraced = train(make_model(), None)
    clock = StepClock()
    monkeypatch.setattr(grads, "batches", fail)
    handle = grads.install(Rows(), clock, grad_every=1)
    torch.manual_seed(0)
    traced = train(make_model(), clock)
    assert all(torch.equal(a, b) for a, b in zip(traced, untraced))
    assert handle.guard.errors == 1 and not handle.guard.enabled and handle.guard.dropped > 0
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "OSError: disk full" in lines[0], lines


class Rows:
    """A writer that keeps the rows appended to it, checked against their table's schema, in memory."""

    def __init__(self) -> None:
        self._rows: list[dict] = []
        self._sources = []

    def add_source(self, drain, in_flight=None):
        self._sources.append(drain)

    @property
    def rows(self) -> list[dict]:
        """Every row so far, with its table's name in `table`."""
        for drain in self._sources:
            for table, columns in drain(False):
                self._rows += [{"table": table, **row} for row in to_batch(table, columns).to_pylist()]
        return self._rows


@pytest.mark.gpu
def test_cuda_gradients_give_the_statistics_of_cpu_ones(installed):
    def rows_on(device: str) -> tuple[list[dict], list[dict]]:
        writer, clock = Rows(), StepClock()
        handle = grads.install(writer, clock, grad_every=1, refresh_every=2, refresh_ladder=(2,))
        train(make_model().to(device), clock)
        handle.uninstall()
        rows = sorted(writer.rows, key=lambda r: (r["step"], r["name"], r.get("keep_ratio", 0)))
        return [r for r in rows if r["table"] == "grads"], [r for r in rows if r["table"] == "dct_replay"]

    (cpu, cpu_replay), (cuda, cuda_replay) = rows_on("cpu"), rows_on("cuda")
    floats = [c for c in cpu[0] if isinstance(cpu[0][c], float)]
    assert len(cpu) == 12
    for a, b in zip(cpu, cuda, strict=True):
        assert {c: v for c, v in a.items() if c not in floats} == {c: v for c, v in b.items() if c not in floats}
        assert [b[c] for c in floats] == pytest.approx([a[c] for c in floats], rel=1e-12, abs=0)
    # the replay's thresholds by one sort on the device, by numpy partitions on CPU: the same counts
    assert len(cpu_replay) == 3 * len(KEEP_RATIOS) * 4 and cuda_replay == cpu_replay


def _hook_rule_counts(values: list[torch.Tensor], keep: float, refresh_every: int, subsampled: bool) -> list[int]:
    """What tracekit/dlrm/compression.py's hook sends of one parameter per step, with error feedback,
    written out independently: f = g + e, τ the k-th largest |f| every `refresh_every` steps (from
    the first), send |f| >= τ and f != 0, keep the rest. On a subset, k = ⌈keep · its size⌉."""
    from tracekit.dlrm.compression import _threshold

    residual, tau, sent = torch.zeros_like(values[0]), 0.0, []
    for step, g in enumerate(values):
        f = g + residual
        if step % refresh_every == 0:
            m = f.numel()
            k = math.ceil(keep * m)
            tau = float(f.abs().kthvalue(m - k + 1).values) if subsampled else _threshold(f.abs(), keep)
        mask = (f.abs() >= tau) & (f != 0)
        sent.append(int(mask.sum()))
        residual = torch.where(mask, torch.zeros_like(f), f)
    return sent


def test_the_replay_counts_what_the_hook_sends_with_error_feedback() -> None:
    sizes = [100, 700, 7, 20000, 8001]  # whole at every ratio (7 < 128), replayed whole, and two subsets
    replay = dct_replay.Replay(sizes, device=torch.device("cpu"), ladder=(5, 2), sample=8000)
    gen = torch.Generator().manual_seed(0)
    fed = [[torch.randn(n, generator=gen) * (1 + step / 4) for n in sizes] for step in range(11)]
    fed[3][2][1] = 0.0  # a zero is never sent, even by a threshold of 0
    counts = []
    for grads_fed in fed:
        for i, g in enumerate(grads_fed):
            replay.put(i, dct_replay.entries(g, replay.index[i]))
        sent, refreshed, positions = replay.step([None] * len(sizes))
        assert positions == list(range(len(sizes)))
        counts.append(sent)
        assert (sent[1] <= sent[0]).all()
    assert replay.replayed == [100, 700, 7, 8000, 8000]  # 0.01 * 700 is 7.000000000000001: k = 8, as the hook
    for pair, (keep, refresh) in enumerate(replay.pairs):
        for i, n in enumerate(sizes):
            values = [dct_replay.entries(g[i], replay.index[i]) for g in fed]
            expected = _hook_rule_counts(values, keep, refresh, subsampled=n > 8000)
            assert [int(c[0, pair, i]) for c in counts] == expected, (keep, refresh, n)
    stale = [int(c[0, 0, 3]) for c in counts]  # keep 0.1%, refreshed every 5 steps: 8 at a refresh, more after
    assert stale[0] == stale[5] == stale[10] == 8 and max(stale) > 8


def test_the_replay_thresholds_are_the_same_sorted_or_partitioned() -> None:
    replay = dct_replay.Replay([300, 9000, 50], device=torch.device("cpu"), ladder=(3,), sample=8000)
    magnitude = torch.rand(len(replay.pairs), replay.grad.numel(), generator=torch.Generator().manual_seed(1))
    rows = torch.arange(len(replay.pairs))
    assert torch.equal(replay._sorted(magnitude, rows), replay._partitioned(magnitude, rows))


def test_dct_replay_rows_are_written_every_step_with_the_local_gradient(clock_and_writer, installed, tmp_path) -> None:
    clock, writer = clock_and_writer
    handle = grads.install(writer, clock, grad_every=3, refresh_ladder=(4, 2))
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    for _ in range(5):
        model(torch.randn(8, 5)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    writer.flush()
    write_manifest(tmp_path, {"status": "completed"})
    rows = open_run(tmp_path).scan("dct_replay").collect()
    assert rows.height == 5 * len(KEEP_RATIOS) * 2 * 4 and sorted(set(rows["step"])) == [0, 1, 2, 3, 4]
    assert set(rows["position"]) == {0, 1, 2, 3}, "every gradient was taken as autograd accumulated it"
    assert set(rows.select("name", "numel", "replayed").iter_rows()) == {
        ("0.weight", 200, 200), ("0.bias", 40, 40), ("2.0.weight", 1200, 1200), ("2.0.bias", 30, 30)}
    import polars as pl  # here, not at the top: the GPU machines have no polars (bench/gpu_check.sh)

    refreshed = rows.filter(pl.col("refreshed")).group_by("refresh_every").agg(pl.col("step").unique().sort())
    assert dict(refreshed.iter_rows()) == {4: [0, 4], 2: [0, 2, 4]}
    assert (rows["sent"] <= rows["numel"]).all() and (rows["sent_first_half"] <= rows["sent"]).all()
    handle.uninstall()
    assert all(not p._post_accumulate_grad_hooks for p in model.parameters()), "uninstall removes the hooks"

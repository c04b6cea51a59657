"""The trainer's runtime helpers: the prefetch thread, core pinning, MKL's GEMM path, the metrics."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import pytest
import torch

from tests.recorded import REPO
from tracekit.dlrm.metrics import log_loss, roc_auc
from tracekit.dlrm.runtime import avx512_gemm_on_amd, pin_to_cores
from tracekit.dlrm.schedule import prefetched

BOUND_S = 60


def test_prefetched_keeps_order_and_ends() -> None:
    assert list(prefetched(iter(range(50)), depth=2)) == list(range(50))


def test_prefetched_reraises_the_producers_error() -> None:
    def items():
        yield 1
        raise ValueError("bad batch 2")

    got = []
    with pytest.raises(ValueError, match="bad batch 2"):
        for item in prefetched(items(), depth=2):
            got.append(item)
    assert got == [1]


def source(n: int, fail: bool, asked_for_a_fourth: threading.Event):
    """Items 0 .. n-1, then an error if `fail`; sets the event when a fourth item is asked for."""
    for i in range(n):
        if i == 3:
            asked_for_a_fourth.set()
        yield i
    asked_for_a_fourth.set()
    if fail:
        raise ValueError("bad batch")


def prefetch_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name == "tracekit-prefetch"}


# The consumer takes item 0 and stops while the buffer (depth 2) is full, holding items 1 and 2,
# and the producer, done with item 2, is blocked handing over the next: item 3, the end, or the error.
@pytest.mark.parametrize(("n", "fail"), [(1000, False), (3, False), (3, True)],
                         ids=["mid-stream", "after-the-last-item", "after-an-error"])
@pytest.mark.parametrize("stop", ["break", "close"])
def test_prefetched_ends_its_thread_when_the_consumer_stops(n: int, fail: bool, stop: str) -> None:
    before, asked = prefetch_threads(), threading.Event()
    if stop == "break":
        for item in prefetched(source(n, fail, asked), depth=2):
            assert item == 0
            mine = prefetch_threads() - before
            assert asked.wait(BOUND_S)
            break
    else:
        batches = prefetched(source(n, fail, asked), depth=2)
        assert next(batches) == 0
        mine = prefetch_threads() - before
        assert asked.wait(BOUND_S)
        batches.close()
    assert len(mine) == 1
    for thread in mine:
        thread.join(BOUND_S)  # a bound for a stuck thread to fail the test, not a speed to meet
        assert not thread.is_alive()


def test_each_rank_is_pinned_to_its_own_share_of_the_cores() -> None:
    """In child processes (affinity is per process): ranks 0 .. R-1 of R get disjoint, equal slices
    of the allowed cores, in order, and the process runs there afterwards."""
    cores = sorted(os.sched_getaffinity(0))
    world = len(cores)  # as many ranks as cores: one core each; on this 2-core box, 2 ranks
    code = ("import json, os, sys; from tracekit.dlrm.runtime import pin_to_cores; "
            "mine = pin_to_cores(int(sys.argv[1]), int(sys.argv[2])); "
            "print(json.dumps([sorted(mine), sorted(os.sched_getaffinity(0))]))")
    got = [json.loads(subprocess.run([sys.executable, "-c", code, str(rank), str(world)], check=True,
                                     capture_output=True, text=True, cwd=REPO).stdout) for rank in range(world)]
    assert [returned for returned, _ in got] == [[core] for core in cores]
    assert [actual for _, actual in got] == [[core] for core in cores]


def test_pinning_is_a_no_op_for_one_process_or_too_many_ranks() -> None:
    before = os.sched_getaffinity(0)
    assert pin_to_cores(0, 1) is None
    assert pin_to_cores(0, len(before) + 1) is None
    assert os.sched_getaffinity(0) == before


def test_roc_auc_counts_ties_as_half() -> None:
    assert roc_auc(torch.tensor([0.1, 0.4, 0.35, 0.8]), torch.tensor([0.0, 0.0, 1.0, 1.0])) == 0.75
    assert roc_auc(torch.tensor([0.5, 0.5]), torch.tensor([0.0, 1.0])) == 0.5
    assert log_loss(torch.tensor([0.0]), torch.tensor([1.0])) == pytest.approx(0.693147, abs=1e-6)


CPUINFO = "processor\t: {n}\nvendor_id\t: {vendor}\nflags\t\t: fpu sse2 avx2 {extra}\n\n"


@pytest.mark.parametrize(("vendor", "extra", "set_before", "expected"), [
    ("AuthenticAMD", "avx512f avx512bw", None, "AVX512"),  # Zen 4: MKL told to use AVX-512
    ("AuthenticAMD", "", None, None),  # no AVX-512 on the CPU: left alone
    ("GenuineIntel", "avx512f", None, None),  # MKL picks AVX-512 (or AMX) itself on Intel
    ("AuthenticAMD", "avx512f", "AVX2", "AVX2"),  # the user's own setting wins
])
def test_avx512_gemm_only_on_amd_with_avx512(tmp_path, monkeypatch, vendor, extra, set_before, expected) -> None:
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("".join(CPUINFO.format(n=n, vendor=vendor, extra=extra) for n in range(2)))
    monkeypatch.delenv("MKL_ENABLE_INSTRUCTIONS", raising=False)
    if set_before:
        monkeypatch.setenv("MKL_ENABLE_INSTRUCTIONS", set_before)
    assert avx512_gemm_on_amd(str(cpuinfo)) == (expected is not None and set_before is None)
    assert os.environ.get("MKL_ENABLE_INSTRUCTIONS") == expected
    monkeypatch.delenv("MKL_ENABLE_INSTRUCTIONS", raising=False)
    assert avx512_gemm_on_amd(str(tmp_path / "missing")) is False  # no /proc/cpuinfo: left alone

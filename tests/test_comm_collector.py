"""The comm collector wraps torch.distributed's functions only while installed."""

from __future__ import annotations

import subprocess
import sys

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from collectors import comm
from collectors.steps import StepClock


def test_importing_changes_nothing() -> None:
    code = ("import torch.distributed as d; before = d.all_reduce; import collectors.comm; "
            "print(d.all_reduce is before)")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == "True"


def test_uninstall_restores_the_very_functions(tmp_path) -> None:
    before = {op: (getattr(dist, op, None), getattr(c10d, op, None)) for op in comm.OPS}
    before_wait = dist.Work.wait

    class Writer:
        def add_source(self, drain, in_flight=None):
            assert drain(True) == [], "no collective ran, nothing to write"

    handle = comm.install(Writer(), StepClock())
    assert comm.install(Writer(), StepClock()) is handle
    assert dist.all_to_all_single is not before["all_to_all_single"][0]
    handle.uninstall()
    assert {op: (getattr(dist, op, None), getattr(c10d, op, None)) for op in comm.OPS} == before
    assert dist.Work.wait is before_wait


def test_calls_behind_an_async_call_that_never_completes_are_written_anyway(monkeypatch) -> None:
    class Writer:
        def add_source(self, drain, in_flight=None):
            self.drain = drain

    writer = Writer()
    handle = comm.install(writer, StepClock())
    try:
        monkeypatch.setattr(comm, "MAX_HELD_CALLS", 3)
        running = [0, "all_reduce", "default", 2, "float32", 4, 4, [], [], 10, 0, "t", True, "train", None]
        done = [0, "barrier", "default", 2, "", 0, 0, [], [], 11, 12, "t", False, "train", None]
        handle.calls.extend([list(running), list(done), list(done)])
        assert writer.drain(False) == []  # held behind the running call
        handle.calls.append(list(done))
        [(table, columns)] = writer.drain(False)
        assert table == "comms" and list(columns["t_end_ns"]) == [-1, 12, 12, 12]
        assert list(columns["seq"]) == [0, 1, 2, 3] and not handle.calls
    finally:
        handle.uninstall()

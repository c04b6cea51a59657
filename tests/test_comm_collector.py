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

    class Writer:
        def add_source(self, drain):
            assert drain(True) == [], "no collective ran, nothing to write"

    handle = comm.install(Writer(), StepClock())
    assert comm.install(Writer(), StepClock()) is handle
    assert dist.all_to_all_single is not before["all_to_all_single"][0]
    handle.uninstall()
    assert {op: (getattr(dist, op, None), getattr(c10d, op, None)) for op in comm.OPS} == before

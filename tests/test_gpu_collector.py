"""The GPU collector: its sampling loop against a stand-in NVML (there is no GPU on CI), the real
no-GPU path of `tracekit record`, and, marked `gpu`, a real CUDA run sampled through NVML.

Imports no polars: the `gpu` test also runs on GPU machines whose Python has none.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pyarrow.parquet as pq
import pynvml
import pytest
from click.testing import CliRunner

from collectors import gpu
from tracekit.app.cli import cli
from tracekit.app.rank_reports import gpu_outcome
from tracekit.app.recording import gpu_status
from tracekit.schema import GPU
from tracekit.store import RunWriter

UUIDS = ["GPU-0a1b2c3d-1111-2222-3333-444455556666", "GPU-0a1bffff-1111-2222-3333-444455556666"]
# what FakeNvml reports of every GPU, in the `gpu` table's units; pcie_tx is not supported (null)
READING = {"util_gpu": 37, "util_mem": 12, "mem_used": 3 << 30, "power_mw": 71_250, "sm_clock_mhz": 1410,
           "pcie_tx": None, "pcie_rx": 2048}


class FakeNvml:
    """Stands in for pynvml, with its error classes and constants: two GPUs with fixed readings,
    no PCIe TX counter; `fail_after` power readings, the next raises NVMLError_Unknown."""

    NVMLError = pynvml.NVMLError
    NVMLError_NotSupported = pynvml.NVMLError_NotSupported
    NVML_CLOCK_SM = pynvml.NVML_CLOCK_SM
    NVML_PCIE_UTIL_TX_BYTES = pynvml.NVML_PCIE_UTIL_TX_BYTES
    NVML_PCIE_UTIL_RX_BYTES = pynvml.NVML_PCIE_UTIL_RX_BYTES

    def __init__(self, count: int = 2, fail_after: int | None = None) -> None:
        self.count, self.fail_after = count, fail_after
        self.calls: Counter = Counter()
        self.initialised = False

    def nvmlInit(self):
        self.initialised = True

    def nvmlShutdown(self):
        self.initialised = False

    def nvmlDeviceGetCount(self):
        return self.count

    def nvmlDeviceGetHandleByIndex(self, index):
        return index

    def nvmlDeviceGetUUID(self, handle):
        return UUIDS[handle]

    def nvmlDeviceGetName(self, handle):
        return b"Fake GPU"  # older pynvml returns bytes

    def nvmlDeviceGetUtilizationRates(self, handle):
        return SimpleNamespace(gpu=READING["util_gpu"], memory=READING["util_mem"])

    def nvmlDeviceGetMemoryInfo(self, handle):
        return SimpleNamespace(used=READING["mem_used"], total=80 << 30)

    def nvmlDeviceGetPowerUsage(self, handle):
        self.calls["power"] += 1
        if self.fail_after is not None and self.calls["power"] > self.fail_after:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_UNKNOWN)
        return READING["power_mw"]

    def nvmlDeviceGetClockInfo(self, handle, clock):
        assert clock == pynvml.NVML_CLOCK_SM
        return READING["sm_clock_mhz"]

    def nvmlDeviceGetPcieThroughput(self, handle, counter):
        self.calls["pcie", counter] += 1
        if counter == pynvml.NVML_PCIE_UTIL_TX_BYTES:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return READING["pcie_rx"]


class AppendLog(RunWriter):
    """A real RunWriter that also keeps the t_ns of each `append` call."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.appends: list[list[int]] = []

    def append(self, table, columns):
        assert table == "gpu"
        self.appends.append(list(columns["t_ns"]))
        super().append(table, columns)


@pytest.fixture
def uninstall_after():
    handles = []
    yield handles.append
    for handle in handles:
        handle.uninstall()


def wait_until(predicate) -> None:
    """Wait until `predicate()` holds; the bound only stops a test that would otherwise hang."""
    deadline = time.monotonic() + 60
    while not predicate():
        assert time.monotonic() < deadline, "still not so after 60 s"
        time.sleep(0.005)


def test_samples_are_rows_in_nvml_units_batched_by_the_second_and_flushed_at_stop(tmp_path, uninstall_after):
    nvml, cuda_used, looked = FakeNvml(), threading.Event(), []

    def in_use() -> bool:
        looked.append(True)
        return cuda_used.is_set()

    writer = AppendLog(tmp_path, rank=0)
    t_install = time.monotonic_ns()
    handle = gpu.install(writer, interval_s=0.02, batch_s=0.2, ordinal=1, nvml=nvml, in_use=in_use)
    uninstall_after(handle)
    wait_until(lambda: len(looked) >= 3)
    assert writer.appends == [] and handle.status() == {"device": None, "reason": "the process did not use CUDA"}
    t_used = time.monotonic_ns()
    cuda_used.set()
    wait_until(lambda: len(writer.appends) >= 3)
    handle.uninstall()
    assert not handle._thread.is_alive() and not nvml.initialised
    writer.close()

    table = pq.read_table(tmp_path / "gpu" / "rank=0")
    assert table.schema.remove_metadata() == GPU
    rows = table.to_pylist()
    assert all(row == {"t_ns": row["t_ns"], "device": 1, **READING} for row in rows)
    t_ns = [row["t_ns"] for row in rows]
    assert t_ns == sorted(set(t_ns)) and t_ns[0] >= t_used
    # the k-th look is at least k intervals after install, however late the sampler runs (1 ms of slack
    # for float rounding)
    assert len(rows) <= (t_ns[-1] - t_install + 1_000_000) // 20_000_000 + 1
    assert nvml.calls["pcie", pynvml.NVML_PCIE_UTIL_TX_BYTES] == 1  # NotSupported is asked once
    assert sum(map(len, writer.appends)) == len(rows)
    # batched: each append but the last (written at stop) ends at the first sample that makes it span 0.2 s
    for batch in writer.appends[:-1]:
        assert batch[-1] - batch[0] + 20_000_000 >= 200_000_000 > batch[-2] - batch[0] + 20_000_000
    assert handle.status() == {"device": 1, "reason": None}


def test_an_nvml_failure_switches_the_sampler_off_and_keeps_the_rows_taken(tmp_path, uninstall_after, capsys):
    writer = RunWriter(tmp_path, rank=0)
    handle = gpu.install(writer, interval_s=0.01, nvml=FakeNvml(fail_after=3), in_use=lambda: True)
    uninstall_after(handle)
    handle._thread.join(60)  # a bound for a thread that never stops, not a speed to meet
    assert not handle._thread.is_alive() and not handle.guard.enabled
    handle.uninstall()
    writer.close()
    assert pq.read_table(tmp_path / "gpu" / "rank=0").num_rows == 3
    assert capsys.readouterr().err.count("tracekit: the gpu collector failed (NVMLError_Unknown") == 1


@pytest.mark.parametrize(("visible", "ordinal", "index"), [
    (None, 0, 0), (None, 1, 1), (None, 2, None),
    ("1", 0, 1), ("1,0", 1, 0), (" 1 , 0 ", 1, 0), ("", 0, None), ("-1", 0, None),
    ("0,7,1", 1, None),  # CUDA stops reading at 7, which names no GPU
    (UUIDS[1], 0, 1), ("GPU-0a1bf", 0, 1), ("GPU-0a1bf,0", 1, 0),
    ("GPU-0a1b", 0, None),  # a prefix of both UUIDs names neither
])
def test_cuda_visible_devices_map_to_nvml_indices(visible, ordinal, index):
    assert gpu.nvml_index(FakeNvml(), visible, ordinal) == index


@pytest.mark.parametrize(("nvml", "visible", "reason"), [
    (FakeNvml(count=0), None, "NVML found no GPU"),
    (FakeNvml(), "1", "CUDA device 1 is not visible (CUDA_VISIBLE_DEVICES='1', 2 GPU(s))"),
])
def test_without_a_gpu_to_sample_nothing_is_started(tmp_path, uninstall_after, nvml, visible, reason):
    writer = RunWriter(tmp_path, rank=0)
    handle = gpu.install(writer, ordinal=1, visible_devices=visible, nvml=nvml, in_use=lambda: True)
    uninstall_after(handle)
    assert handle._thread is None and handle.status() == {"device": None, "reason": reason}
    assert gpu.install(writer, nvml=FakeNvml()) is handle  # a second install is a no-op
    handle.uninstall()
    writer.close()
    assert not nvml.initialised and not (tmp_path / "gpu").exists()


def test_interval_must_be_positive(tmp_path):
    with pytest.raises(ValueError, match="interval_s must be > 0, got 0"):
        gpu.install(RunWriter(tmp_path, rank=0), interval_s=0, nvml=FakeNvml())
    r = CliRunner().invoke(cli, ["record", "-o", str(tmp_path / "run"), "--gpu-interval", "0", "--", "true"])
    assert r.exit_code == 2 and "Invalid value for '--gpu-interval'" in r.output, r.output


def test_the_manifest_says_which_gpu_each_rank_sampled_or_why_none():
    found = {"devices": ["NVIDIA H100"], "samples": False, "reason": "no traced process used a GPU"}
    sampled = {"rank": 0, "written_rows": {"gpu": 12}, "gpu": {"device": 3, "reason": None}}
    cpu_only = {"rank": 1, "written_rows": {"steps": 4}, "gpu": {"device": None, "reason": "the process did not use CUDA"}}
    assert gpu_outcome(found, [sampled, cpu_only], 0.1) == {
        "devices": ["NVIDIA H100"], "samples": True, "interval_s": 0.1, "sampled_devices": {"0": 3}, "reason": None}
    assert gpu_outcome(found, [cpu_only], 0.1) == {**found, "reason": "rank 1: the process did not use CUDA"}
    assert gpu_outcome(found, [], 0.1) == found  # no Python process started
    none = {"devices": [], "samples": False, "reason": "NVML unavailable: NVML Shared Library Not Found"}
    assert gpu_outcome(none, [{**cpu_only, "gpu": {"device": None, "reason": none["reason"]}}], 0.1) == none


def record(tmp_path: Path, gpu_interval: str, script: str) -> Path:
    run_dir = tmp_path / "run"
    r = CliRunner().invoke(cli, ["record", "-o", str(run_dir), "--gpu-interval", gpu_interval, "--",
                                 sys.executable, "-c", script])
    assert r.exit_code == 0, r.output
    return run_dir


@pytest.mark.skipif(bool(gpu_status()["devices"]), reason="NVML sees a GPU here")
def test_without_a_gpu_the_manifest_says_why_and_there_is_no_gpu_table(tmp_path):
    run_dir = record(tmp_path, "0.25", "import torch; torch.nn.Embedding(4, 2)(torch.tensor([1]))")
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["gpu"] == {"devices": [], "samples": False, "reason": gpu_status()["reason"]}
    assert manifest["gpu"]["reason"].startswith(("NVML unavailable: ", "NVML found no GPU", "nvidia-ml-py"))
    assert manifest["collector_settings"]["gpu_interval_s"] == 0.25
    report = json.loads((run_dir / "ranks" / "rank=0.json").read_text())
    assert report["settings"]["gpu_interval_s"] == 0.25 and report["gpu"]["device"] is None
    assert not (run_dir / "gpu").exists()


CUDA_SCRIPT = """
import time, torch
emb = torch.nn.EmbeddingBag(100_000, 64, mode="sum").cuda()
opt = torch.optim.SGD(emb.parameters(), lr=0.1)
ids = torch.randint(0, 100_000, (1 << 18,), device="cuda")
offsets = torch.arange(0, ids.numel(), 8, device="cuda")
end = time.monotonic() + 2.0
while time.monotonic() < end:
    emb(ids, offsets).pow(2).sum().backward()
    opt.step()
    opt.zero_grad()
torch.cuda.synchronize()
"""


@pytest.mark.gpu
def test_a_cuda_run_is_sampled_with_plausible_values(tmp_path):
    run_dir = record(tmp_path, "0.05", CUDA_SCRIPT)
    manifest = json.loads((run_dir / "manifest.json").read_text())
    nvml, reason = gpu.open_nvml()
    assert nvml is not None, reason
    try:
        device = gpu.nvml_index(nvml, manifest["environment"].get("CUDA_VISIBLE_DEVICES"), 0)
    finally:
        nvml.nvmlShutdown()
    assert manifest["gpu"]["samples"] is True and manifest["gpu"]["interval_s"] == 0.05, manifest["gpu"]
    assert manifest["gpu"]["sampled_devices"] == {"0": device}
    rows = pq.read_table(run_dir / "gpu" / "rank=0").to_pylist()
    assert len(rows) >= 10, rows  # 2 s of training at 0.05 s (at least 40 ms per sample)
    t_ns = [row["t_ns"] for row in rows]
    assert t_ns == sorted(set(t_ns))
    assert {row["device"] for row in rows} == {device}
    assert all(0 <= row["util_gpu"] <= 100 and 0 <= row["util_mem"] <= 100 for row in rows), rows
    assert max(row["util_gpu"] for row in rows) > 0, rows  # the training loop kept the GPU busy
    assert all(row["mem_used"] > 256 << 20 for row in rows), rows  # at least the CUDA context and the table
    assert all(10_000 < row["power_mw"] < 2_000_000 for row in rows), rows  # 10 W .. 2 kW
    assert all(100 < row["sm_clock_mhz"] < 5_000 for row in rows), rows
    assert all(row[c] is None or row[c] >= 0 for row in rows for c in ("pcie_tx", "pcie_rx")), rows

"""The GPU collector: NVML samples of the GPU this process trains on, as `gpu` rows.

`install(writer, interval_s=0.1, ordinal=LOCAL_RANK, visible_devices=CUDA_VISIBLE_DEVICES)` finds
the GPU that CUDA device `ordinal` is, as NVML numbers it (`nvml_index`), and starts one daemon
thread that samples it. Where NVML (nvidia-ml-py's `pynvml`) is missing, sees no GPU, or that
device is hidden, it starts nothing, and `handle.status()` says why.

The thread waits until the process has initialised CUDA (a process that never uses CUDA is never
sampled), then every `interval_s` takes one row (units as NVML reports them):

    t_ns          time.monotonic_ns() when the sample began
    device        the GPU's NVML index (nvidia-smi's numbering)
    util_gpu      percent of NVML's last sample period in which a kernel ran
    util_mem      percent of that period in which device memory was read or written
    mem_used      bytes of device memory in use, by every process on the GPU
    power_mw      board power draw in milliwatts
    sm_clock_mhz  SM clock in MHz
    pcie_tx       PCIe KB/s sent, over a 20 ms window NVML waits for
    pcie_rx       PCIe KB/s received, likewise

A metric the GPU does not support (NVMLError_NotSupported) is null in every row: it is asked once,
and a null cannot be mistaken for an idle GPU. Each PCIe counter blocks NVML for 20 ms, so a sample
takes about 40 ms and intervals below that sample back to back. Rows are appended to the writer
once per `batch_s` (1 s) of samples, and at `uninstall()`, which stops the thread and writes what
it holds. Any other NVML error switches the sampler off (collectors/guard.py).

    handle = gpu.install(writer, interval_s=0.1, ordinal=local_rank, visible_devices=visible)
    ...
    handle.uninstall()
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable

from collectors.guard import Guard
from tracekit.schema import GPU
from tracekit.store import RunWriter

NO_GPU = "NVML found no GPU"
JOIN_TIMEOUT_S = 5.0  # uninstall waits this long for a sample in flight; NVML calls take milliseconds


def _utilization(nvml: Any, handle: Any) -> tuple:
    rates = nvml.nvmlDeviceGetUtilizationRates(handle)
    return rates.gpu, rates.memory


# (columns, query): each query is one NVML call giving its columns' values.
READINGS: tuple[tuple[tuple[str, ...], Callable[[Any, Any], tuple]], ...] = (
    (("util_gpu", "util_mem"), _utilization),
    (("mem_used",), lambda nvml, h: (nvml.nvmlDeviceGetMemoryInfo(h).used,)),
    (("power_mw",), lambda nvml, h: (nvml.nvmlDeviceGetPowerUsage(h),)),
    (("sm_clock_mhz",), lambda nvml, h: (nvml.nvmlDeviceGetClockInfo(h, nvml.NVML_CLOCK_SM),)),
    (("pcie_tx",), lambda nvml, h: (nvml.nvmlDeviceGetPcieThroughput(h, nvml.NVML_PCIE_UTIL_TX_BYTES),)),
    (("pcie_rx",), lambda nvml, h: (nvml.nvmlDeviceGetPcieThroughput(h, nvml.NVML_PCIE_UTIL_RX_BYTES),)),
)


def open_nvml(nvml: Any = None) -> tuple[Any, str | None]:
    """(`nvml` initialised, None), or (None, why NVML cannot be used). `nvml` defaults to pynvml."""
    if nvml is None:
        try:
            import pynvml as nvml
        except ImportError:
            return None, "nvidia-ml-py is not installed"
    try:
        nvml.nvmlInit()
    except nvml.NVMLError as err:  # e.g. NVMLError_LibraryNotFound where there is no driver
        return None, f"NVML unavailable: {err}"
    return nvml, None


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value  # older pynvml returns bytes


def device_names(nvml: Any) -> list[str]:
    """The names of the GPUs an initialised NVML sees, by NVML index."""
    handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(nvml.nvmlDeviceGetCount())]
    return [_text(nvml.nvmlDeviceGetName(handle)) for handle in handles]


def nvml_index(nvml: Any, visible_devices: str | None, ordinal: int) -> int | None:
    """The NVML index of CUDA device `ordinal` under CUDA_VISIBLE_DEVICES=`visible_devices` (None:
    unset), or None if no such device is visible.

    Entries are read as CUDA reads them: an NVML index, or a UUID `GPU-...` or a unique prefix of
    one; the list ends at the first entry that names no GPU (so "" and "-1" hide every GPU).
    """
    count = nvml.nvmlDeviceGetCount()
    if visible_devices is None:
        visible = list(range(count))
    else:
        uuids = [_text(nvml.nvmlDeviceGetUUID(nvml.nvmlDeviceGetHandleByIndex(i))) for i in range(count)]
        visible = []
        for entry in (e.strip() for e in visible_devices.split(",")):
            if entry.isdigit() and int(entry) < count:
                visible.append(int(entry))
                continue
            matches = [i for i, uuid in enumerate(uuids) if entry.startswith("GPU-") and uuid.startswith(entry)]
            if len(matches) != 1:
                break
            visible.append(matches[0])
    return visible[ordinal] if 0 <= ordinal < len(visible) else None


class GpuHandle:
    """The installed GPU collector. `device` is the NVML index it samples (None: it samples nothing)."""

    def __init__(self, writer: RunWriter, nvml: Any, device: int | None, reason: str | None, *,
                 interval_s: float, batch_s: float, in_use: Callable[[], bool]) -> None:
        self.writer, self.nvml, self.device = writer, nvml, device
        self.interval_s, self.interval_ns, self.batch_ns = interval_s, int(interval_s * 1e9), int(batch_s * 1e9)
        self.unsupported: set[str] = set()  # columns the GPU does not report: null in every row
        self.guard = Guard("gpu")  # sampling: an NVML error switches the sampler off
        self._write_guard = Guard("gpu")  # the last write still happens after a sampling failure
        self._reason = reason
        self._in_use = in_use
        self._used = False  # the process has initialised CUDA
        self._rows: dict[str, list] = {name: [] for name in GPU.names}
        self._stop = threading.Event()
        self._thread = None
        if device is not None:
            self._handle = nvml.nvmlDeviceGetHandleByIndex(device)
            self._thread = threading.Thread(target=self._run, name="tracekit-gpu", daemon=True)
            self._thread.start()

    def status(self) -> dict:
        """For the rank report: the device sampled, or why none was ("reason")."""
        reason = self._reason
        if reason is None and not self._used:
            reason = "the process did not use CUDA"
        return {"device": self.device if self._used else None, "reason": reason}

    def uninstall(self) -> None:
        """Stop the thread, writing the samples it holds, and shut NVML down."""
        global _installed
        if _installed is self:
            _installed = None
        self._stop.set()
        if self._thread is not None:
            self._thread.join(JOIN_TIMEOUT_S)
        if self.nvml is not None and not (self._thread and self._thread.is_alive()):
            self.nvml.nvmlShutdown()
            self.nvml = None

    def _run(self) -> None:
        next_at = time.monotonic()
        while self.guard.enabled and not self._stop.wait(max(0.0, next_at - time.monotonic())):
            next_at = max(next_at + self.interval_s, time.monotonic())  # a late sample shifts the ones after
            self.guard.run(self._tick)
        self._write_guard.run(self._flush)

    def _tick(self) -> None:
        self._used = self._used or self._in_use()
        if not self._used:
            return
        self._sample()
        t_ns = self._rows["t_ns"]
        if t_ns[-1] - t_ns[0] + self.interval_ns >= self.batch_ns:
            self._flush()

    def _sample(self) -> None:
        row: dict[str, Any] = {"t_ns": time.monotonic_ns(), "device": self.device}
        for columns, query in READINGS:
            row.update(zip(columns, self._read(columns, query)))
        for name, value in row.items():
            self._rows[name].append(value)

    def _read(self, columns: tuple[str, ...], query: Callable[[Any, Any], tuple]) -> tuple:
        if columns[0] not in self.unsupported:
            try:
                return query(self.nvml, self._handle)
            except self.nvml.NVMLError_NotSupported:
                self.unsupported.update(columns)
        return (None,) * len(columns)

    def _flush(self) -> None:
        if self._rows["t_ns"]:
            rows, self._rows = self._rows, {name: [] for name in GPU.names}
            self.writer.append("gpu", rows)


# One sampler per process: set by install, cleared by uninstall, so a second install is a no-op.
_installed: GpuHandle | None = None


def install(writer: RunWriter, *, interval_s: float = 0.1, ordinal: int = 0, visible_devices: str | None = None,
            batch_s: float = 1.0, nvml: Any = None, in_use: Callable[[], bool] | None = None) -> GpuHandle:
    """Sample the GPU that CUDA device `ordinal` is (under CUDA_VISIBLE_DEVICES=`visible_devices`)
    every `interval_s` into `gpu`, once `in_use()` (default: torch.cuda.is_initialized) is true.
    `nvml` stands in for pynvml (tests). A second call while installed returns the installed handle."""
    global _installed
    if interval_s <= 0:
        raise ValueError(f"interval_s must be > 0, got {interval_s}")
    if _installed is None:
        if in_use is None:
            import torch  # here, not at the top: `tracekit record` imports this module for open_nvml

            in_use = torch.cuda.is_initialized
        nvml, reason = open_nvml(nvml)
        device = None
        if nvml is not None:
            device = nvml_index(nvml, visible_devices, ordinal)
            if device is None:
                count = nvml.nvmlDeviceGetCount()
                reason = (f"CUDA device {ordinal} is not visible (CUDA_VISIBLE_DEVICES={visible_devices!r}, "
                          f"{count} GPU(s))" if count else NO_GPU)
        _installed = GpuHandle(writer, nvml, device, reason, interval_s=interval_s, batch_s=batch_s, in_use=in_use)
    return _installed

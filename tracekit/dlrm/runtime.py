"""Process-level settings of a training rank: memory allocator behaviour, core pinning and MKL's
GEMM code path."""

from __future__ import annotations

import ctypes
import os


def keep_freed_memory() -> bool:
    """Ask glibc to keep freed memory instead of returning it to the OS after every step.

    Each step allocates and frees the same multi-MB buffers; by default glibc serves them
    with fresh mmaps and pays a page fault per 4 KiB every time (~10% of a CPU step,
    bench/RESULTS.md). This is what jemalloc/tcmalloc give PyTorch on CPU. No-op off glibc.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3
    one_gib = 1 << 30
    return bool(libc.mallopt(m_mmap_threshold, one_gib)) and bool(libc.mallopt(m_trim_threshold, one_gib))


def pin_to_cores(local_rank: int, local_world_size: int) -> set[int] | None:
    """Give each rank on this host its own slice of the cores it may use.

    With as many ranks as cores, unpinned ranks and their gloo threads migrate and preempt
    each other, and every collective waits for the slowest: pinning gave +10-20% samples/s
    at 2 ranks on 2 cores (bench/RESULTS.md). One process, or more ranks than cores: no-op.
    """
    cores = sorted(os.sched_getaffinity(0))
    if local_world_size <= 1 or local_world_size > len(cores):
        return None
    share = len(cores) // local_world_size
    mine = set(cores[local_rank * share:(local_rank + 1) * share])
    os.sched_setaffinity(0, mine)
    return mine


def avx512_gemm_on_amd(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """Let MKL's fp32 GEMMs use AVX-512 on an AMD CPU that has it.

    MKL picks its AVX-512 kernels by CPU vendor, so on AMD (Zen 4 and later) it runs the MLPs on
    its AVX2 path: 80 GFLOP/s on a 512-cube against 97 with `MKL_ENABLE_INSTRUCTIONS=AVX512`, about
    8% of a reference-trainer step (bench/RESULTS.md). Same arithmetic, another kernel. Set here
    only where the user has not set it and the CPU is AMD with avx512f; read by MKL at its next
    dispatch, so it takes effect if set before the model's first large matmul.
    """
    if "MKL_ENABLE_INSTRUCTIONS" in os.environ:
        return False
    try:
        with open(cpuinfo) as f:
            head = f.read(1 << 16).split("\n\n", 1)[0]
    except OSError:
        return False
    fields = {k.strip(): v.strip() for k, v in (ln.split(":", 1) for ln in head.splitlines() if ":" in ln)}
    if fields.get("vendor_id") != "AuthenticAMD" or "avx512f" not in fields.get("flags", "").split():
        return False
    os.environ["MKL_ENABLE_INSTRUCTIONS"] = "AVX512"
    return True

"""The host: RAM, CPU, NUMA, hugepages, the memlock limit and whether pinning memory actually works.

The memlock limit matters because a pinned host expert store or NVMe arena is locked memory: with the common
8 MiB container default it fails partway through loading, long after the user walked away.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import resource
import time
from dataclasses import dataclass, field
from pathlib import Path

from moetplan.contract.machine import cpu_model  # noqa: F401 (re-used by the probe)
from moetplan.contract import HostInfo
from moetplan.contract.vocab import CpuIsa

GIB = 1024**3
MIB = 1024**2

# Test sizes: big enough to cross the 8 MiB memlock default that breaks pinned stores, small enough to be instant.
MLOCK_TEST_BYTES = 16 * MIB
PIN_TEST_BYTES = 256 * MIB
DRAM_TEST_BYTES = 128 * MIB


@dataclass
class HostReport:
    info: HostInfo
    memlock_hard_bytes: int | None = None  # None = unlimited
    pinned_test: str = ""  # what the pinned test did, for people
    warnings: list[str] = field(default_factory=list)


def _meminfo(path: str = "/proc/meminfo") -> dict[str, int]:
    out: dict[str, int] = {}
    try:
        for line in Path(path).read_text().splitlines():
            key, _, rest = line.partition(":")
            parts = rest.split()
            if parts and parts[0].isdigit():
                out[key.strip()] = int(parts[0])
    except OSError:
        pass
    return out


def _numa_nodes(root: str = "/sys/devices/system/node") -> int | None:
    try:
        n = sum(1 for p in Path(root).iterdir() if p.name.startswith("node") and p.name[4:].isdigit())
    except OSError:
        return None
    return n or None


def memlock_limits() -> tuple[int | None, int | None]:
    """(soft, hard) RLIMIT_MEMLOCK in bytes; None means unlimited."""
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)

    def norm(v: int) -> int | None:
        return None if v == resource.RLIM_INFINITY or v < 0 else int(v)

    return norm(soft), norm(hard)


def _mlock_test(nbytes: int) -> tuple[bool, str]:
    """Lock a small buffer with mlock(2): the same limit a pinned store hits without CUDA's allocator."""
    libc_name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(libc_name, use_errno=True)
    except OSError as e:
        return False, f"mlock test impossible (libc not loadable: {e})"
    buf = ctypes.create_string_buffer(nbytes)
    addr, size = ctypes.c_void_p(ctypes.addressof(buf)), ctypes.c_size_t(nbytes)
    if libc.mlock(addr, size) != 0:
        err = ctypes.get_errno()
        return False, f"mlock of {nbytes // MIB} MiB failed ({os.strerror(err)})"
    libc.munlock(addr, size)
    return True, f"mlock of {nbytes // MIB} MiB worked"


def _torch_pin_test(nbytes: int) -> tuple[bool, str] | None:
    """cudaHostAlloc through torch when CUDA is usable: the allocator the runtime uses. None when no CUDA."""
    try:
        import torch
    except ImportError:
        return None
    try:
        if not torch.cuda.is_available():
            return None
    except Exception:  # a broken CUDA install must not take the host probe down with it
        return None
    try:
        t = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        ok = bool(t.is_pinned())
        del t
        return ok, f"torch pinned allocation of {nbytes // MIB} MiB {'worked' if ok else 'was not pinned'}"
    except RuntimeError as e:
        return False, f"torch pinned allocation of {nbytes // MIB} MiB failed ({str(e).splitlines()[0]})"


def measure_dram_gbps(nbytes: int = DRAM_TEST_BYTES, repeats: int = 3) -> float | None:
    """Single-thread copy bandwidth, read+write counted (a floor: more threads move more)."""
    try:
        import numpy as np
    except ImportError:
        return None
    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)  # fault the pages in before timing
    best = 0.0
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        dt = time.perf_counter() - t0
        best = max(best, 2 * nbytes / dt / 1e9)
    return round(best, 2)


# What csrc/cpu/moe_cpu.cpp's best_isa() asks of the CPU for each of its loops (GCC's __builtin_cpu_supports names
# as /proc/cpuinfo spells them), best first: the ISA decides which weights of an expert row its vector loop takes.
CPU_KERNEL_ISA_FLAGS: tuple[tuple[CpuIsa, tuple[str, ...]], ...] = (
    ("avx512", ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni", "avx512vbmi")),
    ("avx2", ("avx2", "fma", "bmi2")),
)


def cpu_kernel_isa(path: str = "/proc/cpuinfo") -> CpuIsa | None:
    """The loop the CPU expert kernels pick on this CPU, read from its flags without building them; None where
    /proc/cpuinfo is unreadable (not Linux)."""
    try:
        text = Path(path).read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("flags"):
            have = set(line.split(":", 1)[1].split())
            return next((isa for isa, need in CPU_KERNEL_ISA_FLAGS if set(need) <= have), "scalar")
    return None


def _fmt_limit(v: int | None) -> str:
    return "unlimited" if v is None else f"{v / MIB:g} MiB"


def query_host(measure: bool = True, try_cuda: bool = True) -> HostReport:
    """RAM, CPU, NUMA, hugepages, memlock and a pinned-allocation test; `measure` adds the DRAM copy rate.

    `try_cuda=False` skips the torch pinned test (importing torch costs seconds on a machine without GPUs).
    """
    import psutil

    vm = psutil.virtual_memory()
    mi = _meminfo()
    soft, hard = memlock_limits()
    sources: dict[str, str] = {"ram_gib": "measured", "ram_available_gib": "measured", "memlock_bytes": "measured"}

    mlock_ok, mlock_msg = _mlock_test(MLOCK_TEST_BYTES)
    pin = _torch_pin_test(PIN_TEST_BYTES) if try_cuda else None
    pinned_ok, pinned_msg = pin if pin is not None else (mlock_ok, mlock_msg)
    if pin is not None:
        pinned_msg = f"{pinned_msg}; {mlock_msg}"
    sources["pinned_alloc_ok"] = "measured"

    dram = measure_dram_gbps() if measure else None
    if dram is not None:
        sources["dram_gbps"] = "measured"

    cores = psutil.cpu_count(logical=False) or psutil.cpu_count(logical=True)
    isa = cpu_kernel_isa()
    if isa is not None:
        sources["cpu_kernel_isa"] = "derived"  # from the CPU's flags; the probe's kernel run says "measured"
    info = HostInfo(
        ram_gib=round(vm.total / GIB, 2),
        ram_available_gib=round(vm.available / GIB, 2),
        cpu_model=cpu_model(),
        cores=cores,
        numa_nodes=_numa_nodes(),
        hugepages_total=mi.get("HugePages_Total"),
        hugepage_size_kib=mi.get("Hugepagesize"),
        memlock_bytes=soft,
        pinned_alloc_ok=pinned_ok,
        dram_gbps=dram,
        cpu_kernel_isa=isa,
        sources={k: v for k, v in sources.items()},  # type: ignore[misc]
    )
    warnings: list[str] = []
    # A limit the kernel does not enforce on us (CAP_IPC_LOCK, e.g. root) shows as mlock working past it.
    limit_enforced = not (mlock_ok and soft is not None and MLOCK_TEST_BYTES > soft)
    if not limit_enforced:
        pinned_msg += f" (past the {_fmt_limit(soft)} memlock limit: not enforced for this process, e.g. CAP_IPC_LOCK)"
    if soft is not None and soft < vm.total // 2 and limit_enforced:
        warnings.append(
            f"memlock limit is {_fmt_limit(soft)} (hard {_fmt_limit(hard)}): a pinned host expert store or RAM arena "
            "larger than that can fail while loading; raise it (`ulimit -l unlimited`, limits.conf memlock, "
            "or `docker run --ulimit memlock=-1`)"
        )
    if not pinned_ok:
        warnings.append(f"pinned memory test failed: {pinned_msg}; pinned host tiers will not work until it does")
    return HostReport(info=info, memlock_hard_bytes=hard, pinned_test=pinned_msg, warnings=warnings)

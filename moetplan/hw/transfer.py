"""Host->device and device->device copy rates at expert granularity, measured with torch CUDA events.

Expert misses are 4-16 MiB copies from a pinned host store, often many in one go before a layer computes; that is
what we time, not a single huge copy (which flatters the link) and not a tiny one (which measures launch latency).
Back-to-back copies are grouped between two events so launch overhead overlaps the copy engine's work.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Any

MIB = 1024**2

EXPERT_SIZES_MIB = (4, 8, 16)  # span of routed expert sizes at 2 bits across the target models
EXTRA_SIZES_MIB_FULL = (6, 12)
GROUP = 4  # copies between one pair of events
BATCH_COUNT, BATCH_MIB = 64, 6  # one decode step's misses fetched together (FACTS.md: 64 x 6 MiB)
SPIN_CYCLES = 1_000_000  # ~0.5 ms of GPU clock: longer than enqueueing 64 copies from Python


@dataclass(frozen=True)
class TransferBudget:
    reps: int  # timed repetitions per case; the median is reported
    pageable_reps: int
    batch_reps: int
    d2d_mib: int


QUICK = TransferBudget(reps=5, pageable_reps=3, batch_reps=3, d2d_mib=256)
FULL = TransferBudget(reps=15, pageable_reps=7, batch_reps=9, d2d_mib=1024)


@dataclass
class TransferResult:
    h2d_pinned_gbps: float | None = None
    h2d_pageable_gbps: float | None = None
    h2d_batched_gbps: float | None = None
    d2d_gbps: float | None = None
    detail: dict[str, Any] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)


def cuda_torch() -> tuple[Any | None, str | None]:
    """(torch, None) when torch can drive CUDA here; (None, why not) otherwise."""
    try:
        import torch
    except ImportError:
        return None, "torch is not installed"
    try:
        if not torch.cuda.is_available():
            return None, f"torch {torch.__version__} has no usable CUDA (CPU build or no driver)"
    except Exception as e:  # a half-installed CUDA runtime raises instead of answering False
        return None, f"torch CUDA check failed ({e})"
    return torch, None


def norm_uuid(u: Any) -> str:
    s = str(u).lower()
    return s[4:] if s.startswith("gpu-") else s


def torch_index_by_uuid(torch: Any) -> dict[str, int]:
    """NVML UUID -> torch device index (CUDA's order and CUDA_VISIBLE_DEVICES differ from NVML's order)."""
    out: dict[str, int] = {}
    for i in range(torch.cuda.device_count()):
        u = getattr(torch.cuda.get_device_properties(i), "uuid", None)
        if u is not None:
            out[norm_uuid(u)] = i
    return out


def _gbps(nbytes: float, seconds: float) -> float:
    return nbytes / seconds / 1e9


def _event_time(torch: Any, stream: Any, fn: Any) -> float:
    """Seconds the stream spent on fn()'s work (call inside `torch.cuda.stream(stream)`)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    sleep = getattr(torch.cuda, "_sleep", None)
    if sleep is not None:
        # Hold the stream busy while Python enqueues the copies, so launch gaps do not count as link time.
        sleep(SPIN_CYCLES)
    start.record(stream)
    fn()
    end.record(stream)
    end.synchronize()
    return start.elapsed_time(end) / 1e3


def _pinned(torch: Any, dev: Any, stream: Any, b: TransferBudget, quick: bool) -> tuple[float, dict[str, float]]:
    sizes = EXPERT_SIZES_MIB if quick else tuple(sorted(EXPERT_SIZES_MIB + EXTRA_SIZES_MIB_FULL))
    top = max(sizes) * MIB
    src = torch.empty(top, dtype=torch.uint8, pin_memory=True).fill_(1)
    dst = torch.empty(top, dtype=torch.uint8, device=dev)
    torch.cuda.synchronize(dev)
    per_size: dict[str, float] = {}
    with torch.cuda.stream(stream):
        for mib in sizes:
            n = mib * MIB

            def copies() -> None:
                for _ in range(GROUP):
                    dst[:n].copy_(src[:n], non_blocking=True)  # noqa: F821, B023 (runs before the del below)

            _event_time(torch, stream, copies)  # warm-up: first copies pay mapping/setup costs
            runs = [_gbps(GROUP * n, _event_time(torch, stream, copies)) for _ in range(b.reps)]
            per_size[f"{mib}MiB"] = round(statistics.median(runs), 2)
    del src, dst
    return statistics.median(per_size.values()), per_size


def _pageable(torch: Any, dev: Any, b: TransferBudget) -> float:
    n = 8 * MIB
    src = torch.ones(n, dtype=torch.uint8)  # touched, so page faults are not timed
    dst = torch.empty(n, dtype=torch.uint8, device=dev)
    dst.copy_(src)
    torch.cuda.synchronize(dev)
    runs = []
    for _ in range(b.pageable_reps):
        t0 = time.perf_counter()
        for _ in range(GROUP):
            dst.copy_(src)  # synchronous: staged through the driver's pinned bounce buffer
        torch.cuda.synchronize(dev)
        runs.append(_gbps(GROUP * n, time.perf_counter() - t0))
    return statistics.median(runs)


def _batched(torch: Any, dev: Any, stream: Any, b: TransferBudget) -> float:
    n = BATCH_MIB * MIB
    src = torch.empty(BATCH_COUNT * n, dtype=torch.uint8, pin_memory=True).fill_(1).view(BATCH_COUNT, n)
    dst = torch.empty(BATCH_COUNT, n, dtype=torch.uint8, device=dev)
    torch.cuda.synchronize(dev)

    def batch() -> None:
        # Reversed slots: like expert-cache slots, these are separate copies, not one contiguous transfer.
        for k in range(BATCH_COUNT):
            dst[BATCH_COUNT - 1 - k].copy_(src[k], non_blocking=True)  # noqa: F821 (runs before the del below)

    with torch.cuda.stream(stream):
        _event_time(torch, stream, batch)
        runs = [_gbps(BATCH_COUNT * n, _event_time(torch, stream, batch)) for _ in range(b.batch_reps)]
    del src, dst
    return statistics.median(runs)


def _d2d(torch: Any, dev: Any, stream: Any, b: TransferBudget) -> float:
    n = b.d2d_mib * MIB
    a = torch.ones(n, dtype=torch.uint8, device=dev)
    c = torch.empty_like(a)
    torch.cuda.synchronize(dev)  # ones() ran on the default stream; ours must not race it

    def copies() -> None:
        for _ in range(GROUP):
            c.copy_(a, non_blocking=True)  # noqa: F821 (runs before the del below)

    with torch.cuda.stream(stream):
        _event_time(torch, stream, copies)
        # A copy reads n bytes and writes n bytes: count both, as HBM/GDDR bandwidth figures do.
        runs = [_gbps(2 * GROUP * n, _event_time(torch, stream, copies)) for _ in range(b.reps)]
    del a, c
    return statistics.median(runs)


def measure_device(torch: Any, torch_index: int, quick: bool = True) -> TransferResult:
    """All four rates for one CUDA device; a failed case leaves its field None with a warning."""
    b = QUICK if quick else FULL
    res = TransferResult()
    dev = torch.device("cuda", torch_index)
    try:
        free, _total = torch.cuda.mem_get_info(dev)
    except RuntimeError as e:
        res.warnings.append(f"CUDA device {torch_index}: cannot start a context ({str(e).splitlines()[0]})")
        return res
    need = max(BATCH_COUNT * BATCH_MIB, 2 * b.d2d_mib) * MIB + 64 * MIB
    if free < need:
        res.warnings.append(f"CUDA device {torch_index}: only {free / MIB:.0f} MiB free on the GPU (need "
                            f"{need / MIB:.0f} MiB); transfer rates not measured, stop other GPU jobs and rerun")
        return res
    with torch.cuda.device(torch_index):  # streams, events and empty_cache all act on the current device
        _run_cases(torch, dev, b, quick, res)
    return res


def _run_cases(torch: Any, dev: Any, b: TransferBudget, quick: bool, res: TransferResult) -> None:
    torch_index = dev.index
    stream = torch.cuda.Stream(device=dev)
    cases = (
        ("h2d_pinned_gbps", lambda: _pinned(torch, dev, stream, b, quick)),
        ("h2d_pageable_gbps", lambda: _pageable(torch, dev, b)),
        ("h2d_batched_gbps", lambda: _batched(torch, dev, stream, b)),
        ("d2d_gbps", lambda: _d2d(torch, dev, stream, b)),
    )
    for name, fn in cases:
        try:
            out = fn()
        except (RuntimeError, MemoryError) as e:  # torch.cuda.OutOfMemoryError is a RuntimeError
            res.warnings.append(f"CUDA device {torch_index}: {name} not measured ({str(e).splitlines()[0]})")
            continue
        finally:
            torch.cuda.empty_cache()
        if isinstance(out, tuple):
            out, res.detail["h2d_pinned_by_size_gbps"] = out
        setattr(res, name, round(float(out), 2))

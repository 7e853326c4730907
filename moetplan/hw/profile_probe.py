"""`moetplan probe`: GPUs, host, pack-dir storage and copy rates of this machine -> HardwareProfile.

`probe()` is what the planner calls when the user gave no --hw/--box/--gpus; `run_probe()` also returns the
details a person wants to see (what the pinned test did, the test file size, rates per copy size).
"""
from __future__ import annotations

import os
import platform
import socket
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from moetplan.hw.gpus import query_gpus
from moetplan.hw.host import query_host
from moetplan.hw.storage import probe_storage
from moetplan.hw.transfer import norm_uuid, cuda_torch, measure_device, torch_index_by_uuid
from moetplan.contract import HardwareProfile


@dataclass
class ProbeResult:
    profile: HardwareProfile
    quick: bool = True
    elapsed_s: float = 0.0
    details: dict[str, Any] = field(default_factory=dict)


def _status(progress: bool, text: str) -> Any:
    import contextlib

    if not progress:
        return contextlib.nullcontext()
    from rich.console import Console

    return Console(stderr=True).status(text)


def _measure_transfers(profile: HardwareProfile, quick: bool, progress: bool, details: dict[str, Any]) -> None:
    torch, why = cuda_torch()
    if torch is None:
        profile.warnings.append(
            f"{len(profile.gpus)} GPU(s) found by the driver but {why}: host->device and device copy rates not "
            "measured (the planner falls back to datasheet/PCIe estimates); install the CUDA runtime extra "
            "(`pip install 'moetplan[cuda]'`) and rerun `moetplan probe`"
        )
        return
    by_uuid = torch_index_by_uuid(torch)
    nvml_uuids = {norm_uuid(g.uuid) for g in profile.gpus if g.uuid}
    if (not nvml_uuids & by_uuid.keys() and torch.cuda.device_count() == len(profile.gpus)
            and not os.environ.get("CUDA_VISIBLE_DEVICES")):
        # torch gave no comparable UUIDs; the same set of devices is visible, so pair them by order.
        by_uuid = {norm_uuid(g.uuid): g.index for g in profile.gpus if g.uuid}
        details["torch_mapping"] = "by index (no UUID match)"
    for g in profile.gpus:
        tidx = by_uuid.get(norm_uuid(g.uuid)) if g.uuid else None
        if tidx is None:
            profile.warnings.append(f"GPU {g.index} ({g.name}) is not visible to torch (CUDA_VISIBLE_DEVICES?): "
                                    "its copy rates were not measured")
            continue
        with _status(progress, f"measuring copy rates on GPU {g.index} ({g.name})"):
            res = measure_device(torch, tidx, quick=quick)
        profile.warnings.extend(res.warnings)
        for k in ("h2d_pinned_gbps", "h2d_pageable_gbps", "h2d_batched_gbps", "d2d_gbps"):
            v = getattr(res, k)
            if v is not None:
                setattr(g, k, v)
                g.sources[k] = "measured"
        details.setdefault("transfers", {})[g.index] = {"torch_index": tidx, **res.detail}


# The expert shape the CPU rate is measured on (a 4096 x 2048 expert, 7 MiB of 2-bit rows): the rate in GB/s of
# rows barely depends on the shape (bench/results/cpu_experts_*.json: within ~15% over four models' experts).
CPU_PROBE_EXPERT = (4096, 2048)


def _sig(x: float, digits: int = 3) -> float:
    return float(f"{x:.{digits}g}")


def _cpu_kernels() -> tuple[Any, Any, str | None]:
    """(the cpu_kernels module, its built extension, None), or (None, None, why not measured)."""
    try:
        from moetplan.runtime.op import cpu_kernels
    except (ImportError, AttributeError) as e:  # no torch, or a stand-in (a CUDA-only shim): nothing runs here
        return None, None, f"not measured: {e}"
    mod = cpu_kernels.get_module()
    if mod is None:
        return None, None, f"not measured: {cpu_kernels.fallback_reason()}"
    return cpu_kernels, mod, None


def measure_cpu_experts(profile: HardwareProfile, quick: bool, details: dict[str, Any]) -> None:
    """host.cpu_expert_gbps: the CPU kernels' rate for a missed expert at batch 1, all cores (issue 39: the cost
    model splits a tiered step's misses between this and the host link). Absent where the kernels do not build."""
    cpu_kernels, mod, why = _cpu_kernels()
    if why:
        details["cpu_experts"] = why
        return
    from moetplan.contract.layout import RowLayout

    lay = RowLayout.for_expert(*CPU_PROBE_EXPERT, 1, "2bit")
    r = cpu_kernels.measure_expert_throughput(lay, min_seconds=0.3 if quick else 1.0,
                                              pool_bytes=(256 if quick else 1024) << 20)
    # significant figures, not decimals: a loaded machine's (or a small expert's) rate is a measurement too, and
    # two decimals wrote a slow one as 0.0
    profile.host.cpu_expert_gbps = _sig(r["gbps"])
    profile.host.sources["cpu_expert_gbps"] = "measured"
    details["cpu_experts"] = {"isa": cpu_kernels.best_isa(mod), "threads": int(r["threads"]),
                              "experts_per_s": round(r["experts_per_s"], 1), "shape": list(CPU_PROBE_EXPERT)}
    details["cpu_experts"].update(measure_cpu_prefill(profile.host, quick))


# Prefill on the CPU backend: the kernels' vector loop on an expert whose rows are whole vector blocks, and the
# scalar loop (forced) on a smaller one (its rate does not depend on the shape: 2.7-2.8 GFLOP/s per thread on this
# VM's EPYC for 128 x 128 and 4096 x 2048 experts alike), each at 64 / 16 tokens per expert, on one thread: vLLM's
# CPU worker computes on its own cores (not all: it leaves one to the scheduler), so the cost model multiplies a
# core's rate by the worker's cores; one thread is also what a shared machine measures most steadily.
CPU_PREFILL_VECTOR_EXPERT = (2048, 1024)
CPU_PREFILL_SCALAR_EXPERT = (512, 256)


def measure_cpu_prefill(host: Any, quick: bool = True) -> dict[str, Any]:
    """host.cpu_kernel_isa, cpu_expert_prefill_gflops and cpu_expert_scalar_gflops: what one token-expert pair of
    a prefill chunk costs on the CPU kernels (cost_model/prefill.py prices the CPU backend's prefill with them).
    Leaves the host untouched where the kernels do not build; returns what it measured, for the details."""
    cpu_kernels, mod, why = _cpu_kernels()
    if why:
        return {"prefill": why}
    from moetplan.contract.layout import RowLayout

    secs = 0.3 if quick else 1.0
    vec = cpu_kernels.measure_prefill_rate(RowLayout.for_expert(*CPU_PREFILL_VECTOR_EXPERT, 1, "2bit"),
                                           tokens_per_expert=64, threads=1, min_seconds=secs)
    sca = cpu_kernels.measure_prefill_rate(RowLayout.for_expert(*CPU_PREFILL_SCALAR_EXPERT, 1, "2bit"),
                                           isa="scalar", tokens_per_expert=16, threads=1, min_seconds=secs)
    host.cpu_kernel_isa = cpu_kernels.best_isa(mod)
    host.cpu_expert_prefill_gflops = _sig(vec["gflops"])
    host.cpu_expert_scalar_gflops = _sig(sca["gflops"])
    for k in ("cpu_kernel_isa", "cpu_expert_prefill_gflops", "cpu_expert_scalar_gflops"):
        host.sources[k] = "measured"
    return {"prefill_vector_shape": list(CPU_PREFILL_VECTOR_EXPERT),
            "prefill_scalar_shape": list(CPU_PREFILL_SCALAR_EXPERT),
            "prefill_vector_us_per_pair": round(vec["us_per_pair"], 2),
            "prefill_scalar_us_per_pair": round(sca["us_per_pair"], 2)}


# The dense half of a CPU prefill chunk: one GEMM of a prefill chunk's tokens through a projection, and causal
# attention over a chunk, both in bf16 on one thread (torch.nn.functional.linear and scaled_dot_product_attention;
# vLLM's CPU backend runs its linears through oneDNN like torch's bf16 linear, and attention through its own CPU
# kernel, which a torch-profiler trace of tiny-moe-py's prefill here put at ~58 GFLOP/s a core against torch's
# 40-50). Sizes: a 512-token chunk through a 2048 x 2048 projection, 8 heads of 128 over 1,024 tokens.
CPU_GEMM_SHAPE = (512, 2048, 2048)  # tokens, in features, out features
CPU_ATTENTION_SHAPE = (8, 128, 1024)  # heads, head dim, tokens (causal)


def measure_cpu_dense(host: Any, quick: bool = True) -> dict[str, Any]:
    """host.cpu_gemm_gflops / cpu_gemm_dtype / cpu_attention_gflops: the CPU's dense GEMM and causal-attention rate
    on one core, in bf16 (what vLLM's CPU backend computes a bf16 checkpoint's dense layers in); the cost model
    multiplies them by the worker's cores. Leaves the host untouched without torch; returns what it measured."""
    try:
        import torch

        from moetplan.runtime.op.cpu_kernels import best_window
    except (ImportError, AttributeError) as e:  # no torch, or a stand-in (a CUDA-only shim, a test double)
        return {"dense": f"not measured: {e}"}
    secs = 0.2 if quick else 1.0

    def rate(fn: Any, flops: float) -> float:
        fn()  # oneDNN builds its primitive on the first call
        n, dt, _ = best_window(fn, 1, secs)
        return flops * n / dt / 1e9

    try:
        m, k, n = CPU_GEMM_SHAPE
        x = torch.randn(m, k, dtype=torch.bfloat16)
        w = torch.randn(n, k, dtype=torch.bfloat16)
        gemm = rate(lambda: torch.nn.functional.linear(x, w), 2.0 * m * k * n)
        h, d, s = CPU_ATTENTION_SHAPE
        q, kk, v = (torch.randn(1, h, s, d, dtype=torch.bfloat16) for _ in range(3))
        # causal: query i reads i + 1 keys, QK^T and PV 2 FLOPs per multiply-add each
        attn = rate(lambda: torch.nn.functional.scaled_dot_product_attention(q, kk, v, is_causal=True),
                    4.0 * h * d * s * (s + 1) / 2)
    except (RuntimeError, AttributeError) as e:  # a torch without bf16 CPU kernels: the rates stay unmeasured
        return {"dense": f"not measured: {e}"}
    host.cpu_gemm_gflops = _sig(gemm)
    host.cpu_gemm_dtype = "bf16"
    host.cpu_attention_gflops = _sig(attn)
    for key in ("cpu_gemm_gflops", "cpu_gemm_dtype", "cpu_attention_gflops"):
        host.sources[key] = "measured"
    return {"gemm_shape": list(CPU_GEMM_SHAPE), "attention_shape": list(CPU_ATTENTION_SHAPE), "threads": 1}


def run_probe(pack_dir: str | os.PathLike[str] | None = None, quick: bool = True, progress: bool = True,
              measure_storage: bool = True, measure_cpu: bool = True) -> ProbeResult:
    """Probe everything; storage problems the user must fix (unwritable --pack-dir) raise UsageError.
    `measure_cpu`: the CPU kernels' expert rate (builds them on first use, ~35 s of CPU once per install) and the
    dense GEMM / attention rates (under a second in quick mode)."""
    t0 = time.perf_counter()
    details: dict[str, Any] = {}
    with _status(progress, "querying GPUs and host"):
        gpu_report = query_gpus()
        host_report = query_host(try_cuda=bool(gpu_report.gpus))
    details["memlock_hard_bytes"] = host_report.memlock_hard_bytes
    phase_s = details["phase_s"] = {"gpus_host": round(time.perf_counter() - t0, 2)}
    details["pinned_test"] = host_report.pinned_test

    profile = HardwareProfile(
        source="probe",
        description=f"{socket.gethostname()} ({platform.system()} {platform.release()}"
                    f"{f', NVIDIA driver {gpu_report.driver_version}' if gpu_report.driver_version else ''}), "
                    f"probed {'quick' if quick else 'full'}",
        gpus=gpu_report.gpus,
        host=host_report.info,
        p2p=gpu_report.p2p,
        warnings=[*gpu_report.warnings, *host_report.warnings],
    )
    if measure_storage:
        st = probe_storage(pack_dir, quick=quick, progress=progress,
                           ram_bytes=int(host_report.info.ram_gib * 1024**3))
        profile.storage = st.info
        details.update(test_file_mib=st.test_file_bytes // 1024**2, seq_mib_read=st.seq_bytes_read // 1024**2,
                       rand_reads=st.rand_reads, rand_queue_depth=st.rand_queue_depth)
        phase_s["storage"] = round(time.perf_counter() - t0 - sum(phase_s.values()), 2)
    if measure_cpu:
        with _status(progress, "measuring the CPU kernels' expert rate"):
            measure_cpu_experts(profile, quick, details)
        with _status(progress, "measuring the CPU's dense GEMM and attention rates"):
            details["cpu_dense"] = measure_cpu_dense(profile.host, quick)
        phase_s["cpu_experts"] = round(time.perf_counter() - t0 - sum(phase_s.values()), 2)
    if profile.gpus:
        _measure_transfers(profile, quick, progress, details)
        phase_s["transfers"] = round(time.perf_counter() - t0 - sum(phase_s.values()), 2)
    elif not gpu_report.warnings:
        profile.warnings.append("no GPU found")
    profile.measured_at = datetime.now(timezone.utc).isoformat(timespec="seconds")
    return ProbeResult(profile=profile, quick=quick, elapsed_s=round(time.perf_counter() - t0, 2), details=details)


def probe(pack_dir: str | None = None, quick: bool = True, progress: bool = True) -> HardwareProfile:
    """This machine's HardwareProfile (source="probe"); quick by default, for the planner."""
    return run_probe(pack_dir, quick=quick, progress=progress).profile

"""The rates the cost model divides by: memory bandwidth, host link, NVMe, PCIe for TP traffic, tensor TFLOPs.

Each comes from the HardwareProfile first (measured beats datasheet); gaps are filled from documented tables in
hwdb/calibration/ (read once), never from constants in code.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any


from moetplan import hwdb
from moetplan.contract.errors import UsageError
from moetplan.contract import GPUInfo, HardwareProfile, Placement
from moetplan.contract.vocab import CpuIsa

GB = 1e9

# Pinned host->device GB/s typical of a PCIe x16 link per generation (hwdb_facts.md §4: Gen3 12.15, Gen4 24-26.4,
# Gen5 51.6 GiB/s-56.3 GB/s measured). Kept beside the other link tables in hwdb/calibration/links.yaml.


@lru_cache(maxsize=1)
def _tables() -> dict[str, Any]:
    out: dict[str, Any] = {}
    from moetplan import hwdb

    for name in ("gpu_compute.yaml", "links.yaml"):
        out[name] = hwdb.calibration_table(name, missing={}) or {}
    return out


@dataclass(frozen=True)
class Rates:
    mem_bw_gbps: float
    h2d_gbps: float
    h2d_source: str
    pcie_gbps: float  # GPU<->GPU rate for TP traffic: peer-to-peer, or staged through host memory
    nvme_gbps: float
    nvme_source: str
    tflops: float
    tflops_source: str
    host_ram_gib: float
    # The CPU backend only (cpu_rates): the expert kernels at prefill batch, GFLOP/s of their vector and scalar
    # loops and the ISA that sets which weights of a row the vector loop takes (cost_model/cpu_compute.py).
    cpu_isa: CpuIsa | None = None
    cpu_vector_gflops: float = 0.0
    cpu_scalar_gflops: float = 0.0
    cpu_kernel_source: str = ""
    # The CPU backend only: GFLOP/s of the dense GEMMs and of causal attention on the worker's cores (cpu_rates).
    cpu_gemm_gflops: float = 0.0
    cpu_attention_gflops: float = 0.0


def rank_gpus(hw: HardwareProfile, placement: Placement) -> list[GPUInfo]:
    ranks = placement.tp * placement.pp
    if not hw.gpus:
        if ranks > 1:
            raise UsageError(
                f"Placement needs tp x pp = {ranks} GPUs but the profile lists none (CPU serving is one rank); "
                "set tp=1 pp=1, or pass --box ID / --gpus 1xrtx-5090 / a probed hw.json"
            )
        return []
    if ranks > len(hw.gpus):
        raise UsageError(
            f"Placement needs tp x pp = {ranks} GPUs but the profile has {len(hw.gpus)}; lower tp/pp or add GPUs"
        )
    return hw.gpus[:ranks]


def h2d_gbps(gpu: GPUInfo) -> tuple[float, str]:
    """Pinned host->device GB/s: batched measurement, then single-copy measurement / datasheet, then PCIe table."""
    if gpu.h2d_batched_gbps:
        return gpu.h2d_batched_gbps, gpu.sources.get("h2d_batched_gbps", "measured")
    if gpu.h2d_pinned_gbps:
        return gpu.h2d_pinned_gbps, gpu.sources.get("h2d_pinned_gbps", "datasheet")
    rate = hwdb.link_h2d_gbps(gpu.pcie_gen, gpu.pcie_width)
    if rate is not None:
        return rate, f"derived (PCIe gen{gpu.pcie_gen} x{gpu.pcie_width or 16} table)"
    default = float(_tables()["links.yaml"].get("default_h2d_gbps", 12.0))
    return default, "default (no PCIe info: Gen3 x16 assumed)"


def nvme_gbps(hw: HardwareProfile) -> tuple[float, str]:
    st = hw.storage
    if st.rand_read_gbps:
        return st.rand_read_gbps, st.sources.get("rand_read_gbps", "measured")
    if st.seq_read_gbps:
        factor = float(_tables()["links.yaml"].get("rand_over_seq", 0.6))
        return st.seq_read_gbps * factor, "derived (sequential x rand_over_seq)"
    return float(_tables()["links.yaml"].get("default_nvme_gbps", 2.0)), "default (no storage measurement)"


@lru_cache(maxsize=64)
def _datasheet_sms(hwdb_id: str) -> int | None:
    # Read once per process, like the tables above: every candidate the solver predicts asks for it.
    try:
        from moetplan import hwdb

        return hwdb.gpu_value(hwdb_id, "sms")
    except Exception:  # noqa: BLE001 - unknown id or loader missing: the caller falls back to memory BW
        return None


def bf16_tflops(gpu: GPUInfo) -> tuple[float, str]:
    table = _tables()["gpu_compute.yaml"]
    per_gpu = (table.get("gpus") or {}).get(gpu.hwdb_id or "", {})
    cc = gpu.compute_capability
    sms = _datasheet_sms(gpu.hwdb_id) if gpu.hwdb_id else None
    rate = per_gpu.get("flops_per_clk_per_sm") or (table.get("flops_per_clk_per_sm") or {}).get(cc)
    clock = per_gpu.get("boost_clock_ghz")
    if sms and rate and clock:
        return float(sms) * float(clock) * 1e9 * float(rate) / 1e12, "derived (SMs x clock x FLOPs/clk/SM)"
    ratios = table.get("flops_per_byte_fallback") or {}
    ratio = float(ratios.get(cc, ratios.get("default", 120)))
    return gpu.mem_bw_gbps * ratio / 1e3, f"estimated (memory BW x {ratio:g} FLOPs/byte)"


def cpu_rates(hw: HardwareProfile) -> Rates:
    """A host without GPUs (vLLM's CPU backend): one rank whose "device memory" is DRAM and whose compute is the
    cores' vector units. Experts are always resident there, so the link rates only matter for prefill streaming."""
    cpu = _tables()["gpu_compute.yaml"]["cpu"]  # the fallbacks live there, once
    dram = hw.host.dram_gbps or float(cpu["default_dram_gbps"])
    dram_src = hw.host.sources.get("dram_gbps", "measured") if hw.host.dram_gbps else "default (no DRAM figure)"
    host_cores = hw.host.cores or int(cpu["default_cores"])
    # The worker computes on its bound cores: the host's less the one(s) vLLM leaves to its scheduler.
    cores = max(1, host_cores - int(cpu["vllm_reserved_cores"]))
    nv, nv_src = nvme_gbps(hw)
    h = hw.host
    # The expert kernels' measured rates; where the probe did not measure them, per-core table values x cores.
    measured = bool(h.cpu_expert_prefill_gflops and h.cpu_expert_scalar_gflops)
    vec = cores * (h.cpu_expert_prefill_gflops or float(cpu["expert_vector_gflops_per_core"]))
    sca = cores * (h.cpu_expert_scalar_gflops or float(cpu["expert_scalar_gflops_per_core"]))
    isa: CpuIsa = h.cpu_kernel_isa or cpu["default_kernel_isa"]
    isa_src = h.sources.get("cpu_kernel_isa", "measured") if h.cpu_kernel_isa else "default"
    src = (f"{cores} worker core(s) x " + ("the probe's per-core rates" if measured else
                                           "gpu_compute.yaml's per-core rates (not probed)") + f", ISA {isa_src}")
    # Dense GEMMs and attention: the probe's per-core rates, else the table's for this ISA.
    row = cpu["dense_gflops_per_core"][isa]
    gemm = cores * (h.cpu_gemm_gflops or float(row["gemm"]))
    attn = cores * (h.cpu_attention_gflops or float(row["attention"]))
    dense_measured = bool(h.cpu_gemm_gflops and h.cpu_attention_gflops)
    dense_src = (f"{cores} worker core(s) of {host_cores} x " + (
        f"the probe's per-core {h.cpu_gemm_dtype or 'bf16'} rates" if dense_measured
        else f"gpu_compute.yaml's per-core {isa} rates (not probed)"))
    return Rates(mem_bw_gbps=dram, h2d_gbps=dram, h2d_source=dram_src, pcie_gbps=dram, nvme_gbps=nv,
                 nvme_source=nv_src, tflops=gemm / 1e3, tflops_source=dense_src,
                 host_ram_gib=hw.host.ram_available_gib or hw.host.ram_gib, cpu_isa=isa, cpu_vector_gflops=vec,
                 cpu_scalar_gflops=sca, cpu_kernel_source=src, cpu_gemm_gflops=gemm, cpu_attention_gflops=attn)


def rates(hw: HardwareProfile, placement: Placement) -> Rates:
    gpus = rank_gpus(hw, placement)
    if not gpus:
        return cpu_rates(hw)
    # The slowest rank sets the pace of a synchronous TP/PP step.
    slow_mem = min(gpus, key=lambda g: g.mem_bw_gbps)
    h2d = [h2d_gbps(g) for g in gpus]
    h2d_rate, h2d_src = min(h2d, key=lambda t: t[0])
    tfl = [bf16_tflops(g) for g in gpus]
    tflops, tfl_src = min(tfl, key=lambda t: t[0])
    nv, nv_src = nvme_gbps(hw)
    # TP traffic between GPUs: peer-to-peer over PCIe at the link rate; without P2P it is staged through host
    # memory, a device->host copy then a host->device copy of every chunk.
    links = _tables()["links.yaml"]
    pcie = h2d_rate if hw.p2p else h2d_rate * float(links.get("gpu_gpu_via_host_share", 0.5))
    return Rates(
        mem_bw_gbps=slow_mem.mem_bw_gbps,
        h2d_gbps=h2d_rate,
        h2d_source=h2d_src,
        pcie_gbps=pcie,
        nvme_gbps=nv,
        nvme_source=nv_src,
        tflops=tflops,
        tflops_source=tfl_src,
        host_ram_gib=hw.host.ram_available_gib or hw.host.ram_gib,
    )

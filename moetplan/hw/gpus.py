"""GPUs as the NVIDIA driver reports them (pynvml), matched to hwdb for datasheet numbers.

The driver is the truth for what is installed (name, memory, link, power limit); hwdb is the truth for what a
model of GPU can do (memory bandwidth, FP8/FP4 tensor cores). When hwdb does not know the GPU we keep the
driver's numbers, derive what we can, and say so in a warning.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any, Callable

from moetplan.contract import GPUInfo

GIB = 1024**3

# NVML reports half the effective data rate for both GDDR and HBM, hence x2 (DDR); bytes = bits / 8.
_DDR_FACTOR = 2


@dataclass
class GpuReport:
    gpus: list[GPUInfo] = field(default_factory=list)
    p2p: bool = False
    warnings: list[str] = field(default_factory=list)
    driver_available: bool = False
    driver_version: str | None = None


def _try(pynvml: Any, fn: Callable[..., Any], *args: Any) -> Any:
    """Call an NVML query; None when this GPU/driver does not support it (NotSupported, NoPermission, ...)."""
    try:
        return fn(*args)
    except pynvml.NVMLError:
        return None


def _text(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def _hwdb_datasheet(driver_name: str, index: int) -> tuple[GPUInfo | None, str | None]:
    """(datasheet GPUInfo, None) when hwdb knows this GPU, else (None, why not)."""
    try:
        from moetplan import hwdb
    except ImportError as e:  # hwdb ships with moetplan; a broken install should not hide the GPU
        return None, f"hwdb could not be loaded ({e})"
    gpu_id = hwdb.match_gpu(driver_name)
    if gpu_id is None:
        return None, None
    return hwdb.gpu_info(gpu_id, index), None


def _derived_caps(cc: str) -> tuple[bool, bool]:
    """FP8 tensor cores from Ada (8.9) on, FP4 from Blackwell (10.x/12.x) on: architecture rules, not a GPU list."""
    major, minor = (int(x) for x in cc.split("."))
    return (major, minor) >= (8, 9), major >= 10


def _read_one(pynvml: Any, index: int, handle: Any) -> tuple[GPUInfo, list[str]]:
    warnings: list[str] = []
    name = _text(pynvml.nvmlDeviceGetName(handle))
    uuid = _try(pynvml, pynvml.nvmlDeviceGetUUID, handle)
    mem = _try(pynvml, pynvml.nvmlDeviceGetMemoryInfo, handle)
    cc_pair = _try(pynvml, pynvml.nvmlDeviceGetCudaComputeCapability, handle)
    driver_cc = f"{cc_pair[0]}.{cc_pair[1]}" if cc_pair else None
    power_mw = _try(pynvml, pynvml.nvmlDeviceGetPowerManagementLimit, handle)

    measured: dict[str, Any] = {
        "uuid": _text(uuid) if uuid is not None else None,
        "pcie_gen": _try(pynvml, pynvml.nvmlDeviceGetCurrPcieLinkGeneration, handle),
        "pcie_width": _try(pynvml, pynvml.nvmlDeviceGetCurrPcieLinkWidth, handle),
        "pcie_gen_max": _try(pynvml, pynvml.nvmlDeviceGetMaxPcieLinkGeneration, handle),
        "pcie_width_max": _try(pynvml, pynvml.nvmlDeviceGetMaxPcieLinkWidth, handle),
        "power_limit_w": round(power_mw / 1000.0, 1) if power_mw else None,
    }
    if mem is not None:
        measured["vram_gib"] = round(mem.total / GIB, 2)
        measured["free_gib"] = round(mem.free / GIB, 2)
    sources: dict[str, str] = {k: "measured" for k, v in measured.items() if v is not None and k != "uuid"}

    sheet, why = _hwdb_datasheet(name, index)
    if sheet is not None:
        base = sheet.model_dump()
        sheet_sources = dict(sheet.sources)
        for k in ("mem_bw_gbps", "compute_capability", "fp8", "fp4"):
            sheet_sources.setdefault(k, "datasheet")
        if driver_cc and driver_cc != sheet.compute_capability:
            warnings.append(
                f"GPU {index} ({name}): driver reports compute capability {driver_cc}, hwdb entry "
                f"'{sheet.hwdb_id}' says {sheet.compute_capability}; using the driver's value (fix hwdb/gpus.yaml)"
            )
            base["compute_capability"] = driver_cc
            sheet_sources["compute_capability"] = "measured"
        base.update({k: v for k, v in measured.items() if v is not None})  # the installed card beats the sheet
        base.update(index=index, name=name, sources={**sheet_sources, **sources})
        return GPUInfo.model_validate(base), warnings

    # Unmatched: everything from the driver; bandwidth from memory clock x bus width (theoretical peak).
    why_txt = f" ({why})" if why else ""
    warnings.append(
        f"GPU {index} '{name}' is not in hwdb{why_txt}: memory bandwidth and FP8/FP4 support are derived from "
        "the driver's clocks and compute capability, not a datasheet; add it to hwdb/gpus.yaml for exact numbers"
    )
    clock_mhz = _try(pynvml, pynvml.nvmlDeviceGetMaxClockInfo, handle, pynvml.NVML_CLOCK_MEM)
    bus_bits = _try(pynvml, pynvml.nvmlDeviceGetMemoryBusWidth, handle)
    bw = round(clock_mhz * 1e6 * _DDR_FACTOR * bus_bits / 8 / 1e9, 1) if clock_mhz and bus_bits else 0.0
    cc = driver_cc or "0.0"
    fp8, fp4 = _derived_caps(cc)
    sources.update(mem_bw_gbps="derived", fp8="derived", fp4="derived")
    if driver_cc:
        sources["compute_capability"] = "measured"
    if not bw:
        warnings.append(f"GPU {index} '{name}': the driver did not report memory clock/bus width; bandwidth unknown (0)")
    info = GPUInfo(
        index=index, name=name, hwdb_id=None, vram_gib=measured.get("vram_gib", 0.0),
        free_gib=measured.get("free_gib"), mem_bw_gbps=bw, compute_capability=cc, fp8=fp8, fp4=fp4,
        **{k: measured[k] for k in ("uuid", "pcie_gen", "pcie_width", "pcie_gen_max", "pcie_width_max",
                                     "power_limit_w")},
        sources=sources,
    )
    return info, warnings


def _p2p_links(pynvml: Any, handles: list[Any], gpus: list[GPUInfo]) -> bool:
    """Fill nvlink_peers; True when every pair can read each other's memory directly (tensor-parallel traffic)."""
    if len(handles) < 2:
        return False
    all_ok = True
    for (i, hi), (j, hj) in itertools.permutations(enumerate(handles), 2):
        read = _try(pynvml, pynvml.nvmlDeviceGetP2PStatus, hi, hj, pynvml.NVML_P2P_CAPS_INDEX_READ)
        if read != pynvml.NVML_P2P_STATUS_OK:
            all_ok = False
        nvl = _try(pynvml, pynvml.nvmlDeviceGetP2PStatus, hi, hj, pynvml.NVML_P2P_CAPS_INDEX_NVLINK)
        if nvl == pynvml.NVML_P2P_STATUS_OK:
            gpus[i].nvlink_peers.append(j)
    return all_ok


def has_nvidia_gpu() -> bool:
    """Whether the NVIDIA driver reports a GPU; cheap (no device queries), for deciding what to probe. Without the
    driver's device files there is nothing to ask NVML."""
    import os

    if os.name != "nt" and not (os.path.exists("/proc/driver/nvidia") or os.path.exists("/dev/nvidia0")):
        return False
    return local_gpu_count() > 0


def query_gpus() -> GpuReport:
    """Every NVIDIA GPU the driver sees; an empty report (with the reason) when there is no driver."""
    report = GpuReport()
    try:
        import pynvml
    except ImportError:
        report.warnings.append(
            "pynvml (nvidia-ml-py) is not installed, so no GPU could be queried; `pip install nvidia-ml-py` "
            "if this machine has NVIDIA GPUs"
        )
        return report
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as e:
        report.warnings.append(
            f"no NVIDIA GPU: the NVIDIA driver library could not start ({_text(e) or type(e).__name__}); "
            "if this machine has NVIDIA GPUs, install the driver (nvidia-smi must work) and rerun `moetplan probe`"
        )
        return report
    report.driver_available = True
    version = _try(pynvml, getattr(pynvml, "nvmlSystemGetDriverVersion", lambda: None))
    report.driver_version = _text(version) if version else None
    try:
        count = pynvml.nvmlDeviceGetCount()
        handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
        for i, h in enumerate(handles):
            info, warns = _read_one(pynvml, i, h)
            report.gpus.append(info)
            report.warnings.extend(warns)
        report.p2p = _p2p_links(pynvml, handles, report.gpus)
        for g in report.gpus:
            if g.pcie_gen and g.pcie_gen_max and g.pcie_gen < g.pcie_gen_max:
                # Idle GPUs drop the link speed to save power; only the max says what the slot can do.
                report.warnings.append(
                    f"GPU {g.index}: PCIe link now at gen {g.pcie_gen} (max gen {g.pcie_gen_max}); normal when "
                    "idle (power saving), the measured host->device rate shows what the slot delivers under load"
                )
            if g.pcie_width and g.pcie_width_max and g.pcie_width < g.pcie_width_max:
                report.warnings.append(
                    f"GPU {g.index}: PCIe link runs x{g.pcie_width} of x{g.pcie_width_max} possible; a narrower "
                    "slot or riser cuts expert transfer speed (if the measured host->device rate is low too, "
                    "move the card to a full-width slot)"
                )
    except pynvml.NVMLError as e:
        report.warnings.append(f"NVML failed while listing GPUs ({_text(e)}); GPU list may be incomplete")
    finally:
        try:
            pynvml.nvmlShutdown()
        except pynvml.NVMLError:
            pass
    if report.driver_available and not report.gpus:
        report.warnings.append("the NVIDIA driver is loaded but reports no GPU")
    return report


def local_gpu_count() -> int:
    """NVIDIA GPUs the driver reports here (0 without a driver): decides CPU-backend vs GPU plans."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            return int(pynvml.nvmlDeviceGetCount())
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # noqa: BLE001 - no driver, no library: no GPU
        return 0

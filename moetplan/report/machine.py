"""Machine facts recorded beside every benchmark and run record (so numbers say where they were measured)."""
from __future__ import annotations

import os
import platform
import sys
from typing import Any

from moetplan.hw.host import cpu_model


def machine_info(**extra: Any) -> dict[str, Any]:
    """Platform, CPU, RAM, Python, moetplan; torch/CUDA/GPU only when torch is already imported (it is heavy)."""
    from moetplan import __version__

    info: dict[str, Any] = {
        "hostname": platform.node(),
        "platform": platform.platform(),
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "ram_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
        "python": platform.python_version(),
        "moetplan_version": __version__,
    }
    torch = sys.modules.get("torch")
    if torch is not None:
        info["torch"] = torch.__version__
        info["cuda"] = torch.version.cuda
        if torch.cuda.is_available():
            info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    info.update(extra)
    return info

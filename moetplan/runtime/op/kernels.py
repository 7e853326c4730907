"""Build-on-first-use of the CUDA MoE extension (csrc/moe_kernels.cu), its cache, and `moetplan build-kernels`.

The extension is compiled with torch.utils.cpp_extension.load into the user cache dir, keyed by the source hash,
the torch/CUDA versions and the target architectures, so a rebuilt source or a new torch never loads a stale
binary. Without nvcc or a CUDA device the runtime uses the torch reference path and says so once.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import threading
from pathlib import Path
from typing import Any


from moetplan.contract.errors import MoetplanError, UsageError
from moetplan.contract import envs

log = logging.getLogger("moetplan.kernels")

# One source for every NVIDIA generation moetplan targets: Ampere (RTX 30, A100), Ada (RTX 40), Hopper (H100/H200),
# Blackwell consumer/workstation (RTX 50, RTX PRO). mma.sync m16n8k16 bf16 exists on all of them.
SUPPORTED_ARCHS: tuple[str, ...] = ("8.0", "8.6", "8.9", "9.0", "12.0")
MIN_CAPABILITY = (8, 0)
EXT_NAME = "moetplan_moe"

_lock = threading.Lock()
_state: dict[str, Any] = {"module": None, "tried": False, "reason": None, "noted": set()}


class KernelBuildError(MoetplanError):
    """nvcc failed or is missing; the message names the cause and the fix."""


def source_dir() -> Path:
    # csrc/ sits next to the package in a checkout; an installed wheel ships it under moetplan/_csrc.
    pkg = Path(__file__).resolve().parents[2]  # moetplan/ (this file: moetplan/runtime/op/kernels.py)
    for cand in (pkg.parent / "csrc", pkg / "_csrc"):
        if (cand / "moe_kernels.cu").is_file():
            return cand
    raise KernelBuildError("csrc/moe_kernels.cu not found next to the moetplan package; reinstall from a checkout")


def cache_root() -> Path:
    env = envs.get(envs.KERNEL_CACHE)
    if env:
        return Path(env)
    import platformdirs

    return Path(platformdirs.user_cache_dir("moetplan")) / "kernels"


def normalize_archs(archs: list[str] | None) -> list[str]:
    """'all' / None -> this machine's GPU capability if any, else every supported arch."""
    if archs is None or archs == ["native"]:
        cap = _device_capability()
        return [cap] if cap else list(SUPPORTED_ARCHS)
    if archs == ["all"]:
        return list(SUPPORTED_ARCHS)
    out = []
    for a in archs:
        a = a.strip().removeprefix("sm_").removeprefix("sm")
        if "." not in a and a.isdigit() and len(a) >= 2:
            a = f"{a[:-1]}.{a[-1]}"
        if a not in SUPPORTED_ARCHS:
            raise UsageError(f"Unsupported CUDA arch '{a}'; use one of {', '.join(SUPPORTED_ARCHS)} or 'all'")
        out.append(a)
    return sorted(set(out))


def _device_capability() -> str | None:
    try:
        import torch

        if not torch.cuda.is_available():
            return None
        major, minor = torch.cuda.get_device_capability()
    except Exception:  # pragma: no cover - broken driver
        return None
    if (major, minor) < MIN_CAPABILITY:
        return None
    # A chip between targets (sm_87, sm_100, sm_121) runs the nearest older target: its cubin within one major
    # version, its PTX (always embedded, see gencode_flags) across majors.
    older = [a for a in SUPPORTED_ARCHS if _cap_tuple(a) <= (major, minor)]
    return max(older, key=_cap_tuple)


def _cap_tuple(a: str) -> tuple[int, int]:
    major, minor = a.split(".")
    return int(major), int(minor)


def gencode_flags(archs: list[str]) -> list[str]:
    flags = []
    for a in archs:
        n = a.replace(".", "")
        # 9.0 (H100/H200) builds the arch-specific sm_90a binary: the wgmma prefill stages need it, and the
        # binary runs on exactly the compute-capability 9.0 chips it is for.
        n_bin = "90a" if n == "90" else n
        flags.append(f"-gencode=arch=compute_{n_bin},code=sm_{n_bin}")
    # PTX of the newest target lets a future chip JIT it.
    newest = max(archs, key=_cap_tuple)
    flags.append(f"-gencode=arch=compute_{newest.replace('.', '')},code=compute_{newest.replace('.', '')}")
    return flags


def build_key(archs: list[str]) -> str:
    import torch

    # Every source file counts (moe_kernels.cu includes the .cuh headers beside it).
    h = hashlib.sha256()
    for src in sorted(source_dir().glob("*.cu*")):
        h.update(src.name.encode())
        h.update(src.read_bytes())
    h.update(json.dumps([torch.__version__, torch.version.cuda, archs]).encode())
    return h.hexdigest()[:16]


def nvcc_path() -> str | None:
    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if cuda_home and (Path(cuda_home) / "bin" / "nvcc").is_file():
        return str(Path(cuda_home) / "bin" / "nvcc")
    return shutil.which("nvcc")


def build(archs: list[str] | None = None, verbose: bool = False):
    """Compile (or load from the cache) the extension for `archs`; returns the module."""
    import torch

    if torch.version.cuda is None:
        raise KernelBuildError(f"This torch ({torch.__version__}) has no CUDA support; install a CUDA build of torch")
    if nvcc_path() is None:
        raise KernelBuildError("nvcc not found; install the CUDA toolkit matching torch "
                               f"(CUDA {torch.version.cuda}) or set CUDA_HOME")
    archs = normalize_archs(archs)
    key = build_key(archs)
    build_dir = cache_root() / f"{EXT_NAME}-{key}"
    build_dir.mkdir(parents=True, exist_ok=True)
    from torch.utils.cpp_extension import load

    # The arch flags are explicit; keep torch from adding its own guess on top.
    os.environ["TORCH_CUDA_ARCH_LIST"] = ";".join(archs)
    try:
        return load(
            name=f"{EXT_NAME}_{key}",
            sources=[str(source_dir() / "moe_kernels.cu")],
            extra_cuda_cflags=["-O3", "-std=c++17", "--expt-relaxed-constexpr", *gencode_flags(archs)],
            extra_cflags=["-O3"],
            build_directory=str(build_dir),
            verbose=verbose,
        )
    except Exception as e:  # the compiler's own message is the useful part
        raise KernelBuildError(f"Building the MoE kernels for sm {','.join(archs)} failed: {e}. "
                               f"Check nvcc against torch's CUDA {torch.version.cuda}; build log in {build_dir}") from e


def get_module():
    """The loaded extension, or None (reference path). Builds once per process; never raises."""
    if _state["tried"]:
        return _state["module"]
    with _lock:
        if _state["tried"]:
            return _state["module"]
        reason = None
        mod = None
        try:
            import torch

            if not torch.cuda.is_available():
                reason = "no CUDA device"
            elif _device_capability() is None:
                reason = f"GPU capability {torch.cuda.get_device_capability()} below sm_80"
            else:
                mod = build(None)
        except MoetplanError as e:
            reason = str(e)
        except Exception as e:  # pragma: no cover - unexpected toolchain failures
            reason = f"{type(e).__name__}: {e}"
        _state.update(module=mod, tried=True, reason=reason)
        return mod


def fallback_reason() -> str | None:
    get_module()
    return _state["reason"]


def note_reference(why: str) -> None:
    """One log line per distinct reason a GPU step ran on the torch reference instead of the kernels."""
    seen = _state.setdefault("noted", set())
    if why not in seen:
        seen.add(why)
        log.warning("moetplan MoE kernels not used (%s); using the torch reference path", why)


def reset_for_tests() -> None:
    _state.update(module=None, tried=False, reason=None, noted=set())

"""Workarounds the plugin carries for vLLM on CUDA: two sm_12x bugs (RTX 50, RTX PRO 6000 Blackwell) and the
CUDA-graph capture mode. The plugin calls `apply_fixes()` in every vLLM process on the CUDA platform; each fix is
installed only where `vllm_compat.fix_applies` says this vLLM release and this GPU family need it (the table of
releases is there, docs/VLLM_VERSIONS.md says which fixes upstream already has).

- Triton MLA decode, 576-wide heads (Kimi / DeepSeek-V3 dense MLA; TRITON_MLA is the only dense-MLA decode backend
  on sm_120): vLLM launches `_fwd_grouped_kernel_stage1` with num_stages=2, which with an fp8 KV cache needs
  100 KiB of shared memory; an sm_12x block may have 99 KiB, so the launch fails. The kernel object is wrapped so
  those launches use one stage; every other launch passes through untouched.
- DeepSeek-V4 o_proj: vLLM picks DeepGEMM's SM100 einsum recipe (1,1,128) with TMA-packed scales for every
  capability >= 10. The DeepGEMM vLLM bundles has SM120 fp8 kernels for that layout; a DeepGEMM without them
  (vLLM imports an installed `deep_gemm` before its own) needs the SM90 recipe (1,128,128) with raw fp32 scales.
- Capture mode: vLLM captures in the global error mode, where a CUDA call from any other thread of the process
  during a capture invalidates it; the plugin's background threads (FP4 promoter, expert fetches) make such calls.
  torch.cuda.graph then defaults to thread_local.
"""
from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
import logging
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from moetplan.vllm_compat import fix_applies, vllm_version

log = logging.getLogger("moetplan.runtime")

SM12X_SHARED_MEMORY = 101376  # bytes of shared memory one block may use on sm_120 / sm_121 (99 KiB)

# --------------------------------------------------------------------------- Triton MLA decode stages

TRITON_DECODE_MODULE = "vllm.v1.attention.ops.triton_decode_attention"
STAGE1_KERNEL = "_fwd_grouped_kernel_stage1"
# The tile vLLM picks for 576-wide MLA heads (kv_lora_rank 512 + rope 64).
_MLA_576 = {"IS_MLA": True, "BLOCK_DMODEL": 512, "BLOCK_DPE": 64}
TRITON_DEFAULT_STAGES = 3  # a Triton launch that names no num_stages gets this many


def cap_stages(launch_kwargs: dict[str, Any], max_stages: int = 1) -> dict[str, Any]:
    """The launch's keyword arguments with num_stages lowered to `max_stages` for 576-wide MLA tiles."""
    if any(launch_kwargs.get(k) != v for k, v in _MLA_576.items()):
        return launch_kwargs
    if int(launch_kwargs.get("num_stages", TRITON_DEFAULT_STAGES)) <= max_stages:
        return launch_kwargs
    return {**launch_kwargs, "num_stages": max_stages}


class StageCappedKernel:
    """Stands in for a Triton JIT kernel: `kernel[grid](...)` launches with `cap_stages` applied; attributes are
    the kernel's own."""

    def __init__(self, kernel: Any, max_stages: int = 1):
        self.kernel = kernel
        self.max_stages = max_stages

    def __getitem__(self, grid: Any) -> Callable[..., Any]:
        launch = self.kernel[grid]

        def run(*args: Any, **kwargs: Any) -> Any:
            return launch(*args, **cap_stages(kwargs, self.max_stages))

        return run

    def __getattr__(self, name: str) -> Any:
        return getattr(self.kernel, name)


def cap_triton_mla_stages(module: Any = None, max_stages: int = 1) -> bool:
    """Wrap the grouped decode kernel of vLLM's triton_decode_attention (or `module`); idempotent. The launcher
    `_decode_grouped_att_m_fwd` looks the kernel up in its module's globals at each call, so replacing the
    module attribute is enough."""
    module = module if module is not None else importlib.import_module(TRITON_DECODE_MODULE)
    kernel = getattr(module, STAGE1_KERNEL, None)
    if kernel is None:
        return False
    if not isinstance(kernel, StageCappedKernel):
        setattr(module, STAGE1_KERNEL, StageCappedKernel(kernel, max_stages))
    return True


# --------------------------------------------------------------------------- DeepSeek-V4 o_proj einsum recipe

O_PROJ_MODULE = "vllm.models.deepseek_v4.nvidia.ops.o_proj"
# Modules that import compute_fp8_einsum_recipe by name (0.26-0.33); patched too when already imported.
O_PROJ_USERS = (
    "vllm.models.deepseek_v4.nvidia.flashmla",
    "vllm.models.deepseek_v4.nvidia.flashinfer_sparse",
    "vllm.models.deepseek_v41.nvidia.flashmla",
    "vllm.models.deepseek_v41.nvidia.flashinfer_sparse",
)
RECIPE_FN = "compute_fp8_einsum_recipe"
SM90_RECIPE = ((1, 128, 128), False)  # (einsum recipe, TMA-aligned packed scales)
_SM120_FP8_KERNEL = "include/deep_gemm/impls/sm120_fp8_fp4_gemm_1d1d.cuh"


def deep_gemm_dir() -> Path | None:
    """The DeepGEMM package vLLM uses: an installed `deep_gemm` first, else the copy vLLM bundles."""
    for name in ("deep_gemm", "vllm.third_party.deep_gemm"):
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            spec = None
        if spec is not None and spec.origin:
            return Path(spec.origin).parent
    return None


def deep_gemm_has_sm120_fp8(pkg: Path | None) -> bool:
    """Whether that DeepGEMM carries SM120 fp8 GEMM kernels (it JIT-compiles them from these headers)."""
    return pkg is not None and (pkg / _SM120_FP8_KERNEL).is_file()


def sm90_recipe(original: Callable[..., tuple[tuple[int, int, int], bool]]) -> Callable[..., Any]:
    """compute_fp8_einsum_recipe answering the SM90 recipe where vLLM chose the SM100 one."""
    if getattr(original, "_moetplan_sm90", False):
        return original

    @functools.wraps(original)
    def recipe(*args: Any, **kwargs: Any) -> tuple[tuple[int, int, int], bool]:
        einsum, tma_aligned = original(*args, **kwargs)
        if einsum[1] == 1:  # (1, 1, block): SM100 per-row packed scales
            return SM90_RECIPE
        return einsum, tma_aligned

    recipe._moetplan_sm90 = True  # type: ignore[attr-defined]
    return recipe


def sm90_o_proj_recipe(modules: dict[str, Any] | None = None) -> bool:
    """Patch compute_fp8_einsum_recipe where DeepSeek-V4's attention looks it up. `modules` (name -> module) is
    for tests; by default o_proj is imported and its users patched where already imported."""
    if modules is None:
        try:
            modules = {O_PROJ_MODULE: importlib.import_module(O_PROJ_MODULE)}
        except ImportError:
            return False
        modules.update({n: sys.modules[n] for n in O_PROJ_USERS if n in sys.modules})
    patched = False
    for mod in modules.values():
        fn = getattr(mod, RECIPE_FN, None)
        if fn is not None:
            setattr(mod, RECIPE_FN, sm90_recipe(fn))
            patched = True
    return patched


# --------------------------------------------------------------------------- CUDA-graph capture mode


def thread_local_capture(graph_cls: Any = None) -> bool:
    """Make `torch.cuda.graph(...)` (or `graph_cls`) capture in thread_local mode unless the caller names a mode;
    idempotent. False when this torch has no capture_error_mode."""
    if graph_cls is None:
        import torch

        graph_cls = torch.cuda.graph
    init = graph_cls.__init__
    if getattr(init, "_moetplan_thread_local", False):
        return True
    params = list(inspect.signature(init).parameters)
    if "capture_error_mode" not in params:
        return False
    position = params.index("capture_error_mode")  # counting self

    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        if len(args) < position:
            kwargs.setdefault("capture_error_mode", "thread_local")
        init(self, *args, **kwargs)

    __init__._moetplan_thread_local = True  # type: ignore[attr-defined]
    graph_cls.__init__ = __init__
    return True


# --------------------------------------------------------------------------- the plugin's entry


def _capability() -> tuple[int, int] | None:
    try:
        from vllm.platforms import current_platform

        cap = current_platform.get_device_capability()
    except Exception:  # no device visible to this process (an API server without GPUs)
        return None
    return (int(cap.major), int(cap.minor)) if cap is not None else None


def apply_fixes(version: tuple[int, int, int] | None = None,
                capability: tuple[int, int] | None = None) -> list[str]:
    """Install the fixes this vLLM release and this GPU need; returns their names."""
    version = version if version is not None else vllm_version()
    capability = capability if capability is not None else _capability()
    applied = []
    if fix_applies("triton_mla_576_stages", version, capability) and cap_triton_mla_stages():
        applied.append("triton_mla_576_stages")
    if (fix_applies("ds4_o_proj_sm90_scales", version, capability)
            and not deep_gemm_has_sm120_fp8(deep_gemm_dir()) and sm90_o_proj_recipe()):
        applied.append("ds4_o_proj_sm90_scales")
    if fix_applies("thread_local_capture", version, capability) and thread_local_capture():
        applied.append("thread_local_capture")
    if applied:
        log.info("moetplan: vLLM fixes installed for sm_%d%d: %s", capability[0], capability[1], ", ".join(applied))
    return applied

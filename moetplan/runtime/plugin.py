"""vLLM general plugin (entry point `vllm.general_plugins: moetplan = moetplan.runtime.plugin:register`).

vLLM calls `register()` in every process it starts (API server, engine core, each worker) before the model
config is built, so it must be idempotent and cheap: it registers the "moetplan" quantization method, on the
CPU platform the AMX permission (`cpu_amx`) and the rotary-embedding workaround, on CUDA the fixes this vLLM release
and GPU need (`cuda_fixes`), and a model-loader hook. It first checks the vLLM version against the supported range
(`vllm_compat`). The plan itself (MOETPLAN_PLAN) is read when vLLM builds the method's config.

The model-loader hook: the confidence gate wraps the loaded model's forward / compute_logits (docs/GATE.md), so it
needs the model object, which the MoE method never sees. vLLM's model runners (GPU and CPU) get the model from
`BaseModelLoader.load_model` in the worker process; wrapping that method hands the finished model to the worker
its MoE methods hold (`WorkerRuntime.after_model_loaded`), which does nothing unless the plan enables a gate.
"""
from __future__ import annotations

import functools
import logging
from typing import Any

log = logging.getLogger("moetplan.runtime")

_DONE = False


def install_load_hook(loader_cls: Any = None) -> bool:
    """Wrap vLLM's BaseModelLoader.load_model (or `loader_cls.load_model`) once (idempotent); False when this vLLM
    has no such method."""
    if loader_cls is None:
        try:
            from moetplan.vllm_compat import BaseModelLoader as loader_cls
        except ImportError:  # pragma: no cover - another vLLM layout: the gate is then not installed (logged)
            log.warning("moetplan: vLLM has no BaseModelLoader; the confidence gate cannot be installed")
            return False
    orig = loader_cls.load_model
    if getattr(orig, "_moetplan_hook", False):
        return True

    @functools.wraps(orig)
    def load_model(self: Any, vllm_config: Any, model_config: Any, *args: Any, **kwargs: Any) -> Any:
        model = orig(self, vllm_config, model_config, *args, **kwargs)
        from moetplan.runtime.vllm_method import after_model_loaded

        return after_model_loaded(model, vllm_config)

    load_model._moetplan_hook = True  # type: ignore[attr-defined]
    loader_cls.load_model = load_model
    return True


def register() -> None:
    global _DONE
    if _DONE:
        return
    from moetplan import vllm_compat
    from moetplan.runtime import cpu_amx

    note = vllm_compat.check_supported()  # raises for a vLLM older than the range
    if note:
        log.warning("moetplan: %s", note)
    from moetplan.runtime.rotary_fix import apply_rotary_fix
    from moetplan.runtime.vllm_config import register_method

    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        cpu_amx.prepare()
    elif current_platform.is_cuda():
        from moetplan.runtime.cuda_fixes import apply_fixes

        apply_fixes()
    register_method()
    if apply_rotary_fix():
        log.debug("moetplan: CPU rotary-embedding fallback for 3-D / strided q,k installed")
    install_load_hook()
    _DONE = True

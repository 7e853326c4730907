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

The runner hook (`prepare_replay`, plans with moe_graphs=replay): Model Runner V1 calls each step's model through
one method (`vllm_compat.install_forward_hook`); wrapping it puts the replay driver around the graph replay, before
sampling (runtime/store/miss_replay.py, docs/CUDA_GRAPHS.md).
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
        from moetplan.runtime.vllm.vllm_method import after_model_loaded

        return after_model_loaded(model, vllm_config)

    load_model._moetplan_hook = True  # type: ignore[attr-defined]
    loader_cls.load_model = load_model
    return True


def register() -> None:
    global _DONE
    if _DONE:
        prepare_replay()  # a later engine of this process may serve another plan (offline scripts)
        return
    from moetplan import vllm_compat
    from moetplan.runtime.vllm import cpu_amx

    note = vllm_compat.check_supported()  # raises for a vLLM older than the range
    if note:
        log.warning("moetplan: %s", note)
    from moetplan.runtime.vllm.rotary_fix import apply_rotary_fix
    from moetplan.runtime.vllm.vllm_config import register_method

    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        cpu_amx.prepare()
    elif current_platform.is_cuda():
        from moetplan.runtime.vllm.cuda_fixes import apply_fixes

        apply_fixes()
    register_method()
    if apply_rotary_fix():
        log.debug("moetplan: CPU rotary-embedding fallback for 3-D / strided q,k installed")
    install_load_hook()
    prepare_replay()
    _DONE = True


def _plan_replays() -> bool:
    """Whether MOETPLAN_PLAN names a plan whose steps run through the replay driver (read cheaply: a broken plan is reported by the
    worker, which reads it properly)."""
    from moetplan.contract import Plan, envs, load_json

    path = envs.get(envs.PLAN)
    if not path:
        return False
    try:
        return bool(load_json(Plan, path).runtime.records_steps)
    except Exception:
        return False


def prepare_replay() -> bool:
    """For a plan whose steps the driver runs (tiered or FP4 reserve, moe_graphs=replay): ask vLLM for Model Runner V1 (the runner whose forward call the driver
    wraps; a user's explicit VLLM_USE_V2_MODEL_RUNNER is kept, and the worker refuses V2 with the fix) and wrap
    that call in this process (`WorkerRuntime.forward_step`). Nothing for other plans."""
    import os

    if not _plan_replays():
        return False
    os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")
    from moetplan import vllm_compat
    from moetplan.runtime.vllm import worker

    worker.FORWARD_HOOKED = vllm_compat.install_forward_hook(worker.around_forward)
    if not worker.FORWARD_HOOKED:
        log.warning("moetplan: this vLLM has no Model Runner V1 forward call to wrap; a replay plan cannot run here "
                    "(re-plan with --set moe_graphs=split)")
        return False
    return True

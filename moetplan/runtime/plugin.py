"""vLLM general plugin (entry point `vllm.general_plugins: moetplan = moetplan.runtime.plugin:register`).

vLLM calls `register()` in every process it starts (API server, engine core, each worker) before the model
config is built, so it must be idempotent and cheap: it registers the "moetplan" quantization method and, on
the CPU platform, the rotary-embedding workaround. The plan itself (MOETPLAN_PLAN) is read lazily, when vLLM
builds the method's config in the worker, so the API server never pays for it.
"""
from __future__ import annotations

import logging

log = logging.getLogger("moetplan.runtime")

_DONE = False


def register() -> None:
    global _DONE
    if _DONE:
        return
    from moetplan.runtime.rotary_fix import apply_rotary_fix
    from moetplan.runtime.vllm_method import register_method

    register_method()
    if apply_rotary_fix():
        log.debug("moetplan: CPU rotary-embedding fallback for 3-D / strided q,k installed")
    _DONE = True

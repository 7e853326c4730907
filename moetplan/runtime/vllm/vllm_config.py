"""The "moetplan" quantization method for vLLM: routed experts in our format, everything else as the checkpoint has it.

Selection: `--quantization moetplan`. For a bf16 checkpoint (no quantization_config) vLLM builds `MoetplanConfig()`
with no arguments; for a quantized checkpoint (FP8, ...) `override_quantization_method` claims it when the user
asked for moetplan, and `from_config` receives the checkpoint's own config, kept as the *inner* config: dense layers
and the expert weight loading go through it unchanged, and only the routed experts are re-quantized at load. Users
point at the official checkpoint; nothing is edited on disk.

Configuration comes from the Plan only (MOETPLAN_PLAN): the config holds the process's `WorkerRuntime`, built from
the plan's runtime section, and hands it to every MoE method.
"""
from __future__ import annotations

from typing import Any

import torch

from moetplan import vllm_compat
from moetplan.runtime.vllm.vllm_method import method_for
from moetplan.runtime.vllm.worker import WorkerRuntime
from moetplan.vllm_compat import QuantizationConfig, register_quantization_config

METHOD_NAME = "moetplan"


class MoetplanConfig(QuantizationConfig):
    """Routed experts in the moetplan format; other layers as the checkpoint (or its own config) has them."""

    def __init__(self, checkpoint_config: dict[str, Any] | None = None, worker: WorkerRuntime | None = None):
        super().__init__()
        # Built here so a missing or bad plan fails at config time, with the fix in the message.
        self.worker = worker if worker is not None else WorkerRuntime.for_process()
        self.checkpoint_config = checkpoint_config
        self.inner = None
        qm = (checkpoint_config or {}).get("quant_method")
        if qm and qm != METHOD_NAME:
            from moetplan.vllm_compat import get_quantization_config

            self.inner = get_quantization_config(qm).from_config(checkpoint_config)
            # One shared dict: vLLM fills the mapping in place on the config it sees (ours).
            self.inner.packed_modules_mapping = self._packed

    # Models fill packed_modules_mapping on the config they see; the inner config needs it too.
    @property
    def packed_modules_mapping(self):  # type: ignore[override]
        return self._packed

    @packed_modules_mapping.setter
    def packed_modules_mapping(self, value):
        self._packed = value
        if getattr(self, "inner", None) is not None:
            self.inner.packed_modules_mapping = value

    def get_name(self) -> str:
        return METHOD_NAME

    def get_supported_act_dtypes(self) -> list[torch.dtype]:
        return [torch.bfloat16, torch.float16, torch.float32]

    @classmethod
    def get_min_capability(cls) -> int:
        return 70  # the torch path runs anywhere CUDA does; kernels pick themselves at runtime

    @staticmethod
    def get_config_filenames() -> list[str]:
        return []

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "MoetplanConfig":
        return cls(config)

    @classmethod
    def override_quantization_method(cls, hf_quant_cfg, user_quant, hf_config=None):
        # Claim any checkpoint format when the user asked for moetplan: we re-quantize its routed experts.
        return METHOD_NAME if user_quant == METHOD_NAME else None

    def get_quant_method(self, layer, prefix):
        vllm_compat.check_moe_backend()
        from moetplan.vllm_compat import (
            LinearBase,
            RoutedExperts,
            UnquantizedLinearMethod,
        )

        if isinstance(layer, RoutedExperts):
            source = self.inner.get_quant_method(layer, prefix) if self.inner is not None else None
            if source is not None and type(source).__name__ == "UnquantizedFusedMoEMethod":
                source = None
            return method_for(layer.moe_config, source, self.worker)
        if self.inner is not None:
            return self.inner.get_quant_method(layer, prefix)
        if isinstance(layer, LinearBase):
            return UnquantizedLinearMethod()
        return None

    def get_cache_scale_mapper(self):
        return self.inner.get_cache_scale_mapper() if self.inner is not None else super().get_cache_scale_mapper()

    def apply_vllm_mapper(self, hf_to_vllm_mapper):
        if self.inner is not None:
            self.inner.apply_vllm_mapper(hf_to_vllm_mapper)

    def maybe_update_config(self, model_name, hf_config=None, revision=None):
        if self.inner is not None:
            self.inner.maybe_update_config(model_name, hf_config, revision)


def register_method() -> type:
    """Register the config class under "moetplan" (idempotent: re-registering the same class is a no-op)."""
    from moetplan.vllm_compat import (
        QUANTIZATION_METHODS,
        get_quantization_config,
    )

    if METHOD_NAME not in QUANTIZATION_METHODS or get_quantization_config(METHOD_NAME) is not MoetplanConfig:
        register_quantization_config(METHOD_NAME)(MoetplanConfig)
    return MoetplanConfig


__all__ = ["METHOD_NAME", "MoetplanConfig", "register_method"]

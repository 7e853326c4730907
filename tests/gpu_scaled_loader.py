"""A vLLM general plugin for the GPU end-to-end tests: the load format `moetplan_scaled_dummy`.

vLLM's dummy loader fills every weight, norm weights included, uniformly in +-1e-3. Through a few layers the
activations shrink to that scale and the routed experts' outputs (quadratic in their input) to ~1e-12 of the
residual stream: the logits no longer depend on the MoE at all, and a comparison of the 2-bit kernels with the
torch reference through the served model would pass whatever the kernels computed. This loader runs vLLM's dummy
loader, then gives the weights the magnitudes of a trained model: matrices uniform in +-sqrt(3 / fan_in) (unit
variance out for unit variance in), norm weights 1, FP8 weights' block scales 1; everything else (biases, sinks,
routing bias) keeps vLLM's values. Each tensor is seeded from its name, so two servers of one config hold the same
weights, and the quantization at load turns them into the same 2-bit rows.

The tests register it through a dist-info folder on the servers' PYTHONPATH (entry point group
`vllm.general_plugins`), beside moetplan's own plugin.
"""
from __future__ import annotations

import math
import zlib
from typing import Any

LOAD_FORMAT = "moetplan_scaled_dummy"
SEED = 1234
ENTRY_POINT = "moetplan_gpu_test_loader"


def register() -> None:
    from vllm.model_executor import model_loader as ml
    from vllm.model_executor.model_loader.dummy_loader import DummyModelLoader

    if LOAD_FORMAT in getattr(ml, "_LOAD_FORMAT_TO_MODEL_LOADER", {}):
        return

    @ml.register_model_loader(LOAD_FORMAT)
    class ScaledDummyLoader(DummyModelLoader):
        def load_weights(self, model: Any, model_config: Any) -> None:
            super().load_weights(model, model_config)
            rescale(model)
            from moetplan.vllm_compat import finish_dummy_load

            finish_dummy_load(model)  # what the model's own load_weights derives from the rescaled tensors


def _seed(name: str) -> int:
    return (SEED * 1_000_003 + zlib.crc32(name.encode())) % (2**63)


def rescale(model: Any) -> dict[str, int]:
    """Trained-model magnitudes for the weights (rules in the module docstring); returns counts per rule."""
    import torch

    fp8 = {d for d in (getattr(torch, "float8_e4m3fn", None), getattr(torch, "float8_e5m2", None)) if d}
    e8m0 = getattr(torch, "float8_e8m0fnu", None)
    tensors = dict(model.state_dict(keep_vars=True))
    counts = {"matrix": 0, "norm": 0, "fp8_scale": 0, "kept": 0}
    with torch.no_grad():
        for name, t in sorted(tensors.items()):
            data = t.data if hasattr(t, "data") else t
            if data.device.type == "meta" or data.numel() == 0:
                continue
            stem = name.removesuffix("_scale_inv") if name.endswith("_scale_inv") else name.removesuffix("_scale")
            sibling = tensors.get(stem) if stem != name and stem.endswith("weight") else None
            if sibling is not None and sibling.dtype in fp8:
                try:
                    data.copy_(torch.ones(data.shape, dtype=torch.float32, device=data.device).to(data.dtype))
                    counts["fp8_scale"] += 1
                except (RuntimeError, TypeError):
                    counts["kept"] += 1
                continue
            if not (data.dtype.is_floating_point and data.dtype != e8m0):
                continue
            if data.dim() == 0:  # per-tensor scalars (kv / activation scales) keep their loader values
                counts["kept"] += 1
                continue
            if data.dim() == 1:
                if "norm" in name:
                    data.fill_(1.0)
                    counts["norm"] += 1
                else:
                    counts["kept"] += 1
                continue
            bound = math.sqrt(3.0 / max(int(data.shape[-1]), 1))
            gen = torch.Generator(device=data.device).manual_seed(_seed(name))
            dtype = torch.bfloat16 if data.dtype in fp8 else data.dtype
            fresh = torch.empty(data.shape, dtype=dtype, device=data.device).uniform_(-bound, bound, generator=gen)
            data.copy_(fresh.to(data.dtype))
            counts["matrix"] += 1
    return counts


def dist_info(folder: Any) -> Any:
    """Write the dist-info that makes vLLM load this plugin when `folder` (and tests/) are on sys.path."""
    from pathlib import Path

    d = Path(folder) / f"{ENTRY_POINT}-0.0.0.dist-info"
    d.mkdir(parents=True, exist_ok=True)
    (d / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {ENTRY_POINT}\nVersion: 0.0.0\n")
    (d / "entry_points.txt").write_text(f"[vllm.general_plugins]\n{ENTRY_POINT} = gpu_scaled_loader:register\n")
    (d / "RECORD").write_text("")
    return Path(folder)

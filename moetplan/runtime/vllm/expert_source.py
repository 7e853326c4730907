"""A vLLM MoE layer's loaded routed experts as exact values, one expert at a time, whatever the checkpoint stored.

bf16 / fp16 / fp32 experts are handed out as they are; FP8 (e4m3 with block, per-tensor or global scales) is
dequantized exactly in float64 per expert (a whole FP8 layer in float64 would not fit in memory for the big models).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from moetplan.contract.errors import ConfigError


@dataclass
class ExpertSource:
    """A layer's loaded routed experts, handed out one expert at a time."""

    name: str  # "bfloat16", "float32", "fp8", ...
    num_experts: int
    hidden: int
    inter: int
    device: torch.device
    get: Callable[[int], tuple[torch.Tensor, torch.Tensor]]  # e -> (w13 [2I, H], w2 [H, I]); float64 for FP8

    def expert(self, e: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.get(e)


def _expand_block_scale(s: torch.Tensor, rows: int, cols: int, block: list[int] | None) -> torch.Tensor:
    """A [sn, sk] block-scale grid -> [rows, cols]. The block size is the layer's `weight_block_size` when it
    fits the grid, else the grid's own (vLLM may refine a checkpoint's 128x128 grid for small experts)."""
    sn, sk = s.shape
    if block and -(-rows // block[0]) == sn and -(-cols // block[1]) == sk:
        bn, bk = block
    else:
        bn, bk = -(-rows // sn), -(-cols // sk)
    return s.to(torch.float64).repeat_interleave(bn, 0)[:rows].repeat_interleave(bk, 1)[:, :cols]


def _fp8_expert(layer: Any, e: int) -> tuple[torch.Tensor, torch.Tensor]:
    from moetplan.runtime.format.sources import dequantize_fp8

    block = getattr(layer, "weight_block_size", None)
    out = []
    for name, halves in (("w13", 2), ("w2", 1)):
        w = getattr(layer, f"{name}_weight").data[e]
        sp = getattr(layer, f"{name}_weight_scale_inv", None)
        if sp is None:
            sp = getattr(layer, f"{name}_weight_scale")
        E = getattr(layer, f"{name}_weight").data.shape[0]
        # [E, sn, sk] block grid, [E, 2] / [E] per tensor (per half for w13), or one global scale
        s = sp.data[e] if sp.data.dim() >= 1 and sp.data.shape[0] == E and sp.data.numel() > 1 else \
            sp.data.reshape(-1)[:1]
        base = dequantize_fp8(w, torch.ones(1), f"{layer.layer_name}.{name}[{e}]")  # exact e4m3 -> float64
        N, K = w.shape
        if s.dim() == 2:  # block grid; gate and up halves carry their own rows of it
            parts = []
            for h in range(halves):
                rows = N // halves
                sh = s[h * s.shape[0] // halves:(h + 1) * s.shape[0] // halves]
                parts.append(_expand_block_scale(sh, rows, K, block))
            scale = torch.cat(parts, 0)
        elif s.numel() == halves == 2:  # per tensor, one scale per half
            scale = s.to(torch.float64).repeat_interleave(N // halves).reshape(N, 1)
        else:
            scale = s.to(torch.float64).reshape(-1)[:1].reshape(1, 1)
        out.append(base * scale)
    return out[0], out[1]


def source_expert_weights(layer: Any) -> ExpertSource:
    """The layer's loaded routed experts as exact values, per expert, and the source format's name."""
    w13 = layer.w13_weight.data
    E, two_i, H = w13.shape
    if w13.dtype in (torch.bfloat16, torch.float16, torch.float32):
        w2 = layer.w2_weight.data
        return ExpertSource(str(w13.dtype).replace("torch.", ""), E, H, two_i // 2, w13.device,
                            lambda e: (w13[e], w2[e]))
    hidden = getattr(layer, "hidden_size", None)
    if w13.dtype == torch.uint8 and isinstance(hidden, int) and H != hidden:
        # Packed sub-byte experts (MXFP4 / NVFP4: two values per byte) are not FP8 bytes.
        raise ConfigError(
            f"{getattr(layer, 'layer_name', 'MoE layer')}: routed experts are packed {w13.shape[-1] * 8 // hidden}-bit "
            f"values ({w13.dtype} [E, {two_i}, {H}] for hidden size {hidden}), not a source the moetplan method "
            "reads at load: convert the checkpoint with `moetplan quantize` into packs first")
    if w13.dtype in (torch.float8_e4m3fn, torch.uint8) and (
        hasattr(layer, "w13_weight_scale") or hasattr(layer, "w13_weight_scale_inv")
    ):
        return ExpertSource("fp8", E, H, two_i // 2, w13.device, lambda e: _fp8_expert(layer, e))
    raise ConfigError(
        f"{getattr(layer, 'layer_name', 'MoE layer')}: routed experts of dtype {w13.dtype} are not a source the "
        "moetplan method reads (bf16/fp16/fp32/FP8 at load; convert NVFP4/MXFP4 checkpoints with "
        "`moetplan quantize` into packs first)"
    )


__all__ = ["ExpertSource", "source_expert_weights"]

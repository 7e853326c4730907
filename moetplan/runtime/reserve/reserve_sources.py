"""Where FP4 reserve rows come from besides an FP4 pack: float weights re-quantized on demand, or MXFP4 checkpoint
bytes as they are. Both have the RowSource API (num_layers / num_experts / stride / row_index / read_rows)."""
from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from moetplan.contract.errors import ConfigError, UsageError
from moetplan.runtime.store.backing import as_row_source
from moetplan.runtime.format.format import RowLayout, pack_expert_row, pack_quantized_row


class QuantizingRowSource:
    """FP4 rows re-quantized on demand from float expert weights (format.quantize_fp4 through pack_expert_row).

    `weights(layer, expert)` returns (w13 [2Ir, H], w2 [H, Ir]) for this TP shard, any float dtype. Has the
    RowSource API (num_layers/num_experts/stride/row_index/read_rows), so it plugs in where a pack would.
    """

    def __init__(self, weights: Callable[[int, int], tuple[torch.Tensor, torch.Tensor]], layout: RowLayout,
                 num_layers: int, num_experts: int):
        if layout.fmt != "fp4":
            raise UsageError(f"QuantizingRowSource builds FP4 reserve rows; got a '{layout.fmt}' layout")
        self.weights, self.layout = weights, layout
        self.num_layers, self.num_experts, self.stride = int(num_layers), int(num_experts), layout.stride
        self.identity = f"requant:fp4:{num_layers}x{num_experts}x{layout.stride}"

    def row_index(self, layer: int, expert: int) -> int:
        return layer * self.num_experts + expert

    def read_rows(self, rows: Sequence[int], out: Any, o_direct: bool = False) -> None:
        buf = out if isinstance(out, torch.Tensor) else torch.from_numpy(out)
        for i, r in enumerate(rows):
            w13, w2 = self.weights(int(r) // self.num_experts, int(r) % self.num_experts)
            pack_expert_row(w13.detach().cpu(), w2.detach().cpu(), self.layout, out=buf[i])


class Mxfp4RowSource:
    """FP4 rows straight from an MXFP4 checkpoint: e2m1 codes and UE8M0 block-32 scales are the row bytes.

    `mx(layer, expert)` returns (w13_packed [2Ir, H/2], w13_scales [2Ir, H/32], w2_packed [H, Ir/2],
    w2_scales [H, Ir/32]) as uint8 (the checkpoint's own tensors, sliced to this TP shard).
    """

    def __init__(self, mx: Callable[[int, int], tuple[Any, Any, Any, Any]], layout: RowLayout, num_layers: int,
                 num_experts: int):
        if layout.fmt != "fp4":
            raise UsageError(f"Mxfp4RowSource builds FP4 reserve rows; got a '{layout.fmt}' layout")
        self.mx, self.layout = mx, layout
        self.num_layers, self.num_experts, self.stride = int(num_layers), int(num_experts), layout.stride
        self.identity = f"mxfp4:{num_layers}x{num_experts}x{layout.stride}"

    def row_index(self, layer: int, expert: int) -> int:
        return layer * self.num_experts + expert

    def read_rows(self, rows: Sequence[int], out: Any, o_direct: bool = False) -> None:
        from moetplan.runtime.format.sources import mxfp4_to_fp4

        buf = out if isinstance(out, torch.Tensor) else torch.from_numpy(out)
        for i, r in enumerate(rows):
            p13, s13, p2, s2 = self.mx(int(r) // self.num_experts, int(r) % self.num_experts)
            q13, sc13 = mxfp4_to_fp4(p13, s13, "w13")
            q2, sc2 = mxfp4_to_fp4(p2, s2, "w2")
            pack_quantized_row(self.layout, q13, sc13, q2, sc2, out=buf[i])


def check_source(source: Any, layout: RowLayout) -> Any:
    src = as_row_source(source)
    if layout.fmt != "fp4":
        raise UsageError(f"The FP4 reserve needs an fp4 row layout, got '{layout.fmt}'")
    src_layout = getattr(src, "layout", None)
    if isinstance(src_layout, RowLayout) and src_layout.fmt != "fp4":
        raise ConfigError(f"The FP4 reserve was given a '{src_layout.fmt}' pack; open the fp4 pack "
                          "(Pack.open(..., fmt='fp4')) or re-quantize with QuantizingRowSource")
    if int(src.stride) != layout.stride:
        raise ConfigError(f"Row source stride {src.stride} B does not match the FP4 layout's {layout.stride} B; "
                          "the pack was built for another shape or TP split: rebuild it")
    return src


__all__ = ["Mxfp4RowSource", "QuantizingRowSource", "check_source"]

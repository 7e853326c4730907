"""The torch MoE reference: the oracle every kernel path is checked against, and the path that runs where none applies.

    out[t] = sum_j topk_weights[t, j] * W2_e( silu(G_e x_t) * (U_e x_t) ),   e = topk_ids[t, j]

with G_e, U_e the gate and up halves of w13 (docs/FORMAT.md). Computed in float32 whatever x's dtype, each expert
once for all of its (token, slot) pairs; deterministic on any device.
"""
from __future__ import annotations

import math
from typing import Callable

import torch

from moetplan.contract.errors import MoetplanError, UsageError
from moetplan.contract.layout import BLOCK, RowLayout
from moetplan.runtime.format.format import CODE_VALUES, e2m1_values, row_views

# expert id, and whether the pair reads the expert's FP4 row -> (w13 [2I, H], w2 [H, I])
ExpertWeights = Callable[[int, bool], tuple[torch.Tensor, torch.Tensor]]


class ResidencyError(MoetplanError):
    """A routed expert has no resident row in this layer's slot pool (a tiered-store fault, not user input)."""


def missing_message(missing: list[int], where: str) -> str:
    return (f"Routed expert(s) {missing[:8]} have no resident row in {where} (slot -1); the tiered store must "
            f"fetch them into the slot pool before this layer runs")


def swiglu(h: torch.Tensor, limit: float | None = None) -> torch.Tensor:
    """[P, 2I] gate | up -> [P, I]; with a limit, gate is clamped from above and up to [-limit, limit]."""
    gate, up = h.chunk(2, dim=-1)
    if limit is not None:
        gate = gate.clamp(max=limit)
        up = up.clamp(-limit, limit)
    return torch.nn.functional.silu(gate) * up


def moe_reference(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, weights_of: ExpertWeights,
                  swiglu_limit: float | None = None, use_fp4: torch.Tensor | None = None,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, H], topk_ids / topk_weights [T, k] -> [T, H] in x's dtype. `use_fp4` (bool [T*k]) marks the pairs
    that read their expert's FP4 row."""
    T, H = x.shape
    k = topk_ids.shape[1]
    e = topk_ids.reshape(-1).long()  # [T*k]: the expert of each (token, slot) pair
    fp4 = torch.zeros_like(e, dtype=torch.bool) if use_fp4 is None else use_fp4
    group = e + (int(e.max()) + 1 if e.numel() else 0) * fp4.long()  # 2-bit experts first, then FP4 ones
    order = torch.argsort(group, stable=True)
    keys, counts = torch.unique_consecutive(group[order], return_counts=True)
    xf = x.float()
    y = torch.zeros(T * k, H, dtype=torch.float32, device=x.device)  # [T*k, H]: each pair's expert output
    start = 0
    for _key, n in zip(keys.tolist(), counts.tolist()):
        pairs = order[start:start + n]
        start += n
        w13, w2 = weights_of(int(e[pairs[0]]), bool(fp4[pairs[0]]))
        act = swiglu(xf[pairs // k] @ w13.float().T, swiglu_limit)  # [n, I]
        y[pairs] = act @ w2.float().T  # [n, H]
    res = (y.view(T, k, H) * topk_weights.float().unsqueeze(-1)).sum(dim=1)  # [T, H]
    if out is None:
        return res.to(x.dtype)
    out.copy_(res)
    return out


# --------------------------------------------------------------------------- expert rows -> float weights

_LUT_CACHE: dict[tuple[str, str], torch.Tensor] = {}


def _lut(kind: str, device: torch.device) -> torch.Tensor:
    """Byte -> weights tables built from format.py's code values, and UE8M0 byte -> 2^(b-127), per device."""
    key = (kind, str(device))
    t = _LUT_CACHE.get(key)
    if t is None:
        b = torch.arange(256, dtype=torch.int64)
        if kind == "2bit":
            vals = torch.tensor(CODE_VALUES, dtype=torch.float32)
            t = vals[torch.stack([(b >> s) & 3 for s in (0, 2, 4, 6)], dim=-1)]
        elif kind == "fp4":
            vals = e2m1_values(torch.float32)
            t = vals[torch.stack([b & 15, b >> 4], dim=-1)]
        else:  # scales; 255 is NaN in UE8M0 and never written by the quantizer
            t = torch.tensor([math.ldexp(1.0, int(i) - 127) for i in range(255)] + [float("nan")],
                             dtype=torch.float32)
        t = t.to(device)
        _LUT_CACHE[key] = t
    return t


def dequantize_rows(q: torch.Tensor, s: torch.Tensor, fmt: str) -> torch.Tensor:
    """(codes [.., N, K/wpb], scales [.., N, K/32]) -> float32 [.., N, K] on the tensors' device."""
    lut = _lut(fmt, q.device)
    k = q.shape[-1] * lut.shape[1]
    # embedding() is a row gather: several times faster on CPU than advanced indexing for this table lookup.
    w = torch.embedding(lut, q.reshape(-1).to(torch.int32)).view(-1, k // BLOCK, BLOCK)
    sc = torch.embedding(_lut("scale", q.device).unsqueeze(1), s.reshape(-1).to(torch.int32))
    return w.mul_(sc.view(-1, k // BLOCK, 1)).view(*q.shape[:-1], k)


def expert_weights(row: torch.Tensor, layout: RowLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """One expert row -> float32 (w13 [2Ir, H], w2 [H, Ir])."""
    q13, s13, q2, s2 = row_views(row, layout)
    return dequantize_rows(q13, s13, layout.fmt), dequantize_rows(q2, s2, layout.fmt)


def moe_forward_reference(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, pool: torch.Tensor,
                          slot_of: torch.Tensor, layout: RowLayout, fp4_pool: torch.Tensor | None = None,
                          fp4_slot_of: torch.Tensor | None = None, fp4_layout: RowLayout | None = None,
                          swiglu_limit: float | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """The reference over expert rows in slot pools: an expert with an FP4-resident row (fp4_slot_of[e] >= 0) is
    computed from it, the others from their 2-bit rows."""
    flat_e = topk_ids.reshape(-1).long()
    E = slot_of.numel()
    if flat_e.numel() and (int(flat_e.min()) < 0 or int(flat_e.max()) >= E):
        raise UsageError(f"topk_ids has expert ids outside [0, {E}); the router and the residency row disagree")
    use4 = None if fp4_slot_of is None else fp4_slot_of.long()[flat_e] >= 0

    def weights_of(e: int, fp4: bool) -> tuple[torch.Tensor, torch.Tensor]:
        lay, pl, so = (fp4_layout, fp4_pool, fp4_slot_of) if fp4 else (layout, pool, slot_of)
        slot = int(so[e])
        if slot < 0 or slot >= pl.shape[0]:
            raise ResidencyError(missing_message([e], "fp4_pool" if fp4 else "pool") if slot < 0 else
                                 f"slot {slot} of expert {e} is outside the pool's {pl.shape[0]} rows")
        return expert_weights(pl[slot], lay)

    return moe_reference(x, topk_ids, topk_weights, weights_of, swiglu_limit, use4, out)


__all__ = ["ExpertWeights", "ResidencyError", "dequantize_rows", "expert_weights", "missing_message",
           "moe_forward_reference", "moe_reference", "swiglu"]

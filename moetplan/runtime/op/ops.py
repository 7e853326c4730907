"""The routed-expert MoE op: one call computes a layer's routed experts for all (token, expert) pairs of a step.

    out[t] = sum_j topk_weights[t, j] * W2_e( silu(G_e x_t) * (U_e x_t) ),   e = topk_ids[t, j]

reading expert rows (docs/FORMAT.md) out of the slot pool through the layer's residency row. An expert whose FP4
reserve copy is resident (fp4_slot_of[e] >= 0) is computed from that copy, otherwise from its 2-bit row.

Dispatch is a table: each `KernelPath` says whether it takes the step (or why not) and runs it; the torch reference
(moetplan.runtime.op.reference) is the fallback and the oracle. The caller's `KernelPolicy` makes every choice, and a
`PathLog` hears which path ran and, when the reference did, why.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Callable

import torch

from moetplan.contract.errors import UsageError
from moetplan.contract.layout import RowLayout
from moetplan.contract.runtime import KernelPolicy
from moetplan.runtime.op import cpu_kernels, kernels
from moetplan.runtime.op.cuda_paths import kernel_shape_ok, moe_cuda
from moetplan.runtime.op.reference import ResidencyError, moe_forward_reference

DEFAULT_POLICY = KernelPolicy()


class PathLog:
    """Which path each call took (counts by name) and why the reference ran where a kernel could have."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.counts: dict[str, int] = {}
        self.fallbacks = 0
        self.reasons: dict[str, int] = {}

    def ran(self, name: str) -> None:
        with self._lock:
            self.counts[name] = self.counts.get(name, 0) + 1

    def fell_back(self, reason: str) -> None:
        with self._lock:
            self.fallbacks += 1
            self.reasons[reason] = self.reasons.get(reason, 0) + 1

    def as_dict(self) -> dict[str, Any]:
        with self._lock:
            return {"kernel_paths": dict(self.counts), "kernel_fallbacks": self.fallbacks,
                    "kernel_fallback_reasons": dict(self.reasons)}


@dataclass(frozen=True)
class Step:
    """One call of the op, as the paths see it."""

    x: torch.Tensor  # [T, H]
    topk_ids: torch.Tensor  # [T, k]
    topk_weights: torch.Tensor  # [T, k]
    pool: torch.Tensor  # [S, stride] uint8
    slot_of: torch.Tensor  # [E] expert -> slot
    layout: RowLayout
    fp4_pool: torch.Tensor | None
    fp4_slot_of: torch.Tensor | None
    fp4_layout: RowLayout | None
    swiglu_limit: float | None
    out: torch.Tensor | None
    policy: KernelPolicy


@dataclass(frozen=True)
class KernelPath:
    """`refusal(step)` is None when the path takes the step, else why not; `run(step, ran)` computes it."""

    name: str
    refusal: Callable[[Step], str | None]
    run: Callable[[Step, Callable[[str], None]], torch.Tensor]


def _cuda_refusal(s: Step) -> str | None:
    if not s.x.is_cuda:
        return "x is on the CPU"
    if not s.policy.cuda:
        return "the kernel policy asks for the reference (cuda=False)"
    if kernels.get_module() is None:
        return f"kernels unavailable: {kernels.fallback_reason()}"
    if not kernel_shape_ok(s.layout, s.fp4_layout, s.x, s.pool, s.fp4_pool):
        return (f"H={s.layout.hidden}, Ir={s.layout.inter_per_rank} ({s.layout.fmt}): the kernels need multiples "
                "of 64 (2-bit) / 32 (FP4) and 16-byte aligned pools")
    return None


def _run_cuda(s: Step, ran: Callable[[str], None]) -> torch.Tensor:
    x = s.x
    if not x.is_contiguous() or x.data_ptr() % 16:
        x = x.contiguous() if not x.is_contiguous() else x.clone()  # 16-byte loads need aligned rows
    return moe_cuda(kernels.get_module(), x, s.topk_ids, s.topk_weights, s.pool, s.slot_of, s.layout, s.fp4_pool,
                    s.fp4_slot_of, s.fp4_layout, s.swiglu_limit, s.out, s.policy,
                    ran=lambda name: ran(f"cuda:{name}"))


def _cpu_refusal(s: Step) -> str | None:
    if s.x.is_cuda or s.x.device.type != "cpu":
        return "x is not on the CPU"
    if not s.policy.cpu:
        return "the kernel policy asks for the reference (cpu=False)"
    if s.pool.device.type != "cpu" or (s.fp4_pool is not None and s.fp4_pool.device.type != "cpu"):
        return "the slot pool is not in host memory"
    if cpu_kernels.get_module() is None:
        return f"CPU kernels unavailable: {cpu_kernels.fallback_reason()}"
    if not cpu_kernels.shape_ok(s.layout, s.fp4_layout):
        return f"H={s.layout.hidden}, Ir={s.layout.inter_per_rank}: the CPU kernels need multiples of 32"
    return None


def _run_cpu(s: Step, ran: Callable[[str], None]) -> torch.Tensor:
    mod = cpu_kernels.get_module()
    ran(f"cpu:{cpu_kernels.best_isa(mod)}")
    return cpu_kernels.moe_cpu(mod, s.x, s.topk_ids, s.topk_weights, s.pool, s.slot_of, s.layout, s.fp4_pool,
                               s.fp4_slot_of, s.fp4_layout, s.swiglu_limit, s.out)


def _run_reference(s: Step, ran: Callable[[str], None]) -> torch.Tensor:
    ran("reference")
    return moe_forward_reference(s.x, s.topk_ids, s.topk_weights, s.pool, s.slot_of, s.layout, s.fp4_pool,
                                 s.fp4_slot_of, s.fp4_layout, s.swiglu_limit, s.out)


PATHS: tuple[KernelPath, ...] = (KernelPath("cuda", _cuda_refusal, _run_cuda),
                                 KernelPath("cpu", _cpu_refusal, _run_cpu))
REFERENCE = KernelPath("reference", lambda s: None, _run_reference)


def select_path(step: Step) -> tuple[KernelPath, list[str]]:
    """The first path of PATHS that takes the step, else the reference; with the refusals met on the way."""
    refusals = []
    for path in PATHS:
        why = path.refusal(step)
        if why is None:
            return path, refusals
        refusals.append(f"{path.name}: {why}")
    return REFERENCE, refusals


# ------------------------------------------------------------------------------------------------ validation


def _check_pool(pool, slot_of, layout, pname, sname):
    if not isinstance(layout, RowLayout):
        raise UsageError(f"layout for {pname} must be a moetplan.contract.layout.RowLayout")
    if pool.dtype != torch.uint8 or pool.ndim != 2 or pool.shape[1] != layout.stride:
        raise UsageError(f"{pname} must be uint8 [S, {layout.stride}] (the {layout.fmt} row stride), "
                         f"got {pool.dtype} {tuple(pool.shape)}")
    if slot_of.ndim != 1 or slot_of.dtype.is_floating_point:
        raise UsageError(f"{sname} must be an integer vector [E] (expert -> slot, -1 = not resident)")


def _check_inputs(x, topk_ids, topk_weights, pool, slot_of, layout, fp4_pool, fp4_slot_of, fp4_layout, out):
    if x.ndim != 2 or x.shape[1] != layout.hidden:
        raise UsageError(f"x must be [T, {layout.hidden}] (the layout's hidden size), got {tuple(x.shape)}")
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise UsageError(f"x must be bfloat16, float16 or float32, got {x.dtype}")
    if topk_ids.ndim != 2 or topk_ids.shape[0] != x.shape[0]:
        raise UsageError(f"topk_ids must be [T, k] with T={x.shape[0]}, got {tuple(topk_ids.shape)}")
    if topk_ids.dtype.is_floating_point:
        raise UsageError(f"topk_ids must be an integer tensor, got {topk_ids.dtype}")
    if tuple(topk_weights.shape) != tuple(topk_ids.shape):
        raise UsageError(f"topk_weights {tuple(topk_weights.shape)} must match topk_ids {tuple(topk_ids.shape)}")
    _check_pool(pool, slot_of, layout, "pool", "slot_of")
    given = [v is not None for v in (fp4_pool, fp4_slot_of, fp4_layout)]
    if any(given) and not all(given):
        raise UsageError("fp4_pool, fp4_slot_of and fp4_layout go together: pass all three or none")
    if all(given):
        _check_pool(fp4_pool, fp4_slot_of, fp4_layout, "fp4_pool", "fp4_slot_of")
        if (fp4_layout.hidden, fp4_layout.inter_per_rank) != (layout.hidden, layout.inter_per_rank):
            raise UsageError(f"fp4_layout (H={fp4_layout.hidden}, Ir={fp4_layout.inter_per_rank}) does not match "
                             f"layout (H={layout.hidden}, Ir={layout.inter_per_rank}); build both for the same shard")
        if fp4_slot_of.numel() != slot_of.numel():
            raise UsageError(f"fp4_slot_of has {fp4_slot_of.numel()} experts, slot_of {slot_of.numel()}")
    for name, t in (("topk_ids", topk_ids), ("topk_weights", topk_weights), ("pool", pool), ("slot_of", slot_of)):
        if t.device != x.device:
            raise UsageError(f"{name} is on {t.device} but x is on {x.device}; move them to one device")
    if out is not None and (tuple(out.shape) != tuple(x.shape) or out.dtype != x.dtype or not out.is_contiguous()):
        raise UsageError(f"out must be a contiguous {x.dtype} tensor of shape {tuple(x.shape)}")


# ------------------------------------------------------------------------------------------------ the op


def moe_forward(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, pool: torch.Tensor,
                slot_of: torch.Tensor, layout: RowLayout, fp4_pool: torch.Tensor | None = None,
                fp4_slot_of: torch.Tensor | None = None, fp4_layout: RowLayout | None = None,
                swiglu_limit: float | None = None, out: torch.Tensor | None = None, *,
                policy: KernelPolicy = DEFAULT_POLICY, paths: PathLog | None = None) -> torch.Tensor:
    """Routed-expert MoE for one layer; returns [T, H] in x's dtype (written into `out` when given).

    Raises ResidencyError when a routed expert has no slot (on the kernels: checked after the launches, once per
    call, unless a CUDA graph is being captured or the policy skips the check).
    """
    _check_inputs(x, topk_ids, topk_weights, pool, slot_of, layout, fp4_pool, fp4_slot_of, fp4_layout, out)
    step = Step(x, topk_ids, topk_weights, pool, slot_of, layout, fp4_pool, fp4_slot_of, fp4_layout, swiglu_limit,
                out, policy)
    path, refusals = select_path(step)
    # why the reference ran: the refusal of the path for x's device (the others refuse any step on it)
    mine = "cuda:" if x.is_cuda else "cpu:"
    why = next((r for r in refusals if r.startswith(mine)), refusals[-1] if refusals else "no kernel path")
    if path is REFERENCE and x.is_cuda:  # a GPU step the kernels did not take: say so once per reason
        if torch.cuda.is_current_stream_capturing():  # the reference reads routed ids on the host
            raise UsageError(f"a CUDA graph is capturing the MoE op, but the kernels do not take this step ({why}) "
                             "and the torch reference cannot be captured; serve with --enforce-eager, or fix the "
                             "kernels' refusal")
        kernels.note_reference(why)
    if paths is not None and path is REFERENCE:
        paths.fell_back(why)
    return path.run(step, paths.ran if paths is not None else (lambda name: None))


__all__ = ["DEFAULT_POLICY", "KernelPath", "PATHS", "PathLog", "REFERENCE", "ResidencyError", "Step", "moe_forward",
           "select_path"]

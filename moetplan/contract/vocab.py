"""Every enumerated value set of the contract, declared once as a `Literal` alias.

The schema types its fields with these aliases, and everything that lists the allowed values (the runtime's checks,
the solver's enumeration, the CLI's choices and its error messages) reads the tuple derived here with
`typing.get_args`, so a new value is one edit and the lists cannot drift apart.
"""
from __future__ import annotations

from typing import Any, Literal, get_args

from moetplan.contract.errors import UsageError

# Where the routed experts live: all on the GPU, or a GPU expert cache over pinned host RAM / a pack file on NVMe.
ExpertTier = Literal["resident", "host", "nvme"]
# Routed experts as the runtime stores them: 2-bit rows, or the checkpoint's own (for checking the path).
ExpertFormat = Literal["2bit", "unquantized"]
# What the solver ranks by.
Objective = Literal["decode", "context", "balanced"]
# Where a measured hardware number came from.
ValueSource = Literal["measured", "datasheet", "derived", "user", "default"]
# Who fills the FP4 reserve.
Promoter = Literal["background", "gate"]
# Where the weights come from.
WeightSource = Literal["checkpoint", "dummy"]
# Who picks each token's experts.
Router = Literal["model", "locality"]
# The op's kernel paths (contract.runtime.KernelPolicy; docs/KERNELS.md).
DecodeKernel = Literal["auto", "rowdot", "gemv", "mma"]
PrefillKernel = Literal["auto", "tiled", "wgmma", "warp"]
DecodeRing = Literal["cp.async", "tma"]  # KernelPolicy.decode_ring; None there = the extension's choice
# The row formats the runtime packs experts in (contract.layout): 2-bit codes, or FP4 (e2m1) for the reserve.
RowFormat = Literal["2bit", "fp4"]
# How quantization treats a tensor's exact zeros (runtime.format).
ZeroMode = Literal["auto", "signed", "balanced"]
# How a tiered plan's MoE layers meet vLLM's CUDA graphs: "replay" (inside the graphs; a step that missed is fetched
# in one batch and run again) or "split" (outside them, the store on the host per layer: the measured fallback).
# docs/CUDA_GRAPHS.md.
MoeGraphs = Literal["replay", "split"]
# How far vLLM holds tool calls to their declared shape (its --tool-strict-level, 0.31+): "auto" (only tools a
# request marks strict), "function" (every call's envelope: a known tool name, JSON arguments), "parameter" (also
# every call's arguments to the tool's JSON schema, as if every tool were strict).
ToolStrictLevel = Literal["auto", "function", "parameter"]
# The CPU expert kernels' loops (csrc/cpu/moe_cpu.cpp), in the extension's ISA code order (its codes are the indices).
CpuIsa = Literal["scalar", "avx2", "avx512"]

EXPERT_TIERS: tuple[ExpertTier, ...] = get_args(ExpertTier)
EXPERT_FORMATS: tuple[ExpertFormat, ...] = get_args(ExpertFormat)
OBJECTIVES: tuple[Objective, ...] = get_args(Objective)
VALUE_SOURCES: tuple[ValueSource, ...] = get_args(ValueSource)
PROMOTERS: tuple[Promoter, ...] = get_args(Promoter)
WEIGHT_SOURCES: tuple[WeightSource, ...] = get_args(WeightSource)
ROUTERS: tuple[Router, ...] = get_args(Router)
DECODE_KERNELS: tuple[DecodeKernel, ...] = get_args(DecodeKernel)
PREFILL_KERNELS: tuple[PrefillKernel, ...] = get_args(PrefillKernel)
DECODE_RINGS: tuple[DecodeRing | None, ...] = (None, *get_args(DecodeRing))
ROW_FORMATS: tuple[RowFormat, ...] = get_args(RowFormat)
ZERO_MODES: tuple[ZeroMode, ...] = get_args(ZeroMode)
MOE_GRAPHS: tuple[MoeGraphs, ...] = get_args(MoeGraphs)
TOOL_STRICT_LEVELS: tuple[ToolStrictLevel, ...] = get_args(ToolStrictLevel)
CPU_ISAS: tuple[CpuIsa, ...] = get_args(CpuIsa)


def check_choice(what: str, value: Any, allowed: tuple[Any, ...], why: str = "") -> None:
    """A UsageError naming `what` (a flag or knob), the bad value and the allowed ones, unless `value` is allowed."""
    if value not in allowed:
        tail = f" ({why})" if why else ""
        raise UsageError(f"{what} {value}: choose one of {', '.join(str(a) for a in allowed)}{tail}")


__all__ = [
    "DECODE_KERNELS", "DECODE_RINGS", "DecodeKernel", "DecodeRing", "EXPERT_FORMATS", "EXPERT_TIERS", "ExpertFormat",
    "MOE_GRAPHS", "MoeGraphs", "TOOL_STRICT_LEVELS", "ToolStrictLevel", "CPU_ISAS", "CpuIsa",
    "ExpertTier", "OBJECTIVES", "Objective", "PREFILL_KERNELS", "PROMOTERS", "PrefillKernel", "Promoter", "ROUTERS",
    "ROW_FORMATS", "Router", "RowFormat", "VALUE_SOURCES", "ValueSource", "WEIGHT_SOURCES", "WeightSource",
    "ZERO_MODES", "ZeroMode",
    "check_choice",
]

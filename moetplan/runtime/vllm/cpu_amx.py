"""Make vLLM's CPU backend take only the AMX paths this process can execute.

Linux keeps AMX tile state off for a process until the process asks for it (`arch_prctl(ARCH_REQ_XCOMP_PERM,
XFEATURE_XTILEDATA)`); the first AMX instruction of a process that has not asked is an illegal instruction.
vLLM's CPU build picks its AMX kernels from CPUID alone (`torch.cpu._is_amx_tile_supported()`: attention with
a bf16 KV cache, AMX MLA, packed bf16 linears) and never asks. oneDNN asks on its first AMX matmul, so whether a
server survives depended on what ran first: a long first prompt went through a oneDNN matmul and the process had
the permission by the time attention ran; a short one reached vLLM's AMX attention kernel first and died
(`Fatal Python error: Illegal instruction` in `cpu_attention_with_kv_cache`).

`prepare()` runs in every vLLM process (from the plugin entry point, before any model code): where CPUID reports
AMX it asks the kernel for the tile state (torch's `_init_amx`, the same system call oneDNN makes). When the
kernel refuses (a VM or kernel without AMX state), AMX is hidden from vLLM for this process, so vLLM selects
its AVX-512 / AVX2 kernels instead of dying on the first AMX instruction.
"""
from __future__ import annotations

import logging
import platform
from dataclasses import dataclass
from typing import Any, Callable

log = logging.getLogger("moetplan.runtime")

_HIDDEN_ATTR = "_moetplan_amx_hidden"


@dataclass(frozen=True)
class AmxState:
    reported: bool  # CPUID reports AMX tiles
    usable: bool  # this process may execute AMX instructions (permission granted)
    note: str

    @property
    def isa(self) -> str:
        return "amx" if self.usable else "no-amx"


def _cpu_capabilities(torch: Any) -> dict[str, Any]:
    try:
        return dict(torch.cpu.get_capabilities())
    except Exception:  # pragma: no cover - a torch without the capability table
        return {}


def decide(reported: bool, request_permission: Callable[[], bool]) -> AmxState:
    """AMX reported by CPUID -> ask for the tile state; the answer says whether vLLM may use AMX here."""
    if not reported:
        return AmxState(False, False, "CPUID reports no AMX")
    try:
        granted = bool(request_permission())
    except Exception as e:  # noqa: BLE001 - any failure to ask means the state is not ours
        return AmxState(True, False, f"asking the kernel for AMX tile state failed ({e})")
    if granted:
        return AmxState(True, True, "AMX tile state granted to this process")
    return AmxState(True, False, "CPUID reports AMX but the kernel refused the tile state (arch_prctl)")


def hide_amx(torch: Any) -> None:
    """Make `torch.cpu._is_amx_*_supported()` answer False in this process (vLLM asks at call time)."""
    cpu = torch.cpu
    if getattr(cpu, _HIDDEN_ATTR, False):
        return
    for name in ("_is_amx_tile_supported", "_is_amx_fp16_supported"):
        if hasattr(cpu, name):
            setattr(cpu, name, lambda: False)
    setattr(cpu, _HIDDEN_ATTR, True)


_STATE: AmxState | None = None


def prepare(torch: Any = None) -> AmxState:
    """Once per process: ask for AMX where it is reported; hide it from vLLM where it cannot run."""
    global _STATE
    if _STATE is not None:
        return _STATE
    if torch is None:
        import torch
    if platform.machine().lower() not in ("x86_64", "amd64"):
        _STATE = AmxState(False, False, f"{platform.machine()} has no AMX")
        return _STATE
    caps = _cpu_capabilities(torch)
    state = decide(bool(caps.get("amx_tile")), lambda: torch.cpu._init_amx())
    if state.reported and not state.usable:
        hide_amx(torch)
        log.warning("moetplan: %s; vLLM's CPU backend will use its AVX kernels", state.note)
    _STATE = state
    return state


def state() -> AmxState | None:
    """What `prepare()` found in this process (None before it ran)."""
    return _STATE

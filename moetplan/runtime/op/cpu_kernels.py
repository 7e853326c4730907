"""The CPU kernels of the routed-expert op (csrc/cpu/moe_cpu.cpp): build on first use, cache, ISA choice, the call.

Built with torch.utils.cpp_extension.load into the same user cache as the CUDA extension, keyed by the hash of
csrc/cpu/ and the torch version. The source is one translation unit compiled without -march: its AVX-512 and
AVX2 kernels carry their ISA in target attributes, so one build serves every x86-64 CPU and the kernel is chosen
at run time from CPUID (`best_isa`). Without a C++ compiler the op runs the torch reference and says why once.
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
import shutil
import threading
from pathlib import Path
from typing import Any

import torch

from moetplan.contract.errors import MoetplanError, UsageError
from moetplan.contract.layout import RowLayout
from moetplan.contract.vocab import CPU_ISAS
from moetplan.runtime.op import kernels
from moetplan.runtime.op.reference import ResidencyError, missing_message

log = logging.getLogger("moetplan.kernels")

EXT_NAME = "moetplan_moe_cpu"
SOURCE = "moe_cpu.cpp"
ISAS = CPU_ISAS  # the extension's ISA codes are the indices
# int8 activation planes per stage (docs/CPU_KERNELS.md, "Tolerance"): one (q8_0, as llama.cpp: ~1e-2 relative to
# the reference) costs half the dot-product instructions of two (float32-class, ~5e-5). Two for the w2 stage alone
# buys little (its error comes mostly from x's plane), so both stages take one.
PLANES_W13, PLANES_W2 = 1, 1
# Pairs whose per-pair fp32 buffers ([T*k, H] + [T*k, Ir]) would exceed this are computed in token chunks.
PARTIAL_BYTES_CAP = 256 << 20

_lock = threading.Lock()
_state: dict[str, Any] = {"module": None, "tried": False, "reason": None}


class CpuKernelBuildError(MoetplanError):
    """The C++ compiler failed or is missing; the message names the cause and the fix."""


def source_dir() -> Path:
    return kernels.source_dir() / "cpu"


def build_key() -> str:
    h = hashlib.sha256()
    for src in sorted(source_dir().glob("*.c*")):
        h.update(src.name.encode())
        h.update(src.read_bytes())
    h.update(json.dumps([torch.__version__, EXT_NAME]).encode())
    return h.hexdigest()[:16]


def compiler() -> str | None:
    return shutil.which("c++") or shutil.which("g++")


def build(verbose: bool = False) -> Any:
    """Compile (or load from the cache) the CPU extension; returns the module."""
    if compiler() is None:
        raise CpuKernelBuildError("no C++ compiler (c++/g++) on PATH; install g++ to build the CPU MoE kernels")
    if not (source_dir() / SOURCE).is_file():
        raise CpuKernelBuildError(f"{source_dir() / SOURCE} not found next to the moetplan package; reinstall from "
                                  "a checkout")
    key = build_key()
    build_dir = kernels.cache_root() / f"{EXT_NAME}-{key}"
    build_dir.mkdir(parents=True, exist_ok=True)
    from torch.utils.cpp_extension import load

    try:
        # -fopenmp: at::parallel_for runs on torch's own OpenMP pool (libgomp is already loaded by torch).
        return load(name=f"{EXT_NAME}_{key}", sources=[str(source_dir() / SOURCE)],
                    extra_cflags=["-O3", "-std=c++17", "-fopenmp"], extra_ldflags=["-fopenmp"],
                    build_directory=str(build_dir), verbose=verbose)
    except Exception as e:  # the compiler's own message is the useful part
        raise CpuKernelBuildError(f"Building the CPU MoE kernels failed: {e}. Build log in {build_dir}") from e


def get_module() -> Any:
    """The loaded CPU extension, or None (reference path). Builds once per process; never raises."""
    if _state["tried"]:
        return _state["module"]
    with _lock:
        if _state["tried"]:
            return _state["module"]
        mod, reason = None, None
        try:
            mod = build()
        except MoetplanError as e:
            reason = str(e)
        except Exception as e:  # pragma: no cover - unexpected toolchain failures
            reason = f"{type(e).__name__}: {e}"
        if reason:
            log.warning("moetplan CPU MoE kernels unavailable (%s); the torch reference computes CPU steps", reason)
        _state.update(module=mod, tried=True, reason=reason)
        return mod


def fallback_reason() -> str | None:
    get_module()
    return _state["reason"]


def reset_for_tests() -> None:
    _state.update(module=None, tried=False, reason=None)


def best_isa(mod: Any) -> str:
    return ISAS[int(mod.best_isa())]


def isa_code(mod: Any, isa: str | None) -> int:
    """None -> the best this CPU runs; a named ISA this CPU cannot run is a UsageError."""
    if isa is None:
        return int(mod.best_isa())
    if isa not in ISAS:
        raise UsageError(f"CPU kernel ISA {isa!r} is not one of {', '.join(ISAS)}")
    if isa not in list(mod.isas_available()):
        raise UsageError(f"this CPU cannot run the {isa} kernel (it runs {', '.join(mod.isas_available())})")
    return ISAS.index(isa)


def shape_ok(layout: RowLayout, fp4_layout: RowLayout | None) -> bool:
    """H and Ir multiples of 32 (every layout is): the kernels' chunks end at 32 weights (16 for FP4)."""
    return layout.hidden % 32 == 0 and layout.inter_per_rank % 32 == 0


def _offsets(layout: RowLayout) -> list[int]:
    return [layout.w13_q_off, layout.w13_s_off, layout.w2_q_off, layout.w2_s_off]


def moe_cpu(mod: Any, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, pool: torch.Tensor,
            slot_of: torch.Tensor, layout: RowLayout, fp4_pool: torch.Tensor | None,
            fp4_slot_of: torch.Tensor | None, fp4_layout: RowLayout | None, swiglu_limit: float | None,
            out: torch.Tensor | None, isa: str | None = None,
            planes: tuple[int, int] = (PLANES_W13, PLANES_W2)) -> torch.Tensor:
    """The op on the CPU kernels: same contract as ops.moe_forward (inputs already validated there). `planes`:
    the int8 activation planes (1 or 2) of the w13 and the w2 stage (tests, benches)."""
    E = slot_of.numel()
    ids = topk_ids.to(torch.int64).contiguous()
    flat = ids.view(-1)
    if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= E):
        raise UsageError(f"topk_ids has expert ids outside [0, {E}); the router and the residency row disagree")
    so = slot_of.to(torch.int64).contiguous()
    so4 = fp4_slot_of.to(torch.int64).contiguous() if fp4_slot_of is not None else None
    # Residency, checked on the host before the kernel reads any row (the kernel trusts every slot it gets).
    used = torch.unique(flat)
    slots = so[used]
    if so4 is not None:
        slots = torch.where(so4[used] >= 0, torch.zeros_like(slots), slots)  # FP4-resident: the 2-bit slot unused
        bad4 = (so4[used] >= fp4_pool.shape[0])
        if bool(bad4.any()):
            raise ResidencyError(f"FP4 slot {int(so4[used][bad4][0])} is outside fp4_pool's {fp4_pool.shape[0]} rows")
    if bool((slots < 0).any()):
        raise ResidencyError(missing_message(used[slots < 0].tolist(), "pool"))
    if bool((slots >= pool.shape[0]).any()):
        raise ResidencyError(f"a slot of experts {used[slots >= pool.shape[0]].tolist()[:8]} is outside the pool's "
                             f"{pool.shape[0]} rows")
    xf = x.to(torch.float32).contiguous()
    wf = topk_weights.to(torch.float32).contiguous()
    empty_u8 = torch.empty(0, dtype=torch.uint8)
    empty_i64 = torch.empty(0, dtype=torch.int64)
    limit = math.nan if swiglu_limit is None else float(swiglu_limit)
    code = isa_code(mod, isa)
    if any(p not in (1, 2) for p in planes):
        raise UsageError(f"planes {planes}: each stage takes 1 or 2 int8 activation planes")
    offs4 = _offsets(fp4_layout) if fp4_layout is not None else [0, 0, 0, 0]
    T, H = xf.shape
    k = ids.shape[1]
    if T == 0 or k == 0:
        res = torch.zeros(T, H, dtype=x.dtype)
        return res if out is None else out.copy_(res)
    per_token = 4 * k * (H + layout.inter_per_rank) * 3  # y, act and its prepared plane
    chunk = max(1, PARTIAL_BYTES_CAP // max(1, per_token))
    parts = []
    for t0 in range(0, T, chunk):
        parts.append(mod.moe_forward_cpu(
            xf[t0:t0 + chunk], ids[t0:t0 + chunk], wf[t0:t0 + chunk], pool.contiguous(), so,
            fp4_pool.contiguous() if fp4_pool is not None else empty_u8, so4 if so4 is not None else empty_i64,
            _offsets(layout), offs4, layout.inter_per_rank, limit, code, *planes))
    res = parts[0] if len(parts) == 1 else torch.cat(parts)
    if out is None:
        return res if x.dtype == torch.float32 else res.to(x.dtype)
    out.copy_(res)
    return out




def _timing_pool(layout: RowLayout, rows: int) -> torch.Tensor:
    # The kernels' time does not depend on the code values (table lookups): a constant pattern fills fast, and
    # scales of 127 keep every product finite.
    pool = torch.full((rows, layout.stride), 0x1B, dtype=torch.uint8)
    for off, size in ((layout.w13_s_off, layout.w13_s_size), (layout.w2_s_off, layout.w2_s_size)):
        pool[:, off:off + size] = 127
    return pool


def _forward(mod: Any, layout: RowLayout, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, pool: torch.Tensor,
             slot_of: torch.Tensor, isa: int) -> torch.Tensor:
    """The extension's op on 2-bit rows only (no FP4 reserve), as the timings call it."""
    return mod.moe_forward_cpu(x, ids, w, pool, slot_of, torch.empty(0, dtype=torch.uint8),
                               torch.empty(0, dtype=torch.int64), _offsets(layout), [0, 0, 0, 0],
                               layout.inter_per_rank, math.nan, isa, PLANES_W13, PLANES_W2)


def best_window(call: Any, threads: int | None, min_seconds: float) -> tuple[int, float, int]:
    """(calls, seconds, threads) of the fastest of 5 windows of at least min_seconds / 5 and 2 calls each, on
    `threads` torch threads (None: as set): on a shared machine other jobs take the cores from some windows."""
    import time

    old = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    windows: list[tuple[int, float]] = []
    try:
        for _ in range(5):
            n, t0 = 0, time.perf_counter()
            while True:
                call()
                n += 1
                dt = time.perf_counter() - t0
                if dt >= min_seconds / 5 and n >= 2:
                    break
            windows.append((n, dt))
    finally:
        torch.set_num_threads(old)
    n, dt = max(windows, key=lambda nd: nd[0] / nd[1])
    return n, dt, threads or old


def measure_expert_throughput(layout: RowLayout, threads: int | None = None, min_seconds: float = 0.3,
                              pool_bytes: int = 256 << 20) -> dict[str, float]:
    """This host's rate for a missed expert computed on the CPU at batch 1 (what `moetplan probe` records next
    to the pinned H2D rate): GB/s of 2-bit rows and experts per second, one expert per call, rows rotating
    through `pool_bytes` so they come from DRAM; the best of 5 windows of min_seconds / 5. Raises
    CpuKernelBuildError without the kernels."""
    mod = get_module()
    if mod is None:
        raise CpuKernelBuildError(f"CPU kernels unavailable: {fallback_reason()}")
    rows = max(2, pool_bytes // layout.stride)
    pool = _timing_pool(layout, rows)
    x = torch.randn(1, layout.hidden, generator=torch.Generator().manual_seed(0))
    w = torch.ones(1, 1)
    slot_of = torch.arange(rows)
    calls = [0]

    def call() -> None:
        _forward(mod, layout, x, torch.tensor([[calls[0] % rows]]), w, pool, slot_of, int(mod.best_isa()))
        calls[0] += 1

    n, dt, used = best_window(call, threads, min_seconds)
    row = layout.w13_q_size + layout.w13_s_size + layout.w2_q_size + layout.w2_s_size
    return {"gbps": n * row / dt / 1e9, "experts_per_s": n / dt, "threads": float(used)}


def measure_prefill_rate(layout: RowLayout, isa: str | None = None, tokens_per_expert: int = 64, experts: int = 4,
                         threads: int | None = None, min_seconds: float = 0.3) -> dict[str, float]:
    """The CPU kernels' compute rate at prefill batch: `experts` experts of `layout`, each routed by
    `tokens_per_expert` tokens (one expert per token), so every row block is reused across its tokens as in a
    prefill chunk; `isa` forces a loop ("scalar": the loop rows shorter than a vector block run). Returns GFLOP/s of
    expert math (6 x hidden x inter per token-expert pair: gate, up and down) and the time per pair; the best of 5
    windows of min_seconds / 5 (a shared machine takes the cores from some of them). Raises CpuKernelBuildError
    without the kernels."""
    mod = get_module()
    if mod is None:
        raise CpuKernelBuildError(f"CPU kernels unavailable: {fallback_reason()}")
    if tokens_per_expert < 1 or experts < 1:
        raise UsageError(f"tokens_per_expert={tokens_per_expert}, experts={experts}: both must be >= 1")
    pool = _timing_pool(layout, experts)
    T = tokens_per_expert * experts
    x = torch.randn(T, layout.hidden, generator=torch.Generator().manual_seed(0))
    ids = torch.arange(T).remainder(experts).view(T, 1)
    w = torch.ones(T, 1)
    slot_of = torch.arange(experts)
    code = isa_code(mod, isa)

    def call() -> None:
        _forward(mod, layout, x, ids, w, pool, slot_of, code)

    n, dt, used = best_window(call, threads, min_seconds)
    per_pair = dt / (n * T)
    flops = 6.0 * layout.hidden * layout.inter_per_rank
    return {"gflops": flops / per_pair / 1e9, "us_per_pair": per_pair * 1e6, "threads": float(used)}


__all__ = ["ISAS", "PLANES_W13", "PLANES_W2", "CpuKernelBuildError", "best_isa", "build", "build_key", "fallback_reason",
           "best_window", "get_module", "isa_code", "measure_expert_throughput", "measure_prefill_rate", "moe_cpu", "shape_ok"]

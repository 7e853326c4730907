"""The routed-expert MoE op: one call computes a layer's routed experts for all (token, expert) pairs of a step.

    out[t] = sum_j topk_weights[t, j] * W2_e( silu(G_e x_t) * (U_e x_t) ),   e = topk_ids[t, j]

reading expert rows (docs/FORMAT.md) out of the slot pool through the layer's residency row. An expert whose FP4
reserve copy is resident (fp4_slot_of[e] >= 0) is computed from that copy, otherwise from its 2-bit row.

Two implementations, one contract:
- the torch reference (dequantize each used expert once, matmul in float32): runs everywhere and is the oracle;
- the CUDA kernels (csrc/moe_kernels.cu via moetplan.runtime.kernels) when they are built and x is on a GPU.
"""
from __future__ import annotations

import math
import os

import torch

from moetplan.contract.errors import MoetplanError, UsageError
from moetplan.runtime import kernels
from moetplan.runtime.format import BLOCK, CODE_VALUES, RowLayout, e2m1_values

# Average pairs per expert from which the routed prefill tiles (32 pairs per pass, bf16 operands) are used instead
# of the route-free decode tiles (8 pairs per pass, hi/lo split operands). A design choice, not yet tuned: the
# H200 run of bench/kernels.py timed each path on its own side of it (docs/KERNELS.md).
PREFILL_PAIRS_PER_EXPERT = 8
# Cap on the fp32 per-pair partial buffer [T*k, H] of one kernel call; longer prefills are chunked over tokens.
PARTIAL_BYTES_CAP = 1 << 30
DECODE_KERNELS = ("auto", "rowdot", "gemv", "mma")
# Routed (prefill) steps: "tiled" = block tiles with the B operand in shared memory on mma.sync
# (csrc/moe_prefill.cuh, every arch), "wgmma" = warp-specialized block tiles on Hopper warpgroup MMAs
# (csrc/moe_prefill_wgmma.cuh, sm_90a), "warp" = the first version's one-warp tiles (kept for comparison and for
# shapes the block tiles do not take). "auto" = wgmma for wide passes on Hopper, else tiled.
PREFILL_KERNELS = ("auto", "tiled", "wgmma", "warp")
# Average (token, expert) pairs per expert from which 'auto' takes the wgmma stages (on Hopper): their 128-pair passes
# and one block per SM pay off on wide passes. Measured on the H200 (docs/KERNELS.md): the mma.sync tiles are faster
# at 43-48 pairs per expert (Kimi-K2.7-Code / DeepSeek-V4-Flash at 2048 tokens), wgmma at 64 (GLM-5.2, 2048) and up.
WGMMA_PAIRS_PER_EXPERT = 56
# "auto": the CUDA-core rowdot stages for steps of at most this many tokens (1-2 pairs per expert), the gemv stages
# above it. 0 = gemv everywhere: on the H200 rowdot took 1.24-1.55x gemv's time at 1 token and ~2.2x at 2-8
# (instruction-issue bound, docs/KERNELS.md). Raise it only on a GPU where bench/kernels.py measures rowdot faster.
ROWDOT_MAX_TOKENS = 0
# True: without FP4-resident experts in a step, the decode stages' w2 launch also does the weighted per-token sum
# (one launch less per layer, a release atomic per w2 unit, an acquire per completed token group). Off by default:
# on the H200 the separate combine kernel measured 1-6% faster per layer at 1-8 tokens, all three model shapes
# (bench/kernels.py, decode kernel names with "+fused" time the fused form; docs/KERNELS.md).
FUSED_COMBINE = False
# True: the decode stages' w13 launch reads the 2-bit codes as an e4m3 A operand (four weights per table lookup,
# one m16n8k32 MMA per 16 weights) with bf16 x as e4m3 hi/lo planes under a per-token power-of-two scale, on GPUs
# with e4m3 MMAs (sm_89+) and for bf16 x (fp32 x keeps the bf16 hi/lo operand, float32-accurate). Off: on the
# H200 (sm_90, where ptxas emulates e4m3 mma.sync with conversions + f16 MMAs) the layer took 1.09-1.17x the
# bf16 stages' time; sm_89 / sm_120 run it on the tensor cores, unmeasured so far (bench decode kernel "gemv+e4m3").
# Precision and measurements: docs/KERNELS.md ("e4m3 A operand").
E4M3_DECODE = False
# True (the default): the decode stages' w13 launch reads the 2-bit codes as an int8 A operand (four weights per table
# lookup from a per-block table that carries the block scale as a shift, one native m16n8k32 integer MMA per 16
# weights, the round's int32 sums scaled once per row) with bf16 x as int8 hi/mid/lo planes under a per-token
# power-of-two scale: bf16 x exact within 2^12 of its token's largest element (to 2^-20 of it below), weights exact
# within 9 binades of their row's largest block in each 512-weight round (flushed below). Where the w13 stage takes
# the TMA ring (Hopper by default) and for bf16 x; fp32 x keeps the bf16 hi/lo operand (float32-accurate). On the
# H200: 0.83-0.96x the layer time at 1-8 tokens, all three model shapes, with Gaussian-like block scales; a round whose
# rows span more than 4 binades takes a second pass (scales uniform over 8 binades per block: 1.09-1.13x). False:
# the bf16 w13 stage (bench decode kernel "gemv+bf16"). docs/KERNELS.md ("int8 A operand", H28).
I8_DECODE = True
# True (the default): with the int8 w13 stage, the w2 stage takes the int8 operand too. The w13 stage writes its
# intermediate as float32 [P, Ir], xprep8 turns each pair's row into int8 hi/mid/lo planes under a per-pair
# power-of-two scale (one more launch per layer, which triggers the w2 stage before it waits, so the w2 stage still
# fetches its first rounds while the w13 stage runs), and the w2 stage decodes as the int8 w13 stage does. On the
# H200: 0.88-0.98x the layer time at 1-8 tokens, all three model shapes, but DeepSeek-V4-Flash at 2 tokens (1.02x).
# False: the bf16 hi/lo intermediate (float32-accurate; bench decode kernel "gemv+bf16w2"). docs/KERNELS.md, H29.
I8_W2 = True
# How the gemv decode stages spread their units over the warps: None = the extension's choice (gemv_plan:
# "balanced" — a block's rounds split evenly over its warps, units may straddle warps, every warp slot streams —
# when a stage's units outnumber the warp slots, as at 2-8 tokens, where plain took 0.7-6.4% longer per layer on
# the H200; "plain" — whole units per warp — below that, as at 1 token, where balanced measured slower for
# DeepSeek-V4-Flash; docs/KERNELS.md H20. The int8 stages keep plain up to 1.75x the slots: 0.96-0.97x the layer
# time at the 1-2 token points that moves, H30). False / True force plain / balanced (bench decode kernels
# "gemv+plain" / "gemv+balanced"). Both deterministic; they differ only in float summation order.
GEMV_BALANCE: bool | None = None
# Which ring brings the gemv decode stages' weight rounds into shared memory: None = the extension's choice (the TMA
# ring — one tensor-map box of 16 rows x 128 code bytes and one of scales per 512-weight round, 3 rounds in flight
# per warp — on Hopper (sm_90) where K is a multiple of 512, else the cp.async ring); "cp.async" / "tma" force either
# ("tma" runs on any sm_90+ GPU, Blackwell included, where it is not yet timed; an error where it cannot run, asked
# of the extension: mod.gemv_bulk_possible(K)). On the H200, with PDL, all three model shapes: 0.86-0.98x the time
# per layer of the H24 cp.async ring at 1-8 tokens, and 0.89-0.93x the present one's at 8 tokens, 0.99-1.02x at 1
# (docs/KERNELS.md H25; bench decode kernels "gemv+cp.async" / "gemv+tma"). The e4m3 w13 stage always takes the
# cp.async ring.
DECODE_RING: str | None = None
_RING_CODES = {None: -1, "cp.async": 0, "tma": 1}


def decode_ring_code() -> int:
    """DECODE_RING as the extension's `ring` argument (-1 default, 0 cp.async, 1 TMA)."""
    if DECODE_RING not in _RING_CODES:
        raise UsageError(f"ops.DECODE_RING = {DECODE_RING!r}: use None (the default), 'cp.async' or 'tma'")
    return _RING_CODES[DECODE_RING]


class ResidencyError(MoetplanError):
    """A routed expert has no resident row in this layer's slot pool (a tiered-store fault, not user input)."""


# ------------------------------------------------------------------------------------------------ validation


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


def _check_pool(pool, slot_of, layout, pname, sname):
    if not isinstance(layout, RowLayout):
        raise UsageError(f"layout for {pname} must be a moetplan.runtime.format.RowLayout")
    if pool.dtype != torch.uint8 or pool.ndim != 2 or pool.shape[1] != layout.stride:
        raise UsageError(f"{pname} must be uint8 [S, {layout.stride}] (the {layout.fmt} row stride), "
                         f"got {pool.dtype} {tuple(pool.shape)}")
    if slot_of.ndim != 1 or slot_of.dtype.is_floating_point:
        raise UsageError(f"{sname} must be an integer vector [E] (expert -> slot, -1 = not resident)")


def _missing_message(missing: list[int], where: str) -> str:
    return (f"Routed expert(s) {missing[:8]} have no resident row in {where} (slot -1); the tiered store must "
            f"fetch them into the slot pool before this layer runs")


# ------------------------------------------------------------------------------------------------ reference path

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


def _sections(row: torch.Tensor, layout: RowLayout):
    shapes = layout.shapes()
    out = []
    for name in ("w13_q", "w13_s", "w2_q", "w2_s"):
        off = getattr(layout, f"{name}_off")
        n, m = shapes[name]
        out.append(row[off:off + n * m].view(n, m))
    return out


def expert_weights(row: torch.Tensor, layout: RowLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """One expert row -> float32 (w13 [2Ir, H], w2 [H, Ir])."""
    q13, s13, q2, s2 = _sections(row, layout)
    return dequantize_rows(q13, s13, layout.fmt), dequantize_rows(q2, s2, layout.fmt)


def _swiglu(h: torch.Tensor, ir: int, limit: float | None) -> torch.Tensor:
    gate, up = h[:, :ir], h[:, ir:]
    if limit is not None:
        gate = gate.clamp(max=limit)
        up = up.clamp(-limit, limit)
    return torch.nn.functional.silu(gate) * up


def moe_forward_reference(x, topk_ids, topk_weights, pool, slot_of, layout, fp4_pool=None, fp4_slot_of=None,
                          fp4_layout=None, swiglu_limit=None, out=None) -> torch.Tensor:
    """Float32 oracle: pairs grouped by expert, each used expert dequantized once; deterministic on any device."""
    T, H = x.shape
    k = topk_ids.shape[1]
    ir = layout.inter_per_rank
    flat_e = topk_ids.reshape(-1).long()
    P = flat_e.numel()
    E = slot_of.numel()
    if P and (int(flat_e.min()) < 0 or int(flat_e.max()) >= E):
        raise UsageError(f"topk_ids has expert ids outside [0, {E}); the router and the residency row disagree")
    use4 = torch.zeros_like(flat_e, dtype=torch.bool) if fp4_slot_of is None else fp4_slot_of.long()[flat_e] >= 0
    key = flat_e + E * use4.long()
    order = torch.argsort(key, stable=True)
    keys, counts = torch.unique_consecutive(key[order], return_counts=True)
    xf = x.float()
    y = torch.zeros(P, H, dtype=torch.float32, device=x.device)
    start = 0
    for kk, c in zip(keys.tolist(), counts.tolist()):
        pairs = order[start:start + c]
        start += c
        e, is4 = kk % E, kk >= E
        lay, pl, so = (fp4_layout, fp4_pool, fp4_slot_of) if is4 else (layout, pool, slot_of)
        slot = int(so[e])
        if slot < 0 or slot >= pl.shape[0]:
            raise ResidencyError(_missing_message([e], "fp4_pool" if is4 else "pool") if slot < 0 else
                                 f"slot {slot} of expert {e} is outside the pool's {pl.shape[0]} rows")
        w13, w2 = expert_weights(pl[slot], lay)
        act = _swiglu(xf[pairs // k] @ w13.T, ir, swiglu_limit)
        y[pairs] = act @ w2.T
    res = (y.view(T, k, H) * topk_weights.float().unsqueeze(-1)).sum(dim=1)
    if out is None:
        return res.to(x.dtype)
    out.copy_(res)
    return out


# ------------------------------------------------------------------------------------------------ CUDA path


_FLAGS: dict[str, torch.Tensor] = {}


def _error_flag(dev: torch.device) -> torch.Tensor:
    """Per-device sticky residency error flag (expert+1, or -1 for an id out of range); reset when reported."""
    key = str(dev)
    f = _FLAGS.get(key)
    if f is None:
        f = _FLAGS[key] = torch.zeros(1, dtype=torch.int32, device=dev)
    return f


_PDL_CAP: dict[str, bool] = {}


def use_pdl(dev: torch.device) -> bool:
    """Programmatic dependent launch between the op's kernels: sm_90+ and not switched off (MOETPLAN_PDL=0)."""
    if os.environ.get("MOETPLAN_PDL", "1") == "0":
        return False
    key = str(dev)
    if key not in _PDL_CAP:
        _PDL_CAP[key] = torch.cuda.get_device_capability(dev)[0] >= 9
    return _PDL_CAP[key]


def use_fp8_w13(mod, x: torch.Tensor) -> bool:
    """The e4m3 w13 decode stage takes this step: switched on (E4M3_DECODE), bf16 x, and the kernels can run it
    on this GPU (sm_89+, built for it; the extension checks that once per process)."""
    return (E4M3_DECODE and x.dtype == torch.bfloat16 and hasattr(mod, "decode_fp8_available")
            and bool(mod.decode_fp8_available()))


def use_i8_w13(mod, x: torch.Tensor, H: int) -> bool:
    """The int8 w13 decode stage takes this step: switched on (I8_DECODE), bf16 x, and the w13 stage takes the TMA
    ring on this GPU (sm_90+, built for it, H a multiple of its rounds; the extension says so)."""
    if not (I8_DECODE and x.dtype == torch.bfloat16 and hasattr(mod, "decode_i8_available")
            and bool(mod.decode_i8_available())):
        return False
    return _takes_tma_ring(mod, H)


def use_i8_w2(mod, x: torch.Tensor, H: int, Ir: int) -> bool:
    """The int8 w2 decode stage takes this step: the int8 w13 stage does, I8_W2 is on, and the w2 stage takes the TMA
    ring too (Ir a multiple of its rounds: not every tensor-parallel shard is)."""
    return I8_W2 and use_i8_w13(mod, x, H) and _takes_tma_ring(mod, Ir)


def _takes_tma_ring(mod, K: int) -> bool:
    # A gemv stage of contraction K takes the TMA ring here. Asked without forcing the ring: where a forced TMA ring
    # cannot run, the op raises its own UsageError.
    ring = decode_ring_code()
    return ring != 0 and bool(mod.gemv_bulk_possible(K)) and (ring == 1 or mod.gemv_ring(K) == "tma")


def _check_residency() -> bool:
    return os.environ.get("MOETPLAN_CHECK_RESIDENCY", "1") != "0"


def decode_kernel() -> str:
    """Which decode path small steps take, from MOETPLAN_DECODE_KERNEL: 'auto' (the default: rowdot for steps of
    <= ROWDOT_MAX_TOKENS tokens, else gemv), 'rowdot' (CUDA-core row streaming, csrc/moe_rowdot.cuh), 'gemv'
    (mma.sync streaming stages, csrc/moe_decode.cuh) or 'mma' (the first version's scan-mode tiles)."""
    v = os.environ.get("MOETPLAN_DECODE_KERNEL", "auto").strip().lower() or "auto"
    if v not in DECODE_KERNELS:
        raise UsageError(f"MOETPLAN_DECODE_KERNEL={v!r} is not one of {', '.join(DECODE_KERNELS)}; unset it for "
                         "the default (auto)")
    return v


def prefill_kernel() -> str:
    """Which path routed (prefill) steps take, from MOETPLAN_PREFILL_KERNEL: 'auto' (the default), 'wgmma', 'tiled'
    or 'warp' (PREFILL_KERNELS)."""
    v = os.environ.get("MOETPLAN_PREFILL_KERNEL", "auto").strip().lower() or "auto"
    if v not in PREFILL_KERNELS:
        raise UsageError(f"MOETPLAN_PREFILL_KERNEL={v!r} is not one of {', '.join(PREFILL_KERNELS)}; unset it for "
                         "the default (auto)")
    return v


def use_tiled_prefill(mod, layout: RowLayout, pairs_per_expert: float = 0.0) -> str | None:
    """The block-tile prefill stages that take a routed step's 2-bit experts, or None (MOETPLAN_PREFILL_KERNEL=warp,
    an extension without them, or H / Ir not multiples of the extension's prefill_k_align, 128: every target model
    and its TP2/TP4 shards take them). 'auto' takes 'wgmma' (warpgroup MMAs, Hopper with an sm_90a build) for steps
    with at least WGMMA_PAIRS_PER_EXPERT (token, expert) pairs per expert on average, else 'tiled' (mma.sync)."""
    pk = prefill_kernel()
    if pk == "warp" or not hasattr(mod, "prefill_stage"):
        return None
    a = mod.prefill_k_align()
    if layout.hidden % a or layout.inter_per_rank % a:
        return None
    if pk == "auto":
        big = pairs_per_expert >= WGMMA_PAIRS_PER_EXPERT
        return "wgmma" if big and mod.prefill_wgmma_available() else "tiled"
    if pk == "tiled":
        return "tiled"
    if not mod.prefill_wgmma_available():
        raise UsageError("MOETPLAN_PREFILL_KERNEL=wgmma needs a compute-capability 9.0 GPU (H100/H200) and kernels "
                         "built for it (moetplan build-kernels --arch 9.0); unset it for the default (auto)")
    return "wgmma"


def _prefill_variant(kind: str) -> int:
    """Implementation variant of the mma.sync block tiles (MOETPLAN_PREFILL_VARIANT, a benchmarking override): m16
    tiles per warp, 1 (the default: 8 warps along M, each decoding its own rows) or 2 (a 4 x 2 warp grid, 10-12%
    slower on the H200). The wgmma stages have one implementation."""
    v = os.environ.get("MOETPLAN_PREFILL_VARIANT", "").strip()
    if not v or kind == "wgmma":
        return 1
    if v not in ("1", "2"):
        raise UsageError(f"MOETPLAN_PREFILL_VARIANT={v!r} for the tiled prefill stages: use 1 or 2, or unset it for "
                         "the default (1)")
    return int(v)


def _decode_shape_ok(mod, P: int, layout: RowLayout, fn: str) -> bool:
    # The decode stages read K in whole chunks (the extension's gemv_chunk: 256 weights per row), up to gemv_max_k.
    return (hasattr(mod, fn) and P <= mod.gemv_max_pairs()
            and layout.hidden % mod.gemv_chunk() == 0 and layout.inter_per_rank % mod.gemv_chunk() == 0
            and max(layout.hidden, layout.inter_per_rank) <= mod.gemv_max_k())


def use_rowdot(mod, P: int, layout: RowLayout, T: int | None = None) -> bool:
    """The rowdot stages take a step when asked for (MOETPLAN_DECODE_KERNEL=rowdot), or under 'auto' when it has
    at most ROWDOT_MAX_TOKENS tokens; same shape rules as the gemv stages (<= 64 pairs, H and Ir multiples of
    256)."""
    dk = decode_kernel()
    if dk == "auto":
        want = T is not None and T <= ROWDOT_MAX_TOKENS
    else:
        want = dk == "rowdot"
    return want and _decode_shape_ok(mod, P, layout, "rowdot_stage")


def use_gemv(mod, P: int, layout: RowLayout, T: int | None = None) -> bool:
    """The streaming decode stages take a step when it has few pairs (<= the extension's gemv_max_pairs) and the
    2-bit rows split into whole 256-weight chunks (H and Ir multiples of 256: every target model), unless the
    rowdot stages take it."""
    dk = decode_kernel()
    return (dk in ("auto", "gemv") and not use_rowdot(mod, P, layout, T)
            and _decode_shape_ok(mod, P, layout, "gemv_stage"))


def _moe_cuda(mod, x, topk_ids, topk_weights, pool, slot_of, layout, fp4_pool, fp4_slot_of, fp4_layout,
              swiglu_limit, out) -> torch.Tensor:
    T, H = x.shape
    k = topk_ids.shape[1]
    ir = layout.inter_per_rank
    E = slot_of.numel()
    dev = x.device
    if out is None:
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
    if T == 0:
        return out
    slot32 = slot_of.to(torch.int32).contiguous()
    f4slot32 = None if fp4_slot_of is None else fp4_slot_of.to(torch.int32).contiguous()
    ids_all = topk_ids if topk_ids.dtype in (torch.int32, torch.int64) else topk_ids.to(torch.int64)
    weights = topk_weights.to(torch.float32).contiguous()
    flag = _error_flag(dev)
    pdl = use_pdl(dev) if dev.type == "cuda" else False
    lim = float(swiglu_limit) if swiglu_limit is not None else 0.0
    fmts = [(0, pool, slot32, layout)] + ([] if fp4_pool is None else [(1, fp4_pool, f4slot32, fp4_layout)])
    chunk = max(1, PARTIAL_BYTES_CAP // (k * max(H, ir) * 4))
    for t0 in range(0, T, chunk):
        t1 = min(T, t0 + chunk)
        ids = ids_all[t0:t1].reshape(-1).contiguous()
        P = ids.numel()
        routed = P > mod.scan_max_pairs() or P >= PREFILL_PAIRS_PER_EXPERT * E
        seg: list = [None] * 5
        if routed:
            M = min(P, E)
            order = torch.empty(P, dtype=torch.int32, device=dev)
            segs = torch.empty(3, 2 * M, dtype=torch.int32, device=dev)
            nseg = torch.empty(2, dtype=torch.int32, device=dev)
            mod.route(ids, slot32, f4slot32, order, segs[0], segs[1], segs[2], nseg, flag)
        partial = torch.empty(P, H, dtype=torch.float32, device=dev)
        xs = x[t0:t1] if x.dtype != torch.float16 else x[t0:t1].float()  # the kernels take bf16 or fp32 x
        todo = fmts
        act = None
        tiled = use_tiled_prefill(mod, layout, P / E) if routed else None
        if tiled:
            # 2-bit experts on block tiles: x -> bf16 in the stages' B order, passes of bn pairs per expert,
            # w13 (+SiLU) -> bf16 intermediate (same order), w2 -> partial rows. FP4 experts take the tiles below.
            wg = tiled == "wgmma"
            variant = _prefill_variant(tiled)
            bn = mod.prefill_block_n(wg)
            tiles = torch.empty(2, (P + bn - 1) // bn + M, dtype=torch.int32, device=dev)
            ntiles = torch.empty(1, dtype=torch.int32, device=dev)
            mod.prefill_tiles(segs[2, :M], nseg[0:1], tiles[0], tiles[1], ntiles, bn, pdl)
            if wg:
                # The wgmma stages copy B tiles whole: x gathered per pass, and the intermediate, in tile layout.
                xpair = torch.empty(tiles.shape[1], bn, H, dtype=torch.bfloat16, device=dev)
                mod.prefill_tile_b(xs.contiguous(), order, segs[1, :M], segs[2, :M], tiles[0], tiles[1], ntiles,
                                   k, xpair, pdl)
                act_b = torch.empty(tiles.shape[1], bn, ir, dtype=torch.bfloat16, device=dev)
            else:
                xpair = torch.empty(xs.shape[0], H, dtype=torch.bfloat16, device=dev)
                mod.pair_x(xs.contiguous(), xpair, pdl)
                act_b = torch.empty(P, ir, dtype=torch.bfloat16, device=dev)
            for w13, b, a_, p_ in ((True, xpair, act_b, None), (False, act_b, None, partial)):
                q_off, s_off = ((layout.w13_q_off, layout.w13_s_off) if w13 else (layout.w2_q_off, layout.w2_s_off))
                mod.prefill_stage(w13, pool, slot32, q_off, s_off, H, ir, segs[0, :M], segs[1, :M], segs[2, :M],
                                  order, tiles[0], tiles[1], ntiles, k, b, a_, p_, lim,
                                  swiglu_limit is not None, flag, wg, variant, pdl)
            todo = fmts[1:]
        elif not routed and use_rowdot(mod, P, layout, t1 - t0):
            # 2-bit experts on CUDA cores: w13 (+SiLU) reads x directly and writes an fp32 intermediate; w2 writes
            # partial rows (and, with FUSED_COMBINE and no FP4 experts, does the weighted per-token sum). 1 pair
            # per pass for one token (every expert has one pair), else 2.
            np_ = 1 if t1 - t0 == 1 else 2
            fused = fp4_pool is None and FUSED_COMBINE
            xr = xs if xs.dtype in (torch.float32, torch.bfloat16) else xs.float()
            act = torch.empty(P, ir, dtype=torch.float32, device=dev)
            counter = (torch.empty(t1 - t0, H // mod.rowdot_rows_per_unit(ir), dtype=torch.int32, device=dev)
                       if fused else None)
            mod.rowdot_stage(True, np_, pool, slot32, f4slot32, layout.w13_q_off, layout.w13_s_off, H, ir, ids, k,
                             xr, act, None, None, None, counter, lim, swiglu_limit is not None, flag, pdl)
            mod.rowdot_stage(False, np_, pool, slot32, f4slot32, layout.w2_q_off, layout.w2_s_off, H, ir, ids, k,
                             act, None, partial, weights[t0:t1] if fused else None,
                             out[t0:t1] if fused else None, counter, lim, swiglu_limit is not None, flag, pdl)
            if fused:
                continue
            todo = fmts[1:]
        elif not routed and use_gemv(mod, P, layout, t1 - t0):
            # 2-bit experts: x -> bf16 planes in the stages' K pairing, w13 (+SiLU) -> bf16 hi/lo intermediate,
            # w2 -> partial rows. FP4-resident experts (if any) still take the tiles below.
            # With FUSED_COMBINE and no FP4 experts the w2 stage also does the weighted per-token sum.
            # bf16 x: x as int8 (TMA ring, I8_DECODE) or e4m3 (sm_89+, E4M3_DECODE) hi/lo planes + per-token scales
            # and the w13 stage with that A operand.
            i8 = use_i8_w13(mod, xs, H)
            f8 = not i8 and use_fp8_w13(mod, xs)
            split = f8 or i8 or xs.dtype == torch.float32
            fused = fp4_pool is None and FUSED_COMBINE
            i8w2 = use_i8_w2(mod, xs, H, ir)
            act_hl = (torch.empty(P, ir, dtype=torch.float32, device=dev) if i8w2 else
                      torch.empty(P, 2, ir, dtype=torch.bfloat16, device=dev))
            counter = torch.empty(xs.shape[0], H // 16, dtype=torch.int32, device=dev) if fused else None
            xinv = None
            if f8 or i8:
                xp = (torch.empty(xs.shape[0], 3, H, dtype=torch.int8, device=dev) if i8 else
                      torch.empty(xs.shape[0], 2, H, dtype=torch.uint8, device=dev))
                xinv = torch.empty(xs.shape[0], dtype=torch.float32, device=dev)
                mod.xprep8(xs, xp, xinv, counter, pdl)
            else:
                xp = torch.empty(xs.shape[0], 2 if split else 1, H, dtype=torch.bfloat16, device=dev)
                mod.xprep(xs, xp, counter, pdl)
            stage = mod.gemv_stage
            balance = -1 if GEMV_BALANCE is None else int(GEMV_BALANCE)
            ring = decode_ring_code()
            if ring == 1 and hasattr(mod, "gemv_bulk_possible"):
                # Here, not as the extension's own check: a clear error naming the knob (the extension's refusal
                # stays as the backstop, e.g. for unaligned pool rows).
                short = [f"{n} (K = {kk})" for n, kk in (("w13", H), ("w2", ir)) if not mod.gemv_bulk_possible(kk)]
                if short:
                    raise UsageError(f"ops.DECODE_RING = 'tma', but the TMA ring cannot run the {' and '.join(short)} "
                                     "stage here: it needs an sm_90+ GPU and K a multiple of its 512-weight rounds; "
                                     "set it to None (the default picks the ring per stage) or 'cp.async'")
            stage(True, split, pool, slot32, f4slot32, layout.w13_q_off, layout.w13_s_off, H, ir, ids, k,
                  xp, act_hl, None, None, None, None, lim, swiglu_limit is not None, flag, pdl, xinv, balance, ring)
            b2, inv2 = act_hl, None
            if i8w2:  # the intermediate as int8 planes under a per-pair scale
                b2 = torch.empty(P, 3, ir, dtype=torch.int8, device=dev)
                inv2 = torch.empty(P, dtype=torch.float32, device=dev)
                mod.xprep8(act_hl, b2, inv2, None, pdl)
            stage(False, True, pool, slot32, f4slot32, layout.w2_q_off, layout.w2_s_off, H, ir, ids, k,
                  b2, None, partial, weights[t0:t1] if fused else None, out[t0:t1] if fused else None,
                  counter, lim, swiglu_limit is not None, flag, pdl, inv2, balance, ring)
            if fused:
                continue
            todo = fmts[1:]
        if todo and act is None:
            act = torch.empty(P, ir, dtype=torch.float32, device=dev)
        for f, pl, so, lay in todo:
            code = 0 if lay.fmt == "2bit" else 1
            if routed:
                sl = slice(f * M, (f + 1) * M)
                seg = [segs[0, sl], segs[1, sl], segs[2, sl], nseg[f:f + 1], order]
            mod.stage(code, True, pl, so, f4slot32, lay.w13_q_off, lay.w13_s_off, 2 * ir, H, ids, *seg, k, xs, act,
                      None, lim, swiglu_limit is not None, flag, pdl)
            mod.stage(code, False, pl, so, f4slot32, lay.w2_q_off, lay.w2_s_off, H, ir, ids, *seg, k, act, None,
                      partial, lim, swiglu_limit is not None, flag, pdl)
        mod.combine(partial, weights[t0:t1].contiguous(), out[t0:t1], k, pdl)
    if not torch.cuda.is_current_stream_capturing() and _check_residency():
        bad = int(flag.item())
        if bad != 0:
            flag.zero_()
            raise ResidencyError(_missing_message([bad - 1], "pool") if bad > 0 else
                                 f"topk_ids has expert ids outside [0, {E})")
    return out


def kernel_supports(layout: RowLayout, x: torch.Tensor) -> bool:
    """Shapes the CUDA kernels take. They read every code row with 16-byte loads, so a row of codes must be a
    multiple of 16 bytes: H and Ir multiples of 64 for 2-bit rows (32 for FP4). Every target model qualifies;
    anything else runs on the reference path."""
    align = 64 if layout.fmt == "2bit" else 32
    return x.is_cuda and layout.hidden % align == 0 and layout.inter_per_rank % align == 0


def _kernel_shape_ok(layout: RowLayout, fp4_layout: RowLayout | None, x: torch.Tensor, pool: torch.Tensor,
                     fp4_pool: torch.Tensor | None) -> bool:
    # Pools must start 16-byte aligned too (a view at an odd offset into a bigger buffer would not).
    return kernel_supports(layout, x) and pool.data_ptr() % 16 == 0 and (
        fp4_layout is None or (kernel_supports(fp4_layout, x) and fp4_pool.data_ptr() % 16 == 0))


# ------------------------------------------------------------------------------------------------ the op


def moe_forward(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, pool: torch.Tensor,
                slot_of: torch.Tensor, layout: RowLayout, fp4_pool: torch.Tensor | None = None,
                fp4_slot_of: torch.Tensor | None = None, fp4_layout: RowLayout | None = None,
                swiglu_limit: float | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """Routed-expert MoE for one layer; returns [T, H] in x's dtype (written into `out` when given).

    Raises ResidencyError when a routed expert has no slot (checked after the kernels, once per call, unless a
    CUDA graph is being captured or MOETPLAN_CHECK_RESIDENCY=0).
    """
    _check_inputs(x, topk_ids, topk_weights, pool, slot_of, layout, fp4_pool, fp4_slot_of, fp4_layout, out)
    if x.is_cuda:
        mod = kernels.get_module()
        if mod is not None and _kernel_shape_ok(layout, fp4_layout, x, pool, fp4_pool):
            if not x.is_contiguous() or x.data_ptr() % 16:
                x = x.contiguous() if not x.is_contiguous() else x.clone()  # 16-byte loads need aligned rows
            return _moe_cuda(mod, x, topk_ids, topk_weights, pool, slot_of, layout, fp4_pool, fp4_slot_of,
                             fp4_layout, swiglu_limit, out)
        if mod is None:
            kernels.note_fallback()
        else:
            kernels.note_shape_fallback(f"H={layout.hidden}, Ir={layout.inter_per_rank} ({layout.fmt}): the kernels "
                                        "need multiples of 64 (2-bit) / 32 (FP4) and 16-byte aligned pools")
    return moe_forward_reference(x, topk_ids, topk_weights, pool, slot_of, layout, fp4_pool, fp4_slot_of,
                                 fp4_layout, swiglu_limit, out)

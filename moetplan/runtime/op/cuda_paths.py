"""The CUDA paths of the routed-expert op (csrc/ through moetplan.runtime.op.kernels), chosen per token chunk.

A chunk's 2-bit experts take the first path of `CUDA_PATHS` that applies (routed block tiles for wide steps, the
rowdot or gemv streaming stages for small ones), else the generic tile stages; FP4-resident experts always take the
generic stages. Every choice a path makes comes from the `KernelPolicy` the caller passes.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from moetplan.contract.errors import UsageError
from moetplan.contract.layout import RowLayout
from moetplan.contract.runtime import KernelPolicy
from moetplan.runtime.op.reference import ResidencyError, missing_message

# Average pairs per expert from which a step is routed (block tiles, 32 pairs per pass, bf16 operands) rather than
# scanned by the route-free decode tiles (8 pairs per pass, hi/lo split operands).
PREFILL_PAIRS_PER_EXPERT = 8
# Cap on the fp32 per-pair partial buffer [T*k, H] of one kernel call; longer prefills are chunked over tokens.
PARTIAL_BYTES_CAP = 1 << 30
# Average pairs per expert from which "auto" takes the wgmma stages on Hopper: their 128-pair passes and one block
# per SM pay off on wide passes only (the mma.sync tiles are faster below).
WGMMA_PAIRS_PER_EXPERT = 56
_RING_CODES = {None: -1, "cp.async": 0, "tma": 1}


# --------------------------------------------------------------------------- what takes a step


def decode_ring_code(policy: KernelPolicy) -> int:
    """The policy's decode ring as the extension's `ring` argument (-1 its choice, 0 cp.async, 1 TMA)."""
    return _RING_CODES[policy.decode_ring]


def _takes_tma_ring(mod: Any, K: int, policy: KernelPolicy) -> bool:
    # Asked without forcing the ring: where a forced TMA ring cannot run, the op raises its own UsageError.
    ring = decode_ring_code(policy)
    return ring != 0 and bool(mod.gemv_bulk_possible(K)) and (ring == 1 or mod.gemv_ring(K) == "tma")


def use_fp8_w13(mod: Any, x: torch.Tensor, policy: KernelPolicy) -> bool:
    """The e4m3 w13 decode stage takes this step: asked for, bf16 x, and the GPU has e4m3 MMAs (sm_89+)."""
    return (policy.e4m3_decode and x.dtype == torch.bfloat16 and hasattr(mod, "decode_fp8_available")
            and bool(mod.decode_fp8_available()))


def use_i8_w13(mod: Any, x: torch.Tensor, H: int, policy: KernelPolicy) -> bool:
    """The int8 w13 decode stage takes this step: asked for, bf16 x, and the w13 stage takes the TMA ring here."""
    if not (policy.i8_decode and x.dtype == torch.bfloat16 and hasattr(mod, "decode_i8_available")
            and bool(mod.decode_i8_available())):
        return False
    return _takes_tma_ring(mod, H, policy)


def use_i8_w2(mod: Any, x: torch.Tensor, H: int, Ir: int, policy: KernelPolicy) -> bool:
    """The int8 w2 decode stage takes this step: the int8 w13 stage does, and the w2 stage takes the TMA ring too
    (Ir a multiple of its rounds: not every tensor-parallel shard is)."""
    return policy.i8_w2 and use_i8_w13(mod, x, H, policy) and _takes_tma_ring(mod, Ir, policy)


def use_tiled_prefill(mod: Any, layout: RowLayout, pairs_per_expert: float = 0.0,
                      policy: KernelPolicy = KernelPolicy()) -> str | None:
    """The block-tile stages that take a routed step's 2-bit experts ("tiled" or "wgmma"), or None (the policy's
    "warp", an extension without them, or H / Ir not multiples of the extension's prefill_k_align)."""
    pk = policy.prefill
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
        raise UsageError("KernelPolicy.prefill='wgmma' needs a compute-capability 9.0 GPU (H100/H200) and kernels "
                         "built for it (moetplan build-kernels --arch 9.0); leave it out for the default (auto)")
    return "wgmma"


def _decode_shape_ok(mod: Any, P: int, layout: RowLayout, fn: str) -> bool:
    # The decode stages read K in whole chunks (the extension's gemv_chunk: 256 weights per row), up to gemv_max_k.
    return (hasattr(mod, fn) and P <= mod.gemv_max_pairs()
            and layout.hidden % mod.gemv_chunk() == 0 and layout.inter_per_rank % mod.gemv_chunk() == 0
            and max(layout.hidden, layout.inter_per_rank) <= mod.gemv_max_k())


def use_rowdot(mod: Any, P: int, layout: RowLayout, T: int | None = None,
               policy: KernelPolicy = KernelPolicy()) -> bool:
    """The rowdot stages take a step when the policy asks for them, or under "auto" for steps of at most
    rowdot_max_tokens tokens; same shape rules as the gemv stages."""
    if policy.decode == "auto":
        want = T is not None and T <= policy.rowdot_max_tokens
    else:
        want = policy.decode == "rowdot"
    return want and _decode_shape_ok(mod, P, layout, "rowdot_stage")


def use_gemv(mod: Any, P: int, layout: RowLayout, T: int | None = None,
             policy: KernelPolicy = KernelPolicy()) -> bool:
    """The streaming decode stages take a step with few pairs (<= the extension's gemv_max_pairs) whose rows split
    into whole 256-weight chunks, unless the rowdot stages take it."""
    return (policy.decode in ("auto", "gemv") and not use_rowdot(mod, P, layout, T, policy)
            and _decode_shape_ok(mod, P, layout, "gemv_stage"))


def kernel_supports(layout: RowLayout, x: torch.Tensor) -> bool:
    """Shapes the kernels take: code rows read with 16-byte loads, so H and Ir multiples of 64 for 2-bit rows
    (32 for FP4). Every target model qualifies; anything else runs on the reference."""
    align = 64 if layout.fmt == "2bit" else 32
    return x.is_cuda and layout.hidden % align == 0 and layout.inter_per_rank % align == 0


def kernel_shape_ok(layout: RowLayout, fp4_layout: RowLayout | None, x: torch.Tensor, pool: torch.Tensor,
                    fp4_pool: torch.Tensor | None) -> bool:
    # Pools must start 16-byte aligned too (a view at an odd offset into a bigger buffer would not).
    return kernel_supports(layout, x) and pool.data_ptr() % 16 == 0 and (
        fp4_layout is None or (kernel_supports(fp4_layout, x) and fp4_pool.data_ptr() % 16 == 0))


_FLAGS: dict[str, torch.Tensor] = {}
_PDL_CAP: dict[str, bool] = {}


def error_flag(dev: torch.device) -> torch.Tensor:
    """Per-device sticky residency error flag (expert+1, or -1 for an id out of range); reset when reported."""
    key = str(dev)
    f = _FLAGS.get(key)
    if f is None:
        f = _FLAGS[key] = torch.zeros(1, dtype=torch.int32, device=dev)
    return f


def use_pdl(dev: torch.device, policy: KernelPolicy) -> bool:
    """Programmatic dependent launch between the op's kernels: sm_90+ and the policy allows it."""
    if not policy.pdl:
        return False
    key = str(dev)
    if key not in _PDL_CAP:
        _PDL_CAP[key] = torch.cuda.get_device_capability(dev)[0] >= 9
    return _PDL_CAP[key]


# --------------------------------------------------------------------------- one token chunk


@dataclass
class Chunk:
    """One token chunk of a CUDA call: its inputs, the buffers its launches share, and the policy."""

    mod: Any
    xs: torch.Tensor  # [t, H] bf16 or fp32
    ids: torch.Tensor  # [P] expert of each (token, slot) pair
    weights: torch.Tensor  # [t, k] fp32
    out: torch.Tensor  # [t, H]
    partial: torch.Tensor  # [P, H] fp32 per-pair outputs
    pool: torch.Tensor
    slot32: torch.Tensor
    f4slot32: torch.Tensor | None
    layout: RowLayout
    fp4_pool: torch.Tensor | None
    k: int
    lim: float
    has_lim: bool
    flag: torch.Tensor
    pdl: bool
    policy: KernelPolicy
    routed: bool
    segs: Any = None  # routed steps: [3, 2M] per-expert segments (expert, offset, count) per format
    nseg: Any = None
    order: Any = None
    M: int = 0
    tiled: str | None = None
    fused: bool = False  # the w2 stage wrote the weighted sum into `out`: no combine launch
    act: torch.Tensor | None = field(default=None, repr=False)

    @property
    def P(self) -> int:
        return int(self.ids.numel())

    @property
    def T(self) -> int:
        return int(self.xs.shape[0])

    @property
    def H(self) -> int:
        return self.layout.hidden

    @property
    def ir(self) -> int:
        return self.layout.inter_per_rank


def _prefill_tiles(c: Chunk) -> None:
    """2-bit experts on block tiles: x -> bf16 in the stages' B order, passes of bn pairs per expert, w13 (+SiLU) ->
    bf16 intermediate (same order), w2 -> partial rows."""
    mod, dev, M, H, ir = c.mod, c.xs.device, c.M, c.H, c.ir
    wg = c.tiled == "wgmma"
    variant = 1 if wg else c.policy.prefill_variant
    bn = mod.prefill_block_n(wg)
    tiles = torch.empty(2, (c.P + bn - 1) // bn + M, dtype=torch.int32, device=dev)
    ntiles = torch.empty(1, dtype=torch.int32, device=dev)
    mod.prefill_tiles(c.segs[2, :M], c.nseg[0:1], tiles[0], tiles[1], ntiles, bn, c.pdl)
    if wg:  # the wgmma stages copy B tiles whole: x gathered per pass, and the intermediate, in tile layout
        xpair = torch.empty(tiles.shape[1], bn, H, dtype=torch.bfloat16, device=dev)
        mod.prefill_tile_b(c.xs.contiguous(), c.order, c.segs[1, :M], c.segs[2, :M], tiles[0], tiles[1], ntiles,
                           c.k, xpair, c.pdl)
        act_b = torch.empty(tiles.shape[1], bn, ir, dtype=torch.bfloat16, device=dev)
    else:
        xpair = torch.empty(c.T, H, dtype=torch.bfloat16, device=dev)
        mod.pair_x(c.xs.contiguous(), xpair, c.pdl)
        act_b = torch.empty(c.P, ir, dtype=torch.bfloat16, device=dev)
    lay = c.layout
    for w13, b, a_, p_ in ((True, xpair, act_b, None), (False, act_b, None, c.partial)):
        q_off, s_off = (lay.w13_q_off, lay.w13_s_off) if w13 else (lay.w2_q_off, lay.w2_s_off)
        mod.prefill_stage(w13, c.pool, c.slot32, q_off, s_off, H, ir, c.segs[0, :M], c.segs[1, :M], c.segs[2, :M],
                          c.order, tiles[0], tiles[1], ntiles, c.k, b, a_, p_, c.lim, c.has_lim, c.flag, wg, variant,
                          c.pdl)


def _decode_rowdot(c: Chunk) -> None:
    """2-bit experts on CUDA cores: w13 (+SiLU) reads x directly into an fp32 intermediate; w2 writes partial rows
    (and, with fused_combine and no FP4 experts, the weighted per-token sum). 1 pair per pass for one token."""
    mod, dev, lay, H, ir = c.mod, c.xs.device, c.layout, c.H, c.ir
    np_ = 1 if c.T == 1 else 2
    c.fused = c.fp4_pool is None and c.policy.fused_combine
    xr = c.xs if c.xs.dtype in (torch.float32, torch.bfloat16) else c.xs.float()
    act = torch.empty(c.P, ir, dtype=torch.float32, device=dev)
    counter = (torch.empty(c.T, H // mod.rowdot_rows_per_unit(ir), dtype=torch.int32, device=dev)
               if c.fused else None)
    mod.rowdot_stage(True, np_, c.pool, c.slot32, c.f4slot32, lay.w13_q_off, lay.w13_s_off, H, ir, c.ids, c.k,
                     xr, act, None, None, None, counter, c.lim, c.has_lim, c.flag, c.pdl)
    mod.rowdot_stage(False, np_, c.pool, c.slot32, c.f4slot32, lay.w2_q_off, lay.w2_s_off, H, ir, c.ids, c.k,
                     act, None, c.partial, c.weights if c.fused else None, c.out if c.fused else None, counter,
                     c.lim, c.has_lim, c.flag, c.pdl)


def _decode_gemv(c: Chunk) -> None:
    """2-bit experts on the streaming stages: x -> bf16 planes (or int8 / e4m3 planes with per-token scales for
    bf16 x) in the stages' K pairing, w13 (+SiLU) -> intermediate, w2 -> partial rows (or the fused sum)."""
    mod, dev, lay, H, ir, pol = c.mod, c.xs.device, c.layout, c.H, c.ir, c.policy
    i8 = use_i8_w13(mod, c.xs, H, pol)
    f8 = not i8 and use_fp8_w13(mod, c.xs, pol)
    split = f8 or i8 or c.xs.dtype == torch.float32
    c.fused = c.fp4_pool is None and pol.fused_combine
    i8w2 = use_i8_w2(mod, c.xs, H, ir, pol)
    act_hl = (torch.empty(c.P, ir, dtype=torch.float32, device=dev) if i8w2 else
              torch.empty(c.P, 2, ir, dtype=torch.bfloat16, device=dev))
    counter = torch.empty(c.T, H // 16, dtype=torch.int32, device=dev) if c.fused else None
    xinv = None
    if f8 or i8:
        xp = (torch.empty(c.T, 3, H, dtype=torch.int8, device=dev) if i8 else
              torch.empty(c.T, 2, H, dtype=torch.uint8, device=dev))
        xinv = torch.empty(c.T, dtype=torch.float32, device=dev)
        mod.xprep8(c.xs, xp, xinv, counter, c.pdl)
    else:
        xp = torch.empty(c.T, 2 if split else 1, H, dtype=torch.bfloat16, device=dev)
        mod.xprep(c.xs, xp, counter, c.pdl)
    balance = -1 if pol.gemv_balance is None else int(pol.gemv_balance)
    ring = decode_ring_code(pol)
    if ring == 1 and hasattr(mod, "gemv_bulk_possible"):
        # Refused here, naming the knob (the extension's own refusal stays as the backstop, e.g. unaligned pools).
        short = [f"{n} (K = {kk})" for n, kk in (("w13", H), ("w2", ir)) if not mod.gemv_bulk_possible(kk)]
        if short:
            raise UsageError(f"KernelPolicy.decode_ring='tma', but the TMA ring cannot run the {' and '.join(short)} "
                             "stage here: it needs an sm_90+ GPU and K a multiple of its 512-weight rounds; leave it "
                             "out (the extension picks the ring per stage) or use 'cp.async'")
    mod.gemv_stage(True, split, c.pool, c.slot32, c.f4slot32, lay.w13_q_off, lay.w13_s_off, H, ir, c.ids, c.k, xp,
                   act_hl, None, None, None, None, c.lim, c.has_lim, c.flag, c.pdl, xinv, balance, ring)
    b2, inv2 = act_hl, None
    if i8w2:  # the intermediate as int8 planes under a per-pair scale
        b2 = torch.empty(c.P, 3, ir, dtype=torch.int8, device=dev)
        inv2 = torch.empty(c.P, dtype=torch.float32, device=dev)
        mod.xprep8(act_hl, b2, inv2, None, c.pdl)
    mod.gemv_stage(False, True, c.pool, c.slot32, c.f4slot32, lay.w2_q_off, lay.w2_s_off, H, ir, c.ids, c.k, b2,
                   None, c.partial, c.weights if c.fused else None, c.out if c.fused else None, counter, c.lim,
                   c.has_lim, c.flag, c.pdl, inv2, balance, ring)


@dataclass(frozen=True)
class CudaPath:
    """One way a chunk's 2-bit experts can run: `applies(chunk)` decides, `run(chunk)` launches."""

    name: str
    applies: Callable[[Chunk], bool]
    run: Callable[[Chunk], None]


CUDA_PATHS: tuple[CudaPath, ...] = (
    CudaPath("prefill-tiles", lambda c: c.routed and c.tiled is not None, _prefill_tiles),
    CudaPath("decode-rowdot", lambda c: not c.routed and use_rowdot(c.mod, c.P, c.layout, c.T, c.policy),
             _decode_rowdot),
    CudaPath("decode-gemv", lambda c: not c.routed and use_gemv(c.mod, c.P, c.layout, c.T, c.policy), _decode_gemv),
)


def _path_name(path: CudaPath | None, c: Chunk) -> str:
    if path is None:  # both formats on the generic tiles: the one-warp prefill tiles or the decode scan tiles
        return "prefill-warp" if c.routed else "decode-mma"
    return f"prefill-{c.tiled}" if path.name == "prefill-tiles" else path.name


def moe_cuda(mod: Any, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, pool: torch.Tensor,
             slot_of: torch.Tensor, layout: RowLayout, fp4_pool: torch.Tensor | None,
             fp4_slot_of: torch.Tensor | None, fp4_layout: RowLayout | None, swiglu_limit: float | None,
             out: torch.Tensor | None, policy: KernelPolicy = KernelPolicy(),
             ran: Callable[[str], None] | None = None) -> torch.Tensor:
    """The op on the CUDA kernels; `ran(name)` hears which path each chunk's 2-bit experts took."""
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
    flag = error_flag(dev)
    pdl = use_pdl(dev, policy) if dev.type == "cuda" else False
    lim = float(swiglu_limit) if swiglu_limit is not None else 0.0
    fmts = [(0, pool, slot32, layout)] + ([] if fp4_pool is None else [(1, fp4_pool, f4slot32, fp4_layout)])
    chunk = max(1, PARTIAL_BYTES_CAP // (k * max(H, ir) * 4))
    for t0 in range(0, T, chunk):
        t1 = min(T, t0 + chunk)
        ids = ids_all[t0:t1].reshape(-1).contiguous()
        P = ids.numel()
        c = Chunk(mod=mod, xs=x[t0:t1] if x.dtype != torch.float16 else x[t0:t1].float(),  # bf16 or fp32 x
                  ids=ids, weights=weights[t0:t1], out=out[t0:t1],
                  partial=torch.empty(P, H, dtype=torch.float32, device=dev), pool=pool, slot32=slot32,
                  f4slot32=f4slot32, layout=layout, fp4_pool=fp4_pool, k=k, lim=lim, has_lim=swiglu_limit is not None,
                  flag=flag, pdl=pdl, policy=policy,
                  routed=P > mod.scan_max_pairs() or P >= PREFILL_PAIRS_PER_EXPERT * E)
        seg: list = [None] * 5
        if c.routed:
            c.M = min(P, E)
            c.order = torch.empty(P, dtype=torch.int32, device=dev)
            c.segs = torch.empty(3, 2 * c.M, dtype=torch.int32, device=dev)
            c.nseg = torch.empty(2, dtype=torch.int32, device=dev)
            mod.route(ids, slot32, f4slot32, c.order, c.segs[0], c.segs[1], c.segs[2], c.nseg, flag)
            c.tiled = use_tiled_prefill(mod, layout, P / E, policy)
        path = next((p for p in CUDA_PATHS if p.applies(c)), None)
        todo = fmts
        if path is not None:
            path.run(c)
            todo = fmts[1:]  # FP4-resident experts take the generic tiles below
        if ran is not None:
            ran(_path_name(path, c))
        if c.fused:
            continue
        act = torch.empty(P, ir, dtype=torch.float32, device=dev) if todo else None
        for f, pl, so, lay in todo:
            code = 0 if lay.fmt == "2bit" else 1
            if c.routed:
                sl = slice(f * c.M, (f + 1) * c.M)
                seg = [c.segs[0, sl], c.segs[1, sl], c.segs[2, sl], c.nseg[f:f + 1], c.order]
            mod.stage(code, True, pl, so, f4slot32, lay.w13_q_off, lay.w13_s_off, 2 * ir, H, ids, *seg, k, c.xs,
                      act, None, lim, c.has_lim, flag, pdl)
            mod.stage(code, False, pl, so, f4slot32, lay.w2_q_off, lay.w2_s_off, H, ir, ids, *seg, k, act, None,
                      c.partial, lim, c.has_lim, flag, pdl)
        mod.combine(c.partial, c.weights.contiguous(), c.out, k, pdl)
    if policy.check_residency and not torch.cuda.is_current_stream_capturing():
        bad = int(flag.item())
        if bad != 0:
            flag.zero_()
            raise ResidencyError(missing_message([bad - 1], "pool") if bad > 0 else
                                 f"topk_ids has expert ids outside [0, {E})")
    return out


__all__ = ["CUDA_PATHS", "Chunk", "CudaPath", "PARTIAL_BYTES_CAP", "PREFILL_PAIRS_PER_EXPERT",
           "WGMMA_PAIRS_PER_EXPERT", "decode_ring_code", "error_flag", "kernel_shape_ok", "kernel_supports",
           "moe_cuda", "use_fp8_w13", "use_gemv", "use_i8_w13", "use_i8_w2", "use_pdl", "use_rowdot",
           "use_tiled_prefill"]

"""GPU tests of the CUDA MoE kernels against the torch reference (the oracle), run on an H200 with `pytest -m gpu`.

Tolerances (docs/KERNELS.md): relative L2 error vs the float32 reference <= 2e-4 on the decode path (exact bf16
weights, hi/lo split operands, fp32 accumulation) and <= 1e-2 on the prefill path (bf16 intermediate).
"""
from __future__ import annotations

import dataclasses
import subprocess
import sys
import textwrap

import pytest
import torch
from csrc_source import decode_constant, kernels_constant

from moetplan.contract.errors import UsageError
from moetplan.contract.runtime import KernelPolicy
from moetplan.runtime.op import cuda_paths as cp
from moetplan.runtime.op import kernels, ops
from moetplan.runtime.op.reference import moe_forward_reference
from moetplan.runtime.format.format import RowLayout

pytestmark = pytest.mark.gpu

DECODE_TOL = 2e-4
PREFILL_TOL = 1e-2


@pytest.fixture(scope="module")
def mod():
    kernels.reset_for_tests()
    m = kernels.get_module()
    if m is None:
        pytest.skip(f"kernels unavailable: {kernels.fallback_reason()}")
    return m


def _fill_scales(pool: torch.Tensor, layout: RowLayout, lo: int, hi: int, g: torch.Generator,
                 names: tuple[str, ...] = ("w13_s", "w2_s")) -> None:
    """Scale bytes uniform in [lo, hi) for the named row sections of every slot."""
    for name in names:
        off, size = getattr(layout, f"{name}_off"), getattr(layout, f"{name}_size")
        pool[:, off:off + size] = torch.randint(lo, hi, (pool.shape[0], size), generator=g, dtype=torch.uint8,
                                                device="cuda")


def _pool(layout: RowLayout, n_slots: int, seed: int) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    pool = torch.randint(0, 256, (n_slots, layout.stride), generator=g, dtype=torch.uint8, device="cuda")
    _fill_scales(pool, layout, 118, 126, g)
    return pool


def _routing(T, k, E, seed, device="cuda"):
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    w = torch.softmax(torch.randn(T, k, generator=g), dim=-1)
    return ids.to(device), w.to(device)


def _rel(a, b):
    return float(torch.linalg.vector_norm(a.double() - b.double()) / torch.linalg.vector_norm(b.double()))


def _case(H, I, k, T, E=32, fmt_mix=False, dtype=torch.bfloat16, seed=0, limit=None):
    lay = RowLayout.for_expert(H, I, fmt="2bit")
    pool = _pool(lay, E + 2, seed)
    slot_of = torch.randperm(E + 2, generator=torch.Generator().manual_seed(seed))[:E].to(torch.int32).cuda()
    extra = {}
    if fmt_mix:
        lay4 = RowLayout.for_expert(H, I, fmt="fp4")
        n4 = E // 4
        f4 = torch.full((E,), -1, dtype=torch.int32)
        f4[torch.randperm(E, generator=torch.Generator().manual_seed(seed + 1))[:n4]] = torch.arange(n4,
                                                                                                  dtype=torch.int32)
        extra = dict(fp4_pool=_pool(lay4, n4, seed + 2), fp4_slot_of=f4.cuda(), fp4_layout=lay4)
    ids, w = _routing(T, k, E, seed)
    x = (torch.randn(T, H, generator=torch.Generator().manual_seed(seed + 3)) * 0.3).to(dtype).cuda()
    return x, ids, w, pool, slot_of, lay, extra


SHAPES = [(4096, 2048), (6144, 1024), (7168, 2048), (7168, 512)]


@pytest.fixture(params=["gemv", "rowdot", "mma", "gemv+fused", "rowdot+fused", "gemv+e4m3", "gemv+bf16", "gemv+bf16w2",
                        "gemv+plain", "gemv+balanced", "gemv+balanced+fused", "gemv+cp.async"])
def decode_kernel(request, mod) -> KernelPolicy:
    """Every decode path (KernelPolicy.decode): the mma.sync streaming stages (gemv), the CUDA-core rowdot stages
    and the first version's tiles; "+fused": with the per-token sum folded into the w2 stage (fused_combine);
    "+e4m3": the gemv stages with the e4m3 w13 stage for bf16 x (e4m3_decode); "+bf16": with the bf16 stages
    for bf16 x (i8_decode off; on, the default, bf16 x takes the int8 stages where the TMA ring runs);
    "+bf16w2": the int8 w13 stage with the bf16 w2 stage (i8_w2 off); "+plain" / "+balanced": the gemv
    stages' units over warps forced either way (gemv_balance; without it, gemv_plan's choice); "+cp.async": the
    gemv stages' cp.async ring where the default takes the TMA ring (sm_90+: decode_ring; what sm_80-89 run)."""
    e4m3 = request.param.endswith("+e4m3")
    if e4m3 and not mod.decode_fp8_available():
        pytest.skip("the e4m3 w13 stage needs an sm_89+ GPU")
    return KernelPolicy(decode=request.param.split("+")[0], fused_combine=request.param.endswith("+fused"),
                        gemv_balance=True if "+balanced" in request.param else
                        False if "+plain" in request.param else None,
                        e4m3_decode=e4m3, i8_decode=not (e4m3 or request.param.endswith("+bf16")),
                        i8_w2=not request.param.endswith("+bf16w2"),
                        decode_ring="cp.async" if request.param.endswith("+cp.async") else None)


@pytest.mark.parametrize("H,I", SHAPES)
@pytest.mark.parametrize("k", [6, 8])
@pytest.mark.parametrize("T", [1, 2, 3, 8, 64])
def test_decode_matches_reference(mod, decode_kernel, H, I, k, T):
    x, ids, w, pool, slot_of, lay, _ = _case(H, I, k, T, E=128 if T == 64 else 32, seed=H + I + k + T)
    got = ops.moe_forward(x, ids, w, pool, slot_of, lay, policy=decode_kernel)
    ref = moe_forward_reference(x, ids, w, pool, slot_of, lay)
    assert got.dtype == x.dtype
    assert torch.isfinite(got).all()
    # The bf16 output rounding alone is ~2^-9 relative; compare the kernel's fp32 result through an fp32 x too.
    assert _rel(got, ref.float()) < 8e-3
    x32 = x.float()
    got32 = ops.moe_forward(x32, ids, w, pool, slot_of, lay, policy=decode_kernel)
    ref32 = moe_forward_reference(x32, ids, w, pool, slot_of, lay)
    assert _rel(got32, ref32) < DECODE_TOL


@pytest.mark.parametrize("H,I", [(4096, 2048), (7168, 512)])
def test_fp4_reserve_and_clamp(mod, decode_kernel, H, I):
    x, ids, w, pool, slot_of, lay, extra = _case(H, I, 8, 6, fmt_mix=True, dtype=torch.float32, seed=7)
    for limit in (None, 0.5):
        got = ops.moe_forward(x, ids, w, pool, slot_of, lay, swiglu_limit=limit, **extra, policy=decode_kernel)
        ref = moe_forward_reference(x, ids, w, pool, slot_of, lay, swiglu_limit=limit, **extra)
        assert _rel(got, ref) < DECODE_TOL, limit


@pytest.mark.parametrize("H,I", [(320, 192), (128, 64), (4096 + 64, 2048 - 64)])
def test_k_not_a_multiple_of_the_chunk(mod, H, I):
    x, ids, w, pool, slot_of, lay, extra = _case(H, I, 4, 3, E=8, fmt_mix=True, dtype=torch.float32, seed=3)
    got = ops.moe_forward(x, ids, w, pool, slot_of, lay, **extra)
    ref = moe_forward_reference(x, ids, w, pool, slot_of, lay, **extra)
    assert _rel(got, ref) < DECODE_TOL


def test_unaligned_shape_falls_back_to_reference(mod, caplog):
    # 2-bit code rows of H=224 are 56 bytes: not 16-byte aligned, so the reference path runs (one log line).
    x, ids, w, pool, slot_of, lay, _ = _case(224, 96, 4, 3, E=8, dtype=torch.float32, seed=3)
    log = ops.PathLog()
    with caplog.at_level("WARNING", logger="moetplan.kernels"):
        got = ops.moe_forward(x, ids, w, pool, slot_of, lay, paths=log)
    assert not cp.kernel_supports(lay, x)
    assert torch.equal(got, moe_forward_reference(x, ids, w, pool, slot_of, lay))
    assert any("H=224, Ir=96" in r.message for r in caplog.records)
    assert log.counts == {"reference": 1} and log.fallbacks == 1
    x, ids, w, pool, slot_of, lay, _ = _case(4096, 1024, 4, 3, E=8, seed=3)
    ops.moe_forward(x, ids, w, pool, slot_of, lay, paths=log)  # a kernel path, named
    assert log.fallbacks == 1 and any(k.startswith("cuda:decode-") for k in log.counts)


def _prefill_param(request, mod) -> KernelPolicy:
    name, _, variant = request.param.partition(":")
    if name == "wgmma" and not mod.prefill_wgmma_available():
        pytest.skip("wgmma prefill stages need a compute-capability 9.0 GPU")
    return KernelPolicy(prefill=name, prefill_variant=int(variant or 1))


@pytest.fixture(params=["wgmma", "tiled", "tiled:2", "warp"])
def prefill_kernel(request, mod) -> KernelPolicy:
    """Every prefill path (KernelPolicy.prefill[:prefill_variant]): block tiles on wgmma (Hopper) and on mma.sync
    (1 or 2 m tiles per warp), and the first version's one-warp tiles."""
    return _prefill_param(request, mod)


@pytest.fixture(params=["wgmma", "tiled", "tiled:2"])
def block_prefill(request, mod) -> KernelPolicy:
    """The block-tile prefill stages: wgmma (Hopper) and mma.sync (1 or 2 m tiles per warp)."""
    return _prefill_param(request, mod)


def test_prefill_default_path(mod):
    lay = RowLayout.for_expert(4096, 1024, fmt="2bit")
    assert cp.use_tiled_prefill(mod, lay) == "tiled"
    # a 9.0 build carries the sm_90a binary: the wgmma stages are there, and 'auto' takes them for wide passes
    assert mod.prefill_wgmma_available() == (torch.cuda.get_device_capability() == (9, 0))
    wide = cp.use_tiled_prefill(mod, lay, cp.WGMMA_PAIRS_PER_EXPERT)
    assert wide == ("wgmma" if mod.prefill_wgmma_available() else "tiled")
    assert cp.use_tiled_prefill(mod, lay, cp.WGMMA_PAIRS_PER_EXPERT - 1) == "tiled"
    if not mod.prefill_wgmma_available():
        with pytest.raises(UsageError, match="compute-capability 9.0"):
            cp.use_tiled_prefill(mod, lay, policy=KernelPolicy(prefill="wgmma"))


@pytest.mark.parametrize("T,E", [(256, 16), (1024, 64), (512, 64)])
def test_prefill_matches_reference(mod, prefill_kernel, T, E):
    x, ids, w, pool, slot_of, lay, extra = _case(4096, 1024, 8, T, E=E, fmt_mix=True, seed=T)
    assert T * 8 >= cp.PREFILL_PAIRS_PER_EXPERT * E  # takes the prefill tiles
    want = prefill_kernel.prefill
    assert cp.use_tiled_prefill(mod, lay, policy=prefill_kernel) == (None if want == "warp" else want)
    got = ops.moe_forward(x, ids, w, pool, slot_of, lay, **extra, policy=prefill_kernel)
    ref = moe_forward_reference(x, ids, w, pool, slot_of, lay, **extra)
    assert _rel(got, ref.float()) < PREFILL_TOL


@pytest.mark.parametrize("H,I,k,T,E", [(7168, 512, 8, 384, 32), (6144, 1024, 6, 300, 24), (4096, 2048, 8, 700, 16),
                                       (7168, 2048, 6, 96, 64)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_tiled_prefill_shapes_and_clamp(mod, block_prefill, H, I, k, T, E, dtype):
    # Every model's H with TP1/2/4 shards of I, one and several 64-pair passes per expert, partial last passes,
    # FP4 experts (warp tiles) in the same step, the SwiGLU clamp, bf16 and fp32 x.
    x, ids, w, pool, slot_of, lay, extra = _case(H, I, k, T, E=E, fmt_mix=True, dtype=dtype, seed=H + T)
    for limit in (None, 0.5):
        got = ops.moe_forward(x, ids, w, pool, slot_of, lay, swiglu_limit=limit, **extra, policy=block_prefill)
        ref = moe_forward_reference(x, ids, w, pool, slot_of, lay, swiglu_limit=limit, **extra)
        assert got.dtype == dtype
        assert _rel(got, ref.float()) < PREFILL_TOL, limit


def test_tiled_prefill_skewed_routing(mod, block_prefill):
    # One expert takes every token (many passes of one segment), the rest share the remainder unevenly.
    x, _, w, pool, slot_of, lay, _ = _case(4096, 1024, 4, 600, E=32, seed=21)
    g = torch.Generator().manual_seed(21)
    others = torch.tensor([0, 1, 2, 3, 4, 6, 7, 8, 30])
    rest = torch.stack([others[torch.randperm(len(others), generator=g)[:3]] for _ in range(600)])
    ids = torch.cat([torch.full((600, 1), 5), rest], dim=1).cuda()
    got = ops.moe_forward(x, ids, w, pool, slot_of, lay, policy=block_prefill)
    ref = moe_forward_reference(x, ids, w, pool, slot_of, lay)
    assert _rel(got, ref.float()) < PREFILL_TOL
    warp = KernelPolicy(prefill="warp")
    assert _rel(got, ops.moe_forward(x, ids, w, pool, slot_of, lay, policy=warp).float()) < PREFILL_TOL


def test_block_prefill_every_pass_width(mod, block_prefill):
    # Experts with 1..212 pairs: full and partial last passes of every width, the wgmma stages' n32 / n64 / n96 /
    # n128 MMAs (pass pairs rounded up to 32) and the tiled stages' 64-pair passes, on both sides of each boundary.
    counts = [1, 31, 32, 33, 63, 64, 65, 96, 97, 127, 128, 129, 160, 212]
    flat = torch.cat([torch.full((c,), e) for e, c in enumerate(counts)])
    T = flat.numel() // 2  # token t takes flat[t] and flat[t + T]: distinct, since no expert has T pairs
    ids = torch.stack([flat[:T], flat[T:]], dim=1)
    assert bool((ids[:, 0] != ids[:, 1]).all()) and torch.equal(torch.bincount(ids.flatten())[:14],
                                                                  torch.tensor(counts))
    x, _, w, pool, slot_of, lay, _ = _case(4096, 1024, 2, T, E=16, seed=31)
    ids = ids.cuda()
    got = ops.moe_forward(x, ids, w, pool, slot_of, lay, policy=block_prefill)
    ref = moe_forward_reference(x, ids, w, pool, slot_of, lay)
    assert _rel(got, ref.float()) < PREFILL_TOL


def test_tiled_prefill_shape_rules(mod):
    # H = 4160 is a multiple of 64 (the warp tiles take it) but not of 128: the tiled stages decline it.
    tiled = KernelPolicy(prefill="tiled")
    x, ids, w, pool, slot_of, lay, _ = _case(4096 + 64, 1024, 8, 256, E=16, seed=5)
    assert not cp.use_tiled_prefill(mod, lay, policy=tiled)
    log = ops.PathLog()
    got = ops.moe_forward(x, ids, w, pool, slot_of, lay, policy=tiled, paths=log)
    assert _rel(got, moe_forward_reference(x, ids, w, pool, slot_of, lay).float()) < PREFILL_TOL
    assert log.counts == {"cuda:prefill-warp": 1}
    with pytest.raises(UsageError, match="KernelPolicy.prefill='sideways'"):
        KernelPolicy(prefill="sideways")


def test_block_prefill_paths_agree(mod):
    if not mod.prefill_wgmma_available():
        pytest.skip("wgmma prefill stages need a compute-capability 9.0 GPU")
    x, ids, w, pool, slot_of, lay, extra = _case(7168, 2048, 8, 640, E=64, fmt_mix=True, seed=31)
    got = {}
    for pk in ("wgmma", "tiled", "tiled:2"):
        name, _, variant = pk.partition(":")
        policy = KernelPolicy(prefill=name, prefill_variant=int(variant or 1))
        got[pk] = ops.moe_forward(x, ids, w, pool, slot_of, lay, **extra, policy=policy).float()
    # Same bf16 operands and intermediate; only the fp32 accumulation order may differ.
    for pk in ("wgmma", "tiled:2"):
        assert _rel(got[pk], got["tiled"]) < 2e-3, pk


def test_tiled_prefill_missing_expert_and_determinism(mod, block_prefill):
    x, ids, w, pool, slot_of, lay, extra = _case(6144, 2048, 8, 512, E=32, fmt_mix=True, seed=12)
    a = ops.moe_forward(x, ids, w, pool, slot_of, lay, **extra, policy=block_prefill)
    for _ in range(2):
        assert torch.equal(ops.moe_forward(x, ids, w, pool, slot_of, lay, **extra, policy=block_prefill), a)
    missing = int(ids[3, 2])
    if extra["fp4_slot_of"][missing] >= 0:  # make it a 2-bit expert without a slot
        extra["fp4_slot_of"] = extra["fp4_slot_of"].clone()
        extra["fp4_slot_of"][missing] = -1
    slot_of = slot_of.clone()
    slot_of[missing] = -1
    with pytest.raises(ops.ResidencyError, match=str(missing)):
        ops.moe_forward(x, ids, w, pool, slot_of, lay, **extra, policy=block_prefill)


def test_int32_ids_and_fp16_x(mod):
    x, ids, w, pool, slot_of, lay, extra = _case(6144, 1024, 8, 5, fmt_mix=True, dtype=torch.float16, seed=4)
    got = ops.moe_forward(x, ids.to(torch.int32), w, pool, slot_of, lay, **extra)
    ref = moe_forward_reference(x, ids, w, pool, slot_of, lay, **extra)
    assert got.dtype == torch.float16 and _rel(got, ref.float()) < 2e-3


def test_deterministic_run_to_run(mod, decode_kernel):
    for T in (4, 512):
        x, ids, w, pool, slot_of, lay, extra = _case(6144, 2048, 8, T, E=32, fmt_mix=True, seed=11)
        a = ops.moe_forward(x, ids, w, pool, slot_of, lay, **extra, policy=decode_kernel)
        for _ in range(3):
            assert torch.equal(ops.moe_forward(x, ids, w, pool, slot_of, lay, **extra, policy=decode_kernel), a)


def test_pdl_and_plain_launches_agree(mod, decode_kernel):
    x, ids, w, pool, slot_of, lay, extra = _case(7168, 2048, 8, 3, fmt_mix=True, seed=8)
    no_pdl = dataclasses.replace(decode_kernel, pdl=False)
    plain = ops.moe_forward(x, ids, w, pool, slot_of, lay, **extra, policy=no_pdl)
    assert torch.equal(ops.moe_forward(x, ids, w, pool, slot_of, lay, **extra, policy=decode_kernel), plain)


def test_every_output_written_and_out_param(mod):
    x, ids, w, pool, slot_of, lay, _ = _case(4096, 2048, 6, 7, seed=5)
    out = torch.full_like(x, float("nan"))
    res = ops.moe_forward(x, ids, w, pool, slot_of, lay, out=out)
    assert res is out and torch.isfinite(out).all()


def test_missing_expert_raises(mod, decode_kernel):
    x, ids, w, pool, slot_of, lay, _ = _case(4096, 1024, 8, 2, seed=1)
    slot_of = slot_of.clone()
    slot_of[int(ids[1, 3])] = -1
    with pytest.raises(ops.ResidencyError, match=str(int(ids[1, 3]))):
        ops.moe_forward(x, ids, w, pool, slot_of, lay, policy=decode_kernel)


def test_cuda_graph_capture_and_replay(mod, decode_kernel):
    x, ids, w, pool, slot_of, lay, extra = _case(7168, 2048, 8, 4, fmt_mix=True, seed=2)
    eager = ops.moe_forward(x, ids, w, pool, slot_of, lay, **extra, policy=decode_kernel)
    out = torch.empty_like(x)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        # warm-up outside the graph
        ops.moe_forward(x, ids, w, pool, slot_of, lay, out=out, **extra, policy=decode_kernel)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        ops.moe_forward(x, ids, w, pool, slot_of, lay, out=out, **extra, policy=decode_kernel)
    out.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
    # New routing in the same buffers is honoured by the replay.
    ids2, w2 = _routing(4, 8, 32, seed=99)
    ids.copy_(ids2)
    w.copy_(w2)
    g.replay()
    ref = moe_forward_reference(x, ids, w, pool, slot_of, lay, **extra)
    assert _rel(out, ref.float()) < 8e-3


@pytest.mark.parametrize("kernel", ["gemv"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemv_many_pairs_per_expert(mod, dtype, kernel):
    # 9 experts, 8 of them per token: most experts carry 7-8 pairs, i.e. several passes of the decode stages
    # (4 pairs per pass with fp32 x, 8 with bf16 x); P = 64 is still the decode regime.
    policy = KernelPolicy(decode=kernel)
    x, ids, w, pool, slot_of, lay, _ = _case(4096, 1024, 8, 8, E=9, dtype=dtype, seed=21)
    assert cp.use_gemv(mod, ids.numel(), lay, policy=policy)
    got = ops.moe_forward(x, ids, w, pool, slot_of, lay, policy=policy)
    ref = moe_forward_reference(x.float(), ids, w, pool, slot_of, lay)
    assert _rel(got.float(), ref) < (DECODE_TOL if dtype == torch.float32 else 8e-3)


def test_gemv_and_mma_decode_agree(mod):
    x, ids, w, pool, slot_of, lay, extra = _case(7168, 2048, 8, 4, fmt_mix=True, dtype=torch.float32, seed=13)
    a = ops.moe_forward(x, ids, w, pool, slot_of, lay, **extra, policy=KernelPolicy(decode="gemv"))
    b = ops.moe_forward(x, ids, w, pool, slot_of, lay, **extra, policy=KernelPolicy(decode="mma"))
    assert _rel(a, b) < DECODE_TOL


@pytest.mark.parametrize("T", [1, 3, 8])
@pytest.mark.parametrize("H,I", [(4096, 256), (2560, 512), (3584, 768), (7168, 2048)])
def test_gemv_every_round_width(mod, T, H, I):
    # A round reads 4, 2 or 1 16-byte pieces per thread and row (K a multiple of 1024, 512, or only 256; at most
    # GEMV_MAX_NS, 1 since H22): here w13 (K = H) and w2 (K = Ir) cover all three where the build allows them,
    # against the float32 reference and the rowdot stages (both float32-accurate: hi/lo B operand).
    x, ids, w, pool, slot_of, lay, _ = _case(H, I, 8, T, dtype=torch.float32, seed=41 + T)
    gemv = KernelPolicy(decode="gemv")
    assert cp.use_gemv(mod, ids.numel(), lay, T, gemv)
    a = ops.moe_forward(x, ids, w, pool, slot_of, lay, policy=gemv)
    ref = moe_forward_reference(x, ids, w, pool, slot_of, lay)
    assert _rel(a, ref) < DECODE_TOL
    b = ops.moe_forward(x, ids, w, pool, slot_of, lay, policy=KernelPolicy(decode="rowdot"))
    assert _rel(a, b) < 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rowdot_many_pairs_per_expert(mod, dtype):
    # Up to 8 pairs per expert: passes of 2 pairs each re-read the rows; still exact to float32 rounding.
    rowdot = KernelPolicy(decode="rowdot")
    x, ids, w, pool, slot_of, lay, _ = _case(4096, 1024, 8, 8, E=9, dtype=dtype, seed=21)
    assert cp.use_rowdot(mod, ids.numel(), lay, 8, rowdot)
    got = ops.moe_forward(x, ids, w, pool, slot_of, lay, policy=rowdot)
    ref = moe_forward_reference(x.float(), ids, w, pool, slot_of, lay)
    assert _rel(got.float(), ref) < (DECODE_TOL if dtype == torch.float32 else 8e-3)


@pytest.mark.parametrize("T", [1, 2])
@pytest.mark.parametrize("H,I", SHAPES + [(4096, 768)])  # Ir = 768: 12 lanes' worth of a row -> groups of 8
def test_rowdot_and_gemv_decode_agree(mod, T, H, I):
    x, ids, w, pool, slot_of, lay, _ = _case(H, I, 8, T, dtype=torch.float32, seed=31 + T)
    a = ops.moe_forward(x, ids, w, pool, slot_of, lay, policy=KernelPolicy(decode="rowdot"))
    b = ops.moe_forward(x, ids, w, pool, slot_of, lay, policy=KernelPolicy(decode="gemv"))
    assert _rel(a, b) < DECODE_TOL
    # rowdot is fp32 end to end: against the float32 reference it is as close as float32 summation order allows.
    ref = moe_forward_reference(x, ids, w, pool, slot_of, lay)
    assert _rel(a, ref) < 1e-5


def test_int8_stage_plan_stays_plain_to_seven_quarters_of_the_slots(mod):
    # The int8 stages' default (gemv_plan_for's GEMV_I8_PLAIN_EIGHTHS, H30): plain up to 1.75x the warp slots,
    # balanced above; through the built extension with the device's own occupancy, both int8 stages.
    _needs_i8(mod)
    K, W, e = 4096, decode_constant("GEMV_WARPS"), kernels_constant("GEMV_I8_PLAIN_EIGHTHS")
    for w13 in (True, False):
        slots = W * mod.gemv_plan(w13, True, False, K, 1 << 20, 1, -1, True)[1]
        bound = e * slots // 8
        for units in (slots, slots + 1, 3 * slots // 2, bound, bound + 1, 2 * slots, 3 * slots):
            forced = 0 if 8 * units <= e * slots else 1
            assert mod.gemv_plan(w13, True, False, K, units, -1, -1, True) == \
                mod.gemv_plan(w13, True, False, K, units, forced, -1, True)


def test_gemv_plan_spreads_rounds_over_warps(mod):
    # Plain: every warp takes whole units, the same number to one; balanced: a block's units' rounds spread over its
    # W warps, never a longer warp than plain. The default takes balanced exactly when the units outnumber the warp
    # slots. K = 4096: K / (256 x pieces per round) rounds per unit, pieces 1, 2 or 4 (gemv_ns, GEMV_MAX_NS).
    K, W = 4096, decode_constant("GEMV_WARPS")
    rpu = mod.gemv_plan(True, False, False, K, 1, -1)[2]  # one unit: one warp streams all of its rounds
    assert rpu in (K // 256, K // 512, K // 1024)
    slots = W * mod.gemv_plan(True, False, False, K, 1 << 20, 1)[1]  # balanced: one block per resident slot
    assert mod.gemv_plan(True, False, False, K, 1, -1) == (False, 1, rpu)
    assert mod.gemv_plan(True, False, False, K, 1, 1) == (True, 1, -(-rpu // W))  # forced balanced: a share each
    for units in (1, 100, slots - 1, slots, slots + 1, 3 * slots + 5, 16384):
        plain = mod.gemv_plan(True, False, False, K, units, 0)
        bal = mod.gemv_plan(True, False, False, K, units, 1)
        assert mod.gemv_plan(True, False, False, K, units, -1) == (bal if units > slots else plain)
        assert not plain[0] and bal[0]
        assert bal[2] == -(-(-(-units // bal[1]) * rpu) // W)  # ceil(units per block) x rpu rounds over W warps
        assert bal[2] <= plain[2] and bal[1] >= plain[1]
        assert bal[2] * bal[1] * W >= units * rpu and plain[2] * plain[1] * W >= units * rpu  # every round a warp
        assert plain[2] == rpu * -(-units // slots)  # whole units, as few per warp as the slots allow


@pytest.mark.parametrize("T", [1, 2, 3, 8])
@pytest.mark.parametrize("H,I", [(4096, 2048), (7168, 512), (2560, 256), (6144, 1024)])
def test_gemv_balanced_and_plain_agree(mod, T, H, I):
    # Balanced stages sum a straddling unit's parts in warp order: the same products as the plain stages, another
    # float32 summation order, and deterministic run to run (fp32 x: both float32-accurate).
    x, ids, w, pool, slot_of, lay, _ = _case(H, I, 8, T, dtype=torch.float32, seed=51 + T)
    a = ops.moe_forward(x, ids, w, pool, slot_of, lay, policy=KernelPolicy(decode="gemv", gemv_balance=False))
    balanced = KernelPolicy(decode="gemv", gemv_balance=True)
    b = ops.moe_forward(x, ids, w, pool, slot_of, lay, policy=balanced)
    b2 = ops.moe_forward(x, ids, w, pool, slot_of, lay, policy=balanced)
    assert torch.equal(b, b2)
    assert _rel(a, b) < 1e-5
    ref = moe_forward_reference(x, ids, w, pool, slot_of, lay)
    assert _rel(b, ref) < DECODE_TOL


@pytest.mark.parametrize("T", [1, 3, 8])
@pytest.mark.parametrize("H,I", [(4096, 2048), (7168, 512), (6144, 1024)])
def test_tma_and_cp_async_rings_agree(mod, T, H, I):
    # Same K order, same MMAs: with whole units per warp the two rings give the same sums; balanced splits a unit's
    # rounds (512 weights on the TMA ring, 256 on the cp.async ring) at other places: another fp32 summation order.
    if not mod.decode_bulk_available():
        pytest.skip("the TMA ring needs an sm_90+ GPU")
    assert mod.gemv_ring(H, 1) == mod.gemv_ring(I, 1) == "tma" and mod.gemv_ring(H, 0) == "cp.async"
    # The default on Hopper, where it was timed faster; opt-in on newer GPUs until timed there.
    assert (mod.gemv_ring(H) == "tma") == (torch.cuda.get_device_capability()[0] == 9)
    x, ids, w, pool, slot_of, lay, _ = _case(H, I, 8, T, dtype=torch.bfloat16, seed=61 + T)
    out = {}
    for balance in (False, None):
        for ring in ("tma", "cp.async"):
            # the bf16 w13 stage on both rings (the int8 one is TMA-only)
            policy = KernelPolicy(decode="gemv", i8_decode=False, gemv_balance=balance, decode_ring=ring)
            out[balance, ring] = ops.moe_forward(x, ids, w, pool, slot_of, lay, policy=policy)
    assert _rel(out[False, "tma"], out[False, "cp.async"]) < 1e-6
    assert _rel(out[None, "tma"], out[None, "cp.async"]) < 1e-5


def test_tma_ring_refuses_what_it_cannot_run(mod):
    # Forced on a K that is not a multiple of its 512-weight rounds: a clear error, not a silent other ring.
    if not mod.decode_bulk_available():
        pytest.skip("the TMA ring needs an sm_90+ GPU")
    assert mod.gemv_ring(4096 + 256) == "cp.async" and mod.gemv_ring(4096 + 256, 0) == "cp.async"
    x, ids, w, pool, slot_of, lay, _ = _case(4096 + 256, 2048, 8, 1, seed=71)
    with pytest.raises(UsageError, match=r"w13 \(K = 4352\) stage.*512-weight rounds"):
        ops.moe_forward(x, ids, w, pool, slot_of, lay, policy=KernelPolicy(decode="gemv", decode_ring="tma"))
    # the default takes the cp.async ring for w13, TMA for w2
    ref = moe_forward_reference(x, ids, w, pool, slot_of, lay)
    assert _rel(ops.moe_forward(x, ids, w, pool, slot_of, lay, policy=KernelPolicy(decode="gemv")), ref) < DECODE_TOL


def test_extension_errors_raise_with_their_numbers(mod):
    # The extension's checks reach Python as RuntimeError naming the numbers (H25: TORCH_CHECK formatting a number
    # from the nvcc-compiled source segfaulted on the H200; MOET_CHECK formats them itself). In a child process,
    # so that a crash fails this test instead of ending the run.
    code = textwrap.dedent("""
        from moetplan.runtime.op import kernels
        mod = kernels.get_module()
        for args, want in (((True, False, False, 100, 1, -1), "positive multiple of 256"),
                           ((True, False, False, 4096 + 256, 1, -1, 1), "multiple of 512 (got 4352)"),
                           ((True, False, False, 4096, 1, -1, 2), "got 2")):
            try:
                mod.gemv_plan(*args)
            except RuntimeError as e:
                assert want in str(e), (want, str(e))
            else:
                raise AssertionError(f"gemv_plan{args} did not raise")
        print("ok")
    """)
    if not mod.decode_bulk_available():
        code = code.replace("((True, False, False, 4096 + 256, 1, -1, 1), \"multiple of 512 (got 4352)\"),", "")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0 and p.stdout.strip() == "ok", (p.returncode, p.stdout[-500:], p.stderr[-2000:])


def test_default_decode_kernel_is_valid(mod):
    lay = RowLayout.for_expert(7168, 2048)
    for T in (1, 2, 3, 8):
        # Exactly one decode path per small step under the default selection.
        assert cp.use_rowdot(mod, 8 * T, lay, T) != cp.use_gemv(mod, 8 * T, lay, T)


def _w13_act(mod, x, ids, pool, slot_of, lay, f8: bool | str) -> torch.Tensor:
    """The gemv w13 stage's intermediate [P, Ir] (hi + lo, in the w2 stage's K order) for bf16 x, through the e4m3
    stage (f8 True, xprep8 into uint8 planes), the int8 one (f8 "i8", xprep8 into int8 planes) or the bf16 one."""
    T, H = x.shape
    P, Ir = ids.numel(), lay.inter_per_rank
    dev = x.device
    act = torch.empty(P, 2, Ir, dtype=torch.bfloat16, device=dev)
    flag = torch.zeros(1, dtype=torch.int32, device=dev)
    xinv = None
    if f8:
        xp = torch.empty(T, 3 if f8 == "i8" else 2, H, dtype=torch.int8 if f8 == "i8" else torch.uint8, device=dev)
        xinv = torch.empty(T, dtype=torch.float32, device=dev)
        mod.xprep8(x, xp, xinv, None, False)
    else:
        xp = torch.empty(T, 1, H, dtype=torch.bfloat16, device=dev)
        mod.xprep(x, xp, None, False)
    mod.gemv_stage(True, bool(f8), pool, slot_of, None, lay.w13_q_off, lay.w13_s_off, H, Ir, ids, ids.shape[1], xp, act,
                   None, None, None, None, 0.0, False, flag, False, xinv, -1, -1)
    torch.cuda.synchronize()
    assert int(flag.item()) == 0
    return act.float().sum(dim=1)


def _x_of_kind(x: torch.Tensor, kind: str) -> torch.Tensor:
    """x for the 8-bit stages' precision tests: as drawn, with one massive activation channel per token (as in real
    hidden states), scaled by 1e-12, or zeros."""
    if kind == "outlier":
        x[:, 17] = 3000.0
    elif kind == "tiny":
        x = (x.float() * 1e-12).to(torch.bfloat16)
    elif kind == "zeros":
        x = torch.zeros_like(x)
    return x


def _a8_distance(mod, x, ids, pool, slot_of, lay, a8) -> float | None:
    """Relative distance of an 8-bit w13 stage's intermediate (a8 as _w13_act's f8) from the bf16 stage's; None for
    zero x, where both are exact zeros (asserted)."""
    a8_act = _w13_act(mod, x, ids, pool, slot_of, lay, a8)
    a16 = _w13_act(mod, x, ids, pool, slot_of, lay, False)
    if not x.any():
        assert torch.equal(a8_act, torch.zeros_like(a8_act)) and torch.equal(a16, a8_act)
        return None
    assert torch.isfinite(a8_act).all()
    return _rel(a8_act, a16)


@pytest.mark.parametrize("x_kind", ["randn", "outlier", "tiny", "zeros"])
@pytest.mark.parametrize("H,I", [(4096, 2048), (7168, 512), (6144, 1024), (2560, 256)])
@pytest.mark.parametrize("T", [1, 5])
def test_e4m3_w13_stage_matches_bf16_stage(mod, H, I, T, x_kind):
    # The e4m3 operands are exact here (scale bytes within 8 binades, x within 2^10 of its token's largest except a
    # few tiny elements): the e4m3 and bf16 w13 stages agree to fp32 rounding and the bf16 hi/lo intermediate.
    if not mod.decode_fp8_available():
        pytest.skip("the e4m3 w13 stage needs an sm_89+ GPU")
    x, ids, _, pool, slot_of, lay, _ = _case(H, I, 6, T, seed=H + I + T)
    d = _a8_distance(mod, _x_of_kind(x, x_kind), ids, pool, slot_of, lay, True)
    if d is None:
        return
    # With a 10^4 x outlier most elements of x sit near 2^-13 of the largest, where hi + lo / 16 stops being exact
    # (error <= 2^-17 of the largest; tests/test_ops.py): measured 1.8-2.5e-5 on the H200.
    assert d < (5e-5 if x_kind == "outlier" else 2e-5)


def _needs_i8(mod):
    if not mod.decode_i8_available():
        pytest.skip("the int8 stages need an sm_90+ GPU")


@pytest.mark.parametrize("x_kind", ["randn", "outlier", "tiny", "zeros"])
@pytest.mark.parametrize("scales", ["narrow", "wide"])
@pytest.mark.parametrize("H,I", [(4096, 2048), (7168, 512), (6144, 1024), (2560, 512)])
@pytest.mark.parametrize("T", [1, 5])
def test_i8_w13_stage_matches_bf16_stage(mod, H, I, T, x_kind, scales):
    # Weights exact in both forms ("narrow": the one-pass rounds; "wide": the tests' 8-binade scale spread, two
    # passes per round); bf16 x exact in the three int8 planes except elements below 2^-12 of their token's
    # largest (error < 2^-20 of it), so the two stages agree to fp32 rounding and the bf16 hi/lo intermediate.
    _needs_i8(mod)
    x, ids, _, pool, slot_of, lay, _ = _case(H, I, 6, T, seed=H + I + T)
    if scales == "narrow":  # within 4 binades: every round of the int8 stage takes its one-pass form
        _fill_scales(pool, lay, 120, 125, torch.Generator(device="cuda").manual_seed(H + T))
    d = _a8_distance(mod, _x_of_kind(x, x_kind), ids, pool, slot_of, lay, "i8")
    if d is None:
        return
    # With a 10^4 x outlier most elements of x sit near 2^-13 of the largest, below the 2^-12 where the three planes
    # stop being exact (error <= 2^-20 of the largest; tests/test_ops.py): measured up to 5.5e-5 on the H200.
    assert d < (1e-4 if x_kind == "outlier" else 2e-5)


@pytest.mark.parametrize("a8,bound", [(True, 1e-3), ("i8", 2e-3)])
def test_8bit_w13_stages_flush_only_far_smaller_blocks(mod, a8, bound):
    # Scale bytes over 40 binades: blocks more than 12 (e4m3) / 9 (int8) binades below their round's largest (of the
    # row) flush to zero; what they held is < 2^-13 / 2^-9 of that block's weights, so the result moves by far less
    # than bf16 rounding.
    if a8 is True and not mod.decode_fp8_available():
        pytest.skip("the e4m3 w13 stage needs an sm_89+ GPU")
    if a8 == "i8":
        _needs_i8(mod)
    x, ids, _, pool, slot_of, lay, _ = _case(4096, 1024, 8, 3, seed=5)
    _fill_scales(pool, lay, 100, 140, torch.Generator(device="cuda").manual_seed(9), names=("w13_s",))
    assert 0 < _a8_distance(mod, x, ids, pool, slot_of, lay, a8) < bound


def test_i8_w13_stage_is_deterministic_and_graph_safe(mod):
    _needs_i8(mod)
    policy = KernelPolicy(decode="gemv", i8_decode=True)
    x, ids, w, pool, slot_of, lay, _ = _case(7168, 2048, 8, 8, E=64, seed=3)
    assert cp.use_i8_w13(mod, x, 7168, policy)
    a = ops.moe_forward(x, ids, w, pool, slot_of, lay, policy=policy)
    for _ in range(3):
        assert torch.equal(ops.moe_forward(x, ids, w, pool, slot_of, lay, policy=policy), a)
    ref = moe_forward_reference(x.float(), ids, w, pool, slot_of, lay)
    assert _rel(a.float(), ref) < 8e-3
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = ops.moe_forward(x, ids, w, pool, slot_of, lay, policy=policy)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, a)
    # fp32 x keeps the bf16 hi/lo operand (float32-accurate), whatever the switch says.
    assert not cp.use_i8_w13(mod, x.float(), 7168, policy)


@pytest.mark.parametrize("scales", ["narrow", "wide"])
@pytest.mark.parametrize("H,I,T", [(4096, 2048, 1), (7168, 2048, 8), (6144, 1024, 3), (7168, 512, 5)])
def test_i8_w2_stage_matches_the_bf16_w2_stage(mod, load_bench, H, I, T, scales):
    # The intermediate as int8 planes under a per-pair scale (exact within 2^12 of the pair's largest element,
    # within 2^-20 of it below) instead of bf16 hi + lo (~2^-16 of each element): the w2 rows agree to ~1e-5.
    # "narrow": every round of both int8 stages takes the one-pass form; "wide" (8 binades): two passes.
    _needs_i8(mod)
    x, ids, w, pool, slot_of, lay, _ = _case(H, I, 8, T, seed=H + T)
    if scales == "narrow":
        _fill_scales(pool, lay, 119, 123, torch.Generator(device="cuda").manual_seed(H + T))
    # bench/i8w2_precision.py's stages: the int8 w13 stage, then the w2 stage on the int8 planes or the bf16 hi/lo
    # intermediate (it raises on a set error flag).
    stages = load_bench("i8w2_precision").stages
    p8 = stages(mod, x, ids, pool, slot_of, lay, True)["partial"]
    p16 = stages(mod, x, ids, pool, slot_of, lay, False)["partial"]
    assert torch.isfinite(p8).all()
    assert _rel(p8, p16) < 2e-5
    assert torch.equal(stages(mod, x, ids, pool, slot_of, lay, True)["partial"], p8)  # deterministic
    got = ops.moe_forward(x, ids, w, pool, slot_of, lay, policy=KernelPolicy(decode="gemv", i8_decode=True, i8_w2=True))
    assert _rel(got.float(), moe_forward_reference(x.float(), ids, w, pool, slot_of, lay)) < 8e-3


def test_i8_w2_stage_only_where_its_ring_runs(mod):
    # Ir = 256 (a TP shard below the TMA ring's 512-weight rounds): the int8 w13 stage, then the bf16 w2 stage.
    _needs_i8(mod)
    gemv = KernelPolicy(decode="gemv")
    x, ids, w, pool, slot_of, lay, _ = _case(4096, 256, 8, 2, seed=11)
    assert cp.use_i8_w13(mod, x, 4096, gemv) and not cp.use_i8_w2(mod, x, 4096, 256, gemv)
    got = ops.moe_forward(x, ids, w, pool, slot_of, lay, policy=gemv)
    assert _rel(got.float(), moe_forward_reference(x.float(), ids, w, pool, slot_of, lay)) < 8e-3


def test_e4m3_w13_stage_is_deterministic_and_graph_safe(mod):
    if not mod.decode_fp8_available():
        pytest.skip("the e4m3 w13 stage needs an sm_89+ GPU")
    policy = KernelPolicy(decode="gemv", e4m3_decode=True, i8_decode=False)
    x, ids, w, pool, slot_of, lay, _ = _case(7168, 2048, 8, 8, E=64, seed=3)
    assert cp.use_fp8_w13(mod, x, policy)
    a = ops.moe_forward(x, ids, w, pool, slot_of, lay, policy=policy)
    for _ in range(3):
        assert torch.equal(ops.moe_forward(x, ids, w, pool, slot_of, lay, policy=policy), a)
    ref = moe_forward_reference(x.float(), ids, w, pool, slot_of, lay)
    assert _rel(a.float(), ref) < 8e-3
    # fp32 x keeps the bf16 hi/lo operand (float32-accurate), whatever the switch says.
    assert not cp.use_fp8_w13(mod, x.float(), policy)

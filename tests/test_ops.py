"""CPU tests of the MoE op layer: the torch reference path, its inputs and errors, and an emulation of the
kernels' register decode (the bit tricks in csrc/moe_kernels.cu) checked against the format's values."""
from __future__ import annotations

import dataclasses
import math
import re
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from csrc_source import CSRC
from typer.testing import CliRunner

from moetplan.contract.errors import UsageError
from moetplan.contract.runtime import KernelPolicy
from moetplan.runtime.op import cuda_paths as cp
from moetplan.runtime.op import kernels, ops, reference
from moetplan.runtime.format.format import (
    RowLayout,
    dequantize_2bit,
    dequantize_fp4,
    pack_expert_row,
    quantize_2bit,
    quantize_fp4,
    row_views,
    unpack_expert_row,
)


def _rng(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _pool(layout: RowLayout, n_slots: int, seed: int) -> torch.Tensor:
    """Random but valid rows: any code byte is a valid code; scales in a realistic UE8M0 range."""
    g = _rng(seed)
    pool = torch.randint(0, 256, (n_slots, layout.stride), generator=g, dtype=torch.uint8)
    for name in ("w13_s", "w2_s"):
        off, size = getattr(layout, f"{name}_off"), getattr(layout, f"{name}_size")
        pool[:, off:off + size] = torch.randint(118, 128, (n_slots, size), generator=g, dtype=torch.uint8)
    return pool


def _naive(x, ids, w, pool, slot_of, layout, fp4_pool=None, fp4_slot_of=None, fp4_layout=None, limit=None):
    """Float64, one pair at a time, through format.py's own unpacker: independent of ops.py's grouping and LUTs."""
    T, H = x.shape
    out = torch.zeros(T, H, dtype=torch.float64)
    ir = layout.inter_per_rank
    for t in range(T):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            if fp4_slot_of is not None and int(fp4_slot_of[e]) >= 0:
                w13, w2 = unpack_expert_row(fp4_pool[int(fp4_slot_of[e])], fp4_layout, torch.float64)
            else:
                w13, w2 = unpack_expert_row(pool[int(slot_of[e])], layout, torch.float64)
            h = w13 @ x[t].double()
            gate, up = h[:ir], h[ir:]
            if limit is not None:
                gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
            out[t] += float(w[t, j]) * (w2 @ (torch.nn.functional.silu(gate) * up))
    return out


def _routing(T, k, E, seed):
    g = _rng(seed)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    w = torch.softmax(torch.randn(T, k, generator=g), dim=-1)
    return ids, w


def _rel(a, b):
    return float(torch.linalg.vector_norm(a.double() - b.double()) / torch.linalg.vector_norm(b.double()))


# ------------------------------------------------------------------------------------------------ dequantization


@pytest.mark.parametrize("fmt", ["2bit", "fp4"])
def test_dequantize_rows_matches_format(fmt):
    g = _rng(1)
    w = torch.randn(48, 256, generator=g) * 0.02
    q, s = (quantize_2bit if fmt == "2bit" else quantize_fp4)(w)
    ref = (dequantize_2bit if fmt == "2bit" else dequantize_fp4)(q, s, torch.float32)
    got = reference.dequantize_rows(q, s, fmt)
    assert torch.equal(got, ref)


def test_expert_weights_matches_unpack():
    lay = RowLayout.for_expert(128, 64, fmt="2bit")
    g = _rng(2)
    row = pack_expert_row(torch.randn(128, 128, generator=g), torch.randn(128, 64, generator=g), lay)
    w13, w2 = reference.expert_weights(row, lay)
    r13, r2 = unpack_expert_row(row, lay, torch.float32)
    assert torch.equal(w13, r13) and torch.equal(w2, r2)


# ------------------------------------------------------------------------------------------------ the reference op

REF = KernelPolicy(cpu=False)  # the torch reference on the CPU (the CPU kernels: tests/test_cpu_kernels.py)


@pytest.mark.parametrize("T,k,E", [(1, 6, 16), (5, 8, 16), (24, 4, 8)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_matches_naive(T, k, E, dtype):
    lay = RowLayout.for_expert(128, 64, fmt="2bit")
    pool = _pool(lay, E + 3, seed=T * 10 + k)
    slot_of = torch.randperm(E + 3, generator=_rng(5))[:E].to(torch.int32)
    ids, w = _routing(T, k, E, seed=T)
    x = (torch.randn(T, 128, generator=_rng(7)) * 0.5).to(dtype)
    got = ops.moe_forward(x, ids, w, pool, slot_of, lay, policy=REF)
    assert got.dtype == dtype and got.shape == (T, 128)
    ref = _naive(x, ids, w, pool, slot_of, lay)
    assert _rel(got, ref) < (1e-5 if dtype == torch.float32 else 1e-2)


def test_reference_fp4_reserve_and_clamp():
    lay2 = RowLayout.for_expert(96, 64, fmt="2bit")
    lay4 = RowLayout.for_expert(96, 64, fmt="fp4")
    E = 12
    pool = _pool(lay2, E, seed=1)
    fpool = _pool(lay4, 4, seed=2)
    slot_of = torch.arange(E, dtype=torch.int32)
    f4 = torch.full((E,), -1, dtype=torch.int32)
    f4[torch.tensor([1, 4, 7, 9])] = torch.tensor([2, 0, 3, 1], dtype=torch.int32)
    ids, w = _routing(9, 6, E, seed=3)
    x = torch.randn(9, 96, generator=_rng(4))
    for limit in (None, 0.02):
        got = ops.moe_forward(x, ids, w, pool, slot_of, lay2, fpool, f4, lay4, swiglu_limit=limit, policy=REF)
        ref = _naive(x, ids, w, pool, slot_of, lay2, fpool, f4, lay4, limit=limit)
        assert _rel(got, ref) < 1e-5
    # The FP4 copy really is used: dropping it changes the result.
    plain = ops.moe_forward(x, ids, w, pool, slot_of, lay2)
    assert _rel(plain, got) > 1e-3


def test_clamp_changes_result_when_active():
    lay = RowLayout.for_expert(64, 32)
    pool = _pool(lay, 4, seed=9)
    ids, w = _routing(3, 2, 4, seed=1)
    x = torch.randn(3, 64, generator=_rng(1)) * 4
    a = ops.moe_forward(x, ids, w, pool, torch.arange(4), lay)
    b = ops.moe_forward(x, ids, w, pool, torch.arange(4), lay, swiglu_limit=1e-3)
    assert _rel(a, b) > 0.1


def test_duplicate_experts_and_out_param():
    lay = RowLayout.for_expert(64, 32)
    pool = _pool(lay, 3, seed=3)
    ids = torch.tensor([[0, 0], [2, 0], [2, 2], [1, 0]])  # an expert twice for one token is summed twice
    w = torch.tensor([[0.5, 0.25], [1.0, 2.0], [0.1, 0.2], [0.3, 0.7]])
    x = torch.randn(4, 64, generator=_rng(2))
    out = torch.full((4, 64), float("nan"))
    res = ops.moe_forward(x, ids, w, pool, torch.tensor([2, 0, 1], dtype=torch.int32), lay, out=out, policy=REF)
    assert res is out and torch.isfinite(out).all()
    ref = _naive(x, ids, w, pool, torch.tensor([2, 0, 1]), lay)
    assert _rel(out, ref) < 1e-5


def test_reference_deterministic():
    lay = RowLayout.for_expert(128, 64)
    pool = _pool(lay, 16, seed=4)
    ids, w = _routing(32, 8, 16, seed=4)
    x = torch.randn(32, 128, generator=_rng(4))
    a = ops.moe_forward(x, ids, w, pool, torch.arange(16), lay)
    b = ops.moe_forward(x, ids, w, pool, torch.arange(16), lay)
    assert torch.equal(a, b)


def test_zero_tokens():
    lay = RowLayout.for_expert(64, 32)
    pool = _pool(lay, 2, seed=1)
    out = ops.moe_forward(torch.zeros(0, 64), torch.zeros(0, 2, dtype=torch.long), torch.zeros(0, 2), pool,
                          torch.arange(2), lay)
    assert out.shape == (0, 64)


# ------------------------------------------------------------------------------------------------ errors


def test_missing_expert_raises_residency_error():
    lay = RowLayout.for_expert(64, 32)
    pool = _pool(lay, 2, seed=1)
    with pytest.raises(ops.ResidencyError, match=r"\[2\].*fetch them"):
        ops.moe_forward(torch.randn(1, 64), torch.tensor([[0, 2]]), torch.ones(1, 2), pool,
                        torch.tensor([0, 1, -1]), lay)


@pytest.mark.parametrize(
    "change,match",
    [
        (dict(x=torch.randn(2, 32)), "x must be"),
        (dict(x=torch.randn(2, 64).double()), "bfloat16, float16 or float32"),
        (dict(ids=torch.zeros(3, 2, dtype=torch.long)), "topk_ids must be"),
        (dict(ids=torch.zeros(2, 2)), "integer"),
        (dict(w=torch.ones(2, 3)), "topk_weights"),
        (dict(pool=torch.zeros(2, 100, dtype=torch.uint8)), "row stride"),
        (dict(ids=torch.tensor([[0, 5], [1, 1]])), r"outside \[0, 2\)"),
        (dict(out=torch.zeros(2, 64, dtype=torch.bfloat16)), "out must be"),
        (dict(fp4_only=True), "go together"),
    ],
)
def test_bad_inputs_name_the_problem(change, match):
    lay = RowLayout.for_expert(64, 32)
    args = dict(x=torch.randn(2, 64), ids=torch.zeros(2, 2, dtype=torch.long), w=torch.ones(2, 2),
                pool=_pool(lay, 2, seed=0), out=None)
    fp4_only = change.pop("fp4_only", False)
    args.update(change)
    with pytest.raises(UsageError, match=match):
        ops.moe_forward(args["x"], args["ids"], args["w"], args["pool"], torch.arange(2), lay,
                        fp4_pool=args["pool"] if fp4_only else None, out=args["out"])


def test_fp4_layout_must_match():
    lay = RowLayout.for_expert(64, 32)
    lay4 = RowLayout.for_expert(64, 64, fmt="fp4")
    with pytest.raises(UsageError, match="does not match"):
        ops.moe_forward(torch.randn(1, 64), torch.zeros(1, 1, dtype=torch.long), torch.ones(1, 1),
                        _pool(lay, 1, 0), torch.arange(1), lay, _pool(lay4, 1, 0), torch.arange(1), lay4)


# ------------------------------------------------------------------------------------------------ kernel emulation
# The CUDA decode builds bf16 values with byte permutes and exponent arithmetic; these tests run the same integer
# formulas in numpy over every scale byte, so a wrong mask or shift fails here, without a GPU.


def _byte_perm(x: int, y: int, s: int) -> int:
    src = (x & 0xFFFFFFFF) | ((y & 0xFFFFFFFF) << 32)
    out = 0
    for i in range(4):
        sel = (s >> (4 * i)) & 0xF
        assert sel < 8, "the kernel never uses the sign-replicate mode"
        out |= ((src >> (8 * sel)) & 0xFF) << (8 * i)
    return out


def _bf16_bits_to_float(bits: int) -> float:
    return float(np.array([bits << 16], dtype=np.uint32).view(np.float32)[0])


def _decode_2bit(w: int, b: int) -> list[tuple[float, float]]:
    h = b >> 1
    table = (h * 0x01010101 + 0x81800100) & 0xFFFFFFFF
    low = (b & 1) << 7
    shifts = [("l", 4), ("l", 2), ("n", 0), ("r", 2), ("r", 12), ("r", 14), ("r", 16), ("r", 18)]
    regs = []
    for d, n in shifts:
        v = (w << n) if d == "l" else (w >> n)
        regs.append(_byte_perm(table, low, ((v & 0x3030) | 0x0404)))
    return [(_bf16_bits_to_float(r & 0xFFFF), _bf16_bits_to_float(r >> 16)) for r in regs]


def test_decode_2bit_emulation_all_scales():
    g = np.random.default_rng(0)
    lo = [0, 1, 2, 3, 8, 9, 10, 11]  # register r holds weights (lo[r], lo[r] + 4)
    from moetplan.runtime.format.format import CODE_VALUES

    # b=0 (2^-127) decodes +-1 to zero and b>=253 overflows +-4 (as in float32): documented, never quantized
    # from real weights (|w| would have to be ~1e-38 or ~1e38).
    for b in range(1, 253):
        for w in [int(v) for v in g.integers(0, 2**32, 3)] + [0, 0xFFFFFFFF]:
            regs = _decode_2bit(w, b)
            for r, (a, c) in enumerate(regs):
                for j, got in ((lo[r], a), (lo[r] + 4, c)):
                    code = (w >> (2 * j)) & 3
                    assert got == math.ldexp(CODE_VALUES[code], b - 127), (b, w, r, j)


def _prmt(a: int, b: int, s: int) -> int:
    """PTX prmt.b32 (default mode): selector nibbles 0..3 of s; nibble bit 3 would replicate a sign bit."""
    src = (a & 0xFFFFFFFF) | ((b & 0xFFFFFFFF) << 32)
    out = 0
    for i in range(4):
        sel = (s >> (4 * i)) & 0xF
        assert sel < 8, "the decode never sets the sign-replicate bit"
        out |= ((src >> (8 * sel)) & 0xFF) << (8 * i)
    return out


def _scale_table(sw: int, k: int) -> tuple[int, int]:
    """scale_word + scale_table<k> in csrc/moe_decode.cuh: the decode table of byte k of a 4-byte scale word, and
    the word of low bytes (b & 1) << 7 that prmt reads as its second source."""
    h = ((sw * (1 << 31)) >> 32) & 0x7F7F7F7F
    h1 = h + 0x01010101
    lw = ((sw & 0x01010101) * 128) & 0xFFFFFFFF
    return _prmt(h, h1, k | ((4 + k) << 4) | (k << 8) | ((4 + k) << 12)) | 0x80800000, lw


def _decode_2bit_fast(w: int, b: int, k: int = 0, others: int = 0x5A) -> list[tuple[float, float]]:
    """decode_2bit_fast in csrc/moe_decode.cuh: one and_or selector word per two registers (low / high half), the
    scale byte b being byte k of a scale word whose other bytes are `others` (they must not matter)."""
    sw = sum(((b if i == k else others) & 0xFF) << (8 * i) for i in range(4))
    table, lw = _scale_table(sw, k)
    m, o = 0x30303030, 0x04040404 | (k * 0x01010101)
    mask = 0xFFFFFFFF
    sels = [((w * 16) & mask & m) | o, ((w * 4) & mask & m) | o, (w & m) | o, ((w * (1 << 30)) >> 32 & m) | o]
    regs = [_prmt(table, lw, s) for s in sels] + [_prmt(table, lw, (s * (1 << 16)) >> 32) for s in sels]
    return [(_bf16_bits_to_float(r & 0xFFFF), _bf16_bits_to_float(r >> 16)) for r in regs]


def test_decode_2bit_fast_emulation_all_scales():
    from moetplan.runtime.format.format import CODE_VALUES

    g = np.random.default_rng(1)
    lo = [0, 1, 2, 3, 8, 9, 10, 11]  # same register pairing as the first decode: the B operand layout relies on it
    for b in range(1, 253):
        for w in [int(v) for v in g.integers(0, 2**32, 3)] + [0, 0xFFFFFFFF, 0x1B1B1B1B]:
            k, others = int(g.integers(0, 4)), int(g.integers(0, 256))
            for r, (a, c) in enumerate(_decode_2bit_fast(w, b, k, others)):
                for j, got in ((lo[r], a), (lo[r] + 4, c)):
                    assert got == math.ldexp(CODE_VALUES[(w >> (2 * j)) & 3], b - 127), (b, hex(w), r, j)


def test_decode_fp4_emulation_all_scales():
    vals = torch.tensor(list(range(16)), dtype=torch.int64)
    from moetplan.runtime.format.format import e2m1_values

    e2m1 = e2m1_values(torch.float64)
    for b in range(0, 255):
        for w in (0x76543210, 0xFEDCBA98, 0x0F1E2D3C):
            for j in range(4):
                n = w >> (4 * j)
                bits = ((n << 6) & 0x01C001C0) | ((n << 12) & 0x80008000)
                pair = torch.tensor([bits & 0xFFFF, bits >> 16], dtype=torch.int32).to(torch.int16)
                v = pair.view(torch.bfloat16)
                e = b - 1
                if e <= 127:
                    m = torch.tensor(2.0**e, dtype=torch.bfloat16)
                    v = v * m
                else:
                    v = (v * torch.tensor(2.0**126, dtype=torch.bfloat16)) * torch.tensor(2.0 ** (b - 127),
                                                                                        dtype=torch.bfloat16)
                for half, idx in ((0, j), (1, j + 4)):
                    nib = (w >> (4 * idx)) & 15
                    want = float(e2m1[nib]) * 2.0 ** (b - 127)
                    got = float(v[half])
                    # bf16 keeps the exact value except where it underflows bf16's subnormal range
                    if (abs(want) >= 2.0**-133 or want == 0) and abs(want) < 2.0**127:
                        assert got == want, (b, hex(w), j, half)
    assert vals.numel() == 16


def test_b_operand_pairing_matches_decode():
    """load_b8 (bf16): registers (x[j], x[j+4]) for j = 0..3, the pairing the code decode produces."""
    xs = [0x1000 + i for i in range(8)]  # 8 bf16 bit patterns, distinct
    v = [xs[0] | xs[1] << 16, xs[2] | xs[3] << 16, xs[4] | xs[5] << 16, xs[6] | xs[7] << 16]
    regs = [_byte_perm(v[0], v[2], 0x5410), _byte_perm(v[0], v[2], 0x7632),
            _byte_perm(v[1], v[3], 0x5410), _byte_perm(v[1], v[3], 0x7632)]
    for j, r in enumerate(regs):
        assert (r & 0xFFFF, r >> 16) == (xs[j], xs[j + 4])


# ------------------------------------------------------------------------------------------------ kernels module


def test_cpu_falls_back_with_reason(monkeypatch, caplog):
    kernels.reset_for_tests()
    assert kernels.get_module() is None or torch.cuda.is_available()
    if not torch.cuda.is_available():
        assert "CUDA" in (kernels.fallback_reason() or "")
        with caplog.at_level("WARNING", logger="moetplan.kernels"):
            kernels.note_reference("no CUDA device")
            kernels.note_reference("no CUDA device")
        assert sum("reference path" in r.message for r in caplog.records) == 1
    kernels.reset_for_tests()


def test_dispatch_table_falls_back_to_the_reference_and_says_why(monkeypatch):
    lay = RowLayout.for_expert(64, 32)
    pool = _pool(lay, 4, seed=1)
    x, ids, w = torch.randn(2, 64, generator=_rng(2)), torch.tensor([[0, 1], [2, 3]]), torch.full((2, 2), 0.5)
    log = ops.PathLog()
    got = ops.moe_forward(x, ids, w, pool, torch.arange(4), lay, paths=log, policy=KernelPolicy(cpu=False))
    assert torch.equal(got, reference.moe_forward_reference(x, ids, w, pool, torch.arange(4), lay))
    assert log.as_dict() == {"kernel_paths": {"reference": 1}, "kernel_fallbacks": 1,
                             "kernel_fallback_reasons": {"cpu: the kernel policy asks for the reference (cpu=False)": 1}}
    # Without the CPU extension the reason names it.
    monkeypatch.setattr(ops.cpu_kernels, "get_module", lambda: None)
    monkeypatch.setattr(ops.cpu_kernels, "fallback_reason", lambda: "no C++ compiler")
    log = ops.PathLog()
    ops.moe_forward(x, ids, w, pool, torch.arange(4), lay, paths=log)
    assert log.as_dict()["kernel_fallback_reasons"] == {"cpu: CPU kernels unavailable: no C++ compiler": 1}
    # On a GPU: the policy can ask for the reference, and a missing extension is named.
    gpu = ops.Step(SimpleNamespace(is_cuda=True), ids, w, pool, torch.arange(4), lay, None, None, None, None, None,
                   KernelPolicy(cuda=False))
    assert "cuda=False" in ops._cuda_refusal(gpu)
    monkeypatch.setattr(kernels, "get_module", lambda: None)
    monkeypatch.setattr(kernels, "fallback_reason", lambda: "no CUDA device")
    path, why = ops.select_path(dataclasses.replace(gpu, policy=KernelPolicy()))
    assert path is ops.REFERENCE and why == ["cuda: kernels unavailable: no CUDA device", "cpu: x is not on the CPU"]


def test_arch_normalisation_and_flags():
    assert kernels.normalize_archs(["sm_90", "8.6", "120"]) == ["12.0", "8.6", "9.0"] or \
        sorted(kernels.normalize_archs(["sm_90", "8.6", "120"])) == ["12.0", "8.6", "9.0"]
    assert kernels.normalize_archs(["all"]) == list(kernels.SUPPORTED_ARCHS)
    with pytest.raises(UsageError, match="Unsupported CUDA arch '7.5'"):
        kernels.normalize_archs(["sm_75"])
    flags = kernels.gencode_flags(["8.0", "12.0"])
    assert "-gencode=arch=compute_80,code=sm_80" in flags
    assert "-gencode=arch=compute_120,code=compute_120" in flags  # PTX of the newest target for future chips
    h = kernels.gencode_flags(["9.0"])  # H100/H200: the arch-specific binary (wgmma), portable PTX
    assert "-gencode=arch=compute_90a,code=sm_90a" in h and "-gencode=arch=compute_90,code=compute_90" in h


def test_build_key_changes_with_archs():
    assert kernels.build_key(["9.0"]) != kernels.build_key(["8.0"])
    assert kernels.source_dir().joinpath("moe_kernels.cu").is_file()


@pytest.mark.skipif(torch.version.cuda is not None, reason="checks the no-CUDA-torch message")
def test_build_kernels_command_fails_clearly_without_cuda_torch():
    from moetplan.cli import app

    res = CliRunner().invoke(app, ["build-kernels", "--json", "--arch", "9.0"])
    assert res.exit_code != 0
    assert "no CUDA support" in res.output


def test_reference_weights_agree_with_the_format_unpacker():
    lay = RowLayout.for_expert(64, 32, fmt="fp4")
    row = _pool(lay, 1, 3)[0]
    a = reference.expert_weights(row, lay)
    b = unpack_expert_row(row, lay, torch.float32)
    assert all(torch.equal(x, y) for x, y in zip(a, b)) and len(row_views(row, lay)) == 4


# ------------------------------------------------------------------------------------------------ CUDA-path plumbing
# The op layer's CUDA path drives the extension through route/stage/combine with section offsets taken from the
# layout. A pure-torch stand-in with the extension's signatures and semantics runs that plumbing on the CPU.


class _FakeExtension:
    """route/stage/combine with the CUDA extension's argument lists, computed with torch on the CPU."""

    def __init__(self):
        self.calls: list[str] = []

    def scan_max_pairs(self) -> int:
        return 512

    def route(self, ids, slot_of, fp4_slot_of, order, seg_e, seg_off, seg_cnt, nseg, flag):
        self.calls.append("route")
        E = slot_of.numel()
        M = seg_e.numel() // 2
        f4 = (fp4_slot_of[ids.long()] >= 0) if fp4_slot_of is not None else torch.zeros_like(ids, dtype=torch.bool)
        key = ids.long() + E * f4.long()
        o = torch.argsort(key, stable=True)
        order.copy_(o.to(torch.int32))
        keys, counts = torch.unique_consecutive(key[o], return_counts=True)
        offs = torch.cumsum(counts, 0) - counts
        for f in (0, 1):
            sel = (keys >= E) == bool(f)
            n = int(sel.sum())
            seg_e[f * M:f * M + n] = (keys[sel] - f * E).to(torch.int32)
            seg_off[f * M:f * M + n] = offs[sel].to(torch.int32)
            seg_cnt[f * M:f * M + n] = counts[sel].to(torch.int32)
            nseg[f] = n

    def stage(self, fmt, w13, pool, slot_of, fp4_slot_of, q_off, s_off, N, K, ids, seg_e, seg_off, seg_cnt, nseg,
              order, topk, b, act, partial, limit, has_limit, flag, pdl):
        self.calls.append(f"stage{'13' if w13 else '2'}{'r' if order is not None else 's'}")
        fmt_name = "2bit" if fmt == 0 else "fp4"
        wpb = 4 if fmt == 0 else 2
        if order is not None:  # routed: pairs from the segments
            pairs = []
            for i in range(int(nseg[0])):
                o, c = int(seg_off[i]), int(seg_cnt[i])
                pairs += [int(p) for p in order[o:o + c]]
        else:
            pairs = [p for p in range(ids.numel())
                     if ((fp4_slot_of is not None and int(fp4_slot_of[int(ids[p])]) >= 0) == bool(fmt))]
        for p in pairs:
            e = int(ids[p])
            slot = int(slot_of[e])
            if slot < 0:
                flag[0] = e + 1
                continue
            row = pool[slot]
            q = row[q_off:q_off + N * K // wpb].view(N, K // wpb)
            s = row[s_off:s_off + N * K // 32].view(N, K // 32)
            W = reference.dequantize_rows(q, s, fmt_name)
            if w13:
                h = W @ b[p // topk].float()
                gate, up = h[:N // 2], h[N // 2:]
                if has_limit:
                    gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
                act[p] = torch.nn.functional.silu(gate) * up
            else:
                partial[p] = W @ b[p]

    def combine(self, partial, w, out, k, pdl):
        self.calls.append("combine")
        T, H = out.shape
        out.copy_((partial.view(T, k, H) * w.unsqueeze(-1)).sum(1))


# The decode stages' B operand and intermediate: bf16 planes in the K pairing e0,e4,e1,e5,e2,e6,e3,e7 per group
# of 8 (csrc/moe_decode.cuh, paired_pos), hi plane = bf16(v), lo plane = bf16(v - hi).
_PAIRED = torch.tensor([0, 4, 1, 5, 2, 6, 3, 7])


def _to_paired(v: torch.Tensor) -> torch.Tensor:
    return v.reshape(*v.shape[:-1], -1, 8)[..., _PAIRED].reshape(v.shape)


def _from_paired(v: torch.Tensor) -> torch.Tensor:
    return v.reshape(*v.shape[:-1], -1, 8)[..., torch.argsort(_PAIRED)].reshape(v.shape)


def _hi_lo(v: torch.Tensor) -> torch.Tensor:
    hi = v.float().to(torch.bfloat16)
    return torch.stack([hi, (v.float() - hi.float()).to(torch.bfloat16)], dim=-2)


def _stage_pairs(w13, pool, slot_of, fp4_slot_of, q_off, s_off, H, Ir, ids, topk, src, limit, has_limit, flag):
    """What a decode stage computes per 2-bit (token, expert) pair: (pair, SiLU(gate)*up) for w13, (pair, W2 act) for
    w2. FP4-resident experts are left to the FP4 launch; a missing expert sets the sticky flag."""
    N, K = (2 * Ir, H) if w13 else (H, Ir)
    for p in range(ids.numel()):
        e = int(ids[p])
        if fp4_slot_of is not None and int(fp4_slot_of[e]) >= 0:
            continue
        slot = int(slot_of[e])
        if slot < 0:
            flag[0] = e + 1
            continue
        row = pool[slot]
        W = reference.dequantize_rows(row[q_off:q_off + N * K // 4].view(N, K // 4),
                                row[s_off:s_off + N * K // 32].view(N, K // 32), "2bit")
        if not w13:
            yield p, W @ src[p]
            continue
        h = W @ src[p // topk]
        gate, up = h[:Ir], h[Ir:]
        if has_limit:
            gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
        yield p, torch.nn.functional.silu(gate) * up


class _FakeGemvExtension(_FakeExtension):
    """Adds the streaming decode stages (xprep / gemv_stage) with their buffer layouts, on the CPU."""

    def __init__(self):
        super().__init__()
        self.rings: list[int] = []  # each gemv_stage call's ring argument
        self.b_dtypes: list[torch.dtype] = []  # each gemv_stage call's B operand dtype
        self.balances: list[int] = []  # each gemv_stage call's balance argument

    def gemv_max_pairs(self) -> int:
        return 64

    def gemv_chunk(self) -> int:
        return 256

    def gemv_max_k(self) -> int:
        return 65536

    def xprep8(self, x, xp8, xinv, counter, pdl):
        self.calls.append("xprep8")
        if counter is not None:
            counter.zero_()
        planes, inv, self.perm = _e4m3_planes(x)
        if xp8.dtype == torch.int8:  # the int8 stage's hi, mid, lo planes, in the same order
            assert xp8.shape == (x.shape[0], 3, x.shape[1])
            planes, inv = _i8_planes(x)
            planes = planes[:, :, self.perm].to(torch.int8)
        xp8.copy_(planes)
        xinv.copy_(inv)

    def xprep(self, x, xp, counter, pdl):
        self.calls.append("xprep")
        if counter is not None:
            assert counter.dtype == torch.int32 and counter.numel() == x.shape[0] * x.shape[1] // 16
            counter.zero_()
        planes = _hi_lo(x) if x.dtype == torch.float32 else x.unsqueeze(1)
        xp.copy_(_to_paired(planes))

    def gemv_stage(self, w13, split, pool, slot_of, fp4_slot_of, q_off, s_off, H, Ir, ids, topk, b, act, partial,
                   weights, out, counter, limit, has_limit, flag, pdl, xinv, balance, ring):
        self.calls.append(f"gemv{'13' if w13 else '2'}")
        self.b_dtypes.append(b.dtype)
        self.balances.append(balance)
        self.rings.append(ring)
        if xinv is not None and b.dtype == torch.int8:  # the int8 stages: xprep8's hi, mid, lo planes
            assert split and b.shape[1] == 3 and xinv.numel() == b.shape[0]
            q = b.float()
            src = (q[:, 0] + q[:, 1] / 128 + q[:, 2] / 16384)[:, torch.argsort(self.perm)] * xinv[:, None]
        elif xinv is not None:  # the e4m3 w13 stage: xprep8's planes
            assert w13 and split and b.dtype == torch.uint8 and b.shape[1] == 2
            f8 = b.view(torch.float8_e4m3fn).float()
            src = (f8[:, 0] + f8[:, 1] / 16)[:, torch.argsort(self.perm)] * xinv[:, None]
        else:
            assert b.dtype == torch.bfloat16 and b.shape[1] == (2 if split else 1)
            src = _from_paired(b.float()).sum(dim=1)  # hi + lo
        for p, v in _stage_pairs(w13, pool, slot_of, fp4_slot_of, q_off, s_off, H, Ir, ids, topk, src, limit,
                                 has_limit, flag):
            if w13 and act.dtype == torch.float32:  # ahead of the int8 w2 stage: natural order
                assert act.shape == (ids.numel(), Ir)
                act[p] = v
            elif w13:
                act[p] = _to_paired(_hi_lo(v))
            else:
                partial[p] = v
        if weights is not None:  # the fused combine: every pair of the step is a 2-bit one
            assert fp4_slot_of is None and not w13 and counter is not None
            T = out.shape[0]
            out.copy_((partial.view(T, topk, H) * weights.unsqueeze(-1)).sum(1))


class _FakeFp8GemvExtension(_FakeGemvExtension):
    """The stand-in on a GPU with e4m3 MMAs (decode_fp8_available)."""

    def decode_fp8_available(self) -> bool:
        return True


class _FakeI8GemvExtension(_FakeFp8GemvExtension):
    """The stand-in on a GPU whose w13 stage takes the TMA ring (decode_i8_available)."""

    def decode_i8_available(self) -> bool:
        return True

    def gemv_bulk_possible(self, K) -> bool:
        return True  # the stand-in's rings take any K (the stand-in steps have H = I = 256)

    def gemv_ring(self, K, ring=-1) -> str:
        return "tma" if ring != 0 and self.gemv_bulk_possible(K) else "cp.async"


def _stand_in_step(fake, x_dtype, monkeypatch, policy: KernelPolicy) -> torch.Tensor:
    """One 3-token step through the stand-in extension, checked against the float32 reference (float32-accurate
    for fp32 x, bf16 output rounding for bf16 x); returns its x."""
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    lay2, pool, slot_of, _, ids, w, x = _stand_in_case(3, x_dtype, False)
    got = cp.moe_cuda(fake, x, ids, w, pool, slot_of, lay2, None, None, None, None, None, policy)
    ref = reference.moe_forward_reference(x, ids, w, pool, slot_of, lay2)
    assert _rel(got.float(), ref.float()) < (1e-4 if x_dtype == torch.float32 else 8e-3)
    return x


@pytest.mark.parametrize("ring", [None, "cp.async"])
@pytest.mark.parametrize("i8", [False, True])
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
def test_i8_w13_stage_plumbing(i8, x_dtype, ring, monkeypatch):
    # i8_decode sends bf16 x through xprep8 into int8 hi/mid/lo planes [T, 3, H] + per-token scales and the int8
    # w13 stage, ahead of the e4m3 switch, where the w13 stage takes the TMA ring; fp32 x keeps the bf16 hi/lo
    # operand, and the cp.async ring the bf16 one.
    # (i8_w2 off: the w2 stage's operand is test_i8_w2_stage_plumbing's)
    policy = KernelPolicy(i8_decode=i8, i8_w2=False, e4m3_decode=True, decode_ring=ring)
    fake = _FakeI8GemvExtension()
    x = _stand_in_step(fake, x_dtype, monkeypatch, policy)
    want_i8 = i8 and x_dtype == torch.bfloat16 and ring is None
    assert cp.use_i8_w13(fake, x, x.shape[1], policy) == want_i8
    assert fake.calls[:3] == ["xprep8" if x_dtype == torch.bfloat16 else "xprep", "gemv13", "gemv2"]
    w13_b = torch.int8 if want_i8 else torch.uint8 if x_dtype == torch.bfloat16 else torch.bfloat16
    assert fake.b_dtypes[:2] == [w13_b, torch.bfloat16]


@pytest.mark.parametrize("ring", [None, "cp.async"])
@pytest.mark.parametrize("i8w2", [False, True])
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
def test_i8_w2_stage_plumbing(x_dtype, i8w2, ring, monkeypatch):
    # i8_w2 (with the int8 w13 stage): the w13 stage writes a float32 intermediate, xprep8 makes its int8 planes
    # and per-pair scales, the w2 stage reads them. Without the int8 w13 stage (fp32 x, the cp.async ring) both
    # stages keep their bf16 operands, and i8_w2 off keeps the w2 stage's.
    policy = KernelPolicy(i8_decode=True, i8_w2=i8w2, decode_ring=ring)
    fake = _FakeI8GemvExtension()
    _stand_in_step(fake, x_dtype, monkeypatch, policy)
    i8 = x_dtype == torch.bfloat16 and ring is None
    if i8 and i8w2:
        assert fake.calls[:4] == ["xprep8", "gemv13", "xprep8", "gemv2"]
        assert fake.b_dtypes[:2] == [torch.int8, torch.int8]
    else:
        assert fake.calls[:3] == ["xprep8" if i8 else "xprep", "gemv13", "gemv2"]
        assert fake.b_dtypes[:2] == [torch.int8 if i8 else torch.bfloat16, torch.bfloat16]
    # The w2 stage's own ring decides too: a tensor-parallel shard Ir that is not a multiple of the TMA ring's
    # 512-weight rounds keeps the bf16 w2 stage behind the int8 w13 one.
    fake.gemv_bulk_possible = lambda K: K % 512 == 0
    x = torch.zeros(1, 4096, dtype=x_dtype)
    assert cp.use_i8_w2(fake, x, 4096, 1024, policy) == (i8 and i8w2)
    assert not cp.use_i8_w2(fake, x, 4096, 256, policy)
    assert cp.use_i8_w13(fake, x, 4096, policy) == i8


@pytest.mark.parametrize("e4m3", [False, True])
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
def test_e4m3_w13_stage_plumbing(e4m3, x_dtype, monkeypatch):
    # e4m3_decode sends bf16 x through xprep8 (e4m3 hi/lo planes + per-token scales) into the w13 stage; fp32 x
    # keeps the bf16 hi/lo operand either way.
    fake = _FakeFp8GemvExtension()
    _stand_in_step(fake, x_dtype, monkeypatch, KernelPolicy(e4m3_decode=e4m3, i8_decode=False))
    want_fp8 = e4m3 and x_dtype == torch.bfloat16
    assert fake.calls[:3] == ["xprep8" if want_fp8 else "xprep", "gemv13", "gemv2"]


def _b8_off(n: int, ns: int) -> int:
    """b8_off in csrc/moe_decode.cuh: byte offset of 16-weight word n in an e4m3 B plane (xprep8_kernel)."""
    lg = ns >> 1
    ph, wq = n >> 2, n & 3
    rr, t, j = ph >> (2 + lg), (ph >> lg) & 3, ph & (ns - 1)
    return ((((rr << lg) + j) * 4 + wq) * 4 + t) * 16


def _b8_pos(i: int) -> int:
    """b8_pos: weight i (0..15) of a word -> its byte in the word's 16 (the two m16n8k32 MMAs' b0, b1)."""
    return (i & 8) + (i & 1) * 4 + ((i & 7) >> 1)


def _e4m3_planes(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """xprep8_kernel on the CPU: bf16 x [T, H] -> (uint8 [T, 2, H] hi / 16 * lo planes at _b8_off, xinv [T],
    the permutation)."""
    H = x.shape[1]
    xf = x.float()
    e = torch.clamp((xf.abs().amax(dim=1).view(torch.int32) >> 23), min=7)
    s = ((261 - e) << 23).view(torch.float32)
    xinv = ((e - 7) << 23).view(torch.float32)
    v = xf * s[:, None]
    hi = v.to(torch.float8_e4m3fn)
    lo = ((v - hi.float()) * 16).to(torch.float8_e4m3fn)
    ns = 4 if H % 1024 == 0 else 2 if H % 512 == 0 else 1
    perm = torch.empty(H, dtype=torch.long)
    for n in range(H // 16):
        for i in range(16):
            perm[_b8_off(n, ns) + _b8_pos(i)] = 16 * n + i
    planes = torch.stack([hi.view(torch.uint8)[:, perm], lo.view(torch.uint8)[:, perm]], dim=1)
    return planes, xinv, perm


@pytest.mark.parametrize("K", [256, 512, 768, 1024, 2048, 3584, 7168])
def test_e4m3_plane_order_is_a_permutation_that_quads_read_contiguously(K):
    ns = 4 if K % 1024 == 0 else 2 if K % 512 == 0 else 1
    offs = [_b8_off(n, ns) for n in range(K // 16)]
    assert sorted(offs) == list(range(0, K, 16))
    assert sorted(_b8_pos(i) for i in range(16)) == list(range(16))
    # Thread t reads word wq of its piece j of round rr (K piece (rr * 4 + t) * ns + j of 64 weights) at 16-byte
    # unit ((rr ns + j) 4 + wq) 4 + t: a quad's 4 threads read 64 contiguous bytes.
    for rr in range(K // (256 * ns)):
        for j in range(ns):
            for wq in range(4):
                got = [offs[((rr * 4 + t) * ns + j) * 4 + wq] // 16 for t in range(4)]
                assert got == [((rr * ns + j) * 4 + wq) * 4 + t for t in range(4)]
    # Bytes 0-3 of a word feed the first MMA's b0 (k = 4t .. 4t+3): weights 0, 2, 4, 6 (the PRMT of w & 0x3333).
    assert [_b8_pos(i) for i in (0, 2, 4, 6, 1, 3, 5, 7)] == list(range(8))


def test_e4m3_x_planes_are_exact_within_2_to_the_13_of_the_largest():
    g = _rng(4)
    x = (torch.randn(3, 1024, generator=g) * 0.3)
    x[0, 5] = 3000.0  # a 10^4 x outlier
    x[2] = 0.0
    x = x.to(torch.bfloat16)
    planes, xinv, perm = _e4m3_planes(x)
    inv = torch.argsort(perm)
    f8 = planes.view(torch.float8_e4m3fn).float()
    back = (f8[:, 0] + f8[:, 1] / 16)[:, inv] * xinv[:, None]
    xf = x.float()
    big = xf.abs() >= xf.abs().amax(dim=1, keepdim=True) * 2.0 ** -13
    assert torch.equal(back[big], xf[big])
    assert not torch.equal(back[0], xf[0])  # below 2^-13 of a 10^4 x outlier: not all exact
    small = ~big[0] & (xf[0] != 0)
    assert float((back[0][small] - xf[0][small]).abs().max()) <= float(xf[0].abs().max()) * 2.0 ** -17
    assert torch.equal(back[2], torch.zeros(1024))
    assert float(xinv[2]) == 0.0


def _i8_planes(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """xprep8_kernel<true> on the CPU, in natural K order: bf16 x [T, H] -> (int planes hi, mid, lo [T, 3, H], xinv
    [T]); torch.round rounds half to even, as rintf."""
    xf = x.float()
    e = torch.clamp((xf.abs().amax(dim=1).view(torch.int32) >> 23), min=7)
    s = ((259 - e) << 23).view(torch.float32)
    xinv = ((e - 5) << 23).view(torch.float32)
    v = xf * s[:, None]
    hi = torch.round(v)
    r1 = (v - hi) * 128
    mid = torch.round(r1)
    lo = torch.round((r1 - mid) * 128)
    return torch.stack([hi, mid, lo], dim=1), xinv


def test_i8_x_planes_fit_int8_and_are_exact_within_2_to_the_12_of_the_largest():
    g = _rng(5)
    x = (torch.randn(4, 2048, generator=g) * 0.3)
    x[0, 5] = 3000.0  # a 10^4 x outlier
    x[2] = 0.0
    x[3] *= 1e-30
    x = x.to(torch.bfloat16)
    planes, xinv = _i8_planes(x)
    assert float(planes.abs().max()) <= 64  # no plane ever needs a clamp
    back = (planes[:, 0] + planes[:, 1] / 128 + planes[:, 2] / 16384) * xinv[:, None]
    xf = x.float()
    big = xf.abs() >= xf.abs().amax(dim=1, keepdim=True) * 2.0 ** -12
    assert torch.equal(back[big], xf[big])
    assert not torch.equal(back[0], xf[0])  # below 2^-12 of a 10^4 x outlier: not all exact
    err = (back - xf).abs().amax(dim=1)
    assert bool((err <= xf.abs().amax(dim=1) * 2.0 ** -20).all())
    assert torch.equal(planes[2], torch.zeros(3, 2048))  # zeros stay zeros (xinv is then 2^-125)


def test_i8_tables_are_the_codes_times_a_power_of_two():
    # i8_table in csrc/moe_decode.cuh: u (1, 4, -1, -4) as int8 bytes is u * mul + add mod 2^32 (constants read from
    # the source), the bytes selected by codes 0..3 (the bf16 decode's values +1, +4, -1, -4 of the block scale).
    src = (CSRC / "moe_decode.cuh").read_text()
    m = re.search(r"\(1u << d\) \* (0x[0-9A-Fa-f]+)u \+ (0x[0-9A-Fa-f]+)u", src)
    assert m, "i8_table's formula not found in csrc/moe_decode.cuh"
    mul, add = int(m.group(1), 16), int(m.group(2), 16)
    for d in range(5):
        u = 1 << d
        tab = (u * mul + add) % 2 ** 32
        assert list(tab.to_bytes(4, "little", signed=False)) == [v % 256 for v in (u, 4 * u, -u, -4 * u)]


def _b_pos(n: int, ns: int) -> int:
    """b_pos in csrc/moe_decode.cuh: where natural 16-byte unit n (8 weights, paired order) of a B plane is stored."""
    lg = ns >> 1
    ph, sub = n >> 3, n & 7
    rr, t, j = ph >> (2 + lg), (ph >> lg) & 3, ph & (ns - 1)
    return ((((rr << lg) + j) * 8 + sub) << 2) + t


@pytest.mark.parametrize("K", [256, 512, 768, 1024, 2048, 2560, 3584, 7168])
def test_b_plane_order_is_a_permutation_that_quads_read_contiguously(K):
    ns = 4 if K % 1024 == 0 else 2 if K % 512 == 0 else 1  # gemv_ns
    units = K // 8
    pos = [_b_pos(n, ns) for n in range(units)]
    assert sorted(pos) == list(range(units))
    # The stage reads group `sub` of its piece j of round rr (thread t) at unit ((rr ns + j) 8 + sub) 4 + t: that
    # must hold the B values of the code piece the thread decodes, K piece (rr * 4 + t) * ns + j of the row; and the
    # 4 threads of a quad read 4 consecutive units (64 contiguous bytes).
    for rr in range(K // (256 * ns)):
        for j in range(ns):
            for sub in range(8):
                got = [pos[((rr * 4 + t) * ns + j) * 8 + sub] for t in range(4)]
                assert got == [((rr * ns + j) * 8 + sub) * 4 + t for t in range(4)]
                assert got == list(range(got[0], got[0] + 4))


def test_paired_order_round_trips_and_matches_the_kernel_position_rule():
    v = torch.arange(32.0)
    assert torch.equal(_from_paired(_to_paired(v)), v)
    pos = [r * 2 if r < 4 else 2 * (r - 4) + 1 for r in range(8)]  # paired_pos() in csrc/moe_decode.cuh
    assert [int(i) for i in _to_paired(v)[:8]] == [pos.index(i) for i in range(8)]


def _stand_in_case(T: int, x_dtype: torch.dtype, fp4: bool):
    """A step for the stand-in extensions: H = I = 256, 16 experts, top-4; experts 1, 5, 9 FP4-resident if fp4."""
    H, I, E, k = 256, 256, 16, 4
    lay2 = RowLayout.for_expert(H, I, fmt="2bit")
    lay4 = RowLayout.for_expert(H, I, fmt="fp4")
    pool = _pool(lay2, E, seed=1)
    extra = {}
    if fp4:
        f4 = torch.full((E,), -1, dtype=torch.int32)
        f4[torch.tensor([1, 5, 9])] = torch.tensor([0, 1, 2], dtype=torch.int32)
        extra = {"fp4_pool": _pool(lay4, 3, seed=2), "fp4_slot_of": f4, "fp4_layout": lay4}
    ids, w = _routing(T, k, E, seed=5)
    x = (torch.randn(T, H, generator=_rng(3)) * 0.3).to(x_dtype)
    return lay2, pool, torch.arange(E), extra, ids, w, x


@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fp4", [False, True])
@pytest.mark.parametrize("fused", [False, True])
def test_gemv_decode_plumbing_with_stand_in_extension(x_dtype, fp4, fused, monkeypatch):
    lay2, pool, slot_of, extra, ids, w, x = _stand_in_case(3, x_dtype, fp4)
    fake = _FakeGemvExtension()
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    ran = []
    got = cp.moe_cuda(fake, x, ids, w, pool, slot_of, lay2, extra.get("fp4_pool"),
                      extra.get("fp4_slot_of"), extra.get("fp4_layout"), None, None, KernelPolicy(fused_combine=fused),
                      ran=ran.append)
    assert ran == ["decode-gemv"] and fake.balances == [-1, -1]  # the extension's own unit plan
    ref = reference.moe_forward_reference(x, ids, w, pool, slot_of, lay2, **extra)
    assert fake.calls[:3] == ["xprep", "gemv13", "gemv2"]
    assert ("stage13s" in fake.calls) == fp4  # FP4-resident experts still take the tile stages
    # The separate combine kernel, unless asked to fold the per-token sum into the w2 stage (only possible
    # without FP4-resident experts, which have their own w2 launch).
    assert ("combine" in fake.calls) == (fp4 or not fused)
    # fp32 x travels as bf16 hi + lo (~16 mantissa bits), the intermediate too.
    assert _rel(got.float(), ref.float()) < (1e-4 if x_dtype == torch.float32 else 8e-3)
    # The first version's decode tiles stay selectable.
    fake.calls.clear()
    ran.clear()
    cp.moe_cuda(fake, x, ids, w, pool, slot_of, lay2, None, None, None, None, None, KernelPolicy(decode="mma"),
                ran=ran.append)
    assert "gemv13" not in fake.calls and "stage13s" in fake.calls and ran == ["decode-mma"]
    with pytest.raises(UsageError, match="KernelPolicy.decode='fast'"):
        KernelPolicy(decode="fast")


@pytest.mark.parametrize("ring,code", [(None, -1), ("cp.async", 0), ("tma", 1)])
def test_decode_ring_reaches_both_stages(ring, code, monkeypatch):
    lay2, pool, slot_of, extra, ids, w, x = _stand_in_case(3, torch.bfloat16, False)
    fake = _FakeGemvExtension()
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    cp.moe_cuda(fake, x, ids, w, pool, slot_of, lay2, None, None, None, None, None, KernelPolicy(decode_ring=ring))
    assert fake.rings == [code, code]  # the w13 and the w2 launch


@pytest.mark.parametrize("bulk", [False, True])
def test_forced_tma_ring_is_refused_where_it_cannot_run(bulk, monkeypatch):
    # The extension says the ring cannot run either stage (H = I = 256: not whole 512-weight rounds; or no sm_90+
    # GPU): "tma" is refused before any launch, naming both stages.
    lay2, pool, slot_of, extra, ids, w, x = _stand_in_case(3, torch.bfloat16, False)
    fake = _FakeGemvExtension()
    fake.gemv_bulk_possible = lambda K: bulk and K % 512 == 0
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    with pytest.raises(UsageError, match=r"w13 \(K = 256\) and w2 \(K = 256\) stage.*'cp.async'"):
        cp.moe_cuda(fake, x, ids, w, pool, slot_of, lay2, None, None, None, None, None,
                    KernelPolicy(decode_ring="tma"))
    assert "gemv13" not in fake.calls


def test_unknown_decode_ring_is_a_usage_error():
    with pytest.raises(UsageError, match="decode_ring='bulk'.*'cp.async', 'tma'"):
        KernelPolicy(decode_ring="bulk")


def test_gemv_takes_only_small_aligned_steps():
    fake = _FakeGemvExtension()
    assert cp.use_gemv(fake, 64, RowLayout.for_expert(7168, 2048, tp=4))  # Ir = 512
    assert not cp.use_gemv(fake, 65, RowLayout.for_expert(7168, 2048))
    assert not cp.use_gemv(fake, 8, RowLayout.for_expert(4096 + 64, 2048))  # not whole 256-weight chunks
    assert not cp.use_gemv(_FakeExtension(), 8, RowLayout.for_expert(4096, 2048))  # an older build


@pytest.mark.parametrize("T,E", [(3, 16), (80, 16)])
def test_cuda_path_plumbing_with_stand_in_extension(T, E, monkeypatch):
    lay2 = RowLayout.for_expert(96, 64, fmt="2bit")
    lay4 = RowLayout.for_expert(96, 64, fmt="fp4")
    pool, fpool = _pool(lay2, E, seed=1), _pool(lay4, 3, seed=2)
    f4 = torch.full((E,), -1, dtype=torch.int32)
    f4[torch.tensor([1, 5, 9])] = torch.tensor([0, 1, 2], dtype=torch.int32)
    ids, w = _routing(T, 4, E, seed=T)
    x = torch.randn(T, 96, generator=_rng(3))
    fake = _FakeExtension()
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    got = cp.moe_cuda(fake, x, ids.to(torch.int32), w, pool, torch.arange(E), lay2, fpool, f4, lay4, 0.5, None)
    ref = reference.moe_forward_reference(x, ids, w, pool, torch.arange(E), lay2, fpool, f4, lay4, 0.5)
    assert _rel(got, ref) < 1e-5
    routed = T * 4 >= cp.PREFILL_PAIRS_PER_EXPERT * E
    assert ("route" in fake.calls) == routed
    assert fake.calls.count("combine") >= 1
    # A missing 2-bit expert is reported through the flag after the launches.
    slot = torch.arange(E)
    slot[int(ids[0, 0])] = -1 if int(f4[int(ids[0, 0])]) < 0 else slot[int(ids[0, 0])]
    if int(f4[int(ids[0, 0])]) < 0:
        with pytest.raises(ops.ResidencyError, match=str(int(ids[0, 0]))):
            cp.moe_cuda(fake, x, ids, w, pool, slot, lay2, fpool, f4, lay4, None, None)
        assert int(cp.error_flag(x.device)) == 0  # reset once reported


def test_kernel_shape_rule():
    x = torch.zeros(1, 1)
    assert not cp.kernel_supports(RowLayout.for_expert(4096, 2048), x)  # CPU tensor: never the CUDA path

    class _Cuda:
        is_cuda = True

    assert cp.kernel_supports(RowLayout.for_expert(7168, 2048, tp=4), _Cuda())
    assert not cp.kernel_supports(RowLayout.for_expert(224, 96), _Cuda())  # 56-byte code rows
    assert cp.kernel_supports(RowLayout.for_expert(224, 96, fmt="fp4"), _Cuda())


def test_decode_stage_shape_rule(monkeypatch):
    """The streaming decode stages take K in whole chunks up to the extension's gemv_max_k (the zero page they
    stream for a missing expert covers that much); other shapes go to the tiles."""
    gemv = KernelPolicy(decode="gemv")
    fake = _FakeGemvExtension()
    assert cp.use_gemv(fake, 8, RowLayout.for_expert(7168, 2048), policy=gemv)
    assert not cp.use_gemv(fake, fake.gemv_max_pairs() + 1, RowLayout.for_expert(7168, 2048), policy=gemv)
    assert not cp.use_gemv(fake, 8, RowLayout.for_expert(7168 + 64, 2048), policy=gemv)  # H not a multiple of 256
    monkeypatch.setattr(fake, "gemv_max_k", lambda: 4096)
    assert cp.use_gemv(fake, 8, RowLayout.for_expert(4096, 2048), policy=gemv)
    assert not cp.use_gemv(fake, 8, RowLayout.for_expert(7168, 2048), policy=gemv)


class _FakeRowdotExtension(_FakeGemvExtension):
    """Adds the CUDA-core rowdot stages (rowdot_stage) with their buffer contract, on the CPU."""

    def rowdot_rows_per_unit(self, K: int) -> int:
        lpr = 32
        while lpr > 1 and lpr * 64 > K:
            lpr //= 2
        return 4 * 32 // lpr

    def rowdot_stage(self, w13, np_, pool, slot_of, fp4_slot_of, q_off, s_off, H, Ir, ids, topk, b, act, partial,
                     weights, out, counter, limit, has_limit, flag, pdl):
        self.calls.append(f"rowdot{'13' if w13 else '2'}/{np_}")
        assert np_ in (1, 2)
        if w13:
            assert b.dtype in (torch.float32, torch.bfloat16) and b.shape[1] == H  # x read directly
            assert act.dtype == torch.float32 and tuple(act.shape) == (ids.numel(), Ir)
            if counter is not None:
                assert counter.dtype == torch.int32 and counter.shape[1] == H // self.rowdot_rows_per_unit(Ir)
                counter.zero_()
        src = b.float()
        for p, v in _stage_pairs(w13, pool, slot_of, fp4_slot_of, q_off, s_off, H, Ir, ids, topk, src, limit,
                                 has_limit, flag):
            (act if w13 else partial)[p] = v
        if weights is not None:
            assert fp4_slot_of is None and not w13 and counter is not None
            T = out.shape[0]
            out.copy_((partial.view(T, topk, H) * weights.unsqueeze(-1)).sum(1))


@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("fp4", [False, True])
@pytest.mark.parametrize("T", [1, 2])
@pytest.mark.parametrize("fused", [False, True])
def test_rowdot_decode_plumbing_with_stand_in_extension(x_dtype, fp4, T, fused, monkeypatch):
    lay2, pool, slot_of, extra, ids, w, x = _stand_in_case(T, x_dtype, fp4)
    fake = _FakeRowdotExtension()
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    got = cp.moe_cuda(fake, x, ids, w, pool, slot_of, lay2, extra.get("fp4_pool"),
                      extra.get("fp4_slot_of"), extra.get("fp4_layout"), None, None,
                      KernelPolicy(decode="rowdot", fused_combine=fused))
    ref = reference.moe_forward_reference(x, ids, w, pool, slot_of, lay2, **extra)
    np_ = 1 if T == 1 else 2
    assert fake.calls[:2] == [f"rowdot13/{np_}", f"rowdot2/{np_}"]
    assert "xprep" not in fake.calls and "gemv13" not in fake.calls
    assert ("stage13s" in fake.calls) == fp4
    assert ("combine" in fake.calls) == (fp4 or not fused)
    # fp32 intermediate and fp32 x: the only rounding left is the output dtype's.
    tol = {torch.float32: 1e-5, torch.bfloat16: 8e-3, torch.float16: 2e-3}[x_dtype]
    assert _rel(got.float(), ref.float()) < tol


def test_decode_kernel_selection():
    fake = _FakeRowdotExtension()
    lay = RowLayout.for_expert(4096, 2048)
    assert KernelPolicy().decode == "auto"
    # auto: rowdot only up to rowdot_max_tokens tokens, gemv above; exactly one of them per step.
    two = KernelPolicy(rowdot_max_tokens=2)
    assert cp.use_rowdot(fake, 12, lay, 2, two) and not cp.use_gemv(fake, 12, lay, 2, two)
    assert not cp.use_rowdot(fake, 24, lay, 3, two) and cp.use_gemv(fake, 24, lay, 3, two)
    assert not cp.use_rowdot(fake, 6, lay, 1) and cp.use_gemv(fake, 6, lay, 1)  # the default: 0
    # Forced choices, shape limits and builds without the stage.
    rowdot = KernelPolicy(decode="rowdot")
    assert cp.use_rowdot(fake, 64, lay, 8, rowdot) and not cp.use_gemv(fake, 64, lay, 8, rowdot)
    assert not cp.use_rowdot(fake, 65, lay, 9, rowdot)
    assert not cp.use_rowdot(fake, 8, RowLayout.for_expert(4096 + 64, 2048), 1, rowdot)
    assert not cp.use_rowdot(_FakeGemvExtension(), 8, lay, 1, rowdot)
    gemv, mma = KernelPolicy(decode="gemv"), KernelPolicy(decode="mma")
    assert not cp.use_rowdot(fake, 6, lay, 1, gemv) and cp.use_gemv(fake, 6, lay, 1, gemv)
    assert not cp.use_rowdot(fake, 6, lay, 1, mma) and not cp.use_gemv(fake, 6, lay, 1, mma)
    with pytest.raises(UsageError, match="'auto'"):
        KernelPolicy(decode="bogus")
    with pytest.raises(UsageError, match="rowdot_max_tokens"):
        KernelPolicy(rowdot_max_tokens=-1)


def _ws_offsets(y: int, K: int) -> torch.Tensor:
    """Mirror of csrc ws_b_offset: element offsets [128 pair columns, K] of pass y in a tiled B operand."""
    c, k = torch.arange(128)[:, None], torch.arange(K)[None, :]
    return (y * (K // 128) + k // 128) * 16384 + (c >> 3) * 1024 + ((k >> 3) & 15) * 64 + (c & 7) * 8 + (k & 7)


class _FakePrefillExtension(_FakeGemvExtension):
    """Adds the block-tile prefill stages (pair_x / prefill_tiles / prefill_stage) with their buffer orders."""

    def __init__(self, wgmma: bool = False):
        super().__init__()
        self.wgmma = wgmma
        self.variants: list[tuple[bool, int]] = []

    def prefill_k_align(self) -> int:
        return 128

    def prefill_block_n(self, wgmma: bool) -> int:
        return 128 if wgmma else 64

    def prefill_wgmma_available(self) -> bool:
        return self.wgmma

    def pair_x(self, x, xp, pdl):
        self.calls.append("pair_x")
        xp.copy_(_to_paired(x.float()).to(torch.bfloat16))

    def prefill_tile_b(self, x, order, seg_off, seg_cnt, tile_seg, tile_start, ntiles, topk, out, pdl):
        self.calls.append("tile_b")
        H = x.shape[1]
        for y in range(int(ntiles[0])):
            i, start = int(tile_seg[y]), int(tile_start[y])
            o, c = int(seg_off[i]), int(seg_cnt[i])
            rows = torch.zeros(128, H)
            toks = order[o + start:o + min(c, start + 128)].long() // topk
            rows[:len(toks)] = _to_paired(x[toks].float())
            out.view(-1)[_ws_offsets(y, H)] = rows.to(torch.bfloat16)

    def prefill_tiles(self, seg_cnt, nseg, tile_seg, tile_start, ntiles, bn, pdl):
        self.calls.append("tiles")
        self.bn = bn
        n = 0
        for i in range(int(nseg[0])):
            for start in range(0, int(seg_cnt[i]), bn):
                tile_seg[n], tile_start[n] = i, start
                n += 1
        assert n <= tile_seg.numel()
        ntiles[0] = n
        self.passes, self.segments = n, int(nseg[0])

    def prefill_stage(self, w13, pool, slot_of, q_off, s_off, H, Ir, seg_e, seg_off, seg_cnt, order, tile_seg,
                      tile_start, ntiles, topk, b, act, partial, limit, has_limit, flag, wgmma, variant, pdl):
        self.calls.append(f"prefill{'13' if w13 else '2'}")
        self.variants.append((wgmma, variant))
        assert self.bn == self.prefill_block_n(wgmma)  # the pass list was built for this kernel's pass size
        N, K = (2 * Ir, H) if w13 else (H, Ir)
        for y in range(int(ntiles[0])):
            i, start = int(tile_seg[y]), int(tile_start[y])
            e, o, c = int(seg_e[i]), int(seg_off[i]), int(seg_cnt[i])
            slot = int(slot_of[e])
            for col, p in enumerate([int(q) for q in order[o + start:o + min(c, start + self.bn)]]):
                if slot < 0:
                    flag[0] = e + 1
                    if not w13:
                        partial[p] = 0
                    continue
                row = pool[slot]
                W = reference.dequantize_rows(row[q_off:q_off + N * K // 4].view(N, K // 4),
                                        row[s_off:s_off + N * K // 32].view(N, K // 32), "2bit")
                if wgmma:  # B tiled per pass (prefill_tile_b / the w13 stage's tiled output)
                    src = _from_paired(b.view(-1)[_ws_offsets(y, K)[col]].float())
                else:
                    src = _from_paired(b[p // topk if w13 else p].float())
                h = W @ src
                if w13:
                    gate, up = h[:Ir], h[Ir:]
                    if has_limit:
                        gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
                    v = _to_paired(torch.nn.functional.silu(gate) * up).to(torch.bfloat16)
                    if wgmma:
                        act.view(-1)[_ws_offsets(y, Ir)[col]] = v
                    else:
                        act[p] = v
                else:
                    partial[p] = h


@pytest.mark.parametrize("wgmma", [False, True])
@pytest.mark.parametrize("fp4", [False, True])
def test_prefill_plumbing_with_stand_in_extension(wgmma, fp4, monkeypatch):
    # 96 tokens x top-4 over 16 experts: a routed step whose experts have 1-3 passes of 64 pairs.
    lay2, pool, slot_of, extra, ids, w, x = _stand_in_case(96, torch.float32, fp4)
    fake = _FakePrefillExtension(wgmma=wgmma)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    ids[:, 0] = 3  # one expert with 96+ pairs: two passes of 64
    for limit in (None, 0.5):
        fake.calls.clear()
        ran = []
        got = cp.moe_cuda(fake, x, ids, w, pool, slot_of, lay2, extra.get("fp4_pool"),
                          extra.get("fp4_slot_of"), extra.get("fp4_layout"), limit, None, ran=ran.append)
        ref = reference.moe_forward_reference(x, ids, w, pool, slot_of, lay2, swiglu_limit=limit, **extra)
        # 24 pairs per expert (< WGMMA_PAIRS_PER_EXPERT): the default is the mma.sync tiles (variant 1) even where
        # wgmma is available; bf16 B and intermediate
        assert fake.calls[:5] == ["route", "tiles", "pair_x", "prefill13", "prefill2"] and ran == ["prefill-tiled"]
        assert fake.passes > fake.segments  # expert 3's pairs span two block passes
        assert fake.variants[-1] == (False, 1)
        assert ("stage13r" in fake.calls) == fp4  # FP4-resident experts take the warp tiles
        assert _rel(got.float(), ref.float()) < 1e-2
    forced = KernelPolicy(prefill="wgmma")
    if not wgmma:
        with pytest.raises(UsageError, match="compute-capability 9.0"):
            cp.moe_cuda(fake, x, ids, w, pool, slot_of, lay2, None, None, None, None, None, forced)
        return
    fake.calls.clear()
    got = cp.moe_cuda(fake, x, ids, w, pool, slot_of, lay2, None, None, None, None, None, forced)
    assert fake.calls[:4] == ["route", "tiles", "tile_b", "prefill13"] and fake.variants[-1] == (True, 1)
    assert fake.bn == 128  # the wgmma stages' pass list: 128-pair passes
    assert _rel(got.float(), reference.moe_forward_reference(x, ids, w, pool, slot_of, lay2).float()) < 1e-2
    cp.moe_cuda(fake, x, ids, w, pool, slot_of, lay2, None, None, None, None, None,
                KernelPolicy(prefill="tiled", prefill_variant=2))
    assert fake.variants[-1] == (False, 2)
    with pytest.raises(UsageError, match="prefill_variant=7"):
        KernelPolicy(prefill="tiled", prefill_variant=7)


def test_prefill_kernel_selection():
    fake = _FakePrefillExtension()
    lay = RowLayout.for_expert(4096, 2048)
    assert KernelPolicy().prefill == "auto" and cp.use_tiled_prefill(fake, lay) == "tiled"
    assert cp.use_tiled_prefill(fake, RowLayout.for_expert(4096 + 64, 2048)) is None  # H % 128: warp tiles
    assert cp.use_tiled_prefill(_FakeGemvExtension(), lay) is None  # an older build
    assert cp.use_tiled_prefill(fake, lay, policy=KernelPolicy(prefill="warp")) is None
    assert cp.use_tiled_prefill(_FakePrefillExtension(wgmma=True), lay, policy=KernelPolicy(prefill="wgmma")) == "wgmma"
    # auto: wgmma on Hopper for wide passes only; never where the build or GPU lacks it
    wide = cp.WGMMA_PAIRS_PER_EXPERT
    assert cp.use_tiled_prefill(_FakePrefillExtension(wgmma=True), lay, wide) == "wgmma"
    assert cp.use_tiled_prefill(_FakePrefillExtension(wgmma=True), lay, wide - 0.5) == "tiled"
    assert cp.use_tiled_prefill(_FakePrefillExtension(wgmma=False), lay, 10 * wide) == "tiled"
    tiled = KernelPolicy(prefill="tiled")
    assert cp.use_tiled_prefill(_FakePrefillExtension(wgmma=True), lay, 10 * wide, tiled) == "tiled"
    with pytest.raises(UsageError, match="'auto'"):
        KernelPolicy(prefill="bogus")


def test_wgmma_b_tile_layout_is_a_permutation_per_pass():
    # The wgmma stages copy a pass's B tiles whole (32 KB per K step; a pass of N <= 128 columns, N a multiple of
    # 32, the first N * 256 bytes): every (pair column, K) element of pass y must own one slot of its step's block,
    # and columns < N must lie in the first N * 128 elements of it.
    K = 512
    for y in (0, 3):
        off = _ws_offsets(y, K)
        base = y * (K // 128) * 16384
        assert sorted(off.flatten().tolist()) == list(range(base, base + 128 * K))
        step = (off - base) // 16384
        assert torch.equal(step, (torch.arange(K) // 128).expand(128, K))
        for n in (32, 64, 96):
            assert int(((off - base) % 16384)[:n].max()) < n * 128 <= int(((off - base) % 16384)[n:].min())

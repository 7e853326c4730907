"""Source formats (FP8 block / per-channel, NVFP4, MXFP4, bf16): exact dequantization and bit-exact 2-bit / FP4."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from moetplan.contract.errors import ConfigError
from moetplan.runtime.format import format as F
from moetplan.runtime.format import sources as S


def _rng(seed: int) -> np.random.Generator:
    return np.random.default_rng(seed)


def _e4m3_bytes(rng, shape, positive: bool = False) -> np.ndarray:
    b = rng.integers(0, 256, size=shape, dtype=np.uint8)
    b[(b & 0x7F) == 0x7F] = 0x7E  # no NaN codes
    if positive:
        b &= 0x7F
    return b


def _wide_f32(rng, shape) -> np.ndarray:
    """f32 scales across a wide exponent range (huge and tiny), including exact powers of two."""
    m = rng.uniform(1, 2, size=shape)
    m[rng.random(shape) < 0.3] = 1.0
    return np.ldexp(m, rng.integers(-100, 100, size=shape)).astype(np.float32)


def _agree_values(w: torch.Tensor, zero_mode: str = "auto") -> None:
    ref = w.numpy()
    c, s = F.quantize_2bit(w, zero_mode)
    cr, sr = F.quantize_2bit_reference(ref, zero_mode)
    np.testing.assert_array_equal(s.numpy(), sr)
    np.testing.assert_array_equal(c.numpy(), cr)
    n4, s4 = F.quantize_fp4(w)
    nr, s4r = F.quantize_fp4_reference(ref)
    np.testing.assert_array_equal(n4.numpy(), nr)
    np.testing.assert_array_equal(s4.numpy(), s4r)


def test_e4m3_decoder_all_codes():
    codes = np.array([b for b in range(256) if b not in (0x7F, 0xFF)], dtype=np.uint8)
    fast = torch.from_numpy(codes).view(torch.float8_e4m3fn).to(torch.float64).numpy()
    ref = np.array([S.e4m3_value_reference(int(b)) for b in codes])
    np.testing.assert_array_equal(fast, ref)
    assert S.e4m3_value_reference(0x7E) == 448.0 and S.e4m3_value_reference(0x01) == 2.0**-9
    assert math.isnan(S.e4m3_value_reference(0x7F))


@pytest.mark.parametrize("scale_kind", ["block", "channel", "tensor", "pow2-block"])
def test_fp8_fast_matches_reference(scale_kind):
    rng = _rng(11)
    n, k = 136, 160  # not multiples of 128: partial scale blocks
    w = _e4m3_bytes(rng, (n, k))
    shape = {"block": (2, 2), "pow2-block": (2, 2), "channel": (n, 1), "tensor": (1,)}[scale_kind]
    scale = _wide_f32(rng, shape)
    if scale_kind == "pow2-block":  # power-of-two scales put many values exactly on e2m1 ties
        scale = np.ldexp(1.0, rng.integers(-20, 20, size=shape)).astype(np.float32)
    fast = S.dequantize_fp8(torch.from_numpy(w).view(torch.float8_e4m3fn), torch.from_numpy(scale))
    ref = S.dequantize_fp8_reference(w, scale)
    assert fast.dtype == torch.float64
    np.testing.assert_array_equal(fast.numpy(), ref)
    per32 = S.dequantize_fp8_per_block32(w, S.fp8_scale_per_block32(scale, n, k), torch.float64)
    assert torch.equal(per32, fast)
    _agree_values(fast[:, :64].contiguous())
    _agree_values(fast[:40].contiguous())
    _direct_fp8_agrees(w, scale, ref)


def _direct_fp8_agrees(w: np.ndarray, scale: np.ndarray, ref: np.ndarray, zero_mode: str = "auto") -> None:
    """The direct FP8 path (code thresholds, no float64 weights) == the reference on the exact values."""
    n, k = w.shape
    s32 = S.fp8_scale_per_block32(scale, n, k)
    q, sb, mode = S.fp8_quantize(w, s32, "2bit", zero_mode)
    cr, sr = F.quantize_2bit_reference(ref, zero_mode)
    np.testing.assert_array_equal(sb.numpy(), sr)
    np.testing.assert_array_equal(q.numpy(), cr)
    n4, s4, _ = S.fp8_quantize(w, s32, "fp4")
    nr, s4r = F.quantize_fp4_reference(ref)
    np.testing.assert_array_equal(n4.numpy(), nr)
    np.testing.assert_array_equal(s4.numpy(), s4r)


@pytest.mark.parametrize("s", [1.0, 2.0**-7, 3.0, 0.7, 2.0**100 / 3])
def test_fp8_direct_on_ties_and_boundaries(s):
    # e4m3 holds the e2m1 midpoints and 2.5 exactly: with scale s the ties land exactly (s a power of two) or not
    vals = [6.0, 2.5, -2.5, 0.25, 0.75, 1.25, 1.75, 3.5, 5.0, -5.0, 0.0, -0.0, 4.5, 4.0, 2.75, 2.25]
    rows = [vals * 2, [v / 64 for v in vals] * 2, [v * 16 for v in vals] * 2, [4.25] + [0.0] * 31]
    w = torch.tensor(rows, dtype=torch.float32).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
    scale = np.array([s], np.float32)
    ref = S.dequantize_fp8_reference(w, scale)
    _direct_fp8_agrees(w, scale, ref)
    _agree_values(torch.from_numpy(ref))


def test_fp8_zeros_are_balanced():
    rng = _rng(12)
    w = _e4m3_bytes(rng, (32, 64))
    w[rng.random(w.shape) < 0.5] = 0x00  # exporter wrote every zero as +0
    v = S.dequantize_fp8(w, np.ones((1, 1), np.float32))
    assert F.resolve_zero_mode(v) == "balanced"
    _agree_values(v)
    _direct_fp8_agrees(w, np.ones((1, 1), np.float32), v.numpy())
    assert S.fp8_quantize(w, S.fp8_scale_per_block32(np.ones(1, np.float32), 32, 64))[2] == "balanced"
    with pytest.raises(ConfigError, match="positive"):
        S.fp8_quantize(w, -torch.ones(32, 2, dtype=torch.float64))
    w[3, 5] = 0xFF
    with pytest.raises(ConfigError, match="NaN"):
        S.fp8_quantize(w, torch.ones(32, 2, dtype=torch.float64))


def test_nvfp4_fast_matches_reference():
    rng = _rng(13)
    n, k = 48, 128
    packed = rng.integers(0, 256, size=(n, k // 2), dtype=np.uint8)
    bscale = _e4m3_bytes(rng, (n, k // 16), positive=True)
    for s2 in (np.float32(1.0 / (6 * 448)), np.float32(3.0e-7), np.float32(2.0**60)):
        fast = S.dequantize_nvfp4(packed, bscale, np.array([s2]))
        ref = S.dequantize_nvfp4_reference(packed, bscale, s2)
        np.testing.assert_array_equal(fast.numpy(), ref)
        _agree_values(fast)


def _direct_nvfp4_agrees(packed, bscale, s2, zero_mode: str = "auto") -> None:
    ref = S.dequantize_nvfp4_reference(packed, bscale, s2)
    sc = S.nvfp4_scale_per_block16(bscale, np.array([s2], np.float32))
    assert torch.equal(S.dequantize_nvfp4_per_block16(packed, sc), torch.from_numpy(ref))
    q, sb, _ = S.nvfp4_quantize(packed, sc, "2bit", zero_mode)
    cr, sr = F.quantize_2bit_reference(ref, zero_mode)
    np.testing.assert_array_equal(sb.numpy(), sr)
    np.testing.assert_array_equal(q.numpy(), cr)
    n4, s4, _ = S.nvfp4_quantize(packed, sc, "fp4")
    nr, s4r = F.quantize_fp4_reference(ref)
    np.testing.assert_array_equal(n4.numpy(), nr)
    np.testing.assert_array_equal(s4.numpy(), s4r)


def test_nvfp4_direct_matches_reference():
    rng = _rng(19)
    n, k = 40, 128
    packed = rng.integers(0, 256, size=(n, k // 2), dtype=np.uint8)
    bscale = _e4m3_bytes(rng, (n, k // 16), positive=True)
    bscale[bscale == 0] = 0x38  # the direct path needs positive scales
    for s2 in (np.float32(1.0 / (6 * 448)), np.float32(2.0**-100), np.float32(3.0)):
        _direct_nvfp4_agrees(packed, bscale, s2)
    # power-of-two block scales: e2m1 x 2^k lands exactly on ties between the two halves of a block of 32
    pw = np.full((n, k // 16), 0x38, np.uint8)  # e4m3 1.0
    pw[:, 1::2] = 0x40  # 2.0
    _direct_nvfp4_agrees(packed, pw, np.float32(1.0))
    # mostly +0 nibbles -> balanced zero signs
    zp = packed & np.uint8(0x70)
    _direct_nvfp4_agrees(zp, bscale, np.float32(1.0))
    assert S.nvfp4_quantize(zp, S.nvfp4_scale_per_block16(bscale, np.ones(1, np.float32)))[2] == "balanced"
    with pytest.raises(ConfigError, match="positive"):
        S.nvfp4_quantize(packed, torch.zeros(n, k // 16, dtype=torch.float64))


def test_mxfp4_remap_matches_reference_and_keeps_scales():
    rng = _rng(14)
    n, k = 24, 128
    packed = rng.integers(0, 256, size=(n, k // 2), dtype=np.uint8)
    scales = rng.integers(0, 255, size=(n, k // 32), dtype=np.uint8)
    scales[0, 0], scales[1, 0] = 0, 254  # extremes of UE8M0
    vals = S.dequantize_mxfp4(packed, scales)
    np.testing.assert_array_equal(vals.numpy(), S.dequantize_mxfp4_reference(packed, scales))
    c, s, mode = S.mxfp4_to_2bit(packed, scales, return_zero_mode=True)
    cr, sr = S.mxfp4_to_2bit_reference(vals.numpy(), scales)
    np.testing.assert_array_equal(c.numpy(), cr)
    np.testing.assert_array_equal(s.numpy(), scales)
    assert mode == "signed"
    # remap is not re-derivation: a block whose max is 4 keeps its scale (re-deriving would pick a smaller one)
    p1 = np.zeros((1, 16), np.uint8)
    p1[0, 0] = 0x6  # first weight = 4.0 * 2^0, rest +0 / mixed
    p1[0, 1:] = 0x82
    s1 = np.array([[127]], np.uint8)
    c1, s1o = S.mxfp4_to_2bit(p1, s1, zero_mode="signed")
    assert int(s1o[0, 0]) == 127 and int(F.quantize_2bit(S.dequantize_mxfp4(p1, s1))[1][0, 0]) == 126
    assert F.dequantize_2bit(c1, s1o)[0, 0].item() == 4.0


@pytest.mark.parametrize("zero_mode", ["signed", "balanced"])
def test_mxfp4_error_report_matches_dequantized(zero_mode):
    rng = _rng(18)
    packed = rng.integers(0, 256, size=(16, 64), dtype=np.uint8)
    scales = rng.integers(90, 160, size=(16, 4), dtype=np.uint8)
    c, s = S.mxfp4_to_2bit(packed, scales, zero_mode)
    want = F.error_report(S.dequantize_mxfp4(packed, scales), c, s)
    got = S.mxfp4_error_report(packed, scales, "2bit", zero_mode)
    assert got["numel"] == want["numel"]
    assert got["rel_rms"] == pytest.approx(want["rel_rms"], rel=1e-9)
    assert got["bias_scale_units"] == pytest.approx(want["bias_scale_units"], rel=1e-9, abs=1e-12)
    assert S.mxfp4_error_report(packed, scales, "fp4")["rel_rms"] == 0.0


def test_mxfp4_zero_balancing():
    rng = _rng(15)
    packed = rng.integers(0, 256, size=(8, 32), dtype=np.uint8)
    packed[:, ::2] &= 0xF0  # many +0 low nibbles
    packed[:, 1::3] = 0
    lo, hi = packed & 0xF, packed >> 4
    lo[lo == 8], hi[hi == 8] = 0, 0  # the exporter never wrote -0
    packed = (lo | (hi << 4)).astype(np.uint8)
    scales = np.full((8, 2), 120, np.uint8)
    c, s, mode = S.mxfp4_to_2bit(packed, scales, return_zero_mode=True)
    assert mode == "balanced"
    cr, _ = S.mxfp4_to_2bit_reference(S.dequantize_mxfp4(packed, scales).numpy(), scales)
    np.testing.assert_array_equal(c.numpy(), cr)


def test_mxfp4_to_fp4_is_the_source_bytes():
    rng = _rng(16)
    packed = rng.integers(0, 256, size=(8, 64), dtype=np.uint8)
    scales = rng.integers(100, 150, size=(8, 4), dtype=np.uint8)
    nib, sc = S.mxfp4_to_fp4(packed, scales)
    np.testing.assert_array_equal(nib.numpy(), packed)
    np.testing.assert_array_equal(sc.numpy(), scales)
    np.testing.assert_array_equal(
        F.dequantize_fp4(nib, sc, torch.float64).numpy(), S.dequantize_mxfp4(packed, scales).numpy()
    )
    # gpt-oss style [N, K/32, 16] blocks are accepted too
    n2, _ = S.mxfp4_to_fp4(packed.reshape(8, 4, 16), scales)
    np.testing.assert_array_equal(n2.numpy(), packed)


def test_bf16_fp16_plain():
    g = torch.Generator().manual_seed(17)
    for dt in (torch.bfloat16, torch.float16):
        w = torch.randn(16, 96, generator=g).to(dt)
        v = S.dequantize_plain(w)
        assert v.dtype == torch.float32 and torch.equal(v.to(dt), w)
        _agree_values(v.to(torch.float64))
        c32, s32 = F.quantize_2bit(w)  # 16-bit input goes the float32 route; same bytes as float64
        c64, s64 = F.quantize_2bit(v.to(torch.float64))
        assert torch.equal(c32, c64) and torch.equal(s32, s64)


def test_bad_sources_are_named():
    with pytest.raises(ConfigError, match="scale shape"):
        S.dequantize_fp8(np.zeros((130, 64), np.uint8), np.ones((3, 3), np.float32), name="experts.0.w1")
    with pytest.raises(ConfigError, match="NaN"):
        S.dequantize_fp8(np.full((4, 32), 0x7F, np.uint8), np.ones(1, np.float32))
    with pytest.raises(ConfigError, match="255"):
        S.mxfp4_to_2bit(np.zeros((1, 16), np.uint8), np.full((1, 1), 255, np.uint8))
    with pytest.raises(ConfigError, match="weight_scale"):
        S.dequantize_nvfp4(np.zeros((2, 16), np.uint8), np.zeros((2, 3), np.uint8), np.ones(1, np.float32))

"""2-bit / FP4 expert format: fast torch path vs the exact reference, byte layout, rows, error report."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moetplan.contract.errors import ConfigError, UsageError
from moetplan.runtime.format import format as F


def _agree(w: torch.Tensor, zero_mode: str = "auto") -> None:
    """Fast path == reference for 2-bit and FP4, scales identical between the two formats."""
    ref_in = w.to(torch.float64).numpy()
    c, s = F.quantize_2bit(w, zero_mode)
    cr, sr = F.quantize_2bit_reference(ref_in, zero_mode)
    np.testing.assert_array_equal(s.numpy(), sr)
    np.testing.assert_array_equal(c.numpy(), cr)
    n, s4 = F.quantize_fp4(w)
    nr, s4r = F.quantize_fp4_reference(ref_in)
    np.testing.assert_array_equal(s4.numpy(), s4r)
    np.testing.assert_array_equal(n.numpy(), nr)
    np.testing.assert_array_equal(s4.numpy(), s.numpy())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
def test_random_matches_reference(dtype):
    g = torch.Generator().manual_seed(1)
    w = (torch.randn(8, 256, generator=g, dtype=torch.float64) * torch.logspace(-3, 1, 8, dtype=torch.float64)[:, None])
    _agree(w.to(dtype))


def test_exponent_boundaries_are_exact():
    # amax just below / at / just above 6 * 2^(e-1/2) = 3*sqrt(2)*2^e for float32 and float64 values.
    rows = []
    for e in (-20, -1, 0, 1, 3, 30):
        t = 3 * math.sqrt(2) * 2.0**e
        for v in (np.nextafter(t, 0), t, np.nextafter(t, np.inf)):
            rows.append([v] + [0.25] * 31)
    w64 = torch.tensor(rows, dtype=torch.float64)
    _agree(w64)
    w32 = torch.tensor(np.array(rows, dtype=np.float32))
    t32 = np.float32(3 * math.sqrt(2))
    w32[0, 0] = torch.tensor(np.nextafter(t32, np.float32(0)))
    w32[1, 0] = torch.tensor(t32)
    w32[2, 0] = torch.tensor(np.nextafter(t32, np.float32(np.inf)))
    _agree(w32)
    _, s = F.quantize_2bit(w64)
    # the float just below 3*sqrt2 gets e=-1, the one above e=0; the nearest float decides by its exact square
    from fractions import Fraction

    at = 0 if Fraction(3 * math.sqrt(2)) ** 2 >= 18 else -1
    assert [int(x) - 127 for x in s[6:9, 0]] == [-1, at, 0]


def test_ties_round_to_lower_magnitude():
    # Block amax 6 (e=0): every e2m1 midpoint and the 2-bit boundary 2.5, with both signs and neighbours.
    mids = list(F.E2M1_MIDPOINTS)
    vals = [6.0] + mids + [-m for m in mids] + [np.nextafter(2.5, 3), np.nextafter(2.5, 0), -np.nextafter(2.5, 3)]
    vals += [0.1] * (32 - len(vals))
    w = torch.tensor([vals, [v * 2.0**-40 for v in vals], [v * 2.0**50 for v in vals]], dtype=torch.float64)
    _agree(w)
    _agree(w.to(torch.float32))
    n, s = F.quantize_fp4(w)
    assert int(s[0, 0]) == 127
    deq = F.dequantize_fp4(n, s, torch.float64)[0]
    assert deq[1:8].tolist() == [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0]  # ties down
    d2 = F.dequantize_2bit(*F.quantize_2bit(w), dtype=torch.float64)[0]
    assert d2[5].item() == 1.0  # exactly 2.5 -> 1
    assert d2[15].item() == 4.0 and d2[16].item() == 1.0 and d2[17].item() == -4.0


def test_zeros_all_zero_blocks_and_zero_signs():
    w = torch.zeros(4, 64, dtype=torch.float32)
    w[1] = -0.0
    w[2, :32] = torch.linspace(-1, 1, 32)
    _agree(w)
    c, s = F.quantize_2bit(w)
    assert (s[0] == 0).all() and (s[1] == 0).all()  # all-zero block -> e = -127


def test_zero_sign_balancing():
    g = torch.Generator().manual_seed(3)
    w = torch.randn(16, 64, generator=g)
    w[w.abs() < 0.8] = 0.0  # many exact +0
    assert F.resolve_zero_mode(w) == "balanced"
    _agree(w)
    d = F.dequantize_2bit(*F.quantize_2bit(w))
    zeros = (w == 0).reshape(-1)
    flat = torch.arange(w.numel())
    assert (d.reshape(-1)[zeros & (flat % 2 == 0)] > 0).all()
    assert (d.reshape(-1)[zeros & (flat % 2 == 1)] < 0).all()
    # signed mode leaves every +0 at +1: the bias the balancing removes
    ds = F.dequantize_2bit(*F.quantize_2bit(w, "signed"))
    assert (ds.reshape(-1)[zeros] > 0).all()
    w2 = w.clone()
    w2[0, :] = -0.0  # mixed zero signs below the 95% bar -> signed
    w2[1, :] = -0.0
    w2[2, :] = -0.0
    assert F.resolve_zero_mode(w2) == "signed"
    _agree(w2)


def test_huge_tiny_and_subnormal_exponents():
    f32 = np.finfo(np.float32)
    rows32 = [
        [float(f32.max)] + [1.0] * 31,
        [1e-40, -1e-42, 1e-45] + [0.0] * 29,  # float32 subnormals -> e clamps at -127
        [float(f32.tiny)] * 32,
        [1e30, -3e29] + [7e28] * 30,
    ]
    _agree(torch.tensor(rows32, dtype=torch.float32))
    rows64 = [
        [1e300, -1e-300] + [1.0] * 30,  # e clamps at 127; the rest underflows to the smallest magnitude
        [5e-324, -1e-310] + [0.0] * 30,  # float64 subnormals
        [1e-200] * 32,
        [2.0**127 * 6, 2.0**127 * 2.5, 2.0**127 * 2.5000001] + [1.0] * 29,
    ]
    w = torch.tensor(rows64, dtype=torch.float64)
    _agree(w)
    _, s = F.quantize_2bit(w)
    assert int(s[0, 0]) == 254 and int(s[1, 0]) == 0 and int(s[2, 0]) == 0


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.floats(allow_nan=False, allow_infinity=False, width=32), min_size=64, max_size=64),
    st.sampled_from(["auto", "signed", "balanced"]),
)
def test_property_float32(vals, zero_mode):
    _agree(torch.tensor(vals, dtype=torch.float32).reshape(2, 32), zero_mode)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.floats(allow_nan=False, allow_infinity=False), min_size=32, max_size=32))
def test_property_float64(vals):
    _agree(torch.tensor(vals, dtype=torch.float64).reshape(1, 32))


def test_bit_layout_matches_spec():
    # weight k of row n sits in byte k//4 at bits 2*(k%4); codes 0:+1 1:+4 2:-1 3:-4
    w = torch.tensor([[1.0, 6.0, -1.0, -6.0] * 8], dtype=torch.float32)
    c, s = F.quantize_2bit(w)
    assert int(s[0, 0]) == 127
    assert c[0, 0].item() == (0 | 1 << 2 | 2 << 4 | 3 << 6)
    n, _ = F.quantize_fp4(torch.tensor([[0.5, -6.0] + [0.0] * 30]))
    assert n[0, 0].item() == (1 | (8 | 7) << 4)  # low nibble = even k
    np.testing.assert_array_equal(
        F.dequantize_2bit(c, s, torch.float64).numpy(), F.dequantize_2bit_reference(c.numpy(), s.numpy())
    )


def test_nonfinite_and_bad_shapes_are_clear_errors():
    with pytest.raises(ConfigError, match="NaN"):
        F.quantize_2bit(torch.tensor([[float("nan")] + [0.0] * 31]))
    with pytest.raises(UsageError, match="multiple of 32"):
        F.quantize_2bit(torch.zeros(2, 48))
    with pytest.raises(UsageError, match="tp"):
        F.RowLayout.for_expert(64, 96, tp=2)
    with pytest.raises(UsageError, match="format"):
        F.RowLayout.for_expert(64, 64, fmt="int3")


def _lloyd_max_with_zero(s: np.ndarray, iters: int = 60) -> np.ndarray:
    """L2-optimal 4-level codebook that keeps an exact zero level (int2-style): necessarily sign-asymmetric."""
    levels = np.array([-3.0, 0.0, 1.5, 3.0])
    for _ in range(iters):
        idx = np.abs(s[:, None] - levels[None]).argmin(1)
        for j in range(4):
            if levels[j] != 0 and (idx == j).any():
                levels[j] = s[idx == j].mean()
    return levels


def test_symmetric_codebook_unbiased_where_asymmetric_is_not():
    g = torch.Generator().manual_seed(7)
    w = torch.randn(256, 512, generator=g, dtype=torch.float64) * 0.02
    c, s = F.quantize_2bit(w)
    sym = F.error_report(w, c, s)
    # the asymmetric codebook on the same block scales, in the same scale units
    sb, _ = F.block_scaled(w)
    sv = sb.reshape(-1).numpy()
    levels = _lloyd_max_with_zero(sv)
    q = levels[np.abs(sv[:, None] - levels[None]).argmin(1)]
    asym_bias = float((q - sv).mean())
    asym_rel = float(np.linalg.norm(q - sv) / np.linalg.norm(sv))
    assert levels[0] < 0 < levels[2] and abs(levels[0] + levels[3]) > 0.5  # sign-asymmetric
    assert abs(sym["bias_scale_units"]) < 0.01
    assert abs(asym_bias) > 0.05 and abs(asym_bias) > 10 * abs(sym["bias_scale_units"])
    assert sym["rel_rms"] < asym_rel + 0.02  # symmetry costs no L2 error here
    assert 0.3 < sym["rel_rms"] < 0.45


def test_error_report_values():
    # FP4: e2m1 grid values with the block max at 6 are exactly representable
    w = torch.tensor([[6.0, -0.5, 1.5, -3.0] * 8] * 2, dtype=torch.float32) * 2.0**-5
    n, s = F.quantize_fp4(w)
    r = F.error_report(w, n, s, "fp4")
    assert r["rel_rms"] == 0.0 and r["bias_scale_units"] == 0.0
    # 2-bit: 6 -> 4, -0.5 -> -1, 1.5 -> 1, -3 -> -4 (scale 2^-5): errors -2, -0.5, -0.5, -1 per 4 weights
    c, s = F.quantize_2bit(w)
    r = F.error_report(w, c, s)
    assert r["bias_scale_units"] == pytest.approx(-4.0 / 4)
    assert r["rel_rms"] == pytest.approx(math.sqrt((4 + 0.25 + 0.25 + 1) / (36 + 0.25 + 2.25 + 9)))


@pytest.mark.parametrize("fmt", ["2bit", "fp4"])
@pytest.mark.parametrize("tp", [1, 2])
def test_row_layout_pack_and_unpack(fmt, tp):
    hidden, inter = 64, 128
    lay = F.RowLayout.for_expert(hidden, inter, tp, fmt)
    ir = inter // tp
    assert lay.stride % 4096 == 0
    for name in ("w13_q", "w13_s", "w2_q", "w2_s"):
        assert getattr(lay, f"{name}_off") % 256 == 0
    offs = sorted((getattr(lay, f"{n}_off"), getattr(lay, f"{n}_size")) for n in ("w13_q", "w13_s", "w2_q", "w2_s"))
    assert all(a[0] + a[1] <= b[0] for a, b in zip(offs, offs[1:])) and offs[-1][0] + offs[-1][1] <= lay.stride
    per = 4 if fmt == "2bit" else 2
    assert lay.w13_q_size == 2 * ir * hidden // per and lay.w2_s_size == hidden * ir // 32
    assert F.RowLayout.from_dict(lay.to_dict()) == lay
    g = torch.Generator().manual_seed(5)
    w13 = torch.randn(2 * ir, hidden, generator=g).to(torch.bfloat16)
    w2 = torch.randn(hidden, ir, generator=g).to(torch.bfloat16)
    stats: dict = {}
    row = F.pack_expert_row(w13, w2, lay, stats=stats)
    assert row.dtype == torch.uint8 and row.shape == (lay.stride,)
    q13, s13, q2, s2 = F.row_views(row, lay)
    exp = F.quantize_2bit(w13) if fmt == "2bit" else F.quantize_fp4(w13)
    assert torch.equal(q13, exp[0]) and torch.equal(s13, exp[1])
    d13, d2 = F.unpack_expert_row(row, lay)
    deq = F.dequantize_2bit if fmt == "2bit" else F.dequantize_fp4
    assert torch.equal(d2, deq(*(F.quantize_2bit(w2) if fmt == "2bit" else F.quantize_fp4(w2))))
    assert d13.shape == (2 * ir, hidden) and d2.shape == (hidden, ir)
    assert stats["w13"]["rel_rms"] > 0 and "zero_mode" in stats["w2"]
    # batched views over [S, stride]
    rows = torch.stack([row, row])
    bq13, _, _, bs2 = F.row_views(rows, lay)
    assert bq13.shape == (2, *lay.shapes()["w13_q"]) and torch.equal(bq13[1], q13) and torch.equal(bs2[0], s2)
    # padding is zero (rows are checksummed; garbage there would make identical weights differ)
    mask = torch.ones(lay.stride, dtype=torch.bool)
    for name in ("w13_q", "w13_s", "w2_q", "w2_s"):
        o = getattr(lay, f"{name}_off")
        mask[o:o + getattr(lay, f"{name}_size")] = False
    assert (row[mask] == 0).all()


def test_ds4_layout_size_matches_facts():
    lay = F.RowLayout.for_expert(4096, 2048, 1, "2bit")
    assert lay.payload_bytes == 3 * 4096 * 2048 * 9 // 32  # 2.25 bits/weight, FACTS.md
    assert lay.stride == lay.payload_bytes  # 6.75 MiB is already 4 KiB aligned


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
def test_bit_domain_path_matches_float_path_on_large_tensors(dtype):
    # Too big for the Fraction reference: check the integer fast path against the frexp/float formulation instead.
    g = torch.Generator().manual_seed(9)
    mag = torch.logspace(-30, 30, 300, dtype=torch.float64)[:, None]
    w = torch.randn(300, 1024, generator=g, dtype=torch.float64) * mag
    if dtype in (torch.float16,):
        w = torch.randn(300, 1024, generator=g, dtype=torch.float64) * 100
    w = w.to(dtype)
    w[0, :100] = 0.0
    s, e = F.block_scaled(w)
    c, sc = F.quantize_2bit(w, "signed")
    assert torch.equal(sc.to(torch.int32) - 127, e)
    codes = F._unpack_crumbs(c).reshape(s.shape)
    assert torch.equal((codes & 1).bool(), s.abs() > 2.5)
    assert torch.equal((codes >> 1).bool(), torch.signbit(s))
    n, _ = F.quantize_fp4(w)
    idx = F.unpack_nibbles(n).reshape(s.shape) & 7
    assert torch.equal(idx.long(), torch.bucketize(s.abs(), torch.tensor(F.E2M1_MIDPOINTS, dtype=s.dtype)))


def test_report_rows_sampling():
    assert F.report_rows(100, None) == slice(None) and F.report_rows(100, 256) == slice(None)
    sl = F.report_rows(4096, 256)
    assert len(range(4096)[sl]) == 256
    g = torch.Generator().manual_seed(4)
    w13, w2 = torch.randn(128, 64, generator=g), torch.randn(64, 64, generator=g)
    lay = F.RowLayout.for_expert(64, 64)
    full, part = {}, {}
    assert torch.equal(F.pack_expert_row(w13, w2, lay, stats=full), F.pack_expert_row(w13, w2, lay, stats=part,
                                                                                         report_max_rows=32))
    assert full["w13"]["numel"] == 128 * 64 and part["w13"]["numel"] == 32 * 64
    assert part["w13"]["rel_rms"] == pytest.approx(full["w13"]["rel_rms"], rel=0.2)

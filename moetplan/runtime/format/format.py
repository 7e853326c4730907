"""Routed-expert storage format v1 (docs/FORMAT.md): 2-bit sign-symmetric codes and the FP4 (e2m1) reserve.

Both formats share one power-of-two (UE8M0) scale per block of 32 weights along K. Two implementations live
here: a vectorised torch path (the one everything uses) and a float64/Fraction reference written straight from
the rules, which tests use as the oracle. They must agree bit for bit; any change that alters output bytes
must bump QUANTIZER_VERSION so existing pack files are detected as stale and rebuilt.
"""
from __future__ import annotations

import math
import sys
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction

import numpy as np
import torch

from moetplan.contract.errors import ConfigError, UsageError
from moetplan.contract.vocab import ZERO_MODES, RowFormat, ZeroMode, check_choice
from moetplan.contract.layout import BLOCK, FORMATS, ROW_ALIGN, SECTION_ALIGN, RowLayout  # noqa: F401 (re-exported)

QUANTIZER_VERSION = "1"
FORMAT_VERSION = 1

E_MIN, E_MAX = -127, 127

E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
CODE_VALUES = (1.0, 4.0, -1.0, -4.0)  # c = sign<<1 | four
ZERO_BALANCE_SHARE = 0.95

Fmt = RowFormat


# --------------------------------------------------------------------------- exponents


def _mantissa_threshold(bits: int) -> float:
    # amax = m * 2^p (m in [0.5, 1)); 6*2^(e-1/2) <= amax  <=>  e <= p-3 when m >= 3/(4*sqrt 2), else p-4.
    # The threshold is irrational, so `m >= T` equals `m >= (smallest float of this precision above T)`: exact.
    big = math.isqrt(9 * 2 ** (2 * bits - 5)) + 1
    return big / 2**bits


_MANT_THR = {torch.float32: _mantissa_threshold(24), torch.float64: _mantissa_threshold(53)}
_POW2_CACHE: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}


def pow2_table(dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """2^k for k in [-127, 127], exact in float32 (2^-127 is a float32 subnormal) and float64."""
    key = (dtype, torch.device(device))
    t = _POW2_CACHE.get(key)
    if t is None:
        t = torch.tensor([math.ldexp(1.0, k) for k in range(E_MIN, E_MAX + 1)], dtype=torch.float64)
        t = _POW2_CACHE[key] = t.to(dtype).to(device)
    return t


def _work_dtype(w: torch.Tensor) -> torch.dtype:
    # bf16/fp16 widen exactly into float32; fp32 stays; everything else (dequantized FP8/NVFP4) is float64.
    if w.dtype in (torch.bfloat16, torch.float16, torch.float32):
        return torch.float32
    if w.dtype == torch.float64:
        return torch.float64
    raise UsageError(f"Cannot quantize a {w.dtype} tensor directly; dequantize it first (moetplan.runtime.format.sources)")


def check_shape(w: torch.Tensor | np.ndarray) -> tuple[int, int]:
    if w.ndim != 2:
        raise UsageError(f"Expected a 2-D weight [N, K], got shape {tuple(w.shape)}")
    n, k = w.shape
    if k % BLOCK:
        raise UsageError(f"K={k} is not a multiple of {BLOCK}; the block-32 formats need it")
    return n, k


def block_scaled(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Float view of the method: (w * 2^-e as [N, K/32, 32], e int32 [N, K/32]); for analysis and tests.

    Exact: frexp gives amax = m * 2^p, and e = p-3 when m >= 3/(4 sqrt 2) else p-4; scaling by a power of two
    only shifts exponents (underflow loses values far below every decision boundary, keeping their sign).
    """
    n, k = check_shape(w)
    wb = w.to(_work_dtype(w)).reshape(n, k // BLOCK, BLOCK)
    amax = wb.abs().amax(dim=-1)
    if not bool(torch.isfinite(amax).all()):
        bad = (~torch.isfinite(amax)).nonzero()[0].tolist()
        raise ConfigError(f"Weight has NaN/Inf (first in row {bad[0]}, block {bad[1]}); the checkpoint is corrupt")
    mant, p = torch.frexp(amax)
    e = p - 4 + (mant >= _MANT_THR[wb.dtype]).to(torch.int32)
    e = torch.where(amax == 0, torch.full_like(e, E_MIN), e).clamp_(E_MIN, E_MAX)
    return wb * pow2_table(wb.dtype, wb.device)[(E_MAX - e).long()].unsqueeze(-1), e


def resolve_zero_mode(w: torch.Tensor, zero_mode: ZeroMode = "auto") -> str:
    """"balanced" when >95% of the tensor's exact zeros share one sign (exports that write every zero as +0)."""
    _check_zero_mode(zero_mode)
    if zero_mode != "auto":
        return zero_mode
    zeros = w == 0
    return _mode_from_counts(int(zeros.sum()), int((zeros & torch.signbit(w)).sum()))


def _check_zero_mode(zero_mode: str) -> None:
    check_choice("zero mode", zero_mode, ZERO_MODES)


def _mode_from_counts(zeros: int, negative_zeros: int) -> str:
    if zeros == 0:
        return "signed"
    return "balanced" if max(negative_zeros, zeros - negative_zeros) > ZERO_BALANCE_SHARE * zeros else "signed"


def _pack_crumbs(c: torch.Tensor) -> torch.Tensor:
    """[N, K] 2-bit values (uint8) -> [N, K/4] bytes, weight k at bits 2*(k%4) (little-endian in the byte)."""
    # Four code bytes read as one little-endian int32 hold the codes at bits 0, 8, 16, 24; fold them to 0, 2, 4, 6.
    v = c.contiguous().view(torch.int32)
    return ((v | (v >> 6) | (v >> 12) | (v >> 18)) & 0xFF).to(torch.uint8)


def _pack_nibbles(x: torch.Tensor) -> torch.Tensor:
    """[N, K] nibbles (uint8) -> [N, K/2] bytes, even k in the low nibble."""
    v = x.contiguous().view(torch.int16)
    return ((v | (v >> 4)) & 0xFF).to(torch.uint8)


# --------------------------------------------------------------------------- fast path: integer bit patterns
#
# For non-negative finite IEEE floats, comparing bit patterns as integers is comparing values, and every decision
# threshold (2.5 * 2^e; the e2m1 midpoints * 2^e) is exactly representable in the source's own format, subnormals
# included (the smallest, 0.25 * 2^-127 = 2^-129, is a bf16/fp32 subnormal). So the fast path does no float
# arithmetic: it reads the bits (bf16 as int16, fp32 as int32, fp64 as int64), takes each block's max, derives e
# from the max's exponent field and mantissa, and compares against per-exponent threshold tables. fp16 widens to
# fp32 first (exact; its own subnormals would need exponents outside the fp16 range). Rows go in chunks so the
# temporaries stay in cache and the allocator reuses them.

if sys.byteorder != "little":  # pragma: no cover - the packing folds rely on little-endian int views
    raise ImportError("moetplan.runtime.format.format needs a little-endian host")

_CHUNK_ELEMS = 1 << 18


@dataclass(frozen=True)
class _Domain:
    float_dtype: torch.dtype
    int_dtype: torch.dtype
    mant_bits: int
    bias: int
    exp_bits: int

    @property
    def abs_mask(self) -> int:
        return (1 << (self.mant_bits + self.exp_bits)) - 1

    @property
    def inf_bits(self) -> int:
        return ((1 << self.exp_bits) - 1) << self.mant_bits

    @property
    def mant_threshold(self) -> int:
        # m >= 3/(4 sqrt 2) for the significand 1.M scaled into [0.5, 1): integer form, exact (see _mantissa_threshold)
        p = self.mant_bits + 1
        return math.isqrt(9 * 2 ** (2 * p - 5)) + 1 - (1 << self.mant_bits)


DOMAINS = {
    torch.bfloat16: _Domain(torch.bfloat16, torch.int16, 7, 127, 8),
    torch.float32: _Domain(torch.float32, torch.int32, 23, 127, 8),
    torch.float64: _Domain(torch.float64, torch.int64, 52, 1023, 11),
}
_TABLES: dict[tuple[torch.dtype, torch.device], tuple[torch.Tensor, torch.Tensor]] = {}


def _thresholds(dom: _Domain, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Bits of 2.5 * 2^e [255] and of the e2m1 midpoints * 2^e [255, 7], indexed by e + 127 (inf when too big)."""
    key = (dom.float_dtype, device)
    t = _TABLES.get(key)
    if t is None:
        es = range(E_MIN, E_MAX + 1)
        four = torch.tensor([math.ldexp(2.5, e) for e in es], dtype=torch.float64)
        mids = torch.tensor([[math.ldexp(m, e) for m in E2M1_MIDPOINTS] for e in es], dtype=torch.float64)
        t = tuple(x.to(dom.float_dtype).view(dom.int_dtype).to(device) for x in (four, mids))
        _TABLES[key] = t  # type: ignore[assignment]
    return t  # type: ignore[return-value]


def _source_bits(w: torch.Tensor) -> tuple[torch.Tensor, _Domain]:
    if w.dtype == torch.float16:
        w = w.to(torch.float32)
    dom = DOMAINS.get(w.dtype)
    if dom is None:
        raise UsageError(f"Cannot quantize a {w.dtype} tensor directly; dequantize it first (moetplan.runtime.format.sources)")
    return w.contiguous().view(dom.int_dtype), dom


def block_exponents(amax_bits: torch.Tensor, dom: _Domain) -> torch.Tensor:
    """Block exponent e (int32, clamped) from the bit pattern of the block max |w| (non-negative, finite)."""
    ef = (amax_bits >> dom.mant_bits).to(torch.int32)
    e = ef - (dom.bias + 3) + ((amax_bits & ((1 << dom.mant_bits) - 1)) >= dom.mant_threshold).to(torch.int32)
    return e.clamp_(E_MIN, E_MAX)  # all-zero and subnormal-max blocks land on -127


# BlockRule(r0, amax_bits [m, K/32]) -> (e int32 [m, K/32], 2-bit threshold [m, K/32], FP4 thresholds [m, K/32, 7]),
# thresholds in the element bit domain: an element is "above" when its magnitude bits exceed the threshold.
BlockRule = Callable[[int, torch.Tensor], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


def _ieee_rule(dom: _Domain, device: torch.device) -> BlockRule:
    four_t, mids_t = _thresholds(dom, device)

    def rule(r0: int, amax: torch.Tensor):
        if int(amax.max()) >= dom.inf_bits:
            r, blk = (amax >= dom.inf_bits).nonzero()[0].tolist()
            raise ConfigError(f"Weight has NaN/Inf (row {r0 + r}, block {blk}); the checkpoint is corrupt")
        e = block_exponents(amax, dom)
        idx = (e + 127).long()
        return e, four_t[idx], mids_t[idx]

    return rule


def quantize_core(bits: torch.Tensor, top: int, rule: BlockRule, fmt: str, zero_mode: ZeroMode,
                   q_out: torch.Tensor, s_out: torch.Tensor, sub: int = 1) -> str:
    """The element pass shared by all sources: `bits` are signed ints whose bit `top` is the sign and whose lower
    bits order magnitudes. Returns the zero mode used. `sub` > 1 splits each block of 32 into that many groups
    with their own thresholds (NVFP4's block-16 scales): the rule then gets and returns per-group values, except
    the exponent, which stays per block of 32.

    Comparisons are written as `(threshold - a) >> top` (-1 where a > threshold, else 0): both sides are
    non-negative, so the difference cannot overflow, and integer arithmetic vectorises where bool compares do not.
    """
    _check_zero_mode(zero_mode)
    n, k = check_shape(bits)
    rows = max(1, _CHUNK_ELEMS // k)
    col_odd = -(torch.arange(k, device=bits.device, dtype=bits.dtype) & 1)  # -1 at odd columns
    neg_zero = -(1 << top)  # the bit pattern of -0 as a signed int
    abs_mask = (1 << top) - 1
    mode = "signed" if zero_mode == "auto" else zero_mode
    zeros = neg_zeros = 0
    for r0 in range(0, n, rows):
        b = bits[r0:r0 + rows]
        m = b.shape[0]
        a = b & abs_mask
        ab = a.view(m, k // BLOCK * sub, BLOCK // sub)
        e, four_thr, mids = rule(r0, ab.amax(dim=-1))
        s_out[r0:r0 + m] = (e + 127).to(torch.uint8)
        sgn = b >> top  # -1 where the sign bit is set (including -0), else 0
        if mode == "balanced" or zero_mode == "auto":
            has_zero = int(a.min()) == 0
            if has_zero and zero_mode == "auto":  # count_nonzero on ints and XOR: no bool temporaries
                zeros += a.numel() - int(torch.count_nonzero(a))
                neg_zeros += b.numel() - int(torch.count_nonzero(b ^ neg_zero))
            if has_zero and mode == "balanced":
                sgn = torch.where(a == 0, col_odd, sgn)  # K is even: flat-index parity is column parity
        if fmt == "2bit":
            four = (four_thr.unsqueeze(-1) - ab) >> top
            code = (sgn & 2) | (four.view(m, k) & 1)
            q_out[r0:r0 + m] = _pack_crumbs(code.to(torch.uint8))
        else:
            nib = sgn & 8
            for j in range(len(E2M1_MIDPOINTS)):
                nib = nib - ((mids[..., j:j + 1] - ab) >> top).view(m, k)
            q_out[r0:r0 + m] = _pack_nibbles(nib.to(torch.uint8))
    if zero_mode == "auto" and fmt == "2bit" and _mode_from_counts(zeros, neg_zeros) == "balanced":
        return quantize_core(bits, top, rule, fmt, "balanced", q_out, s_out, sub)  # rare: zeros alternate
    return mode


def _quantize_into(w: torch.Tensor, fmt: str, zero_mode: ZeroMode, q_out: torch.Tensor,
                   s_out: torch.Tensor) -> str:
    """Quantize float w [N, K] into q_out ([N, K/4] 2-bit or [N, K/2] e2m1) and s_out [N, K/32]."""
    check_shape(w)
    bits, dom = _source_bits(w)
    return quantize_core(bits, dom.mant_bits + dom.exp_bits, _ieee_rule(dom, bits.device), fmt, zero_mode,
                          q_out, s_out)


# --------------------------------------------------------------------------- 2-bit, fast path


def quantize_2bit(w: torch.Tensor, zero_mode: ZeroMode = "auto", return_zero_mode: bool = False):
    """w [N, K] (bf16/fp16/fp32/fp64) -> (codes uint8 [N, K/4], scales uint8 [N, K/32]) [, resolved zero mode].

    Vectorised on the source's bit patterns (exact by construction); bit-identical to quantize_2bit_reference.
    """
    if not isinstance(w, torch.Tensor):
        w = torch.from_numpy(np.asarray(w))
    n, k = check_shape(w)
    codes = torch.empty(n, k // 4, dtype=torch.uint8, device=w.device)
    scales = torch.empty(n, k // BLOCK, dtype=torch.uint8, device=w.device)
    mode = _quantize_into(w, "2bit", zero_mode, codes, scales)
    return (codes, scales, mode) if return_zero_mode else (codes, scales)


def _unpack_crumbs(codes: torch.Tensor) -> torch.Tensor:
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=codes.device)
    c = (codes.unsqueeze(-1) >> shifts) & 3
    return c.reshape(*codes.shape[:-1], codes.shape[-1] * 4)


def _scale_values(scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if bool((scales == 255).any()):
        raise ConfigError("UE8M0 scale byte 255 (NaN) found; the source is corrupt")
    if dtype in (torch.float32, torch.float64):
        return pow2_table(dtype, scales.device)[scales.long()]
    return pow2_table(torch.float32, scales.device)[scales.long()].to(dtype)


def dequantize_2bit(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(codes [.., N, K/4], scales [.., N, K/32]) -> weights [.., N, K]."""
    c = _unpack_crumbs(codes).long()
    lut = torch.tensor(CODE_VALUES, dtype=dtype if dtype in (torch.float32, torch.float64) else torch.float32,
                       device=codes.device)
    vals = lut[c]
    s = _scale_values(scales, vals.dtype).repeat_interleave(BLOCK, dim=-1)
    return (vals * s).to(dtype)


# --------------------------------------------------------------------------- FP4 (e2m1), fast path


def quantize_fp4(w: torch.Tensor, return_zero_mode: bool = False):
    """w [N, K] -> (nibbles uint8 [N, K/2], scales uint8 [N, K/32]); same scale bytes as quantize_2bit.

    Zero signs are kept as they are (a zero's sign does not bias an e2m1 value; an MXFP4 source round-trips).
    """
    if not isinstance(w, torch.Tensor):
        w = torch.from_numpy(np.asarray(w))
    n, k = check_shape(w)
    nib = torch.empty(n, k // 2, dtype=torch.uint8, device=w.device)
    scales = torch.empty(n, k // BLOCK, dtype=torch.uint8, device=w.device)
    _quantize_into(w, "fp4", "signed", nib, scales)
    return (nib, scales, "signed") if return_zero_mode else (nib, scales)


def unpack_nibbles(x: torch.Tensor) -> torch.Tensor:
    lo, hi = x & 0xF, x >> 4
    return torch.stack([lo, hi], dim=-1).reshape(*x.shape[:-1], x.shape[-1] * 2)


def e2m1_values(dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> torch.Tensor:
    """The 16 signed e2m1 values by nibble."""
    return torch.tensor(list(E2M1_GRID) + [-g for g in E2M1_GRID], dtype=dtype, device=device)


def dequantize_fp4(nibbles: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    work = dtype if dtype in (torch.float32, torch.float64) else torch.float32
    vals = e2m1_values(work, nibbles.device)[unpack_nibbles(nibbles).long()]
    s = _scale_values(scales, work).repeat_interleave(BLOCK, dim=-1)
    return (vals * s).to(dtype)


# --------------------------------------------------------------------------- float64 / Fraction reference


def _ref_exponent(amax: float) -> int:
    """The integer e with 6*2^(e-1/2) <= amax < 6*2^(e+1/2), i.e. 18*4^e <= amax^2 < 18*4^(e+1), exactly."""
    if amax == 0:
        return E_MIN
    a2 = Fraction(amax) ** 2
    e = math.floor(math.log2(amax) - math.log2(6) + 0.5)
    while 18 * Fraction(4) ** e > a2:
        e -= 1
    while 18 * Fraction(4) ** (e + 1) <= a2:
        e += 1
    return max(E_MIN, min(E_MAX, e))


def _ref_snap_index(s: Fraction) -> int:
    """Index into E2M1_GRID of the nearest grid value to |s|, ties to the lower magnitude."""
    a = abs(s)
    best, best_d = 0, None
    for i, g in enumerate(E2M1_GRID):
        d = abs(a - Fraction(g))
        if best_d is None or d < best_d:
            best, best_d = i, d
    return best


def _ref_blocks(w: np.ndarray) -> tuple[np.ndarray, list[list[int]], list[list[list[int]]]]:
    """-> (float64 weights, exponents [N][K/32], e2m1 indices [N][K])."""
    w = np.asarray(w, dtype=np.float64)
    n, k = check_shape(w)
    if not np.isfinite(w).all():
        raise ConfigError("Weight has NaN/Inf; the checkpoint is corrupt")
    exps, idx = [], []
    for r in range(n):
        er, ir = [], []
        for b in range(k // BLOCK):
            blk = w[r, b * BLOCK:(b + 1) * BLOCK]
            e = _ref_exponent(float(np.max(np.abs(blk))))
            er.append(e)
            inv = Fraction(2) ** (-e)
            ir.extend(_ref_snap_index(Fraction(float(x)) * inv) for x in blk)
        exps.append(er)
        idx.append(ir)
    return w, exps, idx


def ref_zero_mode(w: np.ndarray, zero_mode: str) -> str:
    if zero_mode != "auto":
        return zero_mode
    flat = w.reshape(-1)
    zeros = [bool(np.signbit(x)) for x in flat if x == 0]
    if not zeros:
        return "signed"
    neg = sum(zeros)
    return "balanced" if max(neg, len(zeros) - neg) > ZERO_BALANCE_SHARE * len(zeros) else "signed"


def ref_sign(w: np.ndarray, r: int, c: int, mode: str) -> int:
    x = w[r, c]
    if x == 0 and mode == "balanced":
        return (r * w.shape[1] + c) & 1
    return int(np.signbit(x))


def quantize_2bit_reference(w: np.ndarray, zero_mode: ZeroMode = "auto") -> tuple[np.ndarray, np.ndarray]:
    """The rules of docs/FORMAT.md applied literally with exact rationals: snap to e2m1, then {0..2}->1, {3,4,6}->4."""
    w, exps, idx = _ref_blocks(w)
    n, k = w.shape
    mode = ref_zero_mode(w, zero_mode)
    codes = np.zeros((n, k // 4), dtype=np.uint8)
    for r in range(n):
        for c in range(k):
            four = 1 if E2M1_GRID[idx[r][c]] >= 3.0 else 0
            code = (ref_sign(w, r, c, mode) << 1) | four
            codes[r, c // 4] |= code << (2 * (c % 4))
    scales = np.array([[e + 127 for e in row] for row in exps], dtype=np.uint8).reshape(n, k // BLOCK)
    return codes, scales


def quantize_fp4_reference(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    w, exps, idx = _ref_blocks(w)
    n, k = w.shape
    nib = np.zeros((n, k // 2), dtype=np.uint8)
    for r in range(n):
        for c in range(k):
            v = idx[r][c] | (int(np.signbit(w[r, c])) << 3)
            nib[r, c // 2] |= v << (4 * (c % 2))
    scales = np.array([[e + 127 for e in row] for row in exps], dtype=np.uint8).reshape(n, k // BLOCK)
    return nib, scales


def dequantize_2bit_reference(codes: np.ndarray, scales: np.ndarray) -> np.ndarray:
    n, kb = codes.shape
    out = np.zeros((n, kb * 4), dtype=np.float64)
    for r in range(n):
        for c in range(kb * 4):
            code = (int(codes[r, c // 4]) >> (2 * (c % 4))) & 3
            out[r, c] = math.ldexp(CODE_VALUES[code], int(scales[r, c // BLOCK]) - 127)
    return out


# --------------------------------------------------------------------------- error report


def error_report(w: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, fmt: str = "2bit") -> dict[str, float]:
    """rel_rms = ||wq - w|| / ||w||; bias_scale_units = mean((wq - w) / block scale) (signed; ~0 when unbiased).

    Chunked over rows; float32 arithmetic for 16/32-bit sources (dequantized values and their differences are
    exact or within an ulp there), float64 otherwise; sums accumulate in float64.
    """
    if not isinstance(w, torch.Tensor):
        w = torch.from_numpy(np.asarray(w))
    n, k = check_shape(w)
    work = torch.float64 if w.dtype == torch.float64 else torch.float32
    lut = (torch.tensor(CODE_VALUES, dtype=work, device=w.device) if fmt == "2bit" else e2m1_values(work, w.device))
    unpack = _unpack_crumbs if fmt == "2bit" else unpack_nibbles
    pw = pow2_table(torch.float64, w.device)
    rows = max(1, _CHUNK_ELEMS // k)
    err2 = ref2 = bias = 0.0
    for r0 in range(0, n, rows):
        wc = w[r0:r0 + rows].to(work)
        m = wc.shape[0]
        sc = scales[r0:r0 + rows].long()
        if bool((sc == 255).any()):
            raise ConfigError("UE8M0 scale byte 255 (NaN) found; the source is corrupt")
        # error in scale units: code value - w * 2^-e (exact), then back to weight units per block
        su = lut[unpack(codes[r0:r0 + rows]).long()].view(m, k // BLOCK, BLOCK) - \
            wc.view(m, k // BLOCK, BLOCK) * pw[254 - sc].to(work).unsqueeze(-1)
        bias += float(su.sum(dtype=torch.float64))
        err2 += float(((su * su).sum(dim=-1, dtype=torch.float64) * pw[sc].square()).sum())
        ref2 += float((wc * wc).sum(dtype=torch.float64))
    return {
        "rel_rms": math.sqrt(err2 / ref2) if ref2 > 0 else 0.0,
        "bias_scale_units": bias / (n * k),
        "numel": n * k,
    }


# --------------------------------------------------------------------------- expert rows


def _quantize(w: torch.Tensor, fmt: str, zero_mode: ZeroMode):
    return quantize_2bit(w, zero_mode, return_zero_mode=True) if fmt == "2bit" else quantize_fp4(w, True)


def pack_quantized_row(layout: RowLayout, w13_q: torch.Tensor, w13_s: torch.Tensor, w2_q: torch.Tensor,
                       w2_s: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Place already-quantized sections into a row (zeros in the alignment padding)."""
    row = torch.zeros(layout.stride, dtype=torch.uint8, device=w13_q.device) if out is None else out
    if out is not None:
        row.zero_()
    shapes = layout.shapes()
    for name, t in (("w13_q", w13_q), ("w13_s", w13_s), ("w2_q", w2_q), ("w2_s", w2_s)):
        if tuple(t.shape) != shapes[name]:
            raise UsageError(f"{name} has shape {tuple(t.shape)}, layout {layout.fmt} expects {shapes[name]}")
        off = getattr(layout, f"{name}_off")
        row[off:off + t.numel()] = t.reshape(-1)
    return row


def report_rows(n: int, max_rows: int | None) -> slice:
    """Every k-th row so that at most max_rows rows feed an error report (rows quantize independently, so the
    sampled rows' statistics are exact for those rows)."""
    return slice(None) if not max_rows or n <= max_rows else slice(None, None, -(-n // max_rows))


def pack_expert_row(w13: torch.Tensor, w2: torch.Tensor, layout: RowLayout, zero_mode: ZeroMode = "auto",
                    out: torch.Tensor | None = None, stats: dict | None = None,
                    report_max_rows: int | None = None) -> torch.Tensor:
    """Float weights w13 [2Ir, H], w2 [H, Ir] -> one uint8 row [stride], quantized per layout.fmt.

    `stats`, when given, receives error_report() of both matrices (on at most report_max_rows evenly spaced rows)
    and their resolved zero modes.
    """
    if tuple(w13.shape) != (2 * layout.inter_per_rank, layout.hidden) or \
            tuple(w2.shape) != (layout.hidden, layout.inter_per_rank):
        raise UsageError(
            f"Expert shapes w13 {tuple(w13.shape)}, w2 {tuple(w2.shape)} do not match the layout "
            f"(w13 [{2 * layout.inter_per_rank}, {layout.hidden}], w2 [{layout.hidden}, {layout.inter_per_rank}])"
        )
    q13, s13, z13 = _quantize(w13, layout.fmt, zero_mode)
    q2, s2, z2 = _quantize(w2, layout.fmt, zero_mode)
    if stats is not None:
        a, b = report_rows(w13.shape[0], report_max_rows), report_rows(w2.shape[0], report_max_rows)
        stats["w13"] = {**error_report(w13[a], q13[a], s13[a], layout.fmt), "zero_mode": z13}
        stats["w2"] = {**error_report(w2[b], q2[b], s2[b], layout.fmt), "zero_mode": z2}
    return pack_quantized_row(layout, q13, s13, q2, s2, out)


def row_views(row: torch.Tensor | np.ndarray, layout: RowLayout):
    """Row(s) uint8 [stride] or [S, stride] -> (w13_q, w13_s, w2_q, w2_s) views shaped per layout.shapes()."""
    if isinstance(row, np.ndarray):
        row = torch.from_numpy(row)
    if row.dtype != torch.uint8 or row.shape[-1] != layout.stride or row.ndim not in (1, 2):
        raise UsageError(f"Expected uint8 rows [..., {layout.stride}], got {row.dtype} {tuple(row.shape)}")
    lead = tuple(row.shape[:-1])
    views = []
    for name, shape in layout.shapes().items():
        off = getattr(layout, f"{name}_off")
        views.append(row[..., off:off + shape[0] * shape[1]].view(*lead, *shape))
    return tuple(views)


def unpack_expert_row(row: torch.Tensor, layout: RowLayout, dtype: torch.dtype = torch.float32):
    """Row [stride] (or [S, stride]) -> dequantized (w13 [.., 2Ir, H], w2 [.., H, Ir])."""
    q13, s13, q2, s2 = row_views(row, layout)
    deq = dequantize_2bit if layout.fmt == "2bit" else dequantize_fp4
    return deq(q13, s13, dtype), deq(q2, s2, dtype)

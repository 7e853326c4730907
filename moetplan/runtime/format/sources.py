"""Checkpoint weight formats -> exact float values, or straight to the 2-bit / FP4 bytes.

Every dequantizer has a vectorised torch version (used by `moetplan quantize`) and a float64 reference written
from the format definitions with scalar decoding (tests compare them). All products are exact in the dtype
returned: FP8 (4 significant bits) x f32 scale (24) fits float64's 53; NVFP4 e2m1 (2) x e4m3 (4) x f32 (24) too.

Direct paths skip the float weights: MXFP4 -> 2-bit is a table lookup per four weights (scales kept), MXFP4 -> FP4
is the source bytes, and FP8 -> 2-bit / FP4 compares e4m3 codes against per-block code thresholds
(fp8_quantize); each is tested bit-identical to dequantize-then-quantize.
"""
from __future__ import annotations

import math

import numpy as np
import torch

from moetplan.contract.errors import ConfigError
from moetplan.contract.vocab import ZERO_MODES
from moetplan.runtime.format.format import (BLOCK, E2M1_GRID, E2M1_MIDPOINTS, ZeroMode, unpack_nibbles,
                                     e2m1_values)

FP8_BLOCK = 128
NVFP4_BLOCK = 16
_E4M3_NAN = (0x7F, 0xFF)


def _as_torch(x) -> torch.Tensor:
    return x if isinstance(x, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(x))


def _as_bytes(x) -> torch.Tensor:
    """A float8/uint8/int8 tensor or array -> its raw bytes as uint8 (same shape)."""
    t = _as_torch(x)
    return t if t.dtype == torch.uint8 else t.view(torch.uint8)


# --------------------------------------------------------------------------- plain floats


def dequantize_plain(w) -> torch.Tensor:
    """bf16/fp16/fp32 -> float32 (exact widening); float64 stays float64."""
    t = _as_torch(w)
    if t.dtype in (torch.bfloat16, torch.float16, torch.float32):
        return t.to(torch.float32)
    if t.dtype == torch.float64:
        return t
    raise ConfigError(f"Expected a bf16/fp16/fp32 weight, got {t.dtype}")


# --------------------------------------------------------------------------- FP8 e4m3 + f32 scales


def _expand_fp8_scale(scale: torch.Tensor, n: int, k: int, name: str) -> torch.Tensor:
    """Broadcast a per-tensor, per-channel ([N] / [N,1]) or 128x128 block ([ceil(N/128), ceil(K/128)]) scale."""
    s = scale.to(torch.float64)
    bn, bk = math.ceil(n / FP8_BLOCK), math.ceil(k / FP8_BLOCK)
    if s.numel() == 1:
        return s.reshape(1, 1)
    if tuple(s.shape) in ((n,), (n, 1)):
        return s.reshape(n, 1)
    if tuple(s.shape) == (bn, bk):
        return s.repeat_interleave(FP8_BLOCK, 0)[:n].repeat_interleave(FP8_BLOCK, 1)[:, :k]
    raise ConfigError(
        f"{name}: FP8 scale shape {tuple(s.shape)} fits neither per-tensor, per-channel [{n}] nor "
        f"block-128 [{bn}, {bk}] for a [{n}, {k}] weight; check the checkpoint's quantization_config"
    )


def dequantize_fp8(weight, scale, name: str = "weight", dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """e4m3 weight [N, K] x f32 scale (DeepSeek `weight_scale_inv` multiplies) -> float64 [N, K], exact.

    (dtype=float32 rounds the product: good for error statistics, not for quantizing.)"""
    b = _as_bytes(weight)
    if bool(((b == _E4M3_NAN[0]) | (b == _E4M3_NAN[1])).any()):
        raise ConfigError(f"{name}: FP8 weight holds NaN codes; the checkpoint is corrupt")
    n, k = b.shape
    if b.device.type == "cpu":  # a 256-entry table beats torch's float8 conversion by ~20x on CPU
        w = torch.from_numpy(_E4M3_TABLE[dtype][b.contiguous().numpy()])
    else:
        w = b.view(torch.float8_e4m3fn).to(dtype)
    sc = _as_torch(scale).to(device=b.device, dtype=dtype)
    if tuple(sc.shape) == (n // FP8_BLOCK, k // FP8_BLOCK) and n % FP8_BLOCK == 0 == k % FP8_BLOCK:
        # whole 128x128 blocks: broadcast instead of materialising the expanded scale
        return (w.view(n // FP8_BLOCK, FP8_BLOCK, k // FP8_BLOCK, FP8_BLOCK)
                * sc.view(n // FP8_BLOCK, 1, k // FP8_BLOCK, 1)).view(n, k)
    return w * _expand_fp8_scale(sc, n, k, name).to(dtype)


_E4M3_TABLE = {dt: torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).to(dt).numpy()
               for dt in (torch.float32, torch.float64)}


# --------------------------------------------------------------------------- FP8 straight to 2-bit / FP4

# Finite e4m3 magnitudes by 7-bit code (0x00..0x7E): increasing in the code, so code order is value order.
_E4M3_MAGS = torch.arange(127, dtype=torch.uint8).view(torch.float8_e4m3fn).to(torch.float64)


def fp8_scale_per_block32(scale, n: int, k: int, name: str = "weight") -> torch.Tensor:
    """Any FP8 scale layout (tensor / channel / 128x128 block) -> one float64 scale per block of 32: [N, K/32]."""
    s = _as_torch(scale).to(torch.float64)
    kb = k // BLOCK
    bn, bk = math.ceil(n / FP8_BLOCK), math.ceil(k / FP8_BLOCK)
    if s.numel() == 1:
        return s.reshape(1, 1).expand(n, kb).contiguous()
    if tuple(s.shape) in ((n,), (n, 1)):
        return s.reshape(n, 1).expand(n, kb).contiguous()
    if tuple(s.shape) == (bn, bk):  # a block of 32 along K never straddles two 128-blocks
        return s.repeat_interleave(FP8_BLOCK, 0)[:n].repeat_interleave(FP8_BLOCK // BLOCK, 1)[:, :kb].contiguous()
    raise ConfigError(
        f"{name}: FP8 scale shape {tuple(s.shape)} fits neither per-tensor, per-channel [{n}] nor "
        f"block-128 [{bn}, {bk}] for a [{n}, {k}] weight; check the checkpoint's quantization_config"
    )


def dequantize_fp8_per_block32(weight, scale32: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """e4m3 [N, K] x per-block-32 scales [N, K/32] (fp8_scale_per_block32) -> floats; float64 is exact."""
    b = _as_bytes(weight)
    n, k = b.shape
    w = (torch.from_numpy(_E4M3_TABLE[dtype][b.contiguous().numpy()]) if b.device.type == "cpu"
         else b.view(torch.float8_e4m3fn).to(dtype))
    return (w.view(n, k // BLOCK, BLOCK) * scale32.to(dtype).unsqueeze(-1)).view(n, k)


def _code_threshold(t: torch.Tensor, s: torch.Tensor, mags: torch.Tensor) -> torch.Tensor:
    """Largest e4m3 magnitude code c with mags[c] * s <= t (-1 if none), exactly: the products are exact in
    float64, so the searchsorted guess on the rounded ratio t / s is corrected by one exact comparison each way."""
    c = torch.searchsorted(mags, t / s, right=True)  # count of magnitudes <= t/s (may be off by one)
    last = len(mags)
    c = c - ((c > 0) & (mags[(c - 1).clamp(min=0)] * s > t)).long()
    c = c + ((c < last) & (mags[c.clamp(max=last - 1)] * s <= t)).long()
    return (c - 1).to(torch.int8)


def fp8_quantize(weight, scale32: torch.Tensor, fmt: str = "2bit", zero_mode: ZeroMode = "auto",
                 name: str = "weight"):
    """e4m3 weight [N, K] with positive per-block-32 scales [N, K/32] -> (codes, scale bytes, zero mode), bit-identical
    to dequantize_fp8 + quantize_2bit / quantize_fp4 but without materialising float64 weights: a block of 32 shares
    one scale S, so |q * S| > T is decided on the e4m3 code against a per-block code threshold."""
    from moetplan.runtime.format.format import (DOMAINS, pow2_table, block_exponents, quantize_core, check_shape)

    b = _as_bytes(weight)
    n, k = check_shape(b)
    s32 = scale32.to(device=b.device, dtype=torch.float64)
    if tuple(s32.shape) != (n, k // BLOCK):
        raise ConfigError(f"{name}: per-block scale shape {tuple(s32.shape)}, expected [{n}, {k // BLOCK}]")
    if not (float(s32.min()) > 0 and float(s32.max()) < math.inf):
        raise ConfigError(f"{name}: FP8 scales must be positive and finite for the direct path; "
                          "use dequantize_fp8 + quantize_2bit")
    mags = _E4M3_MAGS.to(b.device)
    dom = DOMAINS[torch.float64]
    pw = pow2_table(torch.float64, b.device)
    mids = torch.tensor(E2M1_MIDPOINTS, dtype=torch.float64, device=b.device)

    def rule(r0: int, amax_code: torch.Tensor):
        if int(amax_code.max()) >= 0x7F:
            r, blk = (amax_code >= 0x7F).nonzero()[0].tolist()
            raise ConfigError(f"{name}: FP8 weight holds NaN codes (row {r0 + r}, block {blk}); "
                              "the checkpoint is corrupt")
        sc = s32[r0:r0 + amax_code.shape[0]]
        amax = mags[amax_code.long()] * sc  # exact
        e = block_exponents(amax.view(torch.int64), dom)
        p2 = pw[(e + 127).long()]
        four = _code_threshold(2.5 * p2, sc, mags)
        mid = _code_threshold(mids * p2.unsqueeze(-1), sc.unsqueeze(-1), mags) if fmt == "fp4" else four
        return e, four, mid

    per = 4 if fmt == "2bit" else 2
    q = torch.empty(n, k // per, dtype=torch.uint8, device=b.device)
    sb = torch.empty(n, k // BLOCK, dtype=torch.uint8, device=b.device)
    mode = quantize_core(b.contiguous().view(torch.int8), 7, rule, fmt, zero_mode if fmt == "2bit" else "signed",
                          q, sb)
    return q, sb, mode


def e4m3_value_reference(byte: int) -> float:
    """OCP e4m3fn: 1 sign, 4 exponent (bias 7), 3 mantissa bits; no inf; S.1111.111 is NaN."""
    sign = -1.0 if byte & 0x80 else 1.0
    exp, man = (byte >> 3) & 0xF, byte & 0x7
    if exp == 0xF and man == 0x7:
        return math.nan
    if exp == 0:
        return sign * math.ldexp(man, -9)  # subnormal: man/8 * 2^-6
    return sign * math.ldexp(8 + man, exp - 10)  # (1 + man/8) * 2^(exp-7)


def dequantize_fp8_reference(weight: np.ndarray, scale: np.ndarray) -> np.ndarray:
    b = np.asarray(weight).view(np.uint8)
    s = np.asarray(scale, dtype=np.float64)
    n, k = b.shape
    out = np.empty((n, k), dtype=np.float64)
    for r in range(n):
        for c in range(k):
            if s.size == 1:
                sc = float(s.reshape(-1)[0])
            elif s.shape in ((n,), (n, 1)):
                sc = float(s.reshape(-1)[r])
            else:
                sc = float(s[r // FP8_BLOCK, c // FP8_BLOCK])
            out[r, c] = e4m3_value_reference(int(b[r, c])) * sc
    return out


# --------------------------------------------------------------------------- NVFP4 (modelopt)


def dequantize_nvfp4(packed, block_scale, scale_2, name: str = "weight") -> torch.Tensor:
    """e2m1 packed [N, K/2] (low nibble = even k) x e4m3 [N, K/16] x f32 scale_2 -> float64 [N, K], exact."""
    p = _as_bytes(packed)
    bs = _as_bytes(block_scale)
    n, k = p.shape[0], p.shape[1] * 2
    if tuple(bs.shape) != (n, k // NVFP4_BLOCK):
        raise ConfigError(f"{name}: NVFP4 weight_scale shape {tuple(bs.shape)}, expected [{n}, {k // NVFP4_BLOCK}]")
    if bool(((bs == _E4M3_NAN[0]) | (bs == _E4M3_NAN[1])).any()):
        raise ConfigError(f"{name}: NVFP4 block scale holds NaN codes; the checkpoint is corrupt")
    vals = e2m1_values(torch.float64, p.device)[unpack_nibbles(p).long()]
    s = bs.view(torch.float8_e4m3fn).to(torch.float64).repeat_interleave(NVFP4_BLOCK, 1)
    s2 = _as_torch(scale_2).to(device=p.device, dtype=torch.float64).reshape(-1)
    if s2.numel() != 1:
        raise ConfigError(f"{name}: NVFP4 weight_scale_2 must be one value, got shape {tuple(s2.shape)}")
    return vals * s * s2[0]


def nvfp4_scale_per_block16(block_scale, scale_2, name: str = "weight") -> torch.Tensor:
    """e4m3 block-16 scales [N, K/16] x f32 scale_2 -> float64 [N, K/16] (exact: 4 x 24 significant bits)."""
    bs = _as_bytes(block_scale)
    if bool(((bs == _E4M3_NAN[0]) | (bs == _E4M3_NAN[1])).any()):
        raise ConfigError(f"{name}: NVFP4 block scale holds NaN codes; the checkpoint is corrupt")
    s2 = _as_torch(scale_2).to(device=bs.device, dtype=torch.float64).reshape(-1)
    if s2.numel() != 1:
        raise ConfigError(f"{name}: NVFP4 weight_scale_2 must be one value, got shape {tuple(s2.shape)}")
    return bs.view(torch.float8_e4m3fn).to(torch.float64) * s2[0]


# Packed byte -> its two nibbles as sign-extended int8 (sign at bit 3 becomes the int8 sign), read as one int16.
_NIB_PAIRS = np.array([[(n ^ 8) - 8 for n in (b & 15, b >> 4)] for b in range(256)], dtype=np.int8).view(np.int16)[:, 0]


def _nibbles_signed(p: torch.Tensor) -> torch.Tensor:
    """Packed e2m1 [N, K/2] -> int8 [N, K]: -8..7, magnitude index in bits 0-2, sign as the int8 sign."""
    n, kh = p.shape
    if p.device.type == "cpu":
        return torch.from_numpy(_NIB_PAIRS[p.contiguous().numpy()]).view(torch.int8).view(n, kh * 2)
    x = torch.stack([p & 15, p >> 4], dim=-1).reshape(n, kh * 2).to(torch.int16)
    return ((x ^ 8) - 8).to(torch.int8)


def nvfp4_quantize(packed, scale16: torch.Tensor, fmt: str = "2bit", zero_mode: ZeroMode = "auto",
                   name: str = "weight"):
    """NVFP4 [N, K/2] with positive float64 scales per block of 16 [N, K/16] (nvfp4_scale_per_block16) ->
    (codes, scale bytes, zero mode), bit-identical to dequantize_nvfp4 + quantize_2bit / quantize_fp4: each block
    of 16 shares one scale, so the decisions are made on the e2m1 index against per-16 code thresholds."""
    from moetplan.runtime.format.format import DOMAINS, check_shape, block_exponents, pow2_table, quantize_core

    p = _as_bytes(packed)
    n, k = p.shape[0], p.shape[1] * 2
    check_shape(torch.empty(0, k))
    sc = scale16.to(device=p.device, dtype=torch.float64)
    if tuple(sc.shape) != (n, k // NVFP4_BLOCK):
        raise ConfigError(f"{name}: per-block-16 scale shape {tuple(sc.shape)}, expected [{n}, {k // NVFP4_BLOCK}]")
    if not (float(sc.min()) > 0 and float(sc.max()) < math.inf):
        raise ConfigError(f"{name}: NVFP4 scales must be positive and finite for the direct path; "
                          "use dequantize_nvfp4 + quantize_2bit")
    grid = torch.tensor(E2M1_GRID, dtype=torch.float64, device=p.device)
    dom = DOMAINS[torch.float64]
    pw = pow2_table(torch.float64, p.device)
    mids = torch.tensor(E2M1_MIDPOINTS, dtype=torch.float64, device=p.device)

    def rule(r0: int, amax_idx: torch.Tensor):
        m = amax_idx.shape[0]
        s = sc[r0:r0 + m]
        amax = (grid[amax_idx.long()] * s).view(m, -1, 2).amax(dim=-1)  # exact products; max over the two halves
        e = block_exponents(amax.view(torch.int64), dom)
        p2 = pw[(e + 127).long()].repeat_interleave(2, dim=1)
        four = _code_threshold(2.5 * p2, s, grid)
        mid = _code_threshold(mids * p2.unsqueeze(-1), s.unsqueeze(-1), grid) if fmt == "fp4" else four
        return e, four, mid

    per = 4 if fmt == "2bit" else 2
    q = torch.empty(n, k // per, dtype=torch.uint8, device=p.device)
    sb = torch.empty(n, k // BLOCK, dtype=torch.uint8, device=p.device)
    mode = quantize_core(_nibbles_signed(p), 3, rule, fmt, zero_mode if fmt == "2bit" else "signed", q, sb,
                          sub=BLOCK // NVFP4_BLOCK)
    return q, sb, mode


def dequantize_nvfp4_per_block16(packed, scale16: torch.Tensor, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """e2m1 [N, K/2] x per-block-16 scales [N, K/16] -> floats (float64 is exact)."""
    p = _as_bytes(packed)
    n, k = p.shape[0], p.shape[1] * 2
    vals = e2m1_values(dtype, p.device)[unpack_nibbles(p).long()]
    return (vals.view(n, k // NVFP4_BLOCK, NVFP4_BLOCK) * scale16.to(dtype).unsqueeze(-1)).view(n, k)


def e2m1_value_reference(nibble: int) -> float:
    mag = E2M1_GRID[nibble & 7]
    return -mag if nibble & 8 else mag


def dequantize_nvfp4_reference(packed: np.ndarray, block_scale: np.ndarray, scale_2) -> np.ndarray:
    p = np.asarray(packed, dtype=np.uint8)
    bs = np.asarray(block_scale).view(np.uint8)
    s2 = float(np.asarray(scale_2, dtype=np.float64).reshape(-1)[0])
    n, k = p.shape[0], p.shape[1] * 2
    out = np.empty((n, k), dtype=np.float64)
    for r in range(n):
        for c in range(k):
            nib = (int(p[r, c // 2]) >> (4 * (c % 2))) & 0xF
            out[r, c] = e2m1_value_reference(nib) * e4m3_value_reference(int(bs[r, c // NVFP4_BLOCK])) * s2
    return out


# --------------------------------------------------------------------------- MXFP4 (OCP)


def _check_mx(packed: torch.Tensor, scales: torch.Tensor, name: str) -> tuple[int, int]:
    if packed.ndim == 3:  # gpt-oss style [N, K/32, 16]
        packed = packed.reshape(packed.shape[0], -1)
    n, k = packed.shape[0], packed.shape[1] * 2
    if tuple(scales.shape) != (n, k // BLOCK):
        raise ConfigError(f"{name}: MXFP4 scales shape {tuple(scales.shape)}, expected [{n}, {k // BLOCK}]")
    if bool((scales == 255).any()):
        raise ConfigError(f"{name}: MXFP4 scale byte 255 (NaN); the checkpoint is corrupt")
    return n, k


def dequantize_mxfp4(packed, scales, name: str = "weight") -> torch.Tensor:
    """e2m1 packed [N, K/2] x UE8M0 [N, K/32] -> float64 [N, K] (float64: 6 * 2^127 overflows float32)."""
    p, s = _as_bytes(packed), _as_bytes(scales)
    n, k = _check_mx(p, s, name)
    vals = e2m1_values(torch.float64, p.device)[unpack_nibbles(p.reshape(n, k // 2)).long()]
    pw = torch.tensor([math.ldexp(1.0, b - 127) for b in range(255)], dtype=torch.float64, device=p.device)
    return vals * pw[s.long()].repeat_interleave(BLOCK, 1)


def dequantize_mxfp4_reference(packed: np.ndarray, scales: np.ndarray) -> np.ndarray:
    p = np.asarray(packed, dtype=np.uint8).reshape(np.shape(packed)[0], -1)
    s = np.asarray(scales, dtype=np.uint8)
    n, k = p.shape[0], p.shape[1] * 2
    out = np.empty((n, k), dtype=np.float64)
    for r in range(n):
        for c in range(k):
            nib = (int(p[r, c // 2]) >> (4 * (c % 2))) & 0xF
            out[r, c] = e2m1_value_reference(nib) * math.ldexp(1.0, int(s[r, c // BLOCK]) - 127)
    return out


def _mx_tables() -> dict[str, np.ndarray]:
    """Lookup tables over 16-bit words (two packed e2m1 bytes = four weights) -> one byte of four 2-bit codes:
    magnitude index {0..4} -> 1, {5,6,7} -> 4, sign kept; 'balanced' gives zeros the sign of their position's parity
    (a word starts at a multiple of 4, so position parity is flat-index parity). Plus zero / -0 counts per word."""
    v = np.arange(1 << 16, dtype=np.uint32)
    nib = [(v >> (4 * j)) & 15 for j in range(4)]  # little-endian: low nibble of the first byte is weight 0
    signed = np.zeros(1 << 16, np.uint32)
    balanced = np.zeros(1 << 16, np.uint32)
    zeros = np.zeros(1 << 16, np.uint8)
    neg_zeros = np.zeros(1 << 16, np.uint8)
    for j, n in enumerate(nib):
        mag = n & 7
        four = (mag >= 5).astype(np.uint32)
        sign = n >> 3
        signed |= ((sign << 1) | four) << (2 * j)
        balanced |= ((np.where(mag == 0, j & 1, sign) << 1) | four) << (2 * j)
        zeros += (mag == 0).astype(np.uint8)
        neg_zeros += (n == 8).astype(np.uint8)
    # error tables in scale units per word: sum of (code value - e2m1 value) and of its square, and of value^2
    grid = np.array(E2M1_GRID + tuple(-g for g in E2M1_GRID))
    codes = np.array([1.0, 4.0, -1.0, -4.0])
    out = {"signed": signed.astype(np.uint8), "balanced": balanced.astype(np.uint8), "zeros": zeros,
           "neg_zeros": neg_zeros, "ref_sq": sum(grid[n] ** 2 for n in nib)}
    for mode, table in (("signed", signed), ("balanced", balanced)):
        diffs = [codes[(table >> (2 * j)) & 3] - grid[n] for j, n in enumerate(nib)]
        out[f"bias_{mode}"] = sum(diffs)
        out[f"sq_{mode}"] = sum(d * d for d in diffs)
    return out


_MX = _mx_tables()


def mxfp4_to_2bit(packed, scales, zero_mode: ZeroMode = "auto", return_zero_mode: bool = False,
                  name: str = "weight"):
    """MXFP4 -> 2-bit by remapping codes and keeping the scale bytes (not re-derived: docs/FORMAT.md rule 6).

    Zero-sign balancing (rule 5) applies to the e2m1 zeros (nibbles 0x0 / 0x8) like to any exact zero.
    One table lookup per four weights.
    """
    p, s = _as_bytes(packed), _as_bytes(scales)
    n, k = _check_mx(p, s, name)
    if zero_mode not in ZERO_MODES:
        raise ConfigError(f"Unknown zero mode '{zero_mode}'; use {', '.join(ZERO_MODES)}")
    p = p.reshape(n, k // 2).contiguous()
    if p.device.type == "cpu":
        words = p.numpy().view(np.uint16)
        mode = zero_mode
        if zero_mode == "auto":
            hist = np.bincount(words.reshape(-1), minlength=1 << 16)
            z, nz = int(hist @ _MX["zeros"]), int(hist @ _MX["neg_zeros"])
            mode = "balanced" if z and max(nz, z - nz) > 0.95 * z else "signed"
        codes = torch.from_numpy(_MX[mode][words])
    else:
        idx = p.view(torch.int16).long() & 0xFFFF
        mode = zero_mode
        if zero_mode == "auto":
            z = int(torch.from_numpy(_MX["zeros"]).to(p.device)[idx].sum())
            nz = int(torch.from_numpy(_MX["neg_zeros"]).to(p.device)[idx].sum())
            mode = "balanced" if z and max(nz, z - nz) > 0.95 * z else "signed"
        codes = torch.from_numpy(_MX[mode]).to(p.device)[idx]
    out = (codes, s.clone())
    return (*out, mode) if return_zero_mode else out


def mxfp4_error_report(packed, scales, fmt: str = "2bit", zero_mode: str = "signed") -> dict[str, float]:
    """error_report() of an MXFP4 -> 2-bit remap without dequantizing: source and codes share the block scale, so
    per-word tables give the error in scale units; squares scale by 4^e per block. FP4 reserve rows are exact."""
    p, s = _as_bytes(packed), _as_bytes(scales)
    n, k = _check_mx(p, s, "weight")
    if fmt != "2bit":
        return {"rel_rms": 0.0, "bias_scale_units": 0.0, "numel": n * k}
    words = p.reshape(n, k // 2).contiguous().cpu().numpy().view(np.uint16)
    four_e = np.ldexp(1.0, 2 * (s.cpu().numpy().astype(np.int64) - 127))  # [N, K/32]
    err2 = (_MX[f"sq_{zero_mode}"][words].reshape(n, k // BLOCK, BLOCK // 4).sum(-1) * four_e).sum()
    ref2 = (_MX["ref_sq"][words].reshape(n, k // BLOCK, BLOCK // 4).sum(-1) * four_e).sum()
    return {"rel_rms": math.sqrt(err2 / ref2) if ref2 > 0 else 0.0,
            "bias_scale_units": float(_MX[f"bias_{zero_mode}"][words].sum()) / (n * k), "numel": n * k}


def mxfp4_to_2bit_reference(values: np.ndarray, scales: np.ndarray, zero_mode: ZeroMode = "auto"):
    """From exact float64 values and the source scale bytes: |w| / scale is an e2m1 grid value; map its index."""
    from moetplan.runtime.format.format import ref_sign, ref_zero_mode

    w = np.asarray(values, dtype=np.float64)
    s = np.asarray(scales, dtype=np.uint8)
    n, k = w.shape
    mode = ref_zero_mode(w, zero_mode)
    codes = np.zeros((n, k // 4), dtype=np.uint8)
    for r in range(n):
        for c in range(k):
            mag = abs(w[r, c]) / math.ldexp(1.0, int(s[r, c // BLOCK]) - 127)
            idx = E2M1_GRID.index(mag)  # exact: ValueError if the value is not on the grid
            code = (ref_sign(w, r, c, mode) << 1) | (1 if idx >= 5 else 0)
            codes[r, c // 4] |= code << (2 * (c % 4))
    return codes, s.copy()


def mxfp4_to_fp4(packed, scales, name: str = "weight") -> tuple[torch.Tensor, torch.Tensor]:
    """An FP4 reserve row from MXFP4 is the source bytes themselves."""
    p, s = _as_bytes(packed), _as_bytes(scales)
    n, k = _check_mx(p, s, name)
    return p.reshape(n, k // 2).clone(), s.clone()

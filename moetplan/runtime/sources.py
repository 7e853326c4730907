"""Checkpoint weight formats -> exact float values (or, for MXFP4, straight to the 2-bit / FP4 bytes).

Every dequantizer has a vectorised torch version (used by `moetplan quantize`) and a float64 reference written
from the format definitions with scalar decoding (tests compare them). All products are exact in the dtype
returned: FP8 (4 significant bits) x f32 scale (24) fits float64's 53; NVFP4 e2m1 (2) x e4m3 (4) x f32 (24) too.
"""
from __future__ import annotations

import math

import numpy as np
import torch

from moetplan.errors import ConfigError
from moetplan.runtime.format import BLOCK, E2M1_GRID, ZeroMode, _pack_crumbs, _unpack_nibbles, e2m1_values

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


def dequantize_fp8(weight, scale, name: str = "weight") -> torch.Tensor:
    """e4m3 weight [N, K] x f32 scale (DeepSeek `weight_scale_inv` multiplies) -> float64 [N, K], exact."""
    b = _as_bytes(weight)
    if bool(((b == _E4M3_NAN[0]) | (b == _E4M3_NAN[1])).any()):
        raise ConfigError(f"{name}: FP8 weight holds NaN codes; the checkpoint is corrupt")
    n, k = b.shape
    w = b.view(torch.float8_e4m3fn).to(torch.float64)
    return w * _expand_fp8_scale(_as_torch(scale).to(b.device), n, k, name)


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
    vals = e2m1_values(torch.float64, p.device)[_unpack_nibbles(p).long()]
    s = bs.view(torch.float8_e4m3fn).to(torch.float64).repeat_interleave(NVFP4_BLOCK, 1)
    s2 = _as_torch(scale_2).to(device=p.device, dtype=torch.float64).reshape(-1)
    if s2.numel() != 1:
        raise ConfigError(f"{name}: NVFP4 weight_scale_2 must be one value, got shape {tuple(s2.shape)}")
    return vals * s * s2[0]


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
    vals = e2m1_values(torch.float64, p.device)[_unpack_nibbles(p.reshape(n, k // 2)).long()]
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


# Nibble -> 2-bit code: magnitude index {0..4} -> 1, {5,6,7} -> 4; sign kept.
_NIB_TO_CODE = torch.tensor([((n >> 3) << 1) | (1 if (n & 7) >= 5 else 0) for n in range(16)], dtype=torch.uint8)


def mxfp4_to_2bit(packed, scales, zero_mode: ZeroMode = "auto", return_zero_mode: bool = False,
                  name: str = "weight"):
    """MXFP4 -> 2-bit by remapping codes and keeping the scale bytes (not re-derived: docs/FORMAT.md rule 6).

    Zero-sign balancing (rule 5) applies to the e2m1 zeros (nibbles 0x0 / 0x8) like to any exact zero.
    """
    p, s = _as_bytes(packed), _as_bytes(scales)
    n, k = _check_mx(p, s, name)
    nib = _unpack_nibbles(p.reshape(n, k // 2))
    codes = _NIB_TO_CODE.to(nib.device)[nib.long()]
    zero = (nib & 7) == 0
    nz = int(zero.sum())
    if zero_mode not in ("auto", "signed", "balanced"):
        raise ConfigError(f"Unknown zero mode '{zero_mode}'; use auto, signed or balanced")
    mode = zero_mode
    if zero_mode == "auto":
        neg = int((zero & (nib >= 8)).sum())
        mode = "balanced" if nz and max(neg, nz - neg) > 0.95 * nz else "signed"
    if mode == "balanced":
        odd = (torch.arange(n * k, dtype=torch.int64, device=nib.device) & 1).to(torch.uint8).reshape(n, k)
        codes = torch.where(zero, odd << 1, codes)
    out = (_pack_crumbs(codes), s.clone())
    return (*out, mode) if return_zero_mode else out


def mxfp4_to_2bit_reference(values: np.ndarray, scales: np.ndarray, zero_mode: ZeroMode = "auto"):
    """From exact float64 values and the source scale bytes: |w| / scale is an e2m1 grid value; map its index."""
    from moetplan.runtime.format import _ref_sign, _ref_zero_mode

    w = np.asarray(values, dtype=np.float64)
    s = np.asarray(scales, dtype=np.uint8)
    n, k = w.shape
    mode = _ref_zero_mode(w, zero_mode)
    codes = np.zeros((n, k // 4), dtype=np.uint8)
    for r in range(n):
        for c in range(k):
            mag = abs(w[r, c]) / math.ldexp(1.0, int(s[r, c // BLOCK]) - 127)
            idx = E2M1_GRID.index(mag)  # exact: ValueError if the value is not on the grid
            code = (_ref_sign(w, r, c, mode) << 1) | (1 if idx >= 5 else 0)
            codes[r, c // 4] |= code << (2 * (c % 4))
    return codes, s.copy()


def mxfp4_to_fp4(packed, scales, name: str = "weight") -> tuple[torch.Tensor, torch.Tensor]:
    """An FP4 reserve row from MXFP4 is the source bytes themselves."""
    p, s = _as_bytes(packed), _as_bytes(scales)
    n, k = _check_mx(p, s, name)
    return p.reshape(n, k // 2).clone(), s.clone()

"""Safetensors shard headers: parameter counts and checkpoint precisions without loading a tensor.

A shard starts with an 8-byte little-endian header length and a JSON header naming every tensor's dtype, shape and
byte range; this module reads only that.
"""
from __future__ import annotations

import json
import re
import struct
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from moetplan.contract.errors import ConfigError

_MAX_HEADER_BYTES = 256 * 2**20


_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_EXPERT_ID = re.compile(r"\.experts\.(\d+)\.")
_FUSED_EXPERTS = re.compile(r"\.experts\.(gate_up_proj|down_proj|gate_proj|up_proj|w13_weight|w2_weight)(_blocks)?$")
# Scales and shape records: bytes of a quantized weight, not weights of their own.
_AUX_SUFFIXES = ("_scale", "_scale_inv", "_scale_2", "_scales", ".scale", "weight_shape", "weight_zero_point",
                 "_global_scale")


@dataclass
class _Tensor:
    name: str
    dtype: str
    shape: list[int]
    nbytes: int


def read_safetensors_header(path: Path) -> dict[str, _Tensor]:
    """Tensor names, dtypes, shapes and byte sizes from a .safetensors file's header (no tensor data read)."""
    try:
        with open(path, "rb") as f:
            raw_len = f.read(8)
            if len(raw_len) != 8:
                raise ConfigError(f"{path}: truncated safetensors file (no header); re-download this shard")
            (n,) = struct.unpack("<Q", raw_len)
            size = path.stat().st_size
            if n > _MAX_HEADER_BYTES or 8 + n > size:
                raise ConfigError(f"{path}: safetensors header length {n} does not fit the file ({size} B); "
                                  "the shard is corrupt or truncated, re-download it")
            header = json.loads(f.read(n))
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise ConfigError(f"{path}: safetensors header is not valid JSON; the shard is corrupt, re-download it") \
            from None
    out: dict[str, _Tensor] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            start, end = info["data_offsets"]
            out[name] = _Tensor(name, str(info["dtype"]), list(info["shape"]), int(end) - int(start))
        except (KeyError, TypeError, ValueError):
            raise ConfigError(f"{path}: header entry '{name}' lacks dtype/shape/data_offsets; the shard is corrupt") \
                from None
    return out


def shard_files(folder: Path) -> tuple[list[Path], list[str]]:
    """(present shards, missing shard names). An index file decides which shards belong to the checkpoint."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            wm = json.loads(index.read_text()).get("weight_map", {})
        except json.JSONDecodeError as e:
            raise ConfigError(f"{index}: not valid JSON ({e.msg}); re-download it") from None
        names = sorted(set(wm.values()))
        present = [folder / n for n in names if (folder / n).is_file()]
        missing = [n for n in names if not (folder / n).is_file()]
        return present, missing
    return sorted(folder.glob("*.safetensors")), []


def _numel(shape: list[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _is_aux(name: str) -> bool:
    return name.endswith(_AUX_SUFFIXES) or name.endswith(("k_scale", "v_scale"))


def _weight_params_and_precision(t: _Tensor, tensors: dict[str, _Tensor], int_bits: int) -> tuple[int, str]:
    """Logical weights a stored tensor holds and its checkpoint precision (packed 4-bit counts 2 per byte)."""
    base = t.name[: -len("weight")] if t.name.endswith("weight") else t.name
    if t.dtype in ("F8_E4M3", "F8_E5M2"):
        return _numel(t.shape), "fp8"
    if t.dtype in ("U8", "I8"):
        if t.name.endswith("_blocks"):
            return 2 * _numel(t.shape), "mxfp4"
        sib2 = tensors.get(base + "weight_scale_2")
        sib = tensors.get(base + "weight_scale") or tensors.get(base + "scale") or tensors.get(base + "weight_scales")
        if sib2 is not None or (sib is not None and sib.dtype == "F8_E4M3"):
            return 2 * _numel(t.shape), "nvfp4"
        if sib is not None:
            return 2 * _numel(t.shape), "mxfp4"
        return _numel(t.shape), "int8"
    if t.dtype == "I32" and t.name.endswith("weight_packed"):
        return _numel(t.shape) * (32 // int_bits), "int4"
    return _numel(t.shape), {"BF16": "bf16", "F16": "fp16", "F32": "fp32"}.get(t.dtype, t.dtype.lower())


@dataclass
class HeaderCounts:
    non_routed_params: int = 0
    non_routed_bytes: int = 0
    routed_params: int = 0
    mtp_params: int = 0
    experts_per_layer: dict[int, set[int] | int] = field(default_factory=dict)
    routed_precision: str | None = None
    dense_precision: str | None = None


def _majority(weights: dict[str, int]) -> str | None:
    return max(weights, key=weights.get) if weights else None  # type: ignore[arg-type]


def count_headers(shards: list[Path], num_layers: int, int_bits: int) -> HeaderCounts:
    tensors: dict[str, _Tensor] = {}
    for p in shards:
        tensors.update(read_safetensors_header(p))
    out = HeaderCounts()
    routed_prec: dict[str, int] = defaultdict(int)
    dense_prec: dict[str, int] = defaultdict(int)
    for t in tensors.values():
        m = _LAYER.search(t.name)
        layer = int(m.group(1)) if m else None
        aux = _is_aux(t.name)
        params, prec = (0, "") if aux else _weight_params_and_precision(t, tensors, int_bits)
        if layer is not None and layer >= num_layers:
            out.mtp_params += params
            continue
        # Routed experts and their scales; expert biases (gpt-oss) stay with the non-routed weights.
        if ".experts." in t.name and layer is not None and not t.name.endswith(("_bias", ".bias")):
            if aux:
                continue
            out.routed_params += params
            routed_prec[prec] += params
            em, fm = _EXPERT_ID.search(t.name), _FUSED_EXPERTS.search(t.name)
            if em:
                ids = out.experts_per_layer.setdefault(layer, set())
                if isinstance(ids, set):
                    ids.add(int(em.group(1)))
            elif fm and t.shape:
                out.experts_per_layer[layer] = t.shape[0]
            continue
        out.non_routed_params += params
        out.non_routed_bytes += t.nbytes
        if not aux and len(t.shape) == 2 and not re.search(r"embed|lm_head|norm", t.name):
            dense_prec[prec] += params
    out.routed_precision = _majority(routed_prec)
    out.dense_precision = _majority(dense_prec)
    return out

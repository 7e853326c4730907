"""Find the routed-expert tensors of a safetensors checkpoint and stream them one expert at a time.

Only headers are read up front (names, dtypes, shapes); tensors are loaded per expert, so memory stays bounded by
one layer whatever the checkpoint size. Supported names (the projection names map to gate / up / down):

    ...layers.{L}.mlp.experts.{E}.{gate,up,down}_proj.{weight,...}     Qwen / DeepSeek / GLM
    ...layers.{L}.block_sparse_moe.experts.{E}.{w1,w3,w2}.{weight,...} Mixtral
    ...layers.{L}.ffn.experts.{E}.{w1,w3,w2}.{weight,...}              DeepSeek reference naming
"""
from __future__ import annotations

import json
import re
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from moetplan.contract.errors import ConfigError, UsageError

_EXPERT_RE = re.compile(
    r"^(?P<prefix>.*?)\.?layers\.(?P<layer>\d+)\.(?:mlp|block_sparse_moe|ffn)\.experts\.(?P<expert>\d+)\."
    r"(?P<proj>gate_proj|up_proj|down_proj|w1|w3|w2)\.(?P<part>[A-Za-z0-9_]+)$"
)
_PROJ = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down", "w2": "down"}
_IGNORED_PARTS = {"input_scale", "bias"}
_FLOAT = {"BF16", "F16", "F32", "F64"}


@dataclass
class SourceTensor:
    """One expert projection in its checkpoint format, with the logical [N, K] shape of the float weight."""

    kind: str  # "plain" | "fp8" | "nvfp4" | "mxfp4"
    name: str
    shape: tuple[int, int]
    parts: dict[str, torch.Tensor]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.parts.values())

    def dequantize(self) -> torch.Tensor:
        """Exact float values: float sources as stored (the quantizer reads bf16/fp16/fp32 directly), float64 for
        FP8 / NVFP4 / MXFP4."""
        from moetplan.runtime.format import sources as S

        p = self.parts
        if self.kind == "plain":
            return p["weight"]
        if self.kind == "fp8":
            return S.dequantize_fp8(p["weight"], p["scale"], self.name)
        if self.kind == "nvfp4":
            return S.dequantize_nvfp4(p["weight"], p["scale"], p["scale_2"], self.name)
        return S.dequantize_mxfp4(p["weight"], p["scale"], self.name)

    def mx_rows(self, a: int, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        """MXFP4 only: packed bytes and scales of logical rows [a, b)."""
        w = self.parts["weight"].reshape(self.shape[0], -1)
        return w[a:b], self.parts["scale"][a:b]

    def mx_cols(self, a: int, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        """MXFP4 only: packed bytes and scales of logical columns [a, b) (multiples of 32)."""
        w = self.parts["weight"].reshape(self.shape[0], -1)
        return w[:, a // 2:b // 2].contiguous(), self.parts["scale"][:, a // 32:b // 32].contiguous()


@dataclass
class _ProjRef:
    parts: dict[str, str] = field(default_factory=dict)  # part -> tensor name


@dataclass
class CheckpointExperts:
    """The routed experts of one checkpoint: MoE layers in order, E experts each, one source format."""

    root: Path
    config: dict[str, Any]
    layers: list[int]  # checkpoint layer indices of the MoE layers; pack layer i = layers[i]
    num_experts: int
    hidden: int
    inter: int
    kind: str
    file_of: dict[str, str]
    refs: dict[tuple[int, int, str], _ProjRef]
    dtypes: dict[str, str]
    shapes: dict[str, list[int]]
    skipped_layers: list[int] = field(default_factory=list)
    _handles: dict[str, Any] = field(default_factory=dict, repr=False)

    @classmethod
    def discover(cls, root: str | Path, include_mtp: bool = False) -> "CheckpointExperts":
        from safetensors import safe_open

        root = Path(root)
        if not root.is_dir():
            raise UsageError(f"--model {root} is not a directory; pass a local safetensors checkpoint folder")
        cfg_path = root / "config.json"
        try:
            config = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            where = f" at line {e.lineno}, column {e.colno}" if isinstance(e, json.JSONDecodeError) else ""
            raise ConfigError(f"{cfg_path}: not valid JSON{where}; restore the checkpoint's config.json") from None
        if not isinstance(config, dict):
            raise ConfigError(f"{cfg_path}: holds a JSON {type(config).__name__}, not an object; restore the "
                              "checkpoint's config.json")
        config = config.get("text_config", config) if isinstance(config.get("text_config"), dict) else config
        files = sorted(p.name for p in root.glob("*.safetensors"))
        if not files:
            raise UsageError(f"{root} holds no *.safetensors files; point --model at a safetensors checkpoint folder")
        file_of, dtypes, shapes = {}, {}, {}
        for fn in files:
            with safe_open(str(root / fn), framework="pt") as f:
                for k in f.keys():
                    if _EXPERT_RE.match(k):
                        sl = f.get_slice(k)
                        file_of[k], dtypes[k], shapes[k] = fn, sl.get_dtype(), list(sl.get_shape())
        if not file_of:
            raise ConfigError(
                f"{root}: no routed-expert tensors found (looked for '...layers.N.mlp.experts.E.gate_proj.weight' and "
                "Mixtral 'block_sparse_moe.experts.E.w1.weight'); fused 3-D expert tensors are not supported yet"
            )
        refs: dict[tuple[int, int, str], _ProjRef] = defaultdict(_ProjRef)
        for k in file_of:
            m = _EXPERT_RE.match(k)
            assert m is not None
            part = m["part"]
            if part in _IGNORED_PARTS:
                continue
            refs[(int(m["layer"]), int(m["expert"]), _PROJ[m["proj"]])].parts[part] = k
        all_layers = sorted({k[0] for k in refs})
        n_hidden = config.get("num_hidden_layers")
        skipped = [li for li in all_layers if n_hidden is not None and li >= n_hidden and not include_mtp]
        layers = [li for li in all_layers if li not in skipped]
        by_layer: dict[int, set[int]] = defaultdict(set)
        for li, e, _ in refs:
            by_layer[li].add(e)
        experts_per_layer = {li: sorted(by_layer[li]) for li in layers}
        num_experts = max(len(v) for v in experts_per_layer.values())
        for li, ex in experts_per_layer.items():
            if ex != list(range(num_experts)):
                missing = sorted(set(range(num_experts)) - set(ex))
                raise ConfigError(f"{root}: layer {li} lacks expert(s) {missing[:8]}; the checkpoint is incomplete")
            for e in ex:
                for proj in ("gate", "up", "down"):
                    if "weight" not in refs[(li, e, proj)].parts and "blocks" not in refs[(li, e, proj)].parts:
                        raise ConfigError(f"{root}: layer {li} expert {e} has no {proj} projection weight")
        ck = cls(root, config, layers, num_experts, 0, 0, "", file_of, dict(refs), dtypes, shapes, skipped)
        first = {p: ck._describe(layers[0], 0, p) for p in ("gate", "up", "down")}
        kinds = {d[0] for d in first.values()}
        if len(kinds) != 1:
            raise ConfigError(f"{root}: expert projections mix source formats {sorted(kinds)}; not supported")
        ck.kind = kinds.pop()
        (i1, h1), (i2, h2), (h3, i3) = first["gate"][1], first["up"][1], first["down"][1]
        if not (i1 == i2 == i3 and h1 == h2 == h3):
            raise ConfigError(
                f"{root}: expert shapes disagree (gate [{i1},{h1}], up [{i2},{h2}], down [{h3},{i3}]); "
                "expected gate/up [I, H] and down [H, I]"
            )
        ck.hidden, ck.inter = h1, i1
        for key, val in (("hidden_size", ck.hidden), ("moe_intermediate_size", ck.inter)):
            if key in config and config[key] != val:
                raise ConfigError(f"{cfg_path}: {key}={config[key]} but the expert tensors say {val}")
        return ck

    def _describe(self, layer: int, expert: int, proj: str) -> tuple[str, tuple[int, int]]:
        """-> (source kind, logical [N, K]) from the headers alone."""
        parts = self.refs[(layer, expert, proj)].parts
        wname = parts.get("weight") or parts.get("blocks")
        dt, shp = self.dtypes[wname], self.shapes[wname]
        sname = _scale_name(parts)
        if dt in _FLOAT and sname is None:
            return "plain", (shp[0], shp[1])
        if dt == "F8_E4M3" and sname is not None:
            return "fp8", (shp[0], shp[1])
        if dt in ("U8", "I8", "F4") and sname is not None:
            sdt = self.dtypes[sname]
            # packed bytes hold 2 weights; an F4 header already counts 4-bit elements
            k = (shp[1] if len(shp) == 2 else shp[1] * shp[2]) * (1 if dt == "F4" else 2)
            if sdt == "F8_E4M3" and "weight_scale_2" in parts:
                return "nvfp4", (shp[0], k)
            if sdt in ("U8", "I8", "F8_E8M0"):
                return "mxfp4", (shp[0], k)
        raise ConfigError(
            f"{self.root}: cannot tell the format of {wname} (dtype {dt}, parts {sorted(parts)}); supported: "
            "bf16/fp16/fp32, FP8 e4m3 + weight_scale_inv, NVFP4 (U8 + F8 weight_scale + weight_scale_2), "
            "MXFP4 (U8 + U8 scales)"
        )

    def _tensor(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        fn = self.file_of[name]
        h = self._handles.get(fn)
        if h is None:
            h = self._handles[fn] = safe_open(str(self.root / fn), framework="pt")
        return h.get_tensor(name)

    def load(self, moe_layer: int, expert: int, proj: str) -> SourceTensor:
        li = self.layers[moe_layer]
        kind, shape = self._describe(li, expert, proj)
        if kind != self.kind:
            raise ConfigError(f"{self.root}: layer {li} expert {expert} {proj} is {kind}, others are {self.kind}")
        ref = self.refs[(li, expert, proj)].parts
        wname = ref.get("weight") or ref["blocks"]
        parts = {"weight": _raw(self._tensor(wname))}
        sname = _scale_name(ref)
        if sname:
            parts["scale"] = _raw(self._tensor(sname))
        if "weight_scale_2" in ref:
            parts["scale_2"] = self._tensor(ref["weight_scale_2"])
        return SourceTensor(kind, wname, shape, parts)

    def load_expert(self, moe_layer: int, expert: int) -> dict[str, SourceTensor]:
        return {p: self.load(moe_layer, expert, p) for p in ("gate", "up", "down")}

    def close(self) -> None:
        self._handles.clear()


def _scale_name(parts: dict[str, str]) -> str | None:
    for p in ("weight_scale_inv", "weight_scale", "scales", "scale"):
        if p in parts:
            return parts[p]
    return None


def _raw(t: torch.Tensor) -> torch.Tensor:
    """Packed e2m1 and UE8M0 tensors as their bytes; e4m3 / float tensors unchanged."""
    if t.dtype in (getattr(torch, "float4_e2m1fn_x2", None), getattr(torch, "float8_e8m0fnu", None), torch.int8):
        return t.view(torch.uint8)
    return t

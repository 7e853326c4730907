"""ModelSpec from a local config.json or checkpoint folder (DeepSeek-V3 style, GLM-MoE, Qwen-MoE, Mixtral, gpt-oss).

With safetensors shards present, parameter counts, checkpoint precisions and the dense stack's exact bytes come
from the shard headers (8-byte length + JSON; tensors are never loaded). Without shards they come from the
config formulas of hwdb/sources/hwdb_facts.md §7 and the config's quantization_config.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from moetplan.contract.errors import ConfigError, validation_summary
from moetplan.contract.model import GIB, Attention, ModelSpec
from moetplan.models.safetensors_headers import HeaderCounts, count_headers, shard_files

# model_type -> family handler name. kimi_k25 wraps a deepseek_v3 text model in `text_config`.
_DEEPSEEK = {"deepseek_v3", "deepseek_v2", "kimi_k2", "kimi_k25", "deepseek_v32", "glm_moe_dsa"}
_SUPPORTED = sorted(_DEEPSEEK | {"glm4_moe", "qwen2_moe", "qwen3_moe", "mixtral", "gpt_oss"})
_HWDB_ONLY = {"deepseek_v4": "deepseek-v4-flash"}

# An indexer K entry of DSA models: index_head_dim fp8 bytes + one fp32 scale.
_INDEXER_SCALE_BYTES = 4


class _Cfg:
    """config.json access whose errors name the file, the key and why it is needed."""

    def __init__(self, data: dict[str, Any], path: Path):
        self.d, self.path = data, path

    def has(self, key: str) -> bool:
        return self.d.get(key) is not None

    def get(self, key: str, default: Any = None) -> Any:
        v = self.d.get(key)
        return default if v is None else v

    def int(self, key: str, why: str, default: int | None = None, *, allow_zero: bool = False) -> int:
        v = self.d.get(key)
        if v is None:
            if default is not None:
                return default
            raise ConfigError(f"{self.path}: missing '{key}' (needed for {why})")
        if isinstance(v, bool) or not isinstance(v, int) or v < 0 or (v == 0 and not allow_zero):
            raise ConfigError(f"{self.path}: field '{key}' must be a positive integer (got {v!r}); needed for {why}")
        return v

    def first_int(self, keys: tuple[str, ...], why: str) -> int:
        for k in keys:
            if self.d.get(k) is not None:
                return self.int(k, why)
        raise ConfigError(f"{self.path}: missing '{keys[0]}' (needed for {why})")


@dataclass
class _Geometry:
    family: str
    arch: str | None
    num_layers: int
    moe_layer_ids: list[int]
    hidden: int
    moe_inter: int
    dense_inter: int | None
    experts: int
    top_k: int
    n_shared: int
    vocab: int
    max_pos: int
    attention: dict[str, Any]
    kv: dict[str, float]
    kv_fixed: dict[str, float] = field(default_factory=dict)
    kv_shards_with_tp: bool = False
    mtp_layers: int = 0
    non_routed_params: float = 0.0
    mtp_params: float = 0.0
    swiglu_limit: float | None = None


# --------------------------------------------------------------------------- config.json -> geometry


def _load_config(path: Path) -> tuple[dict[str, Any], Path, Path]:
    """(config dict, config.json path, checkpoint folder)."""
    if path.is_dir():
        cfg_path = path / "config.json"
        if not cfg_path.is_file():
            raise ConfigError(f"{path}: no config.json in this folder; point --model at a checkpoint folder "
                              "or at its config.json")
        folder = path
    elif path.is_file():
        cfg_path, folder = path, path.parent
    else:
        raise ConfigError(f"{path}: no such file or folder")
    try:
        data = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{cfg_path}: not valid JSON ({e.msg} at line {e.lineno}); fix or re-download it") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{cfg_path}: expected a JSON object of model settings")
    return data, cfg_path, folder


def _text_config(data: dict[str, Any]) -> dict[str, Any]:
    """Multimodal wrappers (Kimi-K2.5+) keep the language model in text_config; quantization stays on top."""
    tc = data.get("text_config")
    if isinstance(tc, dict) and "hidden_size" not in data:
        merged = dict(tc)
        for k in ("quantization_config", "architectures", "model_type", "torch_dtype", "_name_or_path"):
            if k in data and k not in merged:
                merged[k] = data[k]
        merged["_wrapper_model_type"] = data.get("model_type")
        merged["_wrapper_architectures"] = data.get("architectures")
        return merged
    return data


def _mla_attention_params(c: _Cfg, h: int) -> tuple[int, dict[str, Any]]:
    n_h = c.int("num_attention_heads", "attention heads")
    kv_lora = c.int("kv_lora_rank", "the MLA KV latent size")
    rope = c.int("qk_rope_head_dim", "the MLA rope part of the KV")
    nope = c.int("qk_nope_head_dim", "MLA attention weights")
    v = c.int("v_head_dim", "MLA attention weights")
    q_lora = c.get("q_lora_rank")
    if q_lora:
        q = h * q_lora + q_lora + q_lora * n_h * (nope + rope)  # q_a, q_a_layernorm, q_b
    else:
        q = h * n_h * (nope + rope)
    params = q + h * (kv_lora + rope) + kv_lora + kv_lora * n_h * (nope + v) + n_h * v * h
    geo = dict(num_heads=n_h, kv_lora_rank=kv_lora, qk_rope_head_dim=rope, q_lora_rank=q_lora,
               qk_nope_head_dim=nope, v_head_dim=v)
    return params, geo


def _indexer_layers(c: _Cfg, num_layers: int) -> list[int]:
    """DSA layers that own a lightning indexer (and its K cache).

    GLM-5.2's IndexShare: the first `index_skip_topk_offset` layers, then every `index_topk_freq`-th layer
    ({0,1,2} and {6,10,...,74} = 21 of 78); the others reuse the previous full layer's top-k. Without those keys
    (GLM-5/5.1, DeepSeek-V3.2) every layer has one.
    """
    freq = c.get("index_topk_freq")
    if not freq or freq <= 1:
        return list(range(num_layers))
    offset = int(c.get("index_skip_topk_offset", 0))
    return [i for i in range(num_layers) if i < offset or (i - offset + 1) % freq == 0]


def _deepseek_geometry(c: _Cfg) -> _Geometry:
    mt = c.get("model_type")
    h = c.int("hidden_size", "every weight size")
    L = c.int("num_hidden_layers", "the layer count")
    first_dense = c.int("first_k_dense_replace", "which layers are MoE", default=0, allow_zero=True)
    freq = c.int("moe_layer_freq", "which layers are MoE", default=1)
    moe_ids = [i for i in range(L) if i >= first_dense and i % freq == 0]
    E = c.int("n_routed_experts", "the routed expert count")
    k = c.int("num_experts_per_tok", "MoE top-k")
    I_moe = c.int("moe_intermediate_size", "the routed expert size")
    I_dense = c.int("intermediate_size", "the dense FFN layers") if len(moe_ids) < L else c.get("intermediate_size")
    n_shared = c.int("n_shared_experts", "shared experts", default=0, allow_zero=True)
    vocab = c.int("vocab_size", "embeddings")
    mtp = c.int("num_nextn_predict_layers", "MTP layers", default=0, allow_zero=True)
    attn, geo = _mla_attention_params(c, h)

    sparse = mt in ("glm_moe_dsa", "deepseek_v32") or c.has("index_topk")
    idx_layers: list[int] = []
    idx_params_per_layer = 0
    if sparse:
        n_idx = c.int("index_n_heads", "the sparse-attention indexer")
        d_idx = c.int("index_head_dim", "the sparse-attention indexer")
        q_lora = geo["q_lora_rank"] or h
        idx_params_per_layer = q_lora * n_idx * d_idx + h * d_idx + h * n_idx + 2 * d_idx
        idx_layers = _indexer_layers(c, L)
        geo.update(index_topk=c.get("index_topk"), index_n_heads=n_idx, index_head_dim=d_idx,
                   indexer_layers=len(idx_layers))

    expert = 3 * h * I_moe
    layer_norms = 2 * h
    router = E * h + E  # gate + e_score_correction_bias
    non_routed = vocab * h * (1 if c.get("tie_word_embeddings", False) else 2) + h
    for i in range(L):
        non_routed += attn + layer_norms + (idx_params_per_layer if i in idx_layers else 0)
        non_routed += (router + n_shared * expert) if i in moe_ids else 3 * h * I_dense
    # An MTP layer: one MoE decoder layer plus its input projection (eh_proj) and norms; it shares the embeddings.
    mtp_layer = attn + layer_norms + idx_params_per_layer * sparse + router + (E + n_shared) * expert
    mtp_params = mtp * (mtp_layer + 2 * h * h + 3 * h)

    # KV: MLA keeps one latent (kv_lora + rope) per token and layer, on every TP rank. MTP layers included:
    # vLLM allocates their KV when speculating (GLM-5.2's measured 54.7 KB/token counts it).
    kv_layers = L + mtp
    kv_lora, rope = geo["kv_lora_rank"], geo["qk_rope_head_dim"]
    kv: dict[str, float] = {"bf16": 2 * (kv_lora + rope) * kv_layers}
    if sparse:
        n_idx_kv = len(idx_layers) + mtp
        idx_entry = geo["index_head_dim"] + _INDEXER_SCALE_BYTES
        kv["bf16"] += idx_entry * n_idx_kv
        # vLLM fp8_ds_mla: fp8 latent + one fp32 scale per 128 + bf16 rope (656 B for 512/64).
        kv["fp8"] = (kv_lora + 4 * (kv_lora // 128) + 2 * rope) * kv_layers + idx_entry * n_idx_kv
        if (kv_lora, rope) == (512, 64):
            kv["nvfp4"] = 352 * kv_layers + idx_entry * n_idx_kv  # vLLM-Moet's SM120 nvfp4_ds_mla layout
        kind = "mla_sparse"
    else:
        kv["fp8"] = (kv_lora + rope) * kv_layers
        kind = "mla"
    return _Geometry(
        family=c.get("_wrapper_model_type") or mt, arch=None, num_layers=L, moe_layer_ids=moe_ids, hidden=h,
        moe_inter=I_moe, dense_inter=I_dense if len(moe_ids) < L else None, experts=E, top_k=k, n_shared=n_shared,
        vocab=vocab, max_pos=c.int("max_position_embeddings", "the context limit"),
        attention=dict(kind=kind, **geo), kv=kv, kv_shards_with_tp=False, mtp_layers=mtp,
        non_routed_params=non_routed, mtp_params=mtp_params, swiglu_limit=c.get("swiglu_limit"),
    )


def _gqa(c: _Cfg, h: int) -> tuple[int, int, int, int]:
    n_h = c.int("num_attention_heads", "attention heads")
    n_kv = c.int("num_key_value_heads", "the KV cache size", default=n_h)
    hd = c.int("head_dim", "the KV cache size", default=h // n_h)
    params = h * n_h * hd + 2 * h * n_kv * hd + n_h * hd * h
    if c.get("attention_bias", False) or c.get("model_type") == "qwen2_moe":
        params += (n_h + 2 * n_kv) * hd
    if c.get("model_type") == "qwen3_moe":
        params += 2 * hd  # q_norm, k_norm
    return params, n_h, n_kv, hd


def _gqa_kv(n_kv: int, hd: int, full_layers: int, sliding_layers: int, window: int | None) -> tuple[dict, dict]:
    per_layer = 2 * n_kv * hd  # K and V, elements
    kv = {"bf16": float(2 * per_layer * full_layers), "fp8": float(per_layer * full_layers)}
    fixed: dict[str, float] = {}
    if sliding_layers and window:
        fixed = {"bf16": float(2 * per_layer * sliding_layers * window),
                 "fp8": float(per_layer * sliding_layers * window)}
    return kv, fixed


def _layer_types(c: _Cfg, L: int) -> tuple[int, int, int | None]:
    """(full-attention layers, sliding layers, window). Without layer_types every layer counts as full."""
    types = c.get("layer_types")
    window = c.get("sliding_window")
    if isinstance(types, list) and len(types) == L and window:
        sliding = sum(1 for t in types if "sliding" in str(t))
        return L - sliding, sliding, int(window)
    return L, 0, None


def _glm4_geometry(c: _Cfg) -> _Geometry:
    h = c.int("hidden_size", "every weight size")
    L = c.int("num_hidden_layers", "the layer count")
    first_dense = c.int("first_k_dense_replace", "which layers are MoE", default=0, allow_zero=True)
    moe_ids = list(range(first_dense, L))
    E = c.int("n_routed_experts", "the routed expert count")
    I_moe = c.int("moe_intermediate_size", "the routed expert size")
    I_dense = c.int("intermediate_size", "the dense FFN layers")
    n_shared = c.int("n_shared_experts", "shared experts", default=0, allow_zero=True)
    vocab = c.int("vocab_size", "embeddings")
    mtp = c.int("num_nextn_predict_layers", "MTP layers", default=0, allow_zero=True)
    attn, n_h, n_kv, hd = _gqa(c, h)
    expert = 3 * h * I_moe
    router = E * h + E
    non_routed = vocab * h * (1 if c.get("tie_word_embeddings", False) else 2) + h
    for i in range(L):
        non_routed += attn + 2 * h + ((router + n_shared * expert) if i in moe_ids else 3 * h * I_dense)
    mtp_params = mtp * (attn + 2 * h + router + (E + n_shared) * expert + 2 * h * h + 3 * h)
    kv, _ = _gqa_kv(n_kv, hd, L + mtp, 0, None)
    return _Geometry(
        family="glm4_moe", arch=None, num_layers=L, moe_layer_ids=moe_ids, hidden=h, moe_inter=I_moe,
        dense_inter=I_dense if first_dense else None, experts=E,
        top_k=c.int("num_experts_per_tok", "MoE top-k"), n_shared=n_shared, vocab=vocab,
        max_pos=c.int("max_position_embeddings", "the context limit"),
        attention=dict(kind="gqa", num_heads=n_h, num_kv_heads=n_kv, head_dim=hd), kv=kv, kv_shards_with_tp=True,
        mtp_layers=mtp, non_routed_params=non_routed, mtp_params=mtp_params,
    )


def _qwen_geometry(c: _Cfg) -> _Geometry:
    mt = c.get("model_type")
    h = c.int("hidden_size", "every weight size")
    L = c.int("num_hidden_layers", "the layer count")
    step = c.int("decoder_sparse_step", "which layers are MoE", default=1)
    dense_only = set(c.get("mlp_only_layers", []) or [])
    moe_ids = [i for i in range(L) if i not in dense_only and (i + 1) % step == 0]
    E = c.first_int(("num_experts", "n_routed_experts", "num_local_experts"), "the routed expert count")
    I_moe = c.int("moe_intermediate_size", "the routed expert size")
    I_dense = c.get("intermediate_size")
    if len(moe_ids) < L and not I_dense:
        raise ConfigError(f"{c.path}: missing 'intermediate_size' (needed for the dense FFN layers)")
    vocab = c.int("vocab_size", "embeddings")
    attn, n_h, n_kv, hd = _gqa(c, h)
    shared_I = c.get("shared_expert_intermediate_size", 0) if mt == "qwen2_moe" else 0
    moe_extra = E * h + (3 * h * shared_I + h if shared_I else 0)  # router (+ shared expert and its gate)
    non_routed = vocab * h * (1 if c.get("tie_word_embeddings", False) else 2) + h
    for i in range(L):
        non_routed += attn + 2 * h + (moe_extra if i in moe_ids else 3 * h * I_dense)
    full, sliding, window = _layer_types(c, L)
    kv, fixed = _gqa_kv(n_kv, hd, full, sliding, window)
    attention = dict(kind="gqa" if n_kv < n_h else "mha", num_heads=n_h, num_kv_heads=n_kv, head_dim=hd)
    if sliding:
        attention.update(sliding_window=window, full_attention_layers=full)
    return _Geometry(
        family=mt, arch=None, num_layers=L, moe_layer_ids=moe_ids, hidden=h, moe_inter=I_moe,
        dense_inter=I_dense if len(moe_ids) < L else None, experts=E,
        top_k=c.int("num_experts_per_tok", "MoE top-k"), n_shared=1 if shared_I else 0, vocab=vocab,
        max_pos=c.int("max_position_embeddings", "the context limit"), attention=attention, kv=kv, kv_fixed=fixed,
        kv_shards_with_tp=True, non_routed_params=non_routed,
    )


def _mixtral_geometry(c: _Cfg) -> _Geometry:
    h = c.int("hidden_size", "every weight size")
    L = c.int("num_hidden_layers", "the layer count")
    E = c.int("num_local_experts", "the routed expert count")
    I_moe = c.int("intermediate_size", "the expert FFN size")
    vocab = c.int("vocab_size", "embeddings")
    attn, n_h, n_kv, hd = _gqa(c, h)
    non_routed = vocab * h * (1 if c.get("tie_word_embeddings", False) else 2) + h + L * (attn + 2 * h + E * h)
    kv, _ = _gqa_kv(n_kv, hd, L, 0, None)
    attention = dict(kind="gqa" if n_kv < n_h else "mha", num_heads=n_h, num_kv_heads=n_kv, head_dim=hd)
    return _Geometry(
        family="mixtral", arch=None, num_layers=L, moe_layer_ids=list(range(L)), hidden=h, moe_inter=I_moe,
        dense_inter=None, experts=E, top_k=c.int("num_experts_per_tok", "MoE top-k"), n_shared=0, vocab=vocab,
        max_pos=c.int("max_position_embeddings", "the context limit"), attention=attention, kv=kv,
        kv_shards_with_tp=True, non_routed_params=non_routed,
    )


def _gpt_oss_geometry(c: _Cfg) -> _Geometry:
    h = c.int("hidden_size", "every weight size")
    L = c.int("num_hidden_layers", "the layer count")
    E = c.first_int(("num_local_experts", "num_experts"), "the routed expert count")
    I_moe = c.int("intermediate_size", "the expert FFN size")
    vocab = c.int("vocab_size", "embeddings")
    attn, n_h, n_kv, hd = _gqa(c, h)
    attn += (n_h + 2 * n_kv) * hd + h + n_h  # qkv and o biases, attention sinks
    # Router with bias, and the experts' biases (gate_up 2I + down H each), which stay out of the 2-bit planes.
    moe_extra = E * h + E + E * (2 * I_moe + h)
    non_routed = vocab * h * (1 if c.get("tie_word_embeddings", False) else 2) + h + L * (attn + 2 * h + moe_extra)
    full, sliding, window = _layer_types(c, L)
    kv, fixed = _gqa_kv(n_kv, hd, full, sliding, window)
    attention = dict(kind="gqa", num_heads=n_h, num_kv_heads=n_kv, head_dim=hd)
    if sliding:
        attention.update(sliding_window=window, full_attention_layers=full)
    top_k = c.first_int(("num_experts_per_tok", "experts_per_token"), "MoE top-k")
    return _Geometry(
        family="gpt_oss", arch=None, num_layers=L, moe_layer_ids=list(range(L)), hidden=h, moe_inter=I_moe,
        dense_inter=None, experts=E, top_k=top_k, n_shared=0, vocab=vocab,
        max_pos=c.int("max_position_embeddings", "the context limit"), attention=attention, kv=kv, kv_fixed=fixed,
        kv_shards_with_tp=True, non_routed_params=non_routed, swiglu_limit=c.get("swiglu_limit"),
    )


def _geometry(c: _Cfg) -> _Geometry:
    mt = c.get("model_type")
    if mt in _HWDB_ONLY:
        raise ConfigError(f"{c.path}: model_type '{mt}' is not read from config.json yet; use the hwdb entry "
                          f"(--model {_HWDB_ONLY[mt]})")
    if mt in _DEEPSEEK:
        g = _deepseek_geometry(c)
    elif mt == "glm4_moe":
        g = _glm4_geometry(c)
    elif mt in ("qwen2_moe", "qwen3_moe"):
        g = _qwen_geometry(c)
    elif mt == "mixtral":
        g = _mixtral_geometry(c)
    elif mt == "gpt_oss":
        g = _gpt_oss_geometry(c)
    elif mt is None:
        raise ConfigError(f"{c.path}: missing 'model_type' (needed to know the architecture; supported: "
                          f"{', '.join(_SUPPORTED)})")
    else:
        raise ConfigError(f"{c.path}: model_type '{mt}' is not a supported Mixture-of-Experts family (supported: "
                          f"{', '.join(_SUPPORTED)}); add an hwdb/models entry for it instead")
    archs = c.get("_wrapper_architectures") or c.get("architectures") or []
    g.arch = archs[0] if isinstance(archs, list) and archs else None
    if g.top_k > g.experts:
        raise ConfigError(f"{c.path}: field 'num_experts_per_tok' ({g.top_k}) exceeds the expert count "
                          f"({g.experts})")
    if not g.moe_layer_ids:
        raise ConfigError(f"{c.path}: no MoE layers follow from the config (check first_k_dense_replace / "
                          "decoder_sparse_step / mlp_only_layers)")
    return g


# --------------------------------------------------------------------------- quantization_config


def _precisions_from_config(c: _Cfg) -> tuple[str, str]:
    """(expert precision, dense precision) the config declares."""
    q = c.get("quantization_config")
    base = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}.get(
        str(c.get("torch_dtype") or c.get("dtype") or "bfloat16"), "bf16")
    if not isinstance(q, dict):
        return base, base
    method = str(q.get("quant_method", "")).lower()
    if method == "fp8":
        return "fp8", "fp8"
    if method == "mxfp4":
        return "mxfp4", base  # gpt-oss: experts only; attention, router and embeddings stay bf16
    if method == "modelopt":
        algo = str(q.get("quant_algo") or (q.get("quantization") or {}).get("quant_algo") or "").upper()
        if "NVFP4" in algo or "FP4" in algo:
            return "nvfp4", base
        if "FP8" in algo:
            return "fp8", "fp8"
    if method == "compressed-tensors":
        for group in (q.get("config_groups") or {}).values():
            w = (group or {}).get("weights") or {}
            bits, typ = w.get("num_bits"), str(w.get("type", "int"))
            if bits == 4:
                return ("nvfp4" if typ == "float" else "int4"), base
            if bits == 8 and typ == "float":
                return "fp8", "fp8"
    raise ConfigError(f"{c.path}: field 'quantization_config': quant_method '{q.get('quant_method')}' is not "
                      "understood (known: fp8, mxfp4, modelopt NVFP4/FP8, compressed-tensors int4/nvfp4/fp8)")


# --------------------------------------------------------------------------- entry point


def spec_from_config(path: str | Path) -> ModelSpec:
    """ModelSpec of a local checkpoint folder or config.json (id 'local:<folder name>', local_path set)."""
    p = Path(path).expanduser()
    data, cfg_path, folder = _load_config(p)
    c = _Cfg(_text_config(data), cfg_path)
    g = _geometry(c)
    expert_prec, dense_prec = _precisions_from_config(c)
    expert_params = 3 * g.hidden * g.moe_inter
    routed_params = len(g.moe_layer_ids) * g.experts * expert_params
    non_routed, mtp_params = g.non_routed_params, g.mtp_params
    dense_gib: float | None = None
    sources = [f"config.json: {cfg_path}"]

    # A loose *.json elsewhere describes no checkpoint: its folder's shards (if any) belong to something else.
    shards, missing = shard_files(folder) if cfg_path.name == "config.json" else ([], [])
    if shards and missing:
        sources.append(f"safetensors: {len(missing)} of {len(shards) + len(missing)} shards missing; sizes from "
                       "config formulas")
    elif shards:
        q = c.get("quantization_config") or {}
        int_bits = 4
        for group in (q.get("config_groups") or {}).values() if isinstance(q, dict) else []:
            int_bits = int(((group or {}).get("weights") or {}).get("num_bits") or 4)
        h = count_headers(shards, g.num_layers, int_bits)
        _check_experts(h, g, cfg_path, expert_params)
        non_routed, mtp_params = h.non_routed_params, h.mtp_params or mtp_params
        dense_gib = h.non_routed_bytes / GIB
        expert_prec = h.routed_precision or expert_prec
        if h.dense_precision in ("bf16", "fp16", "fp32", "fp8", "nvfp4", "mxfp4"):
            dense_prec = h.dense_precision
        sources.append(f"safetensors headers: {len(shards)} shard(s); non-routed params and dense bytes exact")
    else:
        sources.append("no safetensors shards: non-routed params from config formulas (hwdb_facts.md §7)")

    active = non_routed + g.top_k * expert_params * len(g.moe_layer_ids)
    name = folder.name if cfg_path.name == "config.json" else cfg_path.stem
    repo = c.get("_name_or_path")
    try:
        return ModelSpec(
            id=f"local:{name}",
            name=name,
            family=g.family,
            vllm_arch=g.arch,
            hf_repo=repo if isinstance(repo, str) and "/" in repo and not Path(repo).is_absolute() else None,
            local_path=str(folder.resolve()),
            num_layers=g.num_layers,
            moe_layers=len(g.moe_layer_ids),
            hidden_size=g.hidden,
            moe_intermediate_size=g.moe_inter,
            dense_intermediate_size=g.dense_inter,
            n_routed_experts=g.experts,
            top_k=g.top_k,
            n_shared_experts=g.n_shared,
            vocab_size=g.vocab,
            max_position_embeddings=g.max_pos,
            attention=Attention(**g.attention),
            kv_bytes_per_token=g.kv,
            kv_fixed_bytes_per_seq=g.kv_fixed,
            kv_shards_with_tp=g.kv_shards_with_tp,
            non_routed_params_b=non_routed / 1e9,
            dense_precision=dense_prec,
            dense_gib_published=dense_gib,
            expert_precision=expert_prec,
            mtp_layers=g.mtp_layers,
            mtp_params_b=mtp_params / 1e9 if g.mtp_layers else 0.0,
            swiglu_limit=g.swiglu_limit,
            params_total_b=(routed_params + non_routed) / 1e9,
            params_active_b=active / 1e9,
            sources=sources,
        )
    except ValidationError as e:
        raise ConfigError(f"{cfg_path}: {validation_summary(e)}") from None


def _check_experts(h: HeaderCounts, g: _Geometry, cfg_path: Path, expert_params: int) -> None:
    """The shards must hold the experts the config promises: same MoE layers, same count per layer, same size."""
    layers = sorted(h.experts_per_layer)
    if layers != g.moe_layer_ids:
        raise ConfigError(
            f"{cfg_path}: the shards hold routed experts in {len(layers)} layers but the config implies "
            f"{len(g.moe_layer_ids)} MoE layers; config.json and the shards are from different checkpoints")
    for layer, ids in h.experts_per_layer.items():
        n = len(ids) if isinstance(ids, set) else ids
        if n != g.experts:
            raise ConfigError(
                f"{cfg_path}: layer {layer} of the shards has {n} routed experts but the config says {g.experts} "
                "(n_routed_experts / num_experts / num_local_experts); config.json and the shards disagree")
    want = len(g.moe_layer_ids) * g.experts * expert_params
    if h.routed_params != want:
        raise ConfigError(
            f"{cfg_path}: the shards' routed experts hold {h.routed_params:,} weights but hidden_size x "
            f"moe_intermediate_size x 3 x experts x MoE layers = {want:,}; check 'moe_intermediate_size'")

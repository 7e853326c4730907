"""Tiny configs of the three target architectures (config.json dicts), for tests that build or serve them.

- GLM-5.x: `GlmMoeDsaForCausalLM` (sparse MLA with the lightning indexer),
- DeepSeek-V4: `DeepseekV4ForCausalLM` (CSA / HCA compressed attention, hyper-connections, hash-routed layers),
- Kimi-K2.x as `DeepseekV3ForCausalLM` (dense MLA; Kimi's text model is a DeepSeek-V3).

Two sizes. `size="cpu"` is what vLLM's CPU build can construct block by block (the MoE blocks only: their sparse
attention has no CPU backend). `size="cuda"` is what CUDA vLLM serves end to end on sm_90: the attention geometry
of the real model read from hwdb (heads, latent and rope widths, indexer), only the width of the residual stream,
the layer count, the expert count and the vocabulary cut down, so the attention backends (FlashMLA sparse / dense,
DeepGEMM's indexer logits, TileLang's hyper-connection kernels) run on the shapes they were built for and their
JIT caches are the ones the full-size model needs. The indexer keeps 512 tokens: a top-k every sm_90 sparse path
takes (FlashMLA sparse, the radix top-k kernels), and DeepSeek-V4-Flash's own value.

`write_model_folder` writes a config with the tiny tokenizer (moetplan.models.tiny), which is all vLLM needs to
serve it with random weights (`--load-format dummy`).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

from moetplan.contract.errors import UnknownNameError
from moetplan.contract.model import ModelSpec

Size = Literal["cpu", "cuda"]
ARCHS = ("glm-moe-dsa", "deepseek-v4", "kimi-mla")
# The hwdb model whose geometry each tiny architecture takes.
HWDB_OF = {"glm-moe-dsa": "glm-5.2", "deepseek-v4": "deepseek-v4-flash", "kimi-mla": "kimi-k2.7-code"}

# The tiny tokenizer's vocabulary (moetplan.models.tiny); a model's embedding must cover every id it can emit.
TINY_VOCAB = 512
# Cut-down sizes: multiples of 64 (the 2-bit kernels' row granularity) and of 128 (DeepGEMM's fp8 blocks).
CPU_DIMS = {"experts": 16, "top_k": 4, "hidden": 128, "moe_inter": 64}
CUDA_DIMS = {"experts": 16, "top_k": 4, "hidden": 1024, "moe_inter": 512}
SPARSE_TOPK = 512
# DeepSeek-V4 facts hwdb does not hold (shared/facts/models.yaml: "mHC hyper-connections (hc_mult 4)"; the rest
# from the released config.json): hyper-connection width and its Sinkhorn normalisation, the compressed layers'
# rope base, yarn scaling.
DS4_EXTRA = {"hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6, "compress_rope_theta": 160000.0,
             "rope_scaling": {"rope_type": "yarn", "type": "yarn", "factor": 16,
                              "original_max_position_embeddings": 65536, "beta_fast": 32, "beta_slow": 1}}
# DeepSeek-V4's layer pattern: sliding-window-only, then compressed sparse (ratio 4, with the indexer) and
# heavily compressed (ratio 128) attention (hwdb: swa_only / csa / hca layer counts).
DS4_RATIOS = (0, 4, 128)
# The released DeepSeek-V4-Flash formats: FP8 e4m3 block-128 dense, MXFP4 experts (hwdb expert_precision).
DS4_RELEASE_QUANT = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                     "weight_block_size": [128, 128]}

_COMMON = {"vocab_size": TINY_VOCAB, "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
           "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2, "hidden_act": "silu", "rope_theta": 10000.0}


def _spec(arch: str) -> ModelSpec:
    from moetplan import hwdb

    return hwdb.model_spec(HWDB_OF[arch])


def _dims(size: Size) -> dict[str, int]:
    if size not in ("cpu", "cuda"):
        raise ValueError(f"size must be 'cpu' or 'cuda', got {size!r}")
    return CPU_DIMS if size == "cpu" else CUDA_DIMS


def _routing(d: dict[str, int], shared: int) -> dict[str, Any]:
    return {"n_routed_experts": d["experts"], "num_experts_per_tok": d["top_k"], "n_shared_experts": shared,
            "moe_intermediate_size": d["moe_inter"], "hidden_size": d["hidden"], "n_group": 1, "topk_group": 1,
            "norm_topk_prob": True}


def glm_moe_dsa(size: Size = "cuda", layers: int = 3, **overrides: Any) -> dict[str, Any]:
    """GlmMoeDsaForCausalLM: first layer dense, the rest MoE; sparse MLA with the indexer."""
    d, s = _dims(size), _spec("glm-moe-dsa")
    a = s.attention.model_dump()
    cpu = size == "cpu"
    cfg = {**_COMMON, "model_type": "glm_moe_dsa", "architectures": ["GlmMoeDsaForCausalLM"],
           **_routing(d, s.n_shared_experts), "intermediate_size": 2 * d["hidden"], "num_hidden_layers": layers,
           "first_k_dense_replace": 1, "num_attention_heads": 4 if cpu else a["num_heads"],
           "num_key_value_heads": 4 if cpu else a["num_heads"], "kv_lora_rank": a["kv_lora_rank"],
           "q_lora_rank": 64 if cpu else a["q_lora_rank"], "qk_rope_head_dim": a["qk_rope_head_dim"],
           "qk_nope_head_dim": 64 if cpu else a["qk_nope_head_dim"], "v_head_dim": 64 if cpu else a["v_head_dim"],
           "index_topk": 32 if cpu else SPARSE_TOPK, "index_n_heads": 2 if cpu else a["index_n_heads"],
           "index_head_dim": 64 if cpu else a["index_head_dim"], "topk_method": "noaux_tc",
           "scoring_func": "sigmoid", "routed_scaling_factor": 2.5, "max_position_embeddings": 4096,
           "num_nextn_predict_layers": 0}
    return {**cfg, **overrides}


def kimi_mla(size: Size = "cuda", layers: int = 3, **overrides: Any) -> dict[str, Any]:
    """Kimi-K2.x's text model as DeepseekV3ForCausalLM: dense MLA, first layer dense."""
    d, s = _dims(size), _spec("kimi-mla")
    a = s.attention.model_dump()
    cpu = size == "cpu"
    cfg = {**_COMMON, "model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"],
           **_routing(d, s.n_shared_experts), "intermediate_size": 2 * d["hidden"], "num_hidden_layers": layers,
           "first_k_dense_replace": 1, "num_attention_heads": 4 if cpu else a["num_heads"],
           "num_key_value_heads": 4 if cpu else a["num_heads"], "kv_lora_rank": a["kv_lora_rank"],
           "q_lora_rank": None if cpu else a["q_lora_rank"], "qk_rope_head_dim": a["qk_rope_head_dim"],
           "qk_nope_head_dim": 64 if cpu else a["qk_nope_head_dim"], "v_head_dim": 64 if cpu else a["v_head_dim"],
           "topk_method": "noaux_tc", "scoring_func": "sigmoid", "routed_scaling_factor": 2.5,
           "max_position_embeddings": 4096, "num_nextn_predict_layers": 0, "rope_interleave": True}
    return {**cfg, **overrides}


def deepseek_v4(size: Size = "cuda", layers: int = 3, *, full: bool = False, release_quant: bool = True,
                **overrides: Any) -> dict[str, Any]:
    """DeepseekV4ForCausalLM. `full=True`: DeepSeek-V4-Flash's own sizes (hwdb), `layers` of its layer pattern
    (every layer when layers=None is not given: pass spec.num_layers). `release_quant`: the released checkpoint's
    FP8 dense config (vLLM 0.26's DeepSeek-V4 o_proj runs only FP8 weights; the MoE method is the server's)."""
    d, s = _dims(size), _spec("deepseek-v4")
    a = s.attention.model_dump()
    cpu = size == "cpu"
    if full:
        d = {"experts": s.n_routed_experts, "top_k": s.top_k, "hidden": s.hidden_size,
             "moe_inter": s.moe_intermediate_size}
    elif not cpu:
        # DeepSeek-V4's own residual width: its hyper-connection and o_proj kernels are built for it.
        d = {**d, "hidden": s.hidden_size}
    cfg: dict[str, Any] = {
        **_COMMON, "model_type": "deepseek_v4", "architectures": ["DeepseekV4ForCausalLM"],
        **_routing(d, s.n_shared_experts), "num_hidden_layers": layers, "num_hash_layers": 1,
        "swiglu_limit": s.swiglu_limit, "scoring_func": "sqrtsoftplus", "topk_method": "noaux_tc",
        "routed_scaling_factor": 1.5, "num_attention_heads": 4 if cpu else a["num_heads"],
        "max_position_embeddings": 512 if cpu else s.max_position_embeddings}
    cfg.pop("n_group"), cfg.pop("topk_group")
    if not cpu:
        cfg.update({"num_key_value_heads": 1, "head_dim": a["head_dim"], "qk_rope_head_dim": a["qk_rope_head_dim"],
                    "q_lora_rank": a["q_lora_rank"], "o_lora_rank": a["o_lora_rank"], "o_groups": a["o_groups"],
                    "sliding_window": a["sliding_window"], "index_topk": a["index_topk"],
                    "index_n_heads": a["index_n_heads"], "index_head_dim": a["index_head_dim"],
                    "compress_ratios": ds4_ratios(layers), "num_nextn_predict_layers": s.mtp_layers if full else 0,
                    **json.loads(json.dumps(DS4_EXTRA))})
        if full:
            # The released experts are MXFP4; a tiny model's stay FP8 like its dense part, a format the moetplan
            # method quantizes at load (MXFP4 experts reach it only as packs: `moetplan quantize`).
            cfg["expert_dtype"] = "fp4"
        if full:
            cfg["vocab_size"] = s.vocab_size
        if release_quant:
            cfg["quantization_config"] = dict(DS4_RELEASE_QUANT)
    return {**cfg, **overrides}


def ds4_ratios(layers: int) -> list[int]:
    """The compression ratio of each layer: DeepSeek-V4-Flash's pattern `[0, 0] + [4, 128] * 20 + [4]` for its 43
    layers, kept in that order for fewer (a tiny model gets one layer of each kind first)."""
    if layers < 1:
        raise ValueError(f"layers must be >= 1, got {layers}")
    if layers <= len(DS4_RATIOS):
        return list(DS4_RATIOS[:layers])
    head = [0, 0]
    body = [4, 128] * ((layers - 2) // 2) + ([4] if (layers - 2) % 2 else [])
    return (head + body)[:layers]


def config(arch: str, size: Size = "cuda", **kw: Any) -> dict[str, Any]:
    makers = {"glm-moe-dsa": glm_moe_dsa, "deepseek-v4": deepseek_v4, "kimi-mla": kimi_mla}
    if arch not in makers:
        raise UnknownNameError("tiny architecture", arch, list(ARCHS))
    return makers[arch](size, **kw)


def write_model_folder(folder: str | Path, cfg: dict[str, Any]) -> Path:
    """config.json and the tiny tokenizer in `folder` (what vLLM serves with --load-format dummy)."""
    from moetplan.models.tiny import build_tokenizer

    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    if not (out / "tokenizer.json").exists():
        build_tokenizer(out)
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    return out


def tiny_spec(arch: str, cfg: dict[str, Any], folder: str | Path | None = None) -> ModelSpec:
    """A ModelSpec for a tiny config, for planning it: the hwdb model's entry with the tiny sizes (KV per token
    scaled by the layer count; the byte footprints follow from the dims)."""
    s = _spec(arch)
    layers = int(cfg["num_hidden_layers"])
    dense_first = int(cfg.get("first_k_dense_replace", 0))
    h, vocab = int(cfg["hidden_size"]), int(cfg["vocab_size"])
    share = layers / max(s.num_layers, 1)
    # Dense stack: embeddings + lm head, and per layer the attention block and shared expert (small next to
    # the routed experts; only the planner's ledger reads it).
    per_layer = 4 * h * h + 3 * h * int(cfg["moe_intermediate_size"]) * int(cfg.get("n_shared_experts", 0))
    non_routed = (2 * vocab * h + layers * per_layer) / 1e9
    name = f"tiny-{arch}"
    return s.model_copy(update={
        "id": name, "name": name, "aliases": [], "hf_repo": None,
        "local_path": str(folder) if folder is not None else None,
        "num_layers": layers, "moe_layers": layers - dense_first, "hidden_size": h,
        "moe_intermediate_size": int(cfg["moe_intermediate_size"]),
        "dense_intermediate_size": cfg.get("intermediate_size"), "n_routed_experts": int(cfg["n_routed_experts"]),
        "top_k": int(cfg["num_experts_per_tok"]), "vocab_size": vocab,
        "max_position_embeddings": int(cfg["max_position_embeddings"]),
        "kv_bytes_per_token": {k: v * share for k, v in s.kv_bytes_per_token.items()},
        "kv_fixed_bytes_per_seq": {k: v * share for k, v in s.kv_fixed_bytes_per_seq.items()},
        "non_routed_params_b": non_routed, "dense_precision": "fp8" if "quantization_config" in cfg else "bf16",
        "dense_gib_published": None, "dense_includes_mtp": False, "expert_precision": "bf16",
        "mtp_layers": 0, "mtp_params_b": 0.0, "mtp_acceptance": {}, "drafter_gib": 0.0,
        "params_total_b": None, "params_active_b": None, "sources": [f"moetplan.models.tiny_arch ({arch})"]})


__all__ = ["ARCHS", "CPU_DIMS", "CUDA_DIMS", "DS4_RELEASE_QUANT", "HWDB_OF", "SPARSE_TOPK", "TINY_VOCAB", "config",
           "deepseek_v4", "ds4_ratios", "glm_moe_dsa", "kimi_mla", "tiny_spec", "write_model_folder"]

"""Config-only model folders for `moetplan run --dummy-weights`: an hwdb model's config.json and a tokenizer.

vLLM builds the model from this folder with `--load-format dummy` (random dense weights, nothing read from disk);
the routed experts are the runtime's (random 2-bit rows written into their tier). The config carries the
ModelSpec's shapes; the few keys a ModelSpec does not hold (router scoring, hyper-connection widths, the sparse
attention layer pattern) come from the model's hwdb entry (`hf_config:`), so no model is hard-coded here.

Architectures written: Qwen3MoeForCausalLM, DeepseekV3ForCausalLM (DeepSeek-V3 and the Kimi-K2 text model),
GlmMoeDsaForCausalLM and DeepseekV4ForCausalLM, in the key names vLLM 0.26-0.33 read for them.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable

from moetplan.contract.errors import UsageError
from moetplan.contract.model import ModelSpec

# Bump when what is written changes, so cached folders are rewritten.
GENERATOR_VERSION = 2
MARKER = "moetplan_dummy.json"

# The tokenizer's special tokens (ids 0..3, models/tiny.py); the config's token ids point at them.
_BOS, _EOS, _PAD = 0, 1, 2


def _common(spec: ModelSpec) -> dict[str, Any]:
    return {
        "vocab_size": spec.vocab_size,
        "hidden_size": spec.hidden_size,
        "num_hidden_layers": spec.num_layers,
        "moe_intermediate_size": spec.moe_intermediate_size,
        "num_experts_per_tok": spec.top_k,
        "max_position_embeddings": spec.max_position_embeddings,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "bos_token_id": _BOS,
        "eos_token_id": _EOS,
        "pad_token_id": _PAD,
    }


def _qwen3_moe(spec: ModelSpec) -> dict[str, Any]:
    from moetplan.models.tiny import qwen3_moe_config

    a = spec.attention
    dense = spec.num_layers - spec.moe_layers
    cfg = qwen3_moe_config(hidden=spec.hidden_size, moe_inter=spec.moe_intermediate_size,
                           experts=spec.n_routed_experts, top_k=spec.top_k, layers=spec.num_layers,
                           heads=a.num_heads, kv_heads=a.num_kv_heads or a.num_heads,
                           head_dim=a.head_dim or spec.hidden_size // a.num_heads, vocab=spec.vocab_size)
    cfg.update(max_position_embeddings=spec.max_position_embeddings, torch_dtype="bfloat16",
               mlp_only_layers=list(range(dense)),
               intermediate_size=spec.dense_intermediate_size or cfg["intermediate_size"])
    return cfg


def _mla(spec: ModelSpec) -> dict[str, Any]:
    a = spec.attention
    first_dense = spec.num_layers - spec.moe_layers
    cfg = _common(spec)
    cfg.update(
        intermediate_size=spec.dense_intermediate_size or 2 * spec.hidden_size,
        first_k_dense_replace=first_dense,
        moe_layer_freq=1,
        num_attention_heads=a.num_heads,
        num_key_value_heads=a.num_heads,
        n_routed_experts=spec.n_routed_experts,
        n_shared_experts=spec.n_shared_experts,
        kv_lora_rank=a.kv_lora_rank,
        q_lora_rank=getattr(a, "q_lora_rank", None),
        qk_rope_head_dim=a.qk_rope_head_dim,
        qk_nope_head_dim=getattr(a, "qk_nope_head_dim", None),
        v_head_dim=getattr(a, "v_head_dim", None),
        num_nextn_predict_layers=spec.mtp_layers,
        n_group=1,
        topk_group=1,
        topk_method="noaux_tc",
        scoring_func="sigmoid",
        norm_topk_prob=True,
        hidden_act="silu",
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
    )
    return cfg


def _deepseek_v3(spec: ModelSpec) -> dict[str, Any]:
    cfg = _mla(spec)
    cfg.update(architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3")
    return cfg


def _glm_moe_dsa(spec: ModelSpec) -> dict[str, Any]:
    a = spec.attention
    cfg = _mla(spec)
    cfg.update(architectures=["GlmMoeDsaForCausalLM"], model_type="glm_moe_dsa",
               index_topk=getattr(a, "index_topk", None), index_n_heads=getattr(a, "index_n_heads", None),
               index_head_dim=getattr(a, "index_head_dim", None))
    return cfg


def _deepseek_v4(spec: ModelSpec) -> dict[str, Any]:
    a = spec.attention
    cfg = _common(spec)
    cfg.update(
        architectures=["DeepseekV4ForCausalLM"],
        model_type="deepseek_v4",
        n_routed_experts=spec.n_routed_experts,
        n_shared_experts=spec.n_shared_experts,
        num_attention_heads=a.num_heads,
        num_key_value_heads=a.num_kv_heads or 1,
        head_dim=a.head_dim,
        qk_rope_head_dim=a.qk_rope_head_dim,
        q_lora_rank=getattr(a, "q_lora_rank", None),
        o_lora_rank=getattr(a, "o_lora_rank", None),
        o_groups=getattr(a, "o_groups", None),
        sliding_window=a.sliding_window,
        index_topk=getattr(a, "index_topk", None),
        index_n_heads=getattr(a, "index_n_heads", None),
        index_head_dim=getattr(a, "index_head_dim", None),
        num_nextn_predict_layers=spec.mtp_layers,
        swiglu_limit=spec.swiglu_limit,
        hidden_act="silu",
        norm_topk_prob=True,
        topk_method="noaux_tc",
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
    )
    return cfg


# ModelSpec.vllm_arch -> the config writer. Kimi-K2.x ships as a multimodal wrapper around a DeepSeek-V3 text
# model; the text model is what serves its routed experts, so it is written as one.
WRITERS: dict[str, Callable[[ModelSpec], dict[str, Any]]] = {
    "Qwen3MoeForCausalLM": _qwen3_moe,
    "DeepseekV3ForCausalLM": _deepseek_v3,
    "KimiK25ForConditionalGeneration": _deepseek_v3,
    "GlmMoeDsaForCausalLM": _glm_moe_dsa,
    "DeepseekV4ForCausalLM": _deepseek_v4,
}


def supported_archs() -> list[str]:
    return sorted(WRITERS)


def hf_config(spec: ModelSpec, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """The config.json vLLM builds `spec`'s architecture from; `extra` (the hwdb entry's `hf_config:`) adds or
    overrides the keys a ModelSpec does not carry."""
    writer = WRITERS.get(spec.vllm_arch or "")
    if writer is None:
        raise UsageError(f"--dummy-weights: {spec.id} is a {spec.vllm_arch or 'unknown'} model; configs can be "
                         f"written for {', '.join(supported_archs())} (pick one of those models)")
    cfg = writer(spec)
    cfg.update(extra or {})
    return {k: v for k, v in cfg.items() if v is not None}


def hwdb_extra(spec: ModelSpec) -> dict[str, Any]:
    """The hwdb entry's `hf_config:` block (empty for models not in hwdb)."""
    from moetplan import hwdb
    from moetplan.contract.errors import UnknownNameError

    try:
        return dict(hwdb.model_entry(spec.id).get("hf_config") or {})
    except UnknownNameError:
        return {}


def build_tokenizer(out_dir: Path, vocab_size: int) -> None:
    """The tiny models' byte-level BPE, its vocabulary padded to the model's: every id the random model samples
    decodes to text (filler ids decode as ` w<id>`; no text encodes to them)."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    from moetplan.models.tiny import SPECIAL_TOKENS, CHAT_TEMPLATE, tokenizer_corpus, VOCAB, byte_level_bpe

    tok = byte_level_bpe(tokenizer_corpus(), min(VOCAB, vocab_size), SPECIAL_TOKENS, unk_token="<|unk|>")
    data = json.loads(tok.to_str())
    vocab = data["model"]["vocab"]
    used = set(vocab.values()) | {t["id"] for t in data.get("added_tokens", [])}
    for i in range(vocab_size):
        if i not in used:
            vocab[f"\u0120w{i}"] = i  # \u0120: the byte-level alphabet's space
    fast = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(data)), bos_token="<|bos|>",
                                   eos_token="<|eos|>", pad_token="<|pad|>", unk_token="<|unk|>")
    fast.model_max_length = 1 << 30
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out_dir))


def _fingerprint(cfg: dict[str, Any]) -> str:
    blob = json.dumps({"v": GENERATOR_VERSION, "cfg": cfg}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def ensure_dummy_model(spec: ModelSpec, root: str | os.PathLike[str] | None = None) -> Path:
    """The cached config-only folder of `spec` (config.json, tokenizer, no weights), written first when missing.

    Written into a temp folder and renamed into place: an interrupted write never leaves a folder a later run
    would trust."""
    from moetplan.contract import dummy_root

    cfg = hf_config(spec, hwdb_extra(spec))
    base = Path(root) if root is not None else dummy_root()
    target = base / f"{spec.id.replace(':', '-').replace('/', '-')}-{_fingerprint(cfg)}"
    if (target / MARKER).is_file():
        return target
    base.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=base, prefix=f".{target.name}."))
    try:
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
        build_tokenizer(tmp, spec.vocab_size)
        (tmp / MARKER).write_text(json.dumps({"model": spec.id, "generator_version": GENERATOR_VERSION,
                                             "weights": "none: served with --load-format dummy"}, indent=2) + "\n")
        try:
            os.replace(tmp, target)
        except OSError:
            if not (target / MARKER).is_file():  # another process finished first: keep theirs
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def is_dummy_model_dir(path: str | os.PathLike[str]) -> bool:
    return (Path(path) / MARKER).is_file()


__all__ = ["GENERATOR_VERSION", "MARKER", "WRITERS", "build_tokenizer", "ensure_dummy_model", "hf_config",
           "hwdb_extra", "is_dummy_model_dir", "supported_archs"]

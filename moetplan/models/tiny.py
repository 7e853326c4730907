"""Tiny random-weight MoE checkpoints with a locally built tokenizer, generated once and cached.

They let `moetplan run --model tiny-moe` show the whole path (plan -> vLLM -> plugin -> endpoint) on any
machine, and give the vLLM end-to-end tests something to serve without a model hub:

- ``tiny-moe``: Qwen3-MoE style (GQA attention, softmax router, no shared expert).
- ``tiny-moe-mla``: DeepSeek-V3 style MLA (kv_lora_rank 512 and qk_rope_head_dim 64, the only MLA geometry the
  vLLM CPU kernel accepts; ``topk_method: noaux_tc`` sigmoid router with correction bias; one shared expert,
  first layer dense).
- ``tiny-moe-fp8``: ``tiny-moe`` with its routed experts stored as FP8 block-scaled e4m3 (the checkpoint format
  of DeepSeek/GLM FP8 releases) holding exactly the bf16 values, so both must give the same 2-bit rows.

Weights are random (seeded); routed experts are snapped to FP8-representable values (see
`_snap_experts_to_fp8_grid`). Checkpoints are bf16 with a byte-level BPE tokenizer trained here.

Dims are multiples of 32 so the 2-bit format's block-32 scales apply, and head sizes are ones the CPU
attention backend supports.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator

from moetplan.contract.errors import UnknownNameError

# Bump when the generator changes what it writes, so cached copies are regenerated.
GENERATOR_VERSION = 6

SPECIAL_TOKENS = ["<|bos|>", "<|eos|>", "<|pad|>", "<|unk|>"]  # ids 0..3, referenced by the configs below
# A ChatML-style template that also speaks tools, so what coding agents send works against the tiny models: the
# tools are listed in a system turn, an assistant's tool calls are written the Hermes way
# (<tool_call>{"name": ..., "arguments": {...}}</tool_call>, the format vLLM's `hermes` tool-call parser reads;
# hwdb/serving.yaml names it), tool results come back as <tool_response> turns. Content may be None (an assistant
# turn that only calls tools). The role markers are plain text to this tokenizer, which is fine for random weights.
CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{ '<|system|>\n' }}"
    "{%- if messages and messages[0]['role'] == 'system' %}{{ messages[0]['content'] ~ '\n' }}{%- endif %}"
    "{{ '# Tools\n<tools>\n' }}"
    "{%- for tool in tools %}{{ (tool | tojson) ~ '\n' }}{%- endfor %}"
    "{{ '</tools>\nTo call a tool write <tool_call>{\"name\": NAME, \"arguments\": ARGS}</tool_call><|eos|>\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'system' and tools %}"
    "{%- elif message['role'] == 'tool' %}"
    "{{ '<|tool|>\n<tool_response>\n' ~ (message['content'] or '') ~ '\n</tool_response><|eos|>\n' }}"
    "{%- else %}"
    "{{ '<|' ~ message['role'] ~ '|>\n' ~ (message['content'] or '') }}"
    "{%- if message['tool_calls'] is defined and message['tool_calls'] %}"
    "{%- for call in message['tool_calls'] %}"
    "{%- set fn = call['function'] if call['function'] is defined else call %}"
    "{{ '<tool_call>\n{\"name\": \"' ~ fn['name'] ~ '\", \"arguments\": ' }}"
    "{%- if fn['arguments'] is string %}{{ fn['arguments'] }}{%- else %}{{ fn['arguments'] | tojson }}{%- endif %}"
    "{{ '}\n</tool_call>' }}"
    "{%- endfor %}"
    "{%- endif %}"
    "{{ '<|eos|>\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|assistant|>\n' }}{%- endif %}"
)
VOCAB = 512


def qwen3_moe_config(*, hidden: int, moe_inter: int, experts: int, top_k: int, layers: int, heads: int,
                     kv_heads: int, head_dim: int, vocab: int = VOCAB, **extra: Any) -> dict[str, Any]:
    """A Qwen3-MoE config.json (GQA attention, softmax router, no shared expert); dims multiples of 32."""
    return {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": 2 * hidden,
        "moe_intermediate_size": moe_inter,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "num_experts": experts,
        "num_experts_per_tok": top_k,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "pad_token_id": 2,
        **extra,
    }


def byte_level_bpe(texts: Iterable[str], vocab_size: int, special_tokens: list[str], unk_token: str | None = None):
    """A byte-level BPE tokenizer (tokenizers.Tokenizer) trained here on `texts`: no hub."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token=unk_token) if unk_token else models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=special_tokens,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


@dataclass(frozen=True)
class TinyModel:
    name: str
    description: str
    config: dict[str, Any]
    seed: int = 0
    aliases: tuple[str, ...] = field(default_factory=tuple)
    fp8_of: str | None = None  # an FP8 export of another tiny model (same values, other checkpoint format)


TINY_MODELS: dict[str, TinyModel] = {
    "tiny-moe": TinyModel(
        name="tiny-moe",
        description="Qwen3-MoE-style, 2 layers, 16 experts top-4, hidden 128, expert FFN 64",
        config=qwen3_moe_config(hidden=128, moe_inter=64, experts=16, top_k=4, layers=2, heads=4, kv_heads=2,
                                head_dim=64, initializer_range=0.1),
    ),
    "tiny-moe-mla": TinyModel(
        name="tiny-moe-mla",
        description="DeepSeek-V3-style MLA, 2 layers (1 dense), 16 experts top-4 + 1 shared, noaux_tc router",
        config={
            "architectures": ["DeepseekV3ForCausalLM"],
            "model_type": "deepseek_v3",
            "vocab_size": VOCAB,
            "hidden_size": 128,
            "intermediate_size": 256,
            "moe_intermediate_size": 64,
            "num_hidden_layers": 2,
            "first_k_dense_replace": 1,
            "num_attention_heads": 4,
            "num_key_value_heads": 4,
            "n_routed_experts": 16,
            "n_shared_experts": 1,
            "num_experts_per_tok": 4,
            "n_group": 1,
            "topk_group": 1,
            "topk_method": "noaux_tc",
            "scoring_func": "sigmoid",
            "norm_topk_prob": True,
            "routed_scaling_factor": 2.5,
            "kv_lora_rank": 512,
            "q_lora_rank": None,
            "qk_rope_head_dim": 64,
            "qk_nope_head_dim": 64,
            "v_head_dim": 64,
            "num_nextn_predict_layers": 0,
            "rope_interleave": True,
            "max_position_embeddings": 4096,
            "rms_norm_eps": 1e-6,
            "rope_theta": 10000.0,
            "tie_word_embeddings": False,
            "initializer_range": 0.1,
            "bos_token_id": 0,
            "eos_token_id": 1,
            "pad_token_id": 2,
        },
    ),
}
TINY_MODELS["tiny-moe-fp8"] = TinyModel(
    name="tiny-moe-fp8",
    description="tiny-moe with routed experts stored as FP8 e4m3 (block-64 scales), the rest bf16",
    config=TINY_MODELS["tiny-moe"].config,
    fp8_of="tiny-moe",
)

# 64, not DeepSeek's 128: the tiny experts' FFN (64) must be a multiple of the block, or vLLM re-grids the
# scales (and its re-gridding does not handle experts smaller than one block).
FP8_BLOCK = 64
E4M3_MAX = 448.0


def tiny_names() -> list[str]:
    return sorted(TINY_MODELS)


def is_tiny(name: str) -> bool:
    return name in TINY_MODELS


def get_tiny(name: str) -> TinyModel:
    if name not in TINY_MODELS:
        raise UnknownNameError("tiny model", name, tiny_names())
    return TINY_MODELS[name]


def default_cache_root() -> Path:
    from moetplan.contract import tiny_root

    return tiny_root()


def _fingerprint(tm: TinyModel) -> str:
    blob = json.dumps({"v": GENERATOR_VERSION, "cfg": tm.config, "seed": tm.seed, "fp8_of": tm.fp8_of},
                      sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def checkpoint_dir(name: str, cache_root: str | os.PathLike[str] | None = None) -> Path:
    tm = get_tiny(name)
    root = Path(cache_root) if cache_root is not None else default_cache_root()
    return root / f"{tm.name}-{_fingerprint(tm)}"


def tokenizer_corpus() -> list[str]:
    # Deterministic synthetic text: enough variety for BPE merges over common English fragments.
    words = (
        "the a of to and in is that it for on with as was be by this are at from or an have not they which "
        "one you all there their can has more when will would what about out up into time only other some "
        "model expert token layer cache memory plan run serve quantize route hidden weight scale block byte "
        "hello world moe tiny random fast slow small large first last next every each many few"
    ).split()
    lines = []
    for i in range(600):
        n = 5 + (i * 7) % 9
        lines.append(" ".join(words[(i * 13 + j * (j + 3)) % len(words)] for j in range(n)) + ".")
    lines += [str(i) for i in range(200)]
    return lines


def build_tokenizer(out_dir: Path) -> None:
    """A byte-level BPE tokenizer trained here (no hub), saved as tokenizer.json + tokenizer_config.json."""
    from transformers import PreTrainedTokenizerFast

    tok = byte_level_bpe(tokenizer_corpus(), VOCAB, SPECIAL_TOKENS, unk_token="<|unk|>")
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|bos|>",
        eos_token="<|eos|>",
        pad_token="<|pad|>",
        unk_token="<|unk|>",
    )
    fast.model_max_length = 4096
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out_dir))


def _restore_config_keys(path: Path, wanted: dict[str, Any]) -> None:
    """transformers 5 renames some keys on save (qwen3_moe num_experts -> num_local_experts); official
    checkpoints carry the original names, which vLLM and config readers look for, so write them back."""
    data = json.loads(path.read_text())
    for k, v in wanted.items():
        if k not in data and k not in ("rope_theta",):
            data[k] = v
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def _write_checkpoint(tm: TinyModel, out_dir: Path) -> None:
    import torch
    import transformers

    cfg_dict = dict(tm.config)
    model_type = cfg_dict.pop("model_type")
    cfg_dict.pop("architectures", None)
    extra = {k: cfg_dict.pop(k) for k in ("topk_method", "scoring_func") if k in cfg_dict}
    rope_theta = cfg_dict.pop("rope_theta", None)
    config = transformers.AutoConfig.for_model(model_type, **cfg_dict)
    if rope_theta is not None:
        config.rope_parameters = {"rope_type": "default", "rope_theta": rope_theta}
    for k, v in extra.items():
        setattr(config, k, v)
    torch.manual_seed(tm.seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        # A non-zero router correction bias exercises vLLM's noaux_tc path the way real checkpoints do.
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(torch.randn_like(buf) * 0.05)
    model = model.to(torch.bfloat16)  # a bf16 checkpoint, like the official releases
    model.save_pretrained(str(out_dir))
    _snap_experts_to_fp8_grid(out_dir / "model.safetensors")
    _restore_config_keys(out_dir / "config.json", tm.config)
    build_tokenizer(out_dir)
    (out_dir / "moetplan_tiny.json").write_text(
        json.dumps({"name": tm.name, "generator_version": GENERATOR_VERSION, "seed": tm.seed}, indent=2) + "\n"
    )


def _is_expert_weight(name: str) -> bool:
    return ".experts." in name and name.endswith("_proj.weight")


def _fp8_blocks(w: Any) -> tuple[Any, Any]:
    """w [N, K] -> (e4m3 codes [N, K], power-of-two scale_inv per FP8_BLOCK^2 tile), w ~= codes * scale."""
    import torch

    n, k = w.shape
    bn, bk = -(-n // FP8_BLOCK), -(-k // FP8_BLOCK)
    wf = w.float()
    pad = torch.zeros(bn * FP8_BLOCK, bk * FP8_BLOCK)
    pad[:n, :k] = wf.abs()
    amax = pad.view(bn, FP8_BLOCK, bk, FP8_BLOCK).amax(dim=(1, 3)).clamp(min=2.0**-60)
    scale = torch.exp2(torch.ceil(torch.log2(amax / E4M3_MAX)))
    full = scale.repeat_interleave(FP8_BLOCK, 0)[:n].repeat_interleave(FP8_BLOCK, 1)[:, :k]
    return (wf / full).to(torch.float8_e4m3fn), scale


def _snap_experts_to_fp8_grid(path: Path) -> None:
    """Round routed experts to values an FP8 block checkpoint holds exactly (e4m3 x power of two).

    bf16 holds them exactly too, so the bf16 and FP8 exports of a tiny model carry identical expert values:
    the runtime must then produce identical 2-bit rows (and tokens) from either format.
    """
    import torch
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(path))
    for name, w in tensors.items():
        if _is_expert_weight(name):
            codes, scale = _fp8_blocks(w)
            full = scale.repeat_interleave(FP8_BLOCK, 0)[: w.shape[0]].repeat_interleave(FP8_BLOCK, 1)[:, : w.shape[1]]
            tensors[name] = (codes.float() * full).to(torch.bfloat16)
    save_file(tensors, str(path), metadata={"format": "pt"})


def _write_fp8_export(base_dir: Path, out_dir: Path) -> None:
    """Routed experts as FP8 e4m3 + `weight_scale_inv` (DeepSeek-style block scales); dense layers stay bf16 and are
    listed in `ignored_layers` (vLLM's CPU backend has no FP8 dense kernels)."""
    import shutil

    from safetensors.torch import load_file, save_file

    for f in base_dir.iterdir():
        if f.name not in ("model.safetensors", "moetplan_tiny.json"):
            shutil.copy2(f, out_dir / f.name)
    tensors = load_file(str(base_dir / "model.safetensors"))
    out, ignored = {}, set()
    for name, w in tensors.items():
        if _is_expert_weight(name):
            codes, scale = _fp8_blocks(w)
            out[name], out[name + "_scale_inv"] = codes, scale
        else:
            out[name] = w
            if name.endswith(".weight") and w.dim() == 2:
                ignored.add(name[: -len(".weight")])
    save_file(out, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((out_dir / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                                  "weight_block_size": [FP8_BLOCK, FP8_BLOCK], "ignored_layers": sorted(ignored)}
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def ensure_tiny_checkpoint(name: str, cache_root: str | os.PathLike[str] | None = None) -> Path:
    """Return the cached checkpoint folder for `name`, generating it first when missing.

    Generation writes into a temp folder next to the target and renames it into place, so an interrupted
    run never leaves a half-written checkpoint that a later run would trust.
    """
    tm = get_tiny(name)
    target = checkpoint_dir(name, cache_root)
    if (target / "moetplan_tiny.json").is_file():
        return target
    base = ensure_tiny_checkpoint(tm.fp8_of, cache_root) if tm.fp8_of else None
    with _written_into(target) as tmp:
        if base is not None:
            _write_fp8_export(base, tmp)
            (tmp / "moetplan_tiny.json").write_text(json.dumps(
                {"name": tm.name, "generator_version": GENERATOR_VERSION, "fp8_of": tm.fp8_of}, indent=2) + "\n")
        else:
            _write_checkpoint(tm, tmp)
    return target


@contextlib.contextmanager
def _written_into(target: Path) -> Iterator[Path]:
    """A temp folder beside `target`, renamed into place when the block ends without error (an interrupted write
    leaves nothing a later run would trust); if another process finished first, its folder is kept."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}."))
    try:
        yield tmp
        try:
            os.replace(tmp, target)
        except OSError:
            if not (target / "moetplan_tiny.json").is_file():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


# --------------------------------------------------------------------------- the trained tiny MoE

# A tiny MoE trained here on the standard library's Python source (the model bench/quality.py measures,
# moetplan.runtime.offline.quality): its completions look like Python, so a first request says something. Trained once
# (minutes on a laptop CPU) into the quality cache, then exported here as a served checkpoint.
TRAINED_NAME = "tiny-moe-py"
TRAINED_DESCRIPTION = "Qwen3-MoE-style, 4 layers, 16 experts top-2, trained here on Python's standard library"
# Bump when export_trained writes something else, so exported folders are rewritten (training stays cached).
TRAINED_EXPORT_VERSION = 2
# vLLM's default sampling for requests that set none (it reads generation_config.json): a model this small loops
# under greedy decoding, and samples at 0.7 read as Python.
TRAINED_SAMPLING = {"do_sample": True, "temperature": 0.7, "top_p": 0.95}


def is_trained(name: str) -> bool:
    return name == TRAINED_NAME


def trained_dir(info: dict[str, Any], cache_root: str | os.PathLike[str] | None = None) -> Path:
    """Where the served export of a trained model goes: keyed by its training record (spec, steps, losses)."""
    key = hashlib.sha256(json.dumps({"v": GENERATOR_VERSION, "export": TRAINED_EXPORT_VERSION, "info": info},
                                    sort_keys=True,
                                    default=str).encode()).hexdigest()[:12]
    root = Path(cache_root) if cache_root is not None else default_cache_root()
    return root / f"{TRAINED_NAME}-{key}"


def export_trained(model: Any, tokenizer: Any, info: dict[str, Any],
                   cache_root: str | os.PathLike[str] | None = None) -> Path:
    """A served checkpoint of a trained tiny MoE (transformers model, tokenizers.Tokenizer): bf16 weights, the
    config keys vLLM reads, a tokenizer with the tool-capable chat template. Written once (temp + rename)."""
    import torch
    from transformers import PreTrainedTokenizerFast

    target = trained_dir(info, cache_root)
    if (target / "moetplan_tiny.json").is_file():
        return target
    with _written_into(target) as tmp:
        model.to(torch.bfloat16).save_pretrained(str(tmp))
        cfg = model.config
        # transformers 5 writes num_local_experts; checkpoints (and vLLM's readers) name it num_experts
        _restore_config_keys(tmp / "config.json", {"num_experts": getattr(cfg, "num_local_experts", None) or
                                                   getattr(cfg, "num_experts", None),
                                                   "architectures": ["Qwen3MoeForCausalLM"]})
        fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<|bos|>", eos_token="<|eos|>",
                                       pad_token="<|pad|>")
        fast.model_max_length = int(getattr(cfg, "max_position_embeddings", 4096))
        fast.chat_template = CHAT_TEMPLATE
        fast.save_pretrained(str(tmp))
        (tmp / "generation_config.json").write_text(json.dumps(
            {**TRAINED_SAMPLING, "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2}, indent=2) + "\n")
        (tmp / "moetplan_tiny.json").write_text(json.dumps({"name": TRAINED_NAME, "trained": info}, indent=2,
                                                           default=str) + "\n")
    return target

"""ModelSpec from config.json / checkpoint folders: every family, safetensors headers, bad input."""
from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import save_file

from moetplan import hwdb
from moetplan.contract.errors import ConfigError, UnknownNameError
from moetplan.models import resolve_model
from moetplan.models.from_config import spec_from_config
from moetplan.models.safetensors_headers import read_safetensors_header
from moetplan.contract.model import GIB, ModelSpec

FIXTURES = Path(__file__).parent / "fixtures" / "configs"
# Fixture configs that mirror an hwdb entry (same public config values, from hwdb/sources).
MIRRORED = ["glm-5.2", "deepseek-v3", "kimi-k2.7-code", "glm-4.7", "qwen3-30b-a3b", "qwen3-235b-a22b",
            "mixtral-8x7b", "gpt-oss-120b", "deepseek-v2-lite", "glm-5.1", "deepseek-v3.2", "kimi-k2.5"]


# --------------------------------------------------------------------------- config formulas vs hwdb


@pytest.mark.parametrize("name", MIRRORED)
def test_config_reproduces_hwdb_entry(name):
    got = spec_from_config(FIXTURES / name)
    want = hwdb.model_spec(name)
    for f in ("num_layers", "moe_layers", "hidden_size", "moe_intermediate_size", "n_routed_experts", "top_k",
              "n_shared_experts", "vocab_size", "max_position_embeddings", "kv_shards_with_tp", "mtp_layers"):
        assert getattr(got, f) == getattr(want, f), f
    assert got.routed_expert_params == want.routed_expert_params
    assert got.attention.kind == want.attention.kind
    # KV per token and per-sequence fixed parts are exact formulas; the hwdb holds the facts' figures.
    for dtype in ("bf16", "fp8"):
        assert got.kv_bytes_per_token[dtype] == want.kv_bytes_per_token[dtype], dtype
    assert got.kv_fixed_bytes_per_seq == want.kv_fixed_bytes_per_seq
    # Non-routed params by formula match the facts' totals (given to 0.1B) within 3%.
    assert got.non_routed_params_b == pytest.approx(want.non_routed_params_b, rel=0.03)
    assert got.id == f"local:{name}" and got.local_path == str((FIXTURES / name).resolve())


def test_glm52_sparse_mla_kv_and_indexshare():
    s = spec_from_config(FIXTURES / "glm-5.2")
    assert s.attention.kind == "mla_sparse"
    assert s.attention.model_extra["indexer_layers"] == 21  # {0,1,2} + {6,10,...,74}
    assert s.kv_bytes_per_token == {"bf16": 93912, "fp8": 54728, "nvfp4": 30712}
    assert s.routed_gib("2bit") == pytest.approx(190.0, rel=0.01)
    assert s.params_total_b == pytest.approx(743.4, rel=0.002)
    assert s.mtp_params_b == pytest.approx(9.9, rel=0.02)
    assert s.vllm_arch == "GlmMoeDsaForCausalLM" and s.hf_repo == "zai-org/GLM-5.2"


def test_kimi_text_config_wrapper_and_int4():
    s = spec_from_config(FIXTURES / "kimi-k2.7-code" / "config.json")
    assert s.family == "kimi_k25" and s.vllm_arch == "KimiK25ForConditionalGeneration"
    assert s.expert_precision == "int4" and s.dense_precision == "bf16"
    assert s.routed_gib("2bit") == pytest.approx(265.8, rel=0.01)
    assert s.mtp_layers == 0 and s.attention.kind == "mla"


def test_precisions_from_quantization_config():
    assert (spec_from_config(FIXTURES / "deepseek-v3").expert_precision,
            spec_from_config(FIXTURES / "deepseek-v3").dense_precision) == ("fp8", "fp8")
    oss = spec_from_config(FIXTURES / "gpt-oss-120b")
    assert (oss.expert_precision, oss.dense_precision) == ("mxfp4", "bf16")
    assert spec_from_config(FIXTURES / "mixtral-8x7b").expert_precision == "bf16"


def test_gpt_oss_sliding_layers_are_fixed_kv():
    s = spec_from_config(FIXTURES / "gpt-oss-120b")
    assert s.attention.sliding_window == 128 and s.attention.full_attention_layers == 18
    # 18 full layers x 2 x 8 heads x 64 x 2 B; the sliding half costs 128 tokens per sequence
    assert s.kv_bytes(kv_dtype="bf16", tokens=1000, tp=1, seqs=2) == 36864 * 1000 + 2 * 4718592
    assert s.kv_bytes(kv_dtype="bf16", tokens=1000, tp=2) == (36864 * 1000 + 4718592) / 2


def test_qwen2_moe_shared_expert():
    s = spec_from_config(FIXTURES / "qwen1.5-moe-a2.7b")
    assert s.n_shared_experts == 1 and s.attention.kind == "mha"
    # Qwen1.5-MoE-A2.7B: 14.3B total / 2.7B active (vendor)
    assert s.params_total_b == pytest.approx(14.3, rel=0.02)
    assert s.params_active_b == pytest.approx(2.7, rel=0.03)


def test_spec_json_round_trip():
    s = spec_from_config(FIXTURES / "glm-5.2")
    assert ModelSpec.model_validate_json(s.model_dump_json()) == s


# --------------------------------------------------------------------------- safetensors headers

TINY_QWEN = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 64, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2,
    "moe_intermediate_size": 32, "intermediate_size": 128, "vocab_size": 128, "max_position_embeddings": 2048,
    "tie_word_embeddings": False, "torch_dtype": "float16",
}


def _tiny_qwen_tensors(cfg: dict, n_experts: int | None = None) -> tuple[dict[str, np.ndarray], set[str]]:
    h, v, hd = cfg["hidden_size"], cfg["vocab_size"], cfg["head_dim"]
    nh, nkv, I = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["moe_intermediate_size"]
    E = n_experts or cfg["num_experts"]
    t: dict[str, np.ndarray] = {"model.embed_tokens.weight": np.zeros((v, h)), "lm_head.weight": np.zeros((v, h)),
                                "model.norm.weight": np.zeros(h)}
    experts: set[str] = set()
    for i in range(cfg["num_hidden_layers"]):
        pre = f"model.layers.{i}."
        t.update({pre + "self_attn.q_proj.weight": np.zeros((nh * hd, h)),
                  pre + "self_attn.k_proj.weight": np.zeros((nkv * hd, h)),
                  pre + "self_attn.v_proj.weight": np.zeros((nkv * hd, h)),
                  pre + "self_attn.o_proj.weight": np.zeros((h, nh * hd)),
                  pre + "self_attn.q_norm.weight": np.zeros(hd), pre + "self_attn.k_norm.weight": np.zeros(hd),
                  pre + "input_layernorm.weight": np.zeros(h), pre + "post_attention_layernorm.weight": np.zeros(h),
                  pre + "mlp.gate.weight": np.zeros((E, h))})
        for e in range(E):
            for proj, shape in (("gate_proj", (I, h)), ("up_proj", (I, h)), ("down_proj", (h, I))):
                name = f"{pre}mlp.experts.{e}.{proj}.weight"
                t[name] = np.zeros(shape)
                experts.add(name)
    return {k: a.astype(np.float16) for k, a in t.items()}, experts


def _write_checkpoint(folder: Path, cfg: dict, tensors: dict[str, np.ndarray], shards: int = 2) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg))
    names = sorted(tensors)
    weight_map = {}
    for s in range(shards):
        part = {n: tensors[n] for n in names[s::shards]}
        fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        save_file(part, str(folder / fname))
        weight_map.update({n: fname for n in part})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def test_sizes_come_from_safetensors_headers(tmp_path):
    tensors, experts = _tiny_qwen_tensors(TINY_QWEN)
    ckpt = tmp_path / "tiny-qwen3-moe"
    _write_checkpoint(ckpt, TINY_QWEN, tensors)
    s = spec_from_config(ckpt)
    dense = {n: a for n, a in tensors.items() if n not in experts}
    assert s.non_routed_params_b * 1e9 == pytest.approx(sum(a.size for a in dense.values()), abs=0.5)
    assert s.dense_bytes() == sum(a.nbytes for a in dense.values())  # exact, from the headers
    assert s.routed_expert_params == sum(tensors[n].size for n in experts)
    assert (s.expert_precision, s.dense_precision) == ("fp16", "fp16")
    assert any("safetensors headers" in src for src in s.sources)
    # The formula path gives the same non-routed count for this config.
    cfg_only = tmp_path / "cfg-only"
    cfg_only.mkdir()
    shutil.copy(ckpt / "config.json", cfg_only / "config.json")
    assert spec_from_config(cfg_only).non_routed_params_b == pytest.approx(s.non_routed_params_b, rel=1e-9)
    # the shard really is a safetensors file that the library reads
    with safe_open(str(next(ckpt.glob("*.safetensors"))), framework="numpy") as f:
        assert len(list(f.keys())) > 0


def test_header_parser_matches_library(tmp_path):
    tensors, _ = _tiny_qwen_tensors(TINY_QWEN)
    save_file(tensors, str(tmp_path / "x.safetensors"))
    hdr = read_safetensors_header(tmp_path / "x.safetensors")
    assert set(hdr) == set(tensors)
    assert all(hdr[n].shape == list(a.shape) and hdr[n].nbytes == a.nbytes for n, a in tensors.items())


def test_expert_count_mismatch_is_named(tmp_path):
    tensors, _ = _tiny_qwen_tensors(TINY_QWEN, n_experts=3)
    _write_checkpoint(tmp_path / "bad", TINY_QWEN, tensors)
    with pytest.raises(ConfigError, match=r"3 routed experts but the config says 4"):
        spec_from_config(tmp_path / "bad")


def test_missing_shard_falls_back_to_formulas(tmp_path):
    tensors, _ = _tiny_qwen_tensors(TINY_QWEN)
    ckpt = tmp_path / "partial"
    _write_checkpoint(ckpt, TINY_QWEN, tensors, shards=2)
    next(ckpt.glob("model-00002-*.safetensors")).unlink()
    s = spec_from_config(ckpt)
    assert any("1 of 2 shards missing" in src for src in s.sources)
    assert s.dense_gib_published is None


def test_corrupt_shard_header_is_named(tmp_path):
    ckpt = tmp_path / "corrupt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps(TINY_QWEN))
    (ckpt / "model.safetensors").write_bytes(struct.pack("<Q", 10**9) + b"{}")
    with pytest.raises(ConfigError, match=r"model\.safetensors: safetensors header length"):
        spec_from_config(ckpt)


def _write_raw_safetensors(path: Path, spec: dict[str, tuple[str, list[int]]]) -> None:
    """A valid safetensors file with zero data, for dtypes numpy cannot make (F8_E4M3, packed FP4)."""
    itemsize = {"F8_E4M3": 1, "U8": 1, "F32": 4, "BF16": 2, "I32": 4}
    header, off = {}, 0
    for name, (dtype, shape) in spec.items():
        n = itemsize[dtype] * int(np.prod(shape))
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [off, off + n]}
        off += n
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + bytes(off))


TINY_DSV3 = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": 64,
    "num_hidden_layers": 2, "first_k_dense_replace": 1, "intermediate_size": 128, "moe_intermediate_size": 32,
    "n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1, "num_attention_heads": 2,
    "q_lora_rank": 32, "kv_lora_rank": 32, "qk_rope_head_dim": 16, "qk_nope_head_dim": 16, "v_head_dim": 16,
    "vocab_size": 100, "max_position_embeddings": 4096, "num_nextn_predict_layers": 1,
    "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]},
}


def _tiny_dsv3_spec(expert_fmt: str) -> dict[str, tuple[str, list[int]]]:
    h, I = 64, 32
    t: dict[str, tuple[str, list[int]]] = {"model.embed_tokens.weight": ("BF16", [100, h]),
                                           "lm_head.weight": ("BF16", [100, h]), "model.norm.weight": ("BF16", [h])}

    def fp8(name: str, shape: list[int]) -> None:
        t[name + ".weight"] = ("F8_E4M3", shape)
        t[name + ".weight_scale_inv"] = ("F32", [1, 1])

    def nvfp4(name: str, shape: list[int]) -> None:
        t[name + ".weight"] = ("U8", [shape[0], shape[1] // 2])
        t[name + ".weight_scale"] = ("F8_E4M3", [shape[0], shape[1] // 16])
        t[name + ".weight_scale_2"] = ("F32", [])

    for i in range(3):  # layer 2 is the MTP layer
        pre = f"model.layers.{i}."
        for n, shape in (("self_attn.q_a_proj", [32, h]), ("self_attn.q_b_proj", [2 * 32, 32]),
                         ("self_attn.kv_a_proj_with_mqa", [48, h]), ("self_attn.kv_b_proj", [2 * 32, 32]),
                         ("self_attn.o_proj", [h, 32])):
            fp8(pre + n, shape)
        t[pre + "input_layernorm.weight"] = ("BF16", [h])
        if i == 0:
            for n, shape in (("gate_proj", [128, h]), ("up_proj", [128, h]), ("down_proj", [h, 128])):
                fp8(f"{pre}mlp.{n}", shape)
            continue
        t[pre + "mlp.gate.weight"] = ("BF16", [4, h])
        for n, shape in (("gate_proj", [I, h]), ("up_proj", [I, h]), ("down_proj", [h, I])):
            fp8(f"{pre}mlp.shared_experts.{n}", shape)
            for e in range(4):
                (nvfp4 if expert_fmt == "nvfp4" else fp8)(f"{pre}mlp.experts.{e}.{n}", shape)
    return t


@pytest.mark.parametrize("expert_fmt", ["fp8", "nvfp4"])
def test_checkpoint_precisions_from_headers(tmp_path, expert_fmt):
    ckpt = tmp_path / f"tiny-dsv3-{expert_fmt}"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps(TINY_DSV3))
    spec = _tiny_dsv3_spec(expert_fmt)
    _write_raw_safetensors(ckpt / "model.safetensors", spec)
    s = spec_from_config(ckpt)
    assert s.expert_precision == expert_fmt
    assert s.dense_precision == "fp8"  # attention + dense FFN + shared experts are FP8; embeddings do not count
    # packed FP4 holds two weights per byte: the routed count still equals the config's geometry
    assert s.routed_expert_params == 1 * 4 * 3 * 64 * 32
    dense_bytes = sum(1 * int(np.prod(sh)) if dt in ("F8_E4M3", "U8") else {"BF16": 2, "F32": 4}[dt] * int(np.prod(sh))
                      for n, (dt, sh) in spec.items() if ".layers.2." not in n and ".experts." not in n)
    assert s.dense_bytes() == dense_bytes
    assert s.mtp_layers == 1 and s.mtp_params_b > 0


# --------------------------------------------------------------------------- bad input


def _cfg(tmp_path: Path, base: str, **changes) -> Path:
    data = json.loads((FIXTURES / base / "config.json").read_text())
    for k, v in changes.items():
        if v is None:
            data.pop(k, None)
        else:
            data[k] = v
    d = tmp_path / base
    d.mkdir()
    (d / "config.json").write_text(json.dumps(data))
    return d


def test_missing_top_k_names_the_field(tmp_path):
    d = _cfg(tmp_path, "qwen3-30b-a3b", num_experts_per_tok=None)
    with pytest.raises(ConfigError, match=r"config\.json: missing 'num_experts_per_tok' \(needed for MoE top-k\)"):
        spec_from_config(d)


@pytest.mark.parametrize("base, field", [("deepseek-v3", "kv_lora_rank"), ("mixtral-8x7b", "num_local_experts"),
                                         ("glm-4.7", "n_routed_experts"), ("gpt-oss-120b", "hidden_size")])
def test_missing_fields_named_per_family(tmp_path, base, field):
    with pytest.raises(ConfigError, match=rf"missing '{field}'"):
        spec_from_config(_cfg(tmp_path, base, **{field: None}))


def test_wrong_type_named(tmp_path):
    with pytest.raises(ConfigError, match=r"field 'hidden_size' must be a positive integer \(got '2048'\)"):
        spec_from_config(_cfg(tmp_path, "qwen3-30b-a3b", hidden_size="2048"))


def test_top_k_above_experts(tmp_path):
    with pytest.raises(ConfigError, match="num_experts_per_tok"):
        spec_from_config(_cfg(tmp_path, "mixtral-8x7b", num_experts_per_tok=9))


def test_unsupported_and_dense_models(tmp_path):
    with pytest.raises(ConfigError, match=r"model_type 'llama' is not a supported Mixture-of-Experts family"):
        spec_from_config(_cfg(tmp_path, "mixtral-8x7b", model_type="llama"))
    d = tmp_path / "v4"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "deepseek_v4"}))
    with pytest.raises(ConfigError, match="--model deepseek-v4-flash"):
        spec_from_config(d)


def test_unknown_quantization_named(tmp_path):
    d = _cfg(tmp_path, "mixtral-8x7b", quantization_config={"quant_method": "gptq"})
    with pytest.raises(ConfigError, match="quantization_config"):
        spec_from_config(d)


def test_invalid_json_and_missing_config(tmp_path):
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match=r"config\.json: not valid JSON"):
        spec_from_config(tmp_path / "broken")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="no config.json"):
        spec_from_config(tmp_path / "empty")


# --------------------------------------------------------------------------- resolve_model


def test_resolve_model_by_path_or_name(tmp_path):
    assert resolve_model(str(FIXTURES / "mixtral-8x7b")).id == "local:mixtral-8x7b"
    assert resolve_model(str(FIXTURES / "mixtral-8x7b" / "config.json")).id == "local:mixtral-8x7b"
    shutil.copy(FIXTURES / "qwen3-30b-a3b" / "config.json", tmp_path / "my-qwen.json")
    assert resolve_model(str(tmp_path / "my-qwen.json")).id == "local:my-qwen"
    assert resolve_model("glm5.2").id == "glm-5.2"
    with pytest.raises(UnknownNameError, match="glm-5.2"):
        resolve_model("glm-5.3")
    with pytest.raises(ConfigError, match="no such checkpoint folder"):
        resolve_model(str(tmp_path / "nope"))
    assert resolve_model(str(FIXTURES / "glm-5.2")).dense_gib_published is None  # no shards: formulas
    assert resolve_model("kimi-k2.7-code").dense_bytes() == pytest.approx((22.71 + 1.2) * GIB)  # + vision tower


def test_loose_json_ignores_unrelated_shards_beside_it(tmp_path):
    tensors, _ = _tiny_qwen_tensors(TINY_QWEN, n_experts=3)  # would fail the expert check if read
    _write_checkpoint(tmp_path, TINY_QWEN, tensors)
    (tmp_path / "other.json").write_text(json.dumps(TINY_QWEN))
    s = spec_from_config(tmp_path / "other.json")
    assert s.id == "local:other" and s.dense_gib_published is None


TINY_OSS = {
    "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "hidden_size": 64, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "num_local_experts": 4,
    "num_experts_per_tok": 2, "intermediate_size": 64, "sliding_window": 8,
    "layer_types": ["sliding_attention", "full_attention"], "vocab_size": 100, "max_position_embeddings": 4096,
    "quantization_config": {"quant_method": "mxfp4"},
}


def test_gpt_oss_fused_mxfp4_headers(tmp_path):
    h, I, E = 64, 64, 4
    spec: dict[str, tuple[str, list[int]]] = {"model.embed_tokens.weight": ("BF16", [100, h]),
                                              "lm_head.weight": ("BF16", [100, h])}
    for i in range(2):
        pre = f"model.layers.{i}.mlp."
        spec.update({
            pre + "router.weight": ("BF16", [E, h]), pre + "router.bias": ("BF16", [E]),
            # e2m1 codes packed two per byte in blocks of 32 (16 bytes) + one e8m0 scale per block
            pre + "experts.gate_up_proj_blocks": ("U8", [E, 2 * I, h // 32, 16]),
            pre + "experts.gate_up_proj_scales": ("U8", [E, 2 * I, h // 32]),
            pre + "experts.gate_up_proj_bias": ("BF16", [E, 2 * I]),
            pre + "experts.down_proj_blocks": ("U8", [E, h, I // 32, 16]),
            pre + "experts.down_proj_scales": ("U8", [E, h, I // 32]),
            pre + "experts.down_proj_bias": ("BF16", [E, h]),
            f"model.layers.{i}.self_attn.q_proj.weight": ("BF16", [64, h]),
        })
    ckpt = tmp_path / "tiny-oss"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps(TINY_OSS))
    _write_raw_safetensors(ckpt / "model.safetensors", spec)
    s = spec_from_config(ckpt)
    assert (s.expert_precision, s.dense_precision) == ("mxfp4", "bf16")
    assert s.routed_expert_params == 2 * E * 3 * h * I
    # expert biases and the router stay with the non-routed weights; block scales do not count as weights
    assert s.non_routed_params_b * 1e9 == 2 * 100 * h + 2 * (E * h + E + E * 2 * I + E * h + 64 * h)


def test_compressed_tensors_int4_headers(tmp_path):
    cfg = json.loads((FIXTURES / "kimi-k2.7-code" / "config.json").read_text())
    tc = dict(cfg["text_config"], hidden_size=64, num_hidden_layers=2, first_k_dense_replace=1, intermediate_size=128,
              moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2, num_attention_heads=2,
              q_lora_rank=32, kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16, vocab_size=100)
    cfg["text_config"] = tc
    spec = {n: v for n, v in _tiny_dsv3_spec("fp8").items() if ".layers.2." not in n}
    for n in [n for n in spec if ".experts." in n]:  # routed experts as pack-quantized int4, group 32
        del spec[n]
    for e in range(4):
        for proj, (o, i_) in (("gate_proj", (32, 64)), ("up_proj", (32, 64)), ("down_proj", (64, 32))):
            base = f"model.layers.1.mlp.experts.{e}.{proj}."
            spec[base + "weight_packed"] = ("I32", [o, i_ // 8])
            spec[base + "weight_scale"] = ("BF16", [o, i_ // 32])
            spec[base + "weight_shape"] = ("I32", [2])
    ckpt = tmp_path / "tiny-kimi"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps(cfg))
    _write_raw_safetensors(ckpt / "model.safetensors", spec)
    s = spec_from_config(ckpt)
    assert s.expert_precision == "int4" and s.family == "kimi_k25"
    assert s.routed_expert_params == 4 * 3 * 64 * 32

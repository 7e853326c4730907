"""Tiny embedded checkpoints: generated once with a local tokenizer, cached, readable as ModelSpecs, plannable."""
from __future__ import annotations

import json

import pytest
from safetensors import safe_open

from moetplan.contract.errors import UnknownNameError
from moetplan.models import tiny


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("tiny-cache")


@pytest.mark.parametrize("name,arch,expert_key", [
    ("tiny-moe", "Qwen3MoeForCausalLM", "model.layers.0.mlp.experts.15.down_proj.weight"),
    ("tiny-moe-mla", "DeepseekV3ForCausalLM", "model.layers.1.mlp.experts.15.gate_proj.weight"),
])
def test_generate_once_then_cached(cache, name, arch, expert_key):
    path = tiny.ensure_tiny_checkpoint(name, cache)
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["architectures"] == [arch] and cfg["vocab_size"] == 512
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        assert expert_key in keys
        assert f.get_tensor(expert_key).dtype.is_floating_point and str(f.get_tensor(expert_key).dtype) == \
            "torch.bfloat16"
    stamp = (path / "model.safetensors").stat().st_mtime_ns
    assert tiny.ensure_tiny_checkpoint(name, cache) == path
    assert (path / "model.safetensors").stat().st_mtime_ns == stamp  # not regenerated
    assert not [p for p in cache.iterdir() if p.name.startswith(".")]  # no temp folders left behind


def test_mla_variant_has_the_cpu_kernel_geometry_and_router(cache):
    cfg = json.loads((tiny.ensure_tiny_checkpoint("tiny-moe-mla", cache) / "config.json").read_text())
    assert cfg["kv_lora_rank"] == 512 and cfg["qk_rope_head_dim"] == 64
    assert cfg["topk_method"] == "noaux_tc" and cfg["num_nextn_predict_layers"] == 0


def test_qwen_config_keeps_the_original_key_names(cache):
    cfg = json.loads((tiny.ensure_tiny_checkpoint("tiny-moe", cache) / "config.json").read_text())
    assert cfg["num_experts"] == 16 and cfg["num_experts_per_tok"] == 4


def test_local_tokenizer_round_trips(cache):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny.ensure_tiny_checkpoint("tiny-moe", cache)))
    text = "hello world, the model serves 42 tokens"
    ids = tok(text)["input_ids"]
    assert max(ids) < 512 and tok.decode(ids) == text
    assert tok.eos_token_id == 1 and tok.bos_token_id == 0


def test_spec_from_the_checkpoint_and_a_cpu_plan(cache):
    from moetplan.plan.cpu_backend import plan_for_cpu
    from moetplan.models import resolve_model

    spec = resolve_model(str(tiny.ensure_tiny_checkpoint("tiny-moe-mla", cache)))
    assert spec.n_routed_experts == 16 and spec.top_k == 4 and spec.attention.kind == "mla"
    assert spec.moe_layers == 1  # first layer dense
    plan = plan_for_cpu(spec, expert_format="unquantized")
    assert plan.placement.expert_format == "unquantized" and not plan.hardware.gpus
    assert plan.memory.host_gib > 0


def test_unknown_tiny_name_suggests():
    with pytest.raises(UnknownNameError, match="tiny-moe"):
        tiny.get_tiny("tiny-mo")


def test_cache_root_follows_env(monkeypatch, tmp_path):
    monkeypatch.setenv("MOETPLAN_CACHE_DIR", str(tmp_path))
    assert tiny.checkpoint_dir("tiny-moe").parent == tmp_path / "tiny"


def test_fp8_export_holds_exactly_the_bf16_expert_values(cache):
    import torch
    from safetensors.torch import load_file

    base = load_file(str(tiny.ensure_tiny_checkpoint("tiny-moe", cache) / "model.safetensors"))
    fp8_dir = tiny.ensure_tiny_checkpoint("tiny-moe-fp8", cache)
    fp8 = load_file(str(fp8_dir / "model.safetensors"))
    cfg = json.loads((fp8_dir / "config.json").read_text())
    qc = cfg["quantization_config"]
    assert qc["quant_method"] == "fp8" and qc["weight_block_size"] == [tiny.FP8_BLOCK, tiny.FP8_BLOCK]
    assert "model.layers.0.self_attn.q_proj" in qc["ignored_layers"] and "lm_head" in qc["ignored_layers"]
    name = "model.layers.1.mlp.experts.3.gate_proj.weight"
    codes, scale = fp8[name], fp8[name + "_scale_inv"]
    assert codes.dtype == torch.float8_e4m3fn and scale.shape == (1, 2)  # gate [64, 128] in 64x64 tiles
    assert torch.log2(scale).frac().abs().max() == 0  # powers of two
    for key, w in base.items():
        if ".experts." in key and key.endswith("_proj.weight"):
            s = fp8[key + "_scale_inv"]
            b = tiny.FP8_BLOCK
            full = s.repeat_interleave(b, 0)[: w.shape[0]].repeat_interleave(b, 1)[:, : w.shape[1]]
            assert torch.equal(fp8[key].double() * full.double(), w.double()), key
        else:
            assert torch.equal(fp8[key], w)

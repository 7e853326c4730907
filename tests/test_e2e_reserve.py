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

from pathlib import Path

import pytest

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm")

from served import plan_file, run_offline  # noqa: E402

PROMPT = "hello world, the model"
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def runs(tmp_path_factory, e2e_env):
    tmp = tmp_path_factory.mktemp("reserve")
    env = e2e_env
    from moetplan.models.tiny import ensure_tiny_checkpoint

    ckpt = ensure_tiny_checkpoint("tiny-moe")
    packs = str(tmp / "packs")
    plans = {
        "plain": plan_file(tmp, ckpt, "2bit", ".plain"),
        "reserve": plan_file(tmp, ckpt, "2bit", ".reserve", fp4_reserve_slots=16, pack_dir=packs),
        "gate": plan_file(tmp, ckpt, "2bit", ".gate", gate={"enabled": True, "tau": 1.0}, promoter="gate",
                          fp4_reserve_slots=32, pack_dir=packs),
        "gate_never": plan_file(tmp, ckpt, "2bit", ".gate_never", gate={"enabled": True, "tau": 0.0},
                                promoter="gate", fp4_reserve_slots=32, pack_dir=packs),
    }
    m = str(ckpt)
    settle = 2.5  # the worker's run-record flusher writes about once a second
    jobs = {  # in this order: the reserve run writes the FP4 pack the gate runs read
        "plain": [m, "moetplan", plans["plain"], settle],
        "reserve": [m, "moetplan", plans["reserve"], settle],  # the background promoter (the default)
        "gate_a": [m, "moetplan", plans["gate"], settle],  # gate-only promoter: tokens independent of timing
        "gate_b": [m, "moetplan", plans["gate"], settle],
        "gate_never": [m, "moetplan", plans["gate_never"], settle],
    }
    plan_of = {name: args[2] for name, args in jobs.items()}
    records: dict[str, dict] = {}
    from moetplan.contract import RunRecord, load_json
    from moetplan.runtime.vllm.records import run_record_path

    # gate_a and gate_b share a plan (and so a run-record path): read gate_a's record before gate_b runs
    first = {k: jobs[k] for k in ("plain", "reserve", "gate_a")}
    rest = {k: jobs[k] for k in ("gate_b", "gate_never")}
    out: dict[str, list[int]] = {}
    for part in (first, rest):
        out.update(run_offline(tmp, part, env, PROMPT, MAX_TOKENS))
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

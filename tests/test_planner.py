"""The planner end to end: solver choices, guards, pinned evaluation, infeasible diagnosis, JSON round trip."""
from __future__ import annotations

import json

import pytest

from moetplan import hwdb
from moetplan.contract.errors import InfeasibleError, UnknownNameError, UsageError
from moetplan.contract.model import GIB
from moetplan.plan import ledger as L
from moetplan.contract import Goals, HardwareProfile, Plan
from moetplan.plan.solver import parse_set, solve

# vLLM-Moet's published (box, model) combinations (hwdb/calibration + hwdb/sources/FACTS.md "published results").
PUBLISHED = [
    ("deepseek-v4-flash", "rtx-pro-6000x1"),
    ("deepseek-v4-flash", "rtx-pro-6000x2"),
    ("deepseek-v4-flash", "rtx-5090x1"),
    ("glm-5.2", "rtx-pro-6000x2"),
    ("glm-5.2", "rtx-pro-6000x4"),
    ("kimi-k2.7-code", "rtx-pro-6000x4"),
]


def _assert_ledger_within(plan: Plan) -> None:
    assert plan.memory.gpus, "a feasible plan has at least one GPU rank"
    for g in plan.memory.gpus:
        assert g.used_gib <= g.budget_gib + 0.01, g
        assert g.budget_gib <= g.total_gib
        assert abs(sum(i.gib for i in g.items) - g.used_gib) < 1e-6
    assert plan.memory.host_gib <= plan.memory.host_total_gib


@pytest.mark.parametrize("model,box", PUBLISHED)
def test_published_combinations_plan_feasibly(model: str, box: str) -> None:
    plan = solve(hwdb.model_spec(model), hwdb.box_profile(box), Goals())
    _assert_ledger_within(plan)
    assert plan.prediction.decode_tok_s > 0
    assert plan.prediction.bottleneck


def test_glm_on_two_pro6000_uses_offload_tier_with_cache() -> None:
    plan = solve(hwdb.model_spec("glm-5.2"), hwdb.box_profile("rtx-pro-6000x2"), Goals())
    p = plan.placement
    assert p.expert_tier in ("host", "nvme")  # 190 GiB of 2-bit experts cannot be resident on 2x96 GB
    assert p.gpu_expert_cache_gib > 0 and p.gpu_expert_cache_slots >= L.cache_floor_slots(plan.model, p)
    assert p.tp == 2


def test_ds4_on_one_5090_host_ram() -> None:
    hw = hwdb.inline_profile("1xrtx-5090", 96, None, None)
    plan = solve(hwdb.model_spec("ds4-flash"), hw, Goals())
    assert plan.placement.expert_tier == "host"  # 72.7 GiB pinned fits in 96 GiB, no pack dir given
    assert plan.placement.gpu_expert_cache_gib > 5
    _assert_ledger_within(plan)


def test_kimi_on_one_4090_says_what_is_short_and_what_fits() -> None:
    hw = hwdb.inline_profile("1xrtx-4090", 32, None, None)
    with pytest.raises(InfeasibleError) as ei:
        solve(hwdb.model_spec("kimi-k2.7-code"), hw, Goals())
    e = ei.value
    text = " ".join(e.shortfalls)
    assert "VRAM" in text and "host RAM" in text and "NVMe" in text
    assert any("GiB" in s for s in e.shortfalls)
    # A 24 GB card cannot hold Kimi's 22.7 GiB dense stack plus a cache: two cards, and a base off the GPU.
    assert any(s.startswith("2x rtx-4090 + host RAM >=") for s in e.suggestions), e.suggestions
    assert any(s.startswith("2x rtx-4090 + an NVMe pack dir") for s in e.suggestions), e.suggestions


def test_resident_when_it_fits() -> None:
    plan = solve(hwdb.model_spec("glm-5.2"), hwdb.box_profile("rtx-pro-6000x4"), Goals())
    assert plan.placement.expert_tier == "resident"
    assert plan.prediction.misses_per_step in (None, 0)


def test_objectives_trade_context_for_decode() -> None:
    spec, hw = hwdb.model_spec("ds4-flash"), hwdb.inline_profile("1xrtx-5090", 96, None, None)
    dec = solve(spec, hw, Goals(objective="decode"))
    ctx = solve(spec, hw, Goals(objective="context"))
    assert ctx.placement.context >= dec.placement.context
    assert dec.prediction.decode_tok_s >= ctx.prediction.decode_tok_s


def test_more_vram_never_hurts() -> None:
    spec = hwdb.model_spec("ds4-flash")
    small = solve(spec, hwdb.inline_profile("1xrtx-5090", 96, None, None), Goals(objective="decode"))
    big = solve(spec, hwdb.inline_profile("1xrtx-pro-6000", 96, None, None), Goals(objective="decode"))
    assert big.prediction.decode_tok_s >= small.prediction.decode_tok_s


def test_context_goal_is_respected_and_costs_cache() -> None:
    spec, hw = hwdb.model_spec("ds4-flash"), hwdb.inline_profile("1xrtx-5090", 96, None, None)
    # With MTP the pool keeps vLLM-Moet's 1.7 GiB floor: a 1M window (4.96 KB/token) is what outgrows it.
    short = solve(spec, hw, Goals(pinned=parse_set(["context=8192", "expert_tier=host", "mtp=1"])))
    long = solve(spec, hw, Goals(pinned=parse_set(["context=1048576", "expert_tier=host", "mtp=1"])))
    assert short.placement.context == 8192 and long.placement.context == 1048576
    assert long.placement.kv_cache_gib > short.placement.kv_cache_gib
    assert long.placement.gpu_expert_cache_gib < short.placement.gpu_expert_cache_gib


# --------------------------------------------------------------------------- pins and guards


def test_fully_pinned_evaluates_that_configuration() -> None:
    spec, hw = hwdb.model_spec("ds4-flash"), hwdb.inline_profile("1xrtx-5090", 96, None, None)
    pins = parse_set(["tp=1", "pp=1", "expert_tier=host", "gpu_expert_cache_gib=9.5", "fp4_reserve_gib=0",
                      "host_arena_gib=0", "kv_dtype=fp8", "context=32768", "mtp=2", "mtp_acceptance=2.7",
                      "max_num_seqs=1", "concurrency=1", "gpu_memory_utilization=0.9"])
    plan = solve(spec, hw, Goals(pinned=pins))
    p = plan.placement
    assert (p.tp, p.expert_tier, p.kv_dtype, p.context, p.mtp, p.max_num_seqs) == (1, "host", "fp8", 32768, 2, 1)
    # the pinned GiB becomes whole 2-bit rows (what the runtime allocates); the GiB shown is those rows' bytes
    row = spec.expert_bytes("2bit", 1)
    assert p.gpu_expert_cache_slots == int(9.5 * 2**30 // row) and p.expert_row_bytes == row
    assert p.gpu_expert_cache_gib == p.gpu_expert_cache_slots * row / 2**30 == pytest.approx(9.5, abs=row / 2**30)
    assert p.mtp_acceptance == 2.7 and p.gpu_memory_utilization == 0.9
    assert all("pinned" in r.text for r in plan.reasons if r.knob in ("tp", "kv_dtype", "context"))


def test_pinned_cache_below_floor_is_refused_naming_the_floor() -> None:
    spec, hw = hwdb.model_spec("ds4-flash"), hwdb.inline_profile("1xrtx-5090", 96, None, None)
    with pytest.raises(InfeasibleError) as ei:
        solve(spec, hw, Goals(pinned=parse_set(["expert_tier=host", "gpu_expert_cache_gib=1", "mtp=0"])))
    assert "floor" in " ".join(ei.value.shortfalls)


def test_cache_floor_matches_vllm_moet_rule() -> None:
    spec = hwdb.model_spec("glm-5.2")
    from moetplan.contract import Placement

    p = Placement(tp=2, mtp=2, max_num_seqs=1, concurrency=1)
    # 1.15 x 75 MoE layers x top-8 x (1 + 2 speculative) x min(1, 4)
    assert L.cache_floor_slots(spec, p) == -(-int(1.15 * 75 * 8 * 3 * 100) // 100)
    p8 = Placement(tp=2, mtp=0, max_num_seqs=8, concurrency=8)
    assert L.step_working_set_slots(spec, p8) == 75 * 8 * 4  # seqs capped at 4


def test_resident_fit_guard_reported() -> None:
    plan = solve(hwdb.model_spec("glm-5.2"), hwdb.box_profile("rtx-pro-6000x4"), Goals())
    assert any(g.startswith("resident fit") and g.endswith("ok") for g in plan.memory.guards)


def test_memlock_limit_blocks_pinned_store() -> None:
    hw = hwdb.inline_profile("1xrtx-5090", 96, None, None)
    hw.host.memlock_bytes = 8 * 2**20
    spec = hwdb.model_spec("ds4-flash")
    with pytest.raises(InfeasibleError) as ei:
        solve(spec, hw, Goals(pinned=parse_set(["expert_tier=host"])))
    assert "memlock" in " ".join(ei.value.shortfalls)


def test_parse_set_errors_name_the_knob() -> None:
    with pytest.raises(UsageError, match="unknown knob 'cache_gib'"):
        parse_set(["cache_gib=4"])
    with pytest.raises(UsageError, match="expected name=value"):
        parse_set(["tp"])
    with pytest.raises(UsageError, match="tp=two: .*whole number"):
        parse_set(["tp=two"])
    with pytest.raises(UsageError, match="expert_tier"):
        parse_set(["expert_tier=ssd"])
    assert parse_set(["context=128k"])["context"] == 131072


def test_pinned_tp_beyond_gpus_is_infeasible() -> None:
    with pytest.raises(InfeasibleError, match="needs 4 GPUs"):
        solve(hwdb.model_spec("ds4-flash"), hwdb.box_profile("rtx-pro-6000x2"), Goals(pinned={"tp": 4}))


def test_unknown_model_suggests_close_names() -> None:
    with pytest.raises(UnknownNameError) as ei:
        hwdb.model_spec("glm-5.3")
    assert "glm-5.2" in str(ei.value)


# --------------------------------------------------------------------------- schema round trip


def test_plan_json_round_trip_and_schema(tmp_path) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    from moetplan.contract import load_json, save_json

    plan = solve(hwdb.model_spec("glm-5.2"), hwdb.box_profile("rtx-pro-6000x2"), Goals())
    path = tmp_path / "plan.json"
    save_json(plan, path)
    again = load_json(Plan, path)
    assert again == plan
    doc = json.loads(path.read_text())
    jsonschema.validate(doc, Plan.model_json_schema())
    for key in ("tp", "pp", "expert_tier", "gpu_expert_cache_gib", "fp4_reserve_gib", "host_arena_gib", "kv_dtype",
                "context", "mtp", "max_num_seqs"):
        assert key in doc["placement"]
    assert {"total_gib", "used_gib"} <= set(doc["memory"]["gpus"][0])
    assert {"decode_tok_s", "prefill_tok_s", "bottleneck"} <= set(doc["prediction"])
    assert doc["schema_version"] and doc["model"]["id"] == "glm-5.2"
    assert "host_gib" in doc["memory"] and "disk_gib" in doc["memory"]


def test_corrupt_plan_json_names_the_field(tmp_path) -> None:
    from moetplan.contract import SchemaError, load_json

    plan = solve(hwdb.model_spec("ds4-flash"), hwdb.box_profile("rtx-pro-6000x1"), Goals())
    doc = json.loads(plan.model_dump_json())
    doc["placement"]["tp"] = "two"
    p = tmp_path / "bad.json"
    p.write_text(json.dumps(doc))
    with pytest.raises(SchemaError, match="placement.tp"):
        load_json(Plan, p)
    p.write_text("{not json")
    with pytest.raises(SchemaError, match="not valid JSON"):
        load_json(Plan, p)


def test_no_gpu_profile_is_refused_with_a_box_hint() -> None:
    hw = HardwareProfile(host=hwdb.box_profile("rtx-5090x1").host)
    with pytest.raises(InfeasibleError, match="no GPU"):
        solve(hwdb.model_spec("ds4-flash"), hw, Goals())


def test_kv_bytes_follow_context() -> None:
    plan = solve(hwdb.model_spec("glm-5.2"), hwdb.box_profile("rtx-pro-6000x4"),
                 Goals(pinned=parse_set(["context=131072", "kv_dtype=fp8"])))
    need = plan.model.kv_bytes("fp8", 131072) / GIB
    assert plan.placement.kv_cache_gib >= need - 1e-3


def test_pinned_infeasible_names_the_pinned_problem() -> None:
    spec, hw = hwdb.model_spec("ds4-flash"), hwdb.inline_profile("1xrtx-5090", 96, None, None)
    with pytest.raises(InfeasibleError) as ei:
        solve(spec, hw, Goals(pinned=parse_set(["expert_tier=host", "gpu_expert_cache_gib=9.5", "mtp=2",
                                                "max_num_seqs=2", "concurrency=2"])))
    assert "floor" in ei.value.shortfalls[0]


def test_plans_from_the_committed_h200_probe() -> None:
    """bench/results/hw_h200_probe.json is a real `moetplan probe` of an H200 machine (issue 4's reference)."""
    from pathlib import Path

    from moetplan.contract import load_json

    hw = load_json(HardwareProfile, Path(__file__).parent.parent / "bench/results/hw_h200_probe.json")
    g = hw.gpus[0]
    assert g.hwdb_id == "h200" and g.sources["h2d_pinned_gbps"] == "measured"
    assert (g.pcie_gen_max, g.pcie_width_max) == (5, 16)
    assert abs(g.h2d_pinned_gbps - 55) / 55 <= 0.15
    assert hw.storage.sources["seq_read_gbps"] == "measured" and hw.storage.seq_read_gbps > 0
    plan = solve(hwdb.model_spec("ds4-flash"), hw, Goals())
    assert plan.placement.expert_tier == "resident"  # 72.7 GiB of 2-bit experts fit in 139 GiB
    _assert_ledger_within(plan)
    # 190 GiB of GLM experts fit neither that VM's 126 GiB RAM nor its 64 GiB disk: said so, with what would fit.
    with pytest.raises(InfeasibleError) as ei:
        solve(hwdb.model_spec("glm-5.2"), hw, Goals())
    assert any("64 GiB free" in s for s in ei.value.shortfalls)
    assert any("2x h200" in s for s in ei.value.suggestions)
    hw.storage.free_gib = 2000  # the same machine with a big NVMe: packs + arena + GPU cache
    glm = solve(hwdb.model_spec("glm-5.2"), hw, Goals())
    assert glm.placement.expert_tier == "nvme" and glm.placement.gpu_expert_cache_gib > 50

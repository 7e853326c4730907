"""Choices a practitioner would make, and the engine support matrix: reserve, KV validated windows, MTP on a
tiered store, the arena and the page cache, GPU use, the Eagle3 drafter, unsupported GPU families."""
from __future__ import annotations

import json

import pytest

from moetplan import hwdb
from moetplan.contract import Goals
from moetplan.contract.errors import InfeasibleError, UsageError
from moetplan.plan import ledger as L
from moetplan.plan import support
from moetplan.plan.solver import parse_set, search, solve


def _solve(model: str, hw, *pins: str, **goals):
    return solve(hwdb.model_spec(model), hw, Goals(pinned=parse_set(list(pins)), **goals))


@pytest.mark.parametrize("box", ["rtx-pro-6000x1", "rtx-5090x1", "rtx-5090x4"])
def test_ds4_always_carries_an_fp4_reserve(box):
    plan = _solve("deepseek-v4-flash", hwdb.box_profile(box))
    assert plan.placement.fp4_reserve_gib >= 1.0
    assert "unsupported for serving" in next(r.text for r in plan.reasons if r.knob == "fp4_reserve_gib")


def test_a_pinned_ds4_reserve_of_zero_plans_with_a_warning():
    plan = _solve("deepseek-v4-flash", hwdb.box_profile("rtx-pro-6000x1"), "fp4_reserve_gib=0")
    assert plan.placement.fp4_reserve_gib == 0
    assert any("unsupported for serving" in w for w in plan.warnings)


def test_nvfp4_kv_stays_within_its_validated_window_unless_asked():
    glm, hw = hwdb.model_spec("glm-5.2"), hwdb.box_profile("rtx-pro-6000x4")
    cands = search(glm, hw, Goals(objective="context"))
    nvfp4 = [c.placement.context for c in cands if c.placement.kv_dtype == "nvfp4"]
    assert nvfp4 and max(nvfp4) <= support.validated_context("nvfp4") == 131072
    assert max(c.placement.context for c in cands) > 131072  # fp8 goes further
    asked = solve(glm, hw, Goals(context=262144, pinned=parse_set(["kv_dtype=nvfp4"])))
    assert asked.placement.kv_dtype == "nvfp4" and asked.placement.context >= 262144


def test_the_consumer_card_plan_picks_mtp_and_context_for_decode_speed():
    """One RTX 5090 + 96 GiB: every MTP depth is priced on the tiered store and the fastest kept; balanced keeps the
    longest window that costs no decode and says what longer ones cost; the prediction lands in vLLM-Moet's
    measured range on that card (27-43 tok/s with MTP-2 at 8-32K)."""
    hw = hwdb.inline_profile("1xrtx-5090", 96)
    ds4 = hwdb.model_spec("deepseek-v4-flash")
    cands = search(ds4, hw, Goals())
    assert {c.placement.mtp for c in cands if c.placement.expert_tier != "resident"} >= {1, 2, 3}
    plan = _solve("deepseek-v4-flash", hw)
    p = plan.placement
    same_ctx = [c for c in cands if c.placement.context == p.context and c.placement.expert_tier == p.expert_tier]
    assert plan.prediction.decode_tok_s == pytest.approx(max(c.prediction.decode_tok_s for c in same_ctx))
    assert p.mtp == 2 and 27 <= plan.prediction.decode_tok_s <= 43
    best = max(c.prediction.decode_tok_s for c in cands)
    assert plan.prediction.decode_tok_s >= L.guards()["planner"]["balanced_keep_decode"] * best
    context = next(r.text for r in plan.reasons if r.knob == "context")
    assert "longer windows cost decode" in context and "1048576 tokens" in context
    pinned = _solve("deepseek-v4-flash", hw, "expert_tier=host", "mtp=1")
    assert pinned.placement.mtp == 1


def test_the_arena_leaves_the_page_cache_its_share():
    hw = hwdb.box_profile("rtx-pro-6000x2")  # 128 GiB: GLM's 190 GiB base cannot be pinned here
    plan = _solve("glm-5.2", hw, "expert_tier=nvme")
    p = plan.placement
    ranks = p.tp * p.pp
    page_cache = hw.host.ram_gib - L.host_reserve_gib(hw) - p.host_arena_gib * ranks
    assert p.host_arena_gib > 4
    assert page_cache >= L.guards()["host"]["page_cache_share"] * hw.host.ram_gib


def test_fewer_gpus_than_the_machine_has_come_with_a_reason():
    hw = hwdb.box_profile("rtx-pro-6000x4")
    for model in ("deepseek-v4-flash", "glm-5.2", "kimi-k2.7-code"):
        plan = _solve(model, hw)
        text = next(r.text for r in plan.reasons if r.knob == "tp")
        ranks = plan.placement.tp * plan.placement.pp
        assert (ranks == hw.num_gpus) or "all 4 GPUs" in text, (model, text)


def test_kimi_eagle3_drafter_is_planned_and_launched():
    from moetplan.launch.command import build_launch

    kimi, hw = hwdb.model_spec("kimi-k2.7-code"), hwdb.box_profile("rtx-pro-6000x4")
    cands = search(kimi, hw, Goals())
    assert any(c.placement.mtp > 0 for c in cands)  # the drafter is one of the choices, not opt-in
    plan = solve(kimi, hw, Goals(pinned=parse_set(["mtp=2"])))
    assert any(i.name == "drafter" for i in plan.memory.gpus[0].items)
    argv = build_launch(plan).argv
    spec = json.loads(argv[argv.index("--speculative-config") + 1])
    assert spec == {"method": "eagle3", "model": kimi.drafter_hf_repo, "num_speculative_tokens": 2}
    assert "drafter" in next(r.text for r in plan.reasons if r.knob == "mtp")


def test_glm_on_rtx_40_is_refused_with_the_reason_and_the_nearest_family():
    with pytest.raises(InfeasibleError) as ei:
        _solve("glm-5.2", hwdb.inline_profile("2xrtx-4090", 256))
    e = ei.value
    assert "does not run on GeForce RTX 4090" in str(e) and "sm_89" in str(e) and "current vLLM" in str(e)
    assert any("no sparse-MLA backend" in s and "DeepGEMM" in s for s in e.shortfalls)
    assert any("sm_90" in s for s in e.suggestions) and any("sm_120" in s for s in e.suggestions)


def test_the_matrix_follows_the_source():
    rows = {r.family: r for r in support.matrix(hwdb.model_spec("glm-5.2"))}
    assert not rows["sm_86"].supported and not rows["sm_89"].supported
    assert rows["sm_120"].backends == ("FLASHINFER_MLA_SPARSE_SM120",) and rows["sm_90"].supported
    kimi = {r.family: r for r in support.matrix(hwdb.model_spec("kimi-k2.7-code"))}
    assert kimi["sm_86"].supported and kimi["sm_86"].backends == ("TRITON_MLA",)
    assert kimi["sm_86"].kv_dtypes == ("bf16",)  # fp8 KV needs sm_89+
    plan = _solve("kimi-k2.7-code", hwdb.inline_profile("8xrtx-3090", 512))
    assert plan.placement.kv_dtype == "bf16"
    ds4 = {r.family: r for r in support.matrix(hwdb.model_spec("deepseek-v4-flash"))}
    assert not ds4["sm_89"].supported and ds4["sm_120"].supported


@pytest.mark.parametrize("conc", [0, -3])
def test_concurrency_below_one_is_a_usage_error(conc):
    with pytest.raises(UsageError, match="--concurrency"):
        _solve("deepseek-v4-flash", hwdb.box_profile("rtx-pro-6000x1"), concurrency=conc)


def test_context_above_the_model_maximum_names_the_maximum():
    with pytest.raises(UsageError, match="at most 262144 tokens"):
        _solve("kimi-k2.7-code", hwdb.box_profile("rtx-pro-6000x4"), context=1_000_000)
    with pytest.raises(UsageError, match="at most 262144 tokens"):
        _solve("kimi-k2.7-code", hwdb.box_profile("rtx-pro-6000x4"), "context=300000")


@pytest.mark.parametrize("model,gpus,rams,frees", [
    ("deepseek-v4-flash", ["1xrtx-4090", "1xrtx-5090"], [32, 64, 96, 128], [None, 400]),
    ("glm-5.2", ["2xrtx-5090", "4xrtx-5090"], [96, 256], [None, 1800]),
    ("kimi-k2.7-code", ["1xrtx-5090", "2xrtx-4090"], [64, 512], [None, 1800]),
])
def test_feasible_agrees_with_search(model, gpus, rams, frees):
    """What diagnose() prints as 'would fit' is checked with feasible(): it must say exactly what search finds,
    on both sides of the boundary."""
    from moetplan.plan.solver import feasible

    spec = hwdb.model_spec(model)
    answers = set()
    for g in gpus:
        for ram in rams:
            for free in frees:
                hw = hwdb.inline_profile(g, ram, 3.2 if free else None, free)
                try:
                    found = bool(search(spec, hw, Goals()))
                except InfeasibleError:
                    found = False
                assert feasible(spec, hw, Goals()) == found, (g, ram, free)
                answers.add(found)
    assert answers == {True, False}  # the grid straddles the boundary

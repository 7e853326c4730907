"""The cost model on the target models and boxes from hwdb: bottlenecks the issue names, what-ifs."""
from __future__ import annotations

import pytest

from moetplan import hwdb
from moetplan.cost_model import load_calibration, predict
from moetplan.plan.whatifs import whatifs
from moetplan.cost_model.terms import ALLREDUCE, DENSE, EXPERTS, MISS_HOST, MISS_NVME
from moetplan.contract import Placement


@pytest.fixture(autouse=True)
def _no_user_calibration(tmp_path, monkeypatch):
    monkeypatch.setenv("MOETPLAN_CONFIG_DIR", str(tmp_path / "config"))


def test_ds4_on_one_5090_host_tier_is_miss_bound():
    ds4, hw = hwdb.model_spec("deepseek-v4-flash"), hwdb.box_profile("rtx-5090x1")
    p = predict(ds4, hw, Placement.for_model(ds4, expert_tier="host", gpu_expert_cache_gib=14, context=32768, mtp=2))
    assert p.bottleneck == MISS_HOST
    miss = next(t for t in p.terms if t.name == MISS_HOST)
    assert miss.share > 0.5
    assert 15 < p.decode_tok_s < 60  # vLLM-Moet: ~31-33 tok/s on this box
    assert p.token_hit_rate > 0.9 and p.zero_miss_step_share < 0.5


def test_ds4_nvme_tier_names_the_nvme_path():
    ds4, hw = hwdb.model_spec("deepseek-v4-flash"), hwdb.box_profile("rtx-5090x1")
    p = predict(ds4, hw, Placement.for_model(ds4, expert_tier="nvme", gpu_expert_cache_gib=14, host_arena_gib=20,
                                   context=32768, mtp=2))
    assert p.bottleneck == MISS_NVME


def test_glm_on_four_pro6000_resident_is_memory_bandwidth_bound_on_expert_reads():
    glm, hw = hwdb.model_spec("glm-5.2"), hwdb.box_profile("rtx-pro-6000x4")
    single = predict(glm, hw, Placement(tp=4, context=131072, mtp=2, max_num_seqs=4))
    reads = sum(t.ms for t in single.terms if t.name in (DENSE, EXPERTS))
    assert reads > next(t.ms for t in single.terms if t.name == ALLREDUCE)
    assert 60 < single.decode_tok_s < 160  # vLLM-Moet: 105 tok/s
    assert single.bottleneck.startswith("memory bandwidth") and EXPERTS in single.bottleneck
    batched = predict(glm, hw, Placement(tp=4, context=131072, mtp=2, max_num_seqs=4, concurrency=4))
    # Batched, routed expert reads lead the memory-bandwidth group.
    assert batched.bottleneck.startswith("memory bandwidth: " + EXPERTS)
    assert batched.aggregate_tok_s > single.decode_tok_s


def test_kimi_default_curve_and_prediction_range():
    kimi, hw = hwdb.model_spec("kimi-k2.7-code"), hwdb.box_profile("rtx-pro-6000x4")
    p = predict(kimi, hw, Placement.for_model(kimi, tp=4, context=32768, fp4_reserve_gib=2.7, max_num_seqs=8))
    assert 25 < p.decode_tok_s < 100  # vLLM-Moet: 51 tok/s


def test_whatifs_for_the_5090_plan():
    ds4, hw = hwdb.model_spec("deepseek-v4-flash"), hwdb.box_profile("rtx-5090x1")
    pl = Placement.for_model(ds4, expert_tier="host", gpu_expert_cache_gib=14, context=32768, mtp=2)
    lines = whatifs(ds4, hw, pl)
    assert lines and any(line.startswith("+4 GiB GPU expert cache") for line in lines)
    cache = next(line for line in lines if line.startswith("+4 GiB GPU expert cache"))
    assert "miss steps" in cache and "tok/s" in cache
    more = predict(ds4, hw, pl.resized(ds4, gpu_expert_cache_gib=18))
    assert more.decode_tok_s > predict(ds4, hw, pl).decode_tok_s


def test_whatifs_say_which_changes_do_not_fit():
    from moetplan.contract import Goals
    from moetplan.plan.solver import solve

    ds4, hw = hwdb.model_spec("deepseek-v4-flash"), hwdb.box_profile("rtx-5090x1")
    plan = solve(ds4, hw, Goals(context=32768, pinned={"expert_tier": "host"}))
    lines = whatifs(ds4, hw, plan.placement)
    # The solver gives the GPU expert cache all the VRAM left after the KV pool: 4 GiB more is 4 GiB short; 4 GiB
    # less stays above the cache floor of one step's working set and fits. Lines that fit come first.
    more = next(line for line in lines if line.startswith("+4 GiB GPU expert cache"))
    assert "does not fit as planned" in more and "short 4.0 GiB" in more
    less = next(line for line in lines if line.startswith("-4 GiB GPU expert cache"))
    assert "does not fit" not in less and "tok/s" in less
    assert any(line.startswith("MTP depth") and "does not fit" not in line for line in lines)
    fits = ["does not fit" not in line for line in lines]
    assert fits == sorted(fits, reverse=True)


def test_load_calibration_has_the_fitted_family():
    cal = load_calibration(hwdb.box_profile("rtx-5090x1"))
    # fitted on every row but the check rows (f01, m16: judged, never fitted)
    assert "sm120" in cal.families and len(cal.fitted_on) == 26 and not cal.held_out
    assert 0 < cal.family(hwdb.box_profile("rtx-5090x1")).expert_bw_eff <= 0.92

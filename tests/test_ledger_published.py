"""The memory ledger against vLLM-Moet's published geometry (hwdb/sources/vllm_moet_memory.md): every
configuration that booted plans when pinned, every recorded out-of-memory is refused naming what is short, and
the KV pools match the published sizes."""
from __future__ import annotations

import pytest

from moetplan import hwdb
from moetplan.contract import Goals, Placement
from moetplan.contract.model import GIB
from moetplan.plan import ledger as L
from moetplan.plan import published
from moetplan.plan.solver import parse_set, solve

CONFIGS = published.load()


@pytest.mark.parametrize("cfg", [pytest.param(c, marks=pytest.mark.xfail(strict=True, reason=c.open)) if c.open else c
                                 for c in CONFIGS], ids=[c.id for c in CONFIGS])
def test_published_configuration_is_planned_as_it_ran(cfg):
    out = published.evaluate(cfg)
    if cfg.booted:
        assert out.feasible, f"{cfg.id} booted in vLLM-Moet but is refused: {out.problems}"
    else:
        assert not out.feasible, f"{cfg.id} ran out of memory in vLLM-Moet but plans"
        assert set(out.short) & set(cfg.short), f"{cfg.id}: refused for {out.problems}, expected {cfg.short} short"


def test_the_table_covers_both_outcomes_and_every_target_model():
    assert sum(c.booted for c in CONFIGS) >= 25 and sum(not c.booted for c in CONFIGS) >= 9
    assert {c.model.id for c in CONFIGS} == {"deepseek-v4-flash", "glm-5.2", "kimi-k2.7-code"}


@pytest.mark.parametrize("cid", [c.id for c in CONFIGS if c.kv_tokens])
def test_kv_pool_within_ten_percent_of_the_published_size(cid):
    cfg = next(c for c in CONFIGS if c.id == cid)
    out = published.evaluate(cfg)
    assert out.kv_tokens == pytest.approx(cfg.kv_tokens, rel=0.10), (cid, out.kv_tokens, cfg.kv_tokens)


def _plan(model: str, box: str, *pins: str):
    return solve(hwdb.model_spec(model), hwdb.box_profile(box), Goals(pinned=parse_set(list(pins))))


def test_kv_tokens_is_the_pool_over_bytes_per_token_and_shown_in_the_ledger():
    plan = _plan("glm-5.2", "rtx-pro-6000x4", "tp=4", "expert_tier=resident", "kv_dtype=fp8", "context=131072",
                 "mtp=2", "fp4_reserve_gib=0")
    p = plan.placement
    assert p.kv_tokens == int(p.kv_cache_gib * GIB // plan.model.kv_bytes_per_token["fp8"])
    kv_item = next(i for i in plan.memory.gpus[0].items if i.name == "kv_cache")
    assert f"{p.kv_tokens:,} tokens" in kv_item.note


def test_the_window_is_not_booked_twice():
    """vLLM-Moet's 16 KiB x max_model_len is its guard's estimate of the KV itself: a longer window costs KV only."""
    spec = hwdb.model_spec("deepseek-v4-flash")
    short, long = (Placement(context=c, max_num_batched_tokens=1024) for c in (32768, 524288))
    assert {i.name: i.gib for i in L.fixed_gpu_items(spec, short)} == \
        {i.name: i.gib for i in L.fixed_gpu_items(spec, long)}
    assert L.kv_needed_gib(spec, long) - L.kv_needed_gib(spec, short) == pytest.approx(
        (524288 - 32768) * spec.kv_bytes_per_token["fp8"] / GIB)


def test_activation_peak_follows_max_num_batched_tokens():
    glm = hwdb.model_spec("glm-5.2")
    p = Placement(tp=1, max_num_batched_tokens=9984)
    # vLLM-Moet: the FP32 unpermute scatter took ~1.83 GiB at 9,984 batched tokens (top-8, H 6144).
    assert L.unprofiled_gib(glm, p) == pytest.approx(1.83, rel=0.01)
    small = p.model_copy(update={"max_num_batched_tokens": 1024})
    assert L.activation_gib(glm, p) == pytest.approx(L.activation_gib(glm, small) * 9984 / 1024)
    plan = _plan("deepseek-v4-flash", "rtx-pro-6000x1", "tp=1", "expert_tier=resident", "context=32768",
                 "max_num_batched_tokens=2048")
    assert plan.placement.activation_peak_gib == pytest.approx(L.activation_gib(plan.model, plan.placement), abs=1e-3)
    act = next(i for i in plan.memory.gpus[0].items if i.name == "activations")
    assert "2048 batched tokens" in act.note


def test_ds4_dense_drops_its_mtp_layer_without_speculation():
    ds4 = hwdb.model_spec("deepseek-v4-flash")
    with_mtp, without = Placement(mtp=2), Placement(mtp=0)
    assert L.dense_gib(ds4, with_mtp) - L.dense_gib(ds4, without) == pytest.approx(L.mtp_layer_gib(ds4))
    assert 1.5 < L.mtp_layer_gib(ds4) < 2.2  # 6.44B routed params at 2.25 bit + the layer's FP8 rest


def test_a_pool_one_rounding_step_below_its_need_is_not_refused():
    ds4, hw = hwdb.model_spec("deepseek-v4-flash"), hwdb.box_profile("rtx-pro-6000x1")
    p = Placement(tp=1, expert_tier="resident", context=32768, mtp=0, max_num_batched_tokens=1024,
                  gpu_memory_utilization=0.95)
    p.kv_cache_gib = L.kv_floor_gib(ds4, p) - L.ROUND_GIB / 2
    assert not [x for x in L.build_ledger(ds4, hw, p).problems if "KV pool" in x]
    p.kv_cache_gib = L.kv_floor_gib(ds4, p) - 3 * L.ROUND_GIB
    assert any("KV pool" in x for x in L.build_ledger(ds4, hw, p).problems)


def test_the_fp4_reserve_uses_the_room_above_the_budget_first():
    """vLLM-Moet's automatic pool is 'free after KV - 3 GiB': a reserve that fits there costs the KV nothing."""
    kimi, hw = hwdb.model_spec("kimi-k2.7-code"), hwdb.box_profile("rtx-pro-6000x4")
    base = ["tp=4", "expert_tier=resident", "context=262144", "mtp=0", "gpu_memory_utilization=0.94",
            "max_num_batched_tokens=2048", "max_num_seqs=8"]
    none = solve(kimi, hw, Goals(pinned=parse_set(base + ["fp4_reserve_gib=0"]))).placement
    small = solve(kimi, hw, Goals(pinned=parse_set(base + ["fp4_reserve_gib=1.5"]))).placement
    big = solve(kimi, hw, Goals(pinned=parse_set(base + ["fp4_reserve_gib=4"]))).placement
    room = L.fp4_outside_gib(small, hw.gpus[0].vram_gib, 100.0)
    assert 1.5 < room < 4
    assert small.kv_cache_gib == pytest.approx(none.kv_cache_gib, abs=2e-3)
    assert none.kv_cache_gib - big.kv_cache_gib == pytest.approx(big.fp4_reserve_gib - room, abs=2e-3)


def test_host_ram_counts_an_arena_per_rank():
    glm = hwdb.model_spec("glm-5.2")
    cfg = next(c for c in CONFIGS if c.id == "glm-pro2-nvme-46")
    out = published.evaluate(cfg)
    arena = next(i for i in L.build_ledger(glm, cfg.hw, out.placement).ledger.host_items if i.name == "pinned_arena")
    assert arena.gib == pytest.approx(2 * 57, rel=1e-3)  # whole rows of 57 GiB  # 57 GiB per rank, ~140 GiB of host RAM in all


def test_no_published_measurement_is_refused():
    """Every row the cost model is fitted on ran in vLLM-Moet, so the ledger plans each with its knobs pinned."""
    from moetplan.cost_model.dataset import load_reference
    from moetplan.plan.solver import size_placement

    refused = []
    for m in load_reference():
        p = m.placement
        pins = {k: getattr(p, k) for k in ("tp", "pp", "expert_tier", "kv_dtype", "context", "mtp", "fp4_reserve_gib",
                                           "max_num_seqs", "concurrency", "gpu_memory_utilization",
                                           "max_num_batched_tokens")}
        if p.expert_tier != "resident":
            pins["gpu_expert_cache_gib"] = p.gpu_expert_cache_gib
        if p.expert_tier == "nvme":
            pins["host_arena_gib"] = p.host_arena_gib
        if p.gate.enabled:
            pins["gate_tau"] = p.gate.tau
        got, why = size_placement(m.model, m.hw, Goals(pinned=pins, concurrency=p.concurrency), pins, p.tp, p.pp,
                                  p.expert_tier, p.kv_dtype, p.mtp, p.context)
        if got is None:
            refused.append((m.row_id, why[:1]))
    assert refused == []


def test_a_pin_past_the_resident_guard_plans_with_a_warning_naming_it():
    """vLLM-Moet's production recipe forces its FP4 pool past its own resident guard: pinned, it plans and warns;
    the solver's own search still keeps to the guard."""
    pins = ["tp=1", "expert_tier=resident", "fp4_reserve_gib=1.5", "context=131072", "kv_dtype=fp8", "mtp=2",
            "gpu_memory_utilization=0.95", "max_num_seqs=1"]
    plan = _plan("deepseek-v4-flash", "rtx-pro-6000x1", *pins, "max_num_batched_tokens=256")
    past = [w for w in plan.warnings if w.startswith(L.PAST_GUARD)]
    assert past and "resident guard" in past[0] and "16 KiB x max_model_len" in past[0]
    spec, hw = hwdb.model_spec("deepseek-v4-flash"), hwdb.box_profile("rtx-pro-6000x1")
    check = L.build_ledger(spec, hw, plan.placement)  # the same placement, not pinned: the guard refuses it
    assert not check.ok and "experts_2bit" in check.short


def test_what_is_physically_short_is_refused_even_when_pinned():
    from moetplan.contract.errors import InfeasibleError

    with pytest.raises(InfeasibleError) as e:  # vLLM-Moet: 5.5 GiB pool at util 0.95 left 1.04 GiB of KV; boot failed
        _plan("deepseek-v4-flash", "rtx-pro-6000x1", "tp=1", "expert_tier=resident", "fp4_reserve_gib=5.5",
              "context=32768", "kv_dtype=fp8", "mtp=2", "gpu_memory_utilization=0.95", "max_num_seqs=1",
              "max_num_batched_tokens=256")
    assert "kv_cache" in " ".join(e.value.shortfalls)


def test_an_expert_cache_below_the_working_set_of_the_streams_asked_is_refused():
    from moetplan.contract.errors import InfeasibleError

    base = ["tp=1", "expert_tier=host", "gpu_expert_cache_gib=11", "context=32768", "kv_dtype=fp8", "mtp=2",
            "gpu_memory_utilization=0.90", "max_num_batched_tokens=512", "max_num_seqs=2"]
    assert _plan("deepseek-v4-flash", "rtx-5090x1", *base).placement.gpu_expert_cache_slots > 0  # one stream: ran
    with pytest.raises(InfeasibleError) as e:  # two streams x MTP-2 route 1,548 pairs x 1.15 > 1,668 slots
        _plan("deepseek-v4-flash", "rtx-5090x1", *base, "concurrency=2")
    assert "expert_cache" in " ".join(e.value.shortfalls)


def test_a_kv_clamp_in_bytes_is_the_pool_and_reaches_the_launch():
    from moetplan.launch.command import build_launch

    plan = _plan("glm-5.2", "rtx-pro-6000x4", "tp=4", "expert_tier=resident", "fp4_reserve_gib=18", "context=131072",
                 "kv_dtype=fp8", "mtp=2", "gpu_memory_utilization=0.93", "kv_cache_memory_bytes=8GiB")
    p = plan.placement
    assert p.kv_cache_memory_bytes == 8 * 2**30 and p.kv_cache_gib == pytest.approx(8.0)
    assert p.kv_tokens == int(8 * GIB // plan.model.kv_bytes_per_token["fp8"])
    argv = build_launch(plan).argv
    assert argv[argv.index("--kv-cache-memory-bytes") + 1] == str(8 * 2**30)
    unclamped = _plan("glm-5.2", "rtx-pro-6000x4", "tp=4", "expert_tier=resident", "fp4_reserve_gib=18",
                      "context=131072", "kv_dtype=fp8", "mtp=2", "gpu_memory_utilization=0.93")
    assert "--kv-cache-memory-bytes" not in build_launch(unclamped).argv
    assert abs(unclamped.placement.kv_cache_gib - 8.0) > 0.5


def test_the_sampler_peak_grows_with_the_sequences():
    ds4 = hwdb.model_spec("deepseek-v4-flash")
    few, many = Placement(max_num_seqs=4, mtp=2), Placement(max_num_seqs=192, mtp=2)
    assert L.sampler_gib(ds4, many) == pytest.approx(L.sampler_gib(ds4, few) * 48)
    assert L.sampler_gib(ds4, many) > 1.0  # 576 rows of 129,280 logits: GiB the pool does not get


@pytest.mark.parametrize("cid", [c.id for c in CONFIGS if c.kv_gib is not None])
def test_kv_memory_vllm_reported_is_what_the_ledger_leaves(cid):
    """The 5.5 GiB FP4 recipe at util 0.95 left vLLM 1.04 GiB of KV (and failed the MTP floor): the ledger's every
    other item on that rank, with the build's dense size, leaves the same."""
    cfg = next(c for c in CONFIGS if c.id == cid)
    assert published.kv_left_gib(cfg) == pytest.approx(cfg.kv_gib, abs=0.05)


def test_the_production_recipe_plans_past_the_resident_guard_with_a_warning():
    """vLLM-Moet's 5.5 GiB recipe at util 0.97 boots past its own resident guard at 128K: planned, the guard named;
    the same recipe at util 0.95 (1.04 GiB of KV) is refused naming the KV pool."""
    cfgs = {c.id: c for c in CONFIGS}
    out = published.evaluate(cfgs["ds4-pro1-fp4-5.5-128k"])
    assert out.feasible and any("resident guard" in w for w in out.placement_guards)
    refused = published.evaluate(cfgs["oom-ds4-pro1-fp4-5.5-util-0.95"])
    assert not refused.feasible and "kv_cache" in refused.short


def test_the_dense_term_alone_makes_the_earlier_build_recipes_short_on_todays_build():
    """The recipes that ran on DeepSeek-V4-Flash's earlier build (dense ~2 GiB smaller by the source's account) plan
    on it; with today's dense size each MTP one is refused naming the KV pool, short by less than the ~0.56 GiB
    between the two builds' dense sizes: no other ledger item differs between the two evaluations."""
    earlier = [c for c in CONFIGS if c.booted and c.model.id == "deepseek-v4-flash"
               and c.model.dense_gib_published != hwdb.model_spec("deepseek-v4-flash").dense_gib_published]
    assert {c.id for c in earlier} >= {"ds4-pro1-fp4-5.5", "ds4-pro1-fp4-5.5-128k", "ds4-5090-host-14-fp4-1"}
    today = hwdb.model_spec("deepseek-v4-flash")
    gap = today.dense_gib_published - earlier[0].model.dense_gib_published
    for c in earlier:
        assert published.evaluate(c).feasible
        if int(c.pins["mtp"]) > 0:
            now = published.Published(c.id, today, c.hw, c.pins, c.booted)
            out = published.evaluate(now)
            assert not out.feasible and out.short == ["kv_cache"], (c.id, out.problems)
            assert 0 < L.kv_floor_gib(today, _pinned_placement(now)) - published.kv_left_gib(now) < gap + 0.01


def _pinned_placement(c: published.Published) -> Placement:
    pins = {k: v for k, v in c.pins.items() if k not in ("gate_tau", "kv_cache_memory_bytes")}
    return Placement.for_model(c.model, **pins)


def test_ds4_kv_floor_holds_the_in_flight_state_vllm_026_asked_for():
    """vLLM 0.26 refused DeepSeek-V4-Flash at 8192 batched tokens with 0.1 GiB of KV: one 8192-token request needed
    3.3 GiB (bench/results/e2e_h200_replay.json). The floor our runtime's plans keep grows with the batched tokens;
    vLLM-Moet's published runs (its v0.24 build) are judged without it."""
    from moetplan.contract import Placement

    ds4 = hwdb.model_spec("deepseek-v4-flash")
    need = {t: L.kv_needed_gib(ds4, Placement.for_model(ds4, expert_tier="host", kv_dtype="fp8", context=8192,
                                                        max_num_seqs=1, max_num_batched_tokens=t))
            for t in (256, 2048, 8192)}
    assert 3.3 <= need[8192] < 3.45  # what vLLM asked for, plus the compressed window of 8192 tokens
    assert need[256] < 0.15 and need[2048] < need[8192] / 3
    published = hwdb.published_model_spec("deepseek-v4-flash")
    p = Placement.for_model(published, expert_tier="host", kv_dtype="fp8", context=8192, max_num_seqs=1,
                            max_num_batched_tokens=8192)
    assert L.kv_needed_gib(published, p) < 0.1

"""Cost model physics: each term scales as its bytes/counts say, routing locality, correlated misses."""
from __future__ import annotations

import math

import numpy as np
import pytest

from moetplan.cost_model import coverage, predict
from moetplan.cost_model.calibration import Calibration, FamilyFactors
from moetplan.cost_model.coverage import (
    bb_zero_prob,
    curve_for,
    expected_union,
    miss_stats,
)
from moetplan.cost_model.terms import ALLREDUCE, DENSE, EXPERTS, KV, MISS_HOST, MISS_NVME, decode_step
from moetplan.contract.model import Attention, ModelSpec
from moetplan.contract import GPUInfo, HardwareProfile, HostInfo, Placement, StorageInfo


def toy_model(**over) -> ModelSpec:
    base = dict(
        id="toy", name="Toy MoE", num_layers=12, moe_layers=12, hidden_size=1024, moe_intermediate_size=512,
        n_routed_experts=64, top_k=4, vocab_size=1000, max_position_embeddings=65536,
        attention=Attention(kind="mla", num_heads=8, head_dim=128), kv_bytes_per_token={"fp8": 2000.0},
        non_routed_params_b=0.5, dense_precision="bf16", coverage_points=[(0.2, 0.9)],
        mtp_layers=1, mtp_acceptance={1: 1.8, 2: 2.4},
    )
    base.update(over)
    return ModelSpec(**base)


def toy_hw(n: int = 1, bw: float = 1000.0, h2d: float = 25.0) -> HardwareProfile:
    gpus = [GPUInfo(index=i, name="Test GPU", vram_gib=24, mem_bw_gbps=bw, compute_capability="8.9", pcie_gen=4,
                    pcie_width=16, h2d_pinned_gbps=h2d) for i in range(n)]
    return HardwareProfile(gpus=gpus, host=HostInfo(ram_gib=64),
                           storage=StorageInfo(seq_read_gbps=3.0, rand_read_gbps=2.0))


CAL = Calibration(families={"default": FamilyFactors()})


def term(step, name: str) -> float:
    return next(ms for t, ms in step.term_ms(CAL, None) if t.name == name)


def test_dense_bytes_double_time_doubles():
    hw, pl = toy_hw(), Placement()
    a = decode_step(toy_model(), hw, pl, CAL)
    b = decode_step(toy_model(non_routed_params_b=1.0), hw, pl, CAL)
    # The embedding table (1000 x 1024) is not read; it is 0.2% of the dense bytes here.
    assert term(b, DENSE) / term(a, DENSE) == pytest.approx(2.0, rel=0.01)
    assert term(b, EXPERTS) == pytest.approx(term(a, EXPERTS))


def test_expert_bytes_double_time_doubles():
    hw, pl = toy_hw(), Placement()
    a = decode_step(toy_model(), hw, pl, CAL)
    b = decode_step(toy_model(moe_intermediate_size=1024), hw, pl, CAL)
    assert term(b, EXPERTS) / term(a, EXPERTS) == pytest.approx(2.0, rel=1e-9)
    assert term(b, DENSE) == pytest.approx(term(a, DENSE))


def test_memory_bandwidth_halved_reads_double():
    pl = Placement()
    a = decode_step(toy_model(), toy_hw(bw=1000), pl, CAL)
    b = decode_step(toy_model(), toy_hw(bw=500), pl, CAL)
    for name in (DENSE, EXPERTS, KV):
        assert term(b, name) / term(a, name) == pytest.approx(2.0, rel=1e-9)


def test_kv_term_scales_with_filled_context_and_sparse_caps_it():
    hw = toy_hw()
    a = decode_step(toy_model(), hw, Placement(context=65536), CAL, kv_tokens=16384)
    b = decode_step(toy_model(), hw, Placement(context=65536), CAL, kv_tokens=32768)
    assert term(b, KV) / term(a, KV) == pytest.approx(2.0, rel=0.01)
    # One fill rule: without a measured fill, decode reads routing.decode_filled_tokens whatever the window.
    w1 = decode_step(toy_model(), hw, Placement(context=16384), CAL)
    w2 = decode_step(toy_model(), hw, Placement(context=65536), CAL)
    assert term(w1, KV) == pytest.approx(term(w2, KV))
    short = decode_step(toy_model(), hw, Placement(context=1024), CAL)  # capped by the window
    assert term(short, KV) == pytest.approx(term(w1, KV) * 1024 / CAL.routing.decode_filled_tokens, rel=0.01)
    sparse = toy_model(attention=Attention(kind="mla_sparse", num_heads=8, head_dim=128, index_topk=2048))
    s1 = decode_step(sparse, hw, Placement(context=65536), CAL, kv_tokens=65536)
    s2 = decode_step(sparse, hw, Placement(context=131072), CAL, kv_tokens=131072)
    dense_kv = decode_step(toy_model(), hw, Placement(context=65536), CAL, kv_tokens=65536)
    assert term(s1, KV) < 0.5 * term(dense_kv, KV)  # top-k + indexer, not the whole context
    assert term(s2, KV) >= term(s1, KV)


def test_more_cache_fewer_misses_monotone():
    model, hw = toy_model(), toy_hw()
    full = model.routed_gib("2bit")
    prev = None
    for share in np.linspace(0.02, 0.98, 25):
        pl = Placement.for_model(model, expert_tier="host", gpu_expert_cache_gib=float(share * full))
        p = predict(model, hw, pl, CAL)
        if prev is not None:
            assert p.misses_per_step <= prev.misses_per_step + 1e-9
            assert p.zero_miss_step_share >= prev.zero_miss_step_share - 1e-9
            assert p.token_hit_rate >= prev.token_hit_rate - 1e-12
            assert p.decode_tok_s >= prev.decode_tok_s - 1e-9
        prev = p
    assert prev.misses_per_step < 0.5  # nearly everything cached


def test_resident_has_no_miss_term_and_tiered_does():
    model, hw = toy_model(), toy_hw()
    res = predict(model, hw, Placement(), CAL)
    assert res.misses_per_step is None and res.zero_miss_step_share is None
    host = predict(model, hw, Placement.for_model(model, expert_tier="host", gpu_expert_cache_gib=0.05), CAL)
    nvme = predict(model, hw, Placement.for_model(model, expert_tier="nvme", gpu_expert_cache_gib=0.05, host_arena_gib=0.05), CAL)
    assert any(t.name == MISS_HOST for t in host.terms)
    assert any(t.name == MISS_NVME for t in nvme.terms)
    assert host.decode_tok_s < res.decode_tok_s


def test_miss_bytes_double_when_link_halves():
    model = toy_model()
    pl = Placement.for_model(model, expert_tier="host", gpu_expert_cache_gib=0.05)
    fast = decode_step(model, toy_hw(h2d=25.0), pl, CAL)
    slow = decode_step(model, toy_hw(h2d=12.5), pl, CAL)
    f = next(t for t in fast.terms if t.name == MISS_HOST)
    s = next(t for t in slow.terms if t.name == MISS_HOST)
    assert s.parts["link.h2d_eff"] == pytest.approx(2 * f.parts["link.h2d_eff"])
    # Per-layer fetch overheads are link time too (vLLM-Moet: its slower-linked 5090 pays 2x per miss).
    assert s.parts["link.fetch_overhead_mib"] == pytest.approx(2 * f.parts["link.fetch_overhead_mib"])
    # The replay of a missing step does not depend on the link.
    from moetplan.cost_model.terms import MISS_REPLAY

    fr = next(t for t in fast.terms if t.name == MISS_REPLAY)
    sr = next(t for t in slow.terms if t.name == MISS_REPLAY)
    assert sr.parts["family.miss_replay_factor"] == pytest.approx(fr.parts["family.miss_replay_factor"])
    assert "family.miss_replay_factor" not in s.parts


def test_a_missing_step_replays_its_graph_once_per_factor():
    from moetplan.cost_model.terms import GRAPH_TERMS

    model, hw = toy_model(), toy_hw()
    step = decode_step(model, hw, Placement.for_model(model, expert_tier="host", gpu_expert_cache_gib=0.05), CAL)
    graph = sum(ms for t, ms in step.term_ms(CAL, hw) if t.name in GRAPH_TERMS)
    from moetplan.cost_model.terms import MISS_REPLAY

    replay = next(t for t in step.terms if t.name == MISS_REPLAY)
    assert replay.parts["family.miss_replay_factor"] == pytest.approx(step.miss.p_step_miss * graph)
    assert "family.eager_layer_us" not in replay.parts


def test_the_tiered_graph_mode_is_one_named_term():
    """Replay (vLLM-Moet's design) pays one read per step; split pays host work on every MoE layer, miss or not."""
    from moetplan.contract.errors import UsageError
    from moetplan.cost_model.terms import MOE_GRAPH, moe_graph_overhead

    model, hw = toy_model(), toy_hw()
    pl = Placement.for_model(model, expert_tier="host", gpu_expert_cache_gib=0.05)
    replay = decode_step(model, hw, pl, CAL)
    split = decode_step(model, hw, pl, CAL, moe_graphs="split")
    r, s = term(replay, MOE_GRAPH), term(split, MOE_GRAPH)
    assert moe_graph_overhead(model, pl, "split").parts == {"family.moe_split_us": float(model.moe_layers)}
    assert s == pytest.approx(model.moe_layers * CAL.family(hw).moe_split_us / 1e3)
    assert r == pytest.approx(CAL.family(hw).tiered_step_us / 1e3) and s > r
    assert predict(model, hw, pl, CAL, moe_graphs="split").decode_tok_s < predict(model, hw, pl, CAL).decode_tok_s
    assert not any(t.name == MOE_GRAPH for t in decode_step(model, hw, Placement(), CAL).terms)  # resident
    with pytest.raises(UsageError):
        moe_graph_overhead(model, pl, "eager")


def test_nvme_pack_reads_overlap_the_link_copies():
    """The slower of the pack path and the link path sets the fetch: an arena holding every missing row costs what the
    host tier costs, a slow drive behind a small arena costs more, and a fast one no more than the link path."""
    from moetplan.cost_model.terms import MISS_NVME

    model = toy_model()
    host = Placement.for_model(model, expert_tier="host", gpu_expert_cache_gib=0.05)
    small = Placement.for_model(model, expert_tier="nvme", gpu_expert_cache_gib=0.05, host_arena_gib=0.05)
    whole = Placement.for_model(model, expert_tier="nvme", gpu_expert_cache_gib=0.05, host_arena_gib=64.0)
    fast_drive, slow_drive = toy_hw(), toy_hw()
    fast_drive.storage.rand_read_gbps, slow_drive.storage.rand_read_gbps = 1000.0, 0.05
    host_ms = term(decode_step(model, slow_drive, host, CAL), MISS_HOST)
    assert term(decode_step(model, slow_drive, whole, CAL), MISS_NVME) == pytest.approx(host_ms)
    slow = decode_step(model, slow_drive, small, CAL)
    assert "link.nvme_read_eff" in next(t for t in slow.terms if t.name == MISS_NVME).parts
    assert term(slow, MISS_NVME) > 2 * host_ms
    assert host_ms <= term(decode_step(model, fast_drive, small, CAL), MISS_NVME) < term(slow, MISS_NVME)


def test_per_sequence_cost_grows_with_streams():
    from moetplan.cost_model.terms import SEQ_OVH

    model, hw = toy_model(), toy_hw()
    one = decode_step(model, hw, Placement(max_num_seqs=8), CAL, 1)
    eight = decode_step(model, hw, Placement(max_num_seqs=8), CAL, 8)
    assert term(eight, SEQ_OVH) == pytest.approx(8 * term(one, SEQ_OVH))


def test_tp_traffic_without_p2p_goes_through_host_memory():
    from moetplan.cost_model.hardware import rates

    pl = Placement(tp=2)
    via_host, p2p = toy_hw(2), toy_hw(2)
    p2p.p2p = True
    assert rates(via_host, pl).pcie_gbps == pytest.approx(0.5 * rates(p2p, pl).pcie_gbps)
    assert rates(p2p, pl).pcie_gbps == pytest.approx(25.0)


def test_union_grows_with_concurrency_sublinearly():
    model, hw = toy_model(), toy_hw()
    unions = [decode_step(model, hw, Placement(max_num_seqs=64), CAL, c).union_per_layer for c in (1, 2, 4, 8, 16)]
    assert unions[0] == pytest.approx(model.top_k, rel=1e-6)  # one token reads exactly its top-k
    for a, b in zip(unions, unions[1:]):
        assert a < b < 2 * a
    assert unions[-1] <= model.n_routed_experts
    agg = [predict(model, hw, Placement(max_num_seqs=64, concurrency=c), CAL).aggregate_tok_s for c in (1, 4, 16)]
    assert agg[0] < agg[1] < agg[2]
    assert agg[2] < 16 * agg[0]


def test_union_is_not_k_times_tokens():
    curve = curve_for(toy_model(), CAL.routing)
    u = expected_union(curve, 64, 4, tokens_eff=8)
    assert 4 < u < 32


def test_tp_allreduce_only_with_tp():
    model = toy_model()
    one = decode_step(model, toy_hw(2), Placement(tp=1), CAL)
    two = decode_step(model, toy_hw(2), Placement(tp=2), CAL)
    assert not any(t.name == ALLREDUCE for t in one.terms)
    ar = next(t for t in two.terms if t.name == ALLREDUCE)
    assert ar.parts["family.allreduce_latency_us"] == 2 * model.num_layers * (2 - 1)
    assert term(two, DENSE) == pytest.approx(term(one, DENSE) / 2)


def test_mtp_tokens_per_step_from_acceptance():
    model, hw = toy_model(), toy_hw()
    assert predict(model, hw, Placement(mtp=2), CAL).tokens_per_step == pytest.approx(2.4)
    assert predict(model, hw, Placement(mtp=2, mtp_acceptance=2.9), CAL).tokens_per_step == pytest.approx(2.9)
    assert predict(model, hw, Placement(), CAL).tokens_per_step == 1.0
    with_mtp = decode_step(model, hw, Placement(mtp=2), CAL)
    assert with_mtp.union_per_layer > decode_step(model, hw, Placement(), CAL).union_per_layer


def test_prediction_fields_consistent():
    model, hw = toy_model(), toy_hw()
    p = predict(model, hw, Placement(mtp=1), CAL)
    assert p.step_ms == pytest.approx(sum(t.ms for t in p.terms), rel=1e-3)
    assert sum(t.share for t in p.terms) == pytest.approx(1.0, abs=1e-3)
    assert p.decode_tok_s == pytest.approx(p.tokens_per_step / p.step_ms * 1e3, rel=1e-3)
    top = max(p.terms, key=lambda t: t.ms).name
    assert p.bottleneck == top or p.bottleneck.startswith("memory bandwidth: ")
    assert p.prefill_tok_s > 0 and p.ttft_ms > p.step_ms


def test_bad_kv_dtype_names_the_fix():
    from moetplan.contract.errors import UsageError

    with pytest.raises(UsageError, match="kv_dtype"):
        predict(toy_model(), toy_hw(), Placement(kv_dtype="nvfp4"), CAL)


def test_too_few_gpus_is_a_usage_error():
    from moetplan.contract.errors import UsageError

    with pytest.raises(UsageError, match="tp x pp"):
        predict(toy_model(), toy_hw(1), Placement(tp=2), CAL)


# --------------------------------------------------------------------------- routing locality


@pytest.mark.parametrize("points,tol", [
    ([(0.19, 0.96)], 0.005),  # DeepSeek-V4-Flash
    ([(0.20, 0.89), (0.51, 0.91)], 0.02),  # GLM-5.2: not jointly concave-consistent, so a compromise
])
def test_coverage_curve_passes_through_published_points(points, tol):
    model = toy_model(coverage_points=points)
    for x, y in points:
        assert coverage(model, x, CAL) == pytest.approx(y, abs=tol)


def test_coverage_curve_shape():
    for pts in ([(0.19, 0.96)], [(0.20, 0.89), (0.51, 0.91)], []):
        model = toy_model(coverage_points=pts)
        xs = np.linspace(0, 1, 101)
        ys = np.array([coverage(model, x, CAL) for x in xs])
        assert ys[0] == pytest.approx(0.0, abs=1e-12) and ys[-1] == pytest.approx(1.0, abs=1e-12)
        assert np.all(np.diff(ys) >= -1e-12)  # monotone
        assert np.all(np.diff(ys, 2) <= 1e-9)  # concave: hottest experts cached first


def test_default_curve_is_flatter_than_measured():
    measured = toy_model(coverage_points=[(0.19, 0.96)])
    unmeasured = toy_model(coverage_points=[])
    assert coverage(unmeasured, 0.19, CAL) < coverage(measured, 0.19, CAL) - 0.05


# --------------------------------------------------------------------------- correlated misses


def test_bb_zero_prob_matches_simulation():
    rng = np.random.default_rng(7)
    n, mu, rho = 100, 0.02, 0.05
    s = (1 - rho) / rho
    q = rng.beta(mu * s, (1 - mu) * s, size=200_000)
    sim = float(np.mean(rng.binomial(n, q) == 0))
    assert bb_zero_prob(n, mu, rho) == pytest.approx(sim, abs=0.01)
    assert bb_zero_prob(n, mu, 0.0) == pytest.approx((1 - mu) ** n)


def test_glm_example_independent_vs_correlated():
    # FACTS.md: a GLM step routes ~600 (token, expert) pairs; 99.9% token hits leave ~45% of steps with a miss
    # if misses were independent.
    independent = 1 - bb_zero_prob(600, 0.001, 0.0)
    assert independent == pytest.approx(0.45, abs=0.01)
    correlated = 1 - bb_zero_prob(600, 0.001, 0.01)
    assert correlated < independent - 0.1
    # Stronger correlation, fewer miss steps (the mean miss count is the same).
    assert 1 - bb_zero_prob(600, 0.001, 0.05) < correlated


def test_correlation_keeps_mean_misses_and_lowers_miss_steps():
    model = toy_model(n_routed_experts=256, top_k=8, moe_layers=75, num_layers=78,
                      coverage_points=[(0.2, 0.89), (0.51, 0.91)])
    curve = curve_for(model, CAL.routing)
    ind = miss_stats(curve, 256, 8, 75, 1.0, 0.9, 0.0)
    cor = miss_stats(curve, 256, 8, 75, 1.0, 0.9, 0.01)
    assert cor.misses_per_step == pytest.approx(ind.misses_per_step)
    assert ind.p_step_miss == pytest.approx(ind.p_step_miss_independent, rel=1e-6)
    assert cor.p_step_miss < ind.p_step_miss
    assert cor.layers_with_miss < ind.layers_with_miss
    # Steps that do miss fetch more experts each: misses cluster.
    assert cor.misses_per_step / cor.p_step_miss > ind.misses_per_step / ind.p_step_miss
    assert math.isfinite(cor.p_step_miss)


def test_gate_recomputes_cost_their_share_of_the_step():
    from moetplan.cost_model.terms import GATE
    from moetplan.contract import Gate

    model, hw = toy_model(), toy_hw()
    from moetplan.cost_model.terms import GRAPH_TERMS

    base = Placement.for_model(model, fp4_reserve_gib=0.02)
    off = predict(model, hw, base, CAL)
    graph = sum(t.ms for t in off.terms if t.name in GRAPH_TERMS)
    for tau in (0.3, 0.6, 1.0):
        on = predict(model, hw, base.model_copy(update={"gate": Gate(enabled=True, tau=tau)}), CAL)
        share = CAL.gate_share(tau)
        assert off.gate_fire_share is None and on.gate_fire_share == pytest.approx(share)
        assert on.step_ms - off.step_ms == pytest.approx(share * graph, rel=1e-3)  # one graph replay per recompute
        assert any(t.name == GATE for t in on.terms)
    assert CAL.gate_share(0.3) < CAL.gate_share(0.6) < CAL.gate_share(1.0) == CAL.routing.gate_recompute_share
    # A degraded gate (reserve below its floor) caps promotions but still judges and recomputes.
    degraded = predict(model, hw, base.model_copy(update={"gate": Gate(enabled=True, tau=0.6, degraded=True)}), CAL)
    assert degraded.step_ms > off.step_ms


def test_zero_rates_and_dense_models_are_usage_errors():
    from moetplan.contract.errors import UsageError

    with pytest.raises(UsageError, match="zero rate"):
        predict(toy_model(), toy_hw(bw=0.0), Placement(), CAL)
    with pytest.raises(UsageError, match="no routed experts"):
        predict(toy_model(n_routed_experts=0), toy_hw(), Placement(), CAL)


def test_a_tiered_step_predicts_its_replays_from_the_zero_miss_share():
    """moe_graphs=replay: graph step + P(miss) x (batch fetch + graph step) + one read (terms: MOE_GRAPH, the fetch,
    MISS_REPLAY); the plan carries the replay rate next to the zero-miss share; split has no replay term."""
    from moetplan import hwdb
    from moetplan.contract import Placement
    from moetplan.cost_model import predict
    from moetplan.cost_model.calibration import load_calibration
    from moetplan.cost_model.coverage import curve_for
    from moetplan.cost_model.terms import GRAPH_TERMS, MISS_REPLAY, decode_step

    ds4, hw = hwdb.model_spec("deepseek-v4-flash"), hwdb.box_profile("rtx-5090x1")
    pl = Placement.for_model(ds4, expert_tier="host", gpu_expert_cache_gib=14, context=32768, mtp=0)
    rep = predict(ds4, hw, pl)
    split = predict(ds4, hw, pl.model_copy(update={"moe_graphs": "split"}))
    assert rep.replay_rate == pytest.approx(1 - rep.zero_miss_step_share, abs=1e-6) and 0 < rep.replay_rate < 1
    assert split.replay_rate is None and split.zero_miss_step_share == rep.zero_miss_step_share
    calib = load_calibration(hw)
    curve = curve_for(ds4, calib.routing)
    step = decode_step(ds4, hw, pl, calib, 1, curve)
    term = next(t for t in step.terms if t.name == MISS_REPLAY)
    graph = sum(t.ms(calib, hw) for t in step.terms if t.name in GRAPH_TERMS)
    assert term.parts["family.miss_replay_factor"] == pytest.approx(step.miss.p_step_miss * graph)
    split_step = decode_step(ds4, hw, pl.model_copy(update={"moe_graphs": "split"}), calib, 1, curve)
    assert not any(t.name == MISS_REPLAY for t in split_step.terms)


def test_a_cpu_step_is_priced_from_what_it_does():
    """vLLM's CPU backend: the engine's step, each layer's eager ops, each routed expert's calls (the expert path),
    and the bytes at the probe's DRAM rate; a slower DRAM costs only the byte terms."""
    from moetplan.cost_model.calibration import load_calibration
    from moetplan.cost_model.terms import CPU_EXPERT_CALLS, EXPERTS

    cal = load_calibration(user=False)
    model = toy_model()
    fast = HardwareProfile(gpus=[], host=HostInfo(ram_gib=64, cores=8, dram_gbps=40.0))
    slow = HardwareProfile(gpus=[], host=HostInfo(ram_gib=64, cores=8, dram_gbps=10.0))
    a, b = decode_step(model, fast, Placement(), cal), decode_step(model, slow, Placement(), cal)
    calls = next(t for t in a.terms if t.name == CPU_EXPERT_CALLS)
    assert calls.parts == {"family.expert_call_us": pytest.approx(a.union_per_layer * model.moe_layers)}
    assert cal.family(fast).expert_call_us > 0 and cal.family(toy_hw()).expert_call_us == 0
    assert not any(t.name == CPU_EXPERT_CALLS for t in decode_step(model, toy_hw(), Placement(), cal).terms)
    ms = {t.name: x for t, x in a.term_ms(cal, fast)}
    ms_slow = {t.name: x for t, x in b.term_ms(cal, slow)}
    assert ms_slow[CPU_EXPERT_CALLS] == pytest.approx(ms[CPU_EXPERT_CALLS])
    if "compute-bound" not in next(t for t in a.terms if t.name == EXPERTS).note:
        assert ms_slow[EXPERTS] == pytest.approx(4 * ms[EXPERTS])


def test_a_separate_drafter_pass_is_its_bytes_plus_the_proposer_cost_mtp_rows_pin():
    """An Eagle3 drafter (no MTP head) drafts one token per pass: its weights less the copy of the embedding table
    it only indexes, read at the dense rate, one layer launch, its all-reduces and the proposer's bookkeeping
    (draft_overhead_ms, the same vLLM path as MTP): no factor of its own for one published row to set."""
    from moetplan import hwdb
    from moetplan.contract.model import GIB
    from moetplan.cost_model.calibration import load_calibration
    from moetplan.cost_model.terms import DRAFT, embedding_bytes

    kimi = hwdb.model_spec("kimi-k2.7-code")
    assert kimi.mtp_layers == 0 and kimi.drafter_gib > 0
    hw = hwdb.box_profile("rtx-pro-6000x4")
    calib = load_calibration(user=False)
    p = Placement.for_model(kimi, tp=4, expert_tier="resident", kv_dtype="fp8", context=32768, mtp=2)
    step = decode_step(kimi, hw, p, calib)
    (draft,) = [t for t in step.terms if t.name == DRAFT]
    assert set(draft.parts) == {"family.dense_bw_eff", "family.layer_overhead_us", "family.draft_overhead_ms",
                                "family.allreduce_latency_us"}
    per_pass_bytes = (kimi.drafter_gib * GIB - embedding_bytes(kimi)) / 4
    bw = step.rates.mem_bw_gbps * 1e9
    assert draft.parts["family.dense_bw_eff"] == pytest.approx(2 * per_pass_bytes / bw * 1e3)
    assert draft.parts["family.draft_overhead_ms"] == 2.0
    # Two drafted tokens cost a few ms at TP4, far from the ~10 ms per token one row alone once fitted.
    assert 1.0 < draft.ms(calib, hw) < 8.0

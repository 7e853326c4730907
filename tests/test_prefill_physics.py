"""Prefill physics (GPU path): causal attention's key count, the sparse and windowed caps, and the LM head run only
where vLLM samples. Each test pins a count a miscount would change, not a fitted figure."""
from __future__ import annotations

import pytest

from moetplan.contract import Placement, StorageInfo
from moetplan.contract.model import GIB, Attention
from moetplan.cost_model.calibration import Calibration, FamilyFactors
from moetplan.cost_model.coverage import curve_for, expected_union, expected_union_hot
from moetplan.cost_model.hardware import GB
from moetplan.cost_model.prefill import COMPUTE, STREAM, attended_keys, attention_flops, prefill_run
from moetplan.cost_model.terms import cached_shares
from moetplan.cost_model.hardware import rates
from moetplan.models import resolve_model
from test_cost_model import toy_hw, toy_model

CAL = Calibration(families={"default": FamilyFactors()})


def causal(p0: int, n: int) -> int:
    """Brute force: the query at position p sees p + 1 tokens."""
    return sum(p + 1 for p in range(p0, p0 + n))


def compute_coef(model, prompt: int, mnbt: int = 65536) -> float:
    """The GEMM-compute term's ideal milliseconds (before compute_eff), whichever term the roofline keeps."""
    run = prefill_run(model, toy_hw(), Placement(max_num_batched_tokens=mnbt, context=65536), CAL,
                      prompt_tokens=prompt)
    # prefill_run keeps the larger of compute and the weight-read floor: these toy prompts are compute-bound,
    # asserted so the test cannot silently read the floor.
    assert run.terms[0].name == COMPUTE, run.terms[0].name
    return run.terms[0].parts["family.compute_eff"]


def test_a_chunk_attends_its_offset_plus_half_itself_per_token():
    m = toy_model()  # dense MLA: every earlier key
    assert attended_keys(m, 0, 1000, CAL) == causal(0, 1000) == 1000 * 1001 / 2
    # A later chunk: offset s, n tokens: n*s + n(n+1)/2, i.e. a mean of s + (n+1)/2 per token (not s + n/4).
    assert attended_keys(m, 3000, 1000, CAL) == causal(3000, 1000) == 1000 * 3000 + 1000 * 1001 / 2
    # Chunking does not change the total a prompt attends.
    whole = attended_keys(m, 0, 8192, CAL)
    assert sum(attended_keys(m, i * 1024, 1024, CAL) for i in range(8)) == pytest.approx(whole)
    assert sum(attended_keys(m, i * 3000, min(3000, 8192 - i * 3000), CAL) for i in range(3)) == pytest.approx(whole)


def test_sparse_attention_caps_each_query_at_index_topk_plus_the_indexer():
    att = Attention(kind="mla_sparse", num_heads=8, head_dim=128, index_topk=512)
    m = toy_model(attention=att)
    share = CAL.routing.sparse_index_share
    # Below the cap every key counts, plus the indexer's pass over all of them.
    assert attended_keys(m, 0, 512, CAL) == pytest.approx(causal(0, 512) * (1 + share))
    # Past it each query reads topk keys: the cap is per query, not applied to the chunk's mean context.
    got = attended_keys(m, 4096, 1000, CAL)
    assert got == pytest.approx(1000 * 512 + share * causal(4096, 1000))
    # A chunk straddling the cap: brute force.
    brute = sum(min(p + 1, 512) + share * (p + 1) for p in range(300, 900))
    assert attended_keys(m, 300, 600, CAL) == pytest.approx(brute)


def test_sliding_window_layers_read_at_most_the_window():
    att = Attention(kind="gqa", num_heads=8, num_kv_heads=2, head_dim=64, sliding_window=128, full_attention_layers=3)
    m = toy_model(attention=att)  # 12 layers: 3 full, 9 windowed
    brute = sum(3 / 12 * (p + 1) + 9 / 12 * min(p + 1, 128) for p in range(0, 2048))
    assert attended_keys(m, 0, 2048, CAL) == pytest.approx(brute)
    gpt_oss = resolve_model("gpt-oss-20b")
    # Half its layers are full attention (hwdb: full_attention_layers 12 of 24), the rest a 128-token window.
    assert 0.5 * causal(0, 8192) < attended_keys(gpt_oss, 0, 8192, CAL) < 0.52 * causal(0, 8192)


def test_doubling_the_prompt_scales_the_attention_term_as_the_causal_sum():
    """Within one chunk the compute is a*P + h + b*P(P+1)/2 (linear GEMMs, one LM-head row, causal attention):
    the second difference over P, 2P, 3P is exactly b*P^2, b being one query-key pair's time. The old count (a
    chunk's mean context chunk/4) gave half that."""
    m = toy_model(num_layers=2, moe_layers=2, non_routed_params_b=0.01)
    P = 4096
    c1, c2, c3 = (compute_coef(m, k * P) for k in (1, 2, 3))
    b = attention_flops(m, 1.0) / (rates(toy_hw(), Placement()).tflops * 1e12) * 1e3
    assert c3 - 2 * c2 + c1 == pytest.approx(b * P**2, rel=1e-6)
    # Doubling the prompt multiplies its attention by 2P(2P+1) / (P(P+1)), about 4.
    attn = [attention_flops(m, attended_keys(m, 0, k * P, CAL)) for k in (1, 2)]
    assert attn[0] == pytest.approx(attention_flops(m, 1.0) * P * (P + 1) / 2)
    assert attn[1] / attn[0] == pytest.approx(2 * (2 * P + 1) / (P + 1))


def test_the_lm_head_runs_once_per_chunk_not_per_prompt_token():
    """vLLM computes logits at logits_indices = query_start_loc[1:] - 1: one row per request per step. A bigger
    vocabulary adds the same compute at 2K and 8K prompt tokens in one chunk, and grows with the chunk count."""
    # The bigger vocabulary adds an input-embedding table (looked up, never multiplied) and an LM head.
    small = toy_model(vocab_size=1000)
    big = toy_model(vocab_size=201000, non_routed_params_b=0.5 + 2 * 200000 * 1024 / 1e9)
    extra = {P: compute_coef(big, P) - compute_coef(small, P) for P in (2048, 8192)}
    assert extra[2048] > 0
    assert extra[8192] == pytest.approx(extra[2048], rel=1e-9)
    chunked = compute_coef(big, 8192, mnbt=1024) - compute_coef(small, 8192, mnbt=1024)
    assert chunked == pytest.approx(8 * extra[8192], rel=1e-9)


# --------------------------------------------------------------------------- tiered prefill: what a chunk streams


def stream_term(model, pl, hw, prompt: int = 8192):
    run = prefill_run(model, hw, pl, CAL, prompt_tokens=prompt)
    return next(t for t in run.terms if t.name == STREAM)


def nvme_hw(nvme_gbps: float):
    hw = toy_hw(h2d=2.0)  # a slow link: the chunk's compute hides under its streaming
    return hw.model_copy(update={"storage": StorageInfo(seq_read_gbps=nvme_gbps, rand_read_gbps=nvme_gbps)})


def tiered(model, tier: str, mnbt: int = 512):
    full = model.routed_gib("2bit")
    return Placement.for_model(model, expert_tier=tier, gpu_expert_cache_gib=0.2 * full,
                               host_arena_gib=0.3 * full if tier == "nvme" else 0.0, max_num_batched_tokens=mnbt,
                               context=65536)


def test_the_nvme_share_is_the_coldest_experts_a_chunk_touches():
    """A skewed router's 512-token chunk touches few of the coldest experts: the pack serves the distinct rows
    beyond the arena that the chunk routes to (the coverage curve's union), not their share by expert count."""
    model, hw = toy_model(coverage_points=[(0.2, 0.96)]), nvme_hw(0.05)
    curve = curve_for(model, CAL.routing)
    E, K = model.n_routed_experts, model.top_k
    pl = tiered(model, "nvme")
    _, xc = cached_shares(model, pl)
    xa = pl.host_arena_gib * GIB / (model.moe_layers * E * model.expert_bytes("2bit", 1))
    u, uc, uh = (expected_union(curve, E, K, 512), expected_union_hot(curve, E, K, 512, xc),
                 expected_union_hot(curve, E, K, 512, xc + xa))
    share = (u - uh) / (u - uc)
    by_count = (1 - xc - xa) / (1 - xc)
    assert 0 < share < 0.8 * by_count
    t = stream_term(model, pl, hw)
    rows = 16 * model.moe_layers * (u - uc)  # 16 chunks' misses
    pack_ms = rows * model.expert_bytes("2bit", 1) * share / (0.05 * GB) * 1e3
    assert t.parts["link.nvme_read_eff"] == pytest.approx(pack_ms, rel=1e-6)
    # A chunk that touches every expert (a flat router, 8K tokens) reads the beyond-arena rows by their count.
    flat = toy_model(coverage_points=[(0.2, 0.25)])
    c2 = curve_for(flat, CAL.routing)
    u2, uc2, uh2 = (expected_union(c2, E, K, 8192), expected_union_hot(c2, E, K, 8192, xc),
                    expected_union_hot(c2, E, K, 8192, xc + xa))
    assert (u2 - uh2) / (u2 - uc2) == pytest.approx(by_count, rel=0.02)
    assert "link.nvme_read_eff" in stream_term(flat, tiered(flat, "nvme", mnbt=8192), hw).parts


def test_the_pack_read_overlaps_the_link_as_in_a_decode_fetch():
    """With a pack as fast as needed the link sets the time, as on the host tier with the same cache; with a slow
    one the pack path (its read, then the link for those rows) does, never the two added."""
    model = toy_model(coverage_points=[(0.2, 0.96)])
    host = stream_term(model, tiered(model, "host"), nvme_hw(0.05)).ms(CAL, None)
    fast = stream_term(model, tiered(model, "nvme"), nvme_hw(1e4))
    assert fast.ms(CAL, None) == pytest.approx(host) and "link.nvme_read_eff" not in fast.parts
    slow = stream_term(model, tiered(model, "nvme"), nvme_hw(0.05))
    assert slow.ms(CAL, None) > host
    pack = slow.parts["link.nvme_read_eff"] / CAL.value("link.nvme_read_eff", None)
    assert slow.ms(CAL, None) < pack + host  # the arena's rows cross the link while the pack is read

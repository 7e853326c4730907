"""Prefill time of one prompt on the slowest rank, as named terms (same representation as the decode terms).

Per chunk of max_num_batched_tokens: GEMMs are compute-bound (FLOPs / (tensor TFLOPs x eff)) with a floor of
reading every weight the chunk touches once; TP all-reduces carry chunk x hidden activations over PCIe; experts that
are not on the GPU are streamed in (host link, and NVMe for the part the RAM arena does not hold), overlapped with
compute, so a chunk takes the longer of the two.

vLLM's CPU backend (a profile without GPUs) runs every token-expert pair of a chunk through the CPU expert kernels
(csrc/cpu/moe_cpu.cpp): that term is pairs x the measured time of one pair at prefill batch (cpu_compute.
expert_pair_cost: the vector loop's and the scalar loop's rates, as `moetplan probe` measures them), with the same
floor of reading each routed expert's rows once per chunk; the dense GEMMs and attention are the compute term.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from moetplan.cost_model.calibration import Calibration, linear_value
from moetplan.cost_model.coverage import CoverageCurve, curve_for, expected_union, expected_union_hot, miss_stats
from moetplan.cost_model.cpu_compute import expert_pair_cost
from moetplan.cost_model.hardware import GB, Rates, rates
from moetplan.cost_model.terms import (
    MS,
    TermSpec,
    bytes_per_param,
    cached_shares,
    dense_read_bytes,
    embedding_bytes,
)
from moetplan.contract.model import GIB, ModelSpec
from moetplan.contract import HardwareProfile, Placement

COMPUTE = "prefill GEMM compute"
WEIGHTS = "prefill weight reads (bandwidth floor)"
AR = "prefill TP all-reduce over PCIe"
STREAM = "prefill expert streaming (non-resident experts)"
CHUNK = "prefill per-chunk overhead"
CPU_EXPERTS = "prefill expert kernels (CPU, token-expert pairs)"


@dataclass
class PrefillRun:
    prompt_tokens: int
    chunks: int
    terms: list[TermSpec]
    rates: Rates

    def ms(self, calib: Calibration, hw: HardwareProfile | None) -> float:
        return sum(t.ms(calib, hw) for t in self.terms)


def _sum_capped(first: int, count: int, cap: float | None = None) -> float:
    """sum of min(c, cap) for c = first .. first + count - 1 (cap None: no cap), in closed form."""
    if count <= 0:
        return 0.0
    last = first + count - 1
    if cap is None or last <= cap:
        return (first + last) * count / 2.0
    top = min(last, math.floor(cap))  # the contexts at or below the cap count themselves, the rest the cap
    below = (first + top) * (top - first + 1) / 2.0 if top >= first else 0.0
    return below + (count - max(0, top - first + 1)) * cap


def attended_keys(model: ModelSpec, start: int, count: int, calib: Calibration) -> float:
    """Keys the query tokens at positions start .. start + count - 1 of one prompt attend, summed over those
    queries and averaged over the layers.

    Causal attention: the query at position p (0-based) sees the p + 1 tokens up to itself, so a chunk of n tokens
    after an offset s attends n * s + n (n + 1) / 2 keys: a mean of s + (n + 1) / 2 per token. Sparse attention
    (DSA's index, mla_sparse / csa) reads at most index_topk of them plus the indexer's pass over all of them
    (kv_read_tokens' rule, applied per query, not to the chunk's mean); GQA hybrids that declare a sliding window
    read at most the window on the layers that are not full attention."""
    att = model.attention
    if att.kind in ("mla_sparse", "csa"):
        topk = float(getattr(att, "index_topk", None) or calib.routing.default_index_topk)
        return _sum_capped(start + 1, count, topk) + calib.routing.sparse_index_share * _sum_capped(start + 1, count)
    full = _sum_capped(start + 1, count)
    if att.sliding_window and att.full_attention_layers is not None and model.num_layers > 0:
        share = min(1.0, att.full_attention_layers / model.num_layers)
        return share * full + (1.0 - share) * _sum_capped(start + 1, count, float(att.sliding_window))
    return full


def attention_flops(model: ModelSpec, keys: float) -> float:
    """QK^T and PV over `keys` query-key pairs (attended_keys), all layers."""
    att = model.attention
    head_dim = att.head_dim or (192 if att.kind.startswith("mla") else model.hidden_size // max(att.num_heads, 1))
    return 4.0 * att.num_heads * head_dim * keys * model.num_layers


def lm_head_bytes(model: ModelSpec) -> float:
    """The LM head's weights (all ranks together): vocab x hidden, the part of dense_read_bytes that a forward pass
    runs only for the positions it samples."""
    return min(embedding_bytes(model), dense_read_bytes(model))


def cpu_expert_term(model: ModelSpec, rt: Rates, calib: Calibration, hw: HardwareProfile, pairs: float,
                    read_bytes: float) -> TermSpec:
    """The CPU backend's routed experts in prefill: `pairs` token-expert pairs through the CPU expert kernels, each
    at its measured time at prefill batch (rates: the probe's, else per-core defaults), or reading the chunks'
    routed rows (`read_bytes`) from DRAM where that is longer. The kernel time is measured, not a fitted factor."""
    if rt.cpu_isa is None:
        raise ValueError("CPU expert term without the CPU rates (cost_model.hardware.cpu_rates sets the ISA)")
    pc = expert_pair_cost(model.hidden_size, model.moe_intermediate_size, rt.cpu_isa, rt.cpu_vector_gflops,
                          rt.cpu_scalar_gflops)
    kernel_ms = pairs * pc.seconds * MS
    t = TermSpec(CPU_EXPERTS, note=f"{pairs:,.0f} pairs x {pc.seconds * 1e6:.2f} us ({rt.cpu_isa}: "
                 f"{1 - pc.scalar_share:.0%} of the math in the vector loop at {rt.cpu_vector_gflops:.1f} GFLOP/s, "
                 f"{pc.scalar_share:.0%} in the scalar loop at {rt.cpu_scalar_gflops:.2f}; {rt.cpu_kernel_source})")
    read_ms = read_bytes / (rt.mem_bw_gbps * GB) * MS
    if read_ms * linear_value("family.expert_bw_eff", calib.value("family.expert_bw_eff", hw)) > kernel_ms:
        t.add("family.expert_bw_eff", read_ms)
        t.note += f"; bound by reading {read_bytes / GB:.3g} GB of rows"
    else:
        t.const_ms = kernel_ms
    return t


def prefill_run(model: ModelSpec, hw: HardwareProfile, placement: Placement, calib: Calibration,
                prompt_tokens: int | None = None, curve: CoverageCurve | None = None) -> PrefillRun:
    rt = rates(hw, placement)
    r = calib.routing
    curve = curve or curve_for(model, r)
    # A prompt no longer than the served context (the reference length is for long-context plans).
    P = int(prompt_tokens or min(r.prefill_prompt_tokens, max(1, placement.context - 1)))
    chunk = max(1, min(placement.max_num_batched_tokens, P))
    n_chunks = math.ceil(P / chunk)
    tp = placement.tp
    L, NL, E, K = model.moe_layers, model.num_layers, model.n_routed_experts, model.top_k
    bpp = bytes_per_param(model)

    dense_b = dense_read_bytes(model) / tp
    head_b = lm_head_bytes(model) / tp
    # vLLM computes logits only where it samples: the last scheduled token of each request in each step
    # (gpu_model_runner: logits_indices = query_start_loc[1:] - 1), so one LM-head row per chunk of this prompt.
    dense_flops = 2.0 * (dense_b - head_b) / bpp * P + 2.0 * head_b / bpp * n_chunks
    expert_flops = 2.0 * P * K * model.expert_params * L / tp
    attn_flops = sum(attention_flops(model, attended_keys(model, i * chunk, min(chunk, P - i * chunk), calib))
                     for i in range(n_chunks)) / tp
    cpu = not hw.gpus
    # On the CPU backend the routed experts are their own term (the expert kernels, below), not GEMM FLOPs.
    flops = dense_flops + attn_flops + (0.0 if cpu else expert_flops)
    if cpu:
        # GEMMs and attention each at their own measured rate (the probe's, else gpu_compute.yaml's per ISA):
        # attention runs at a fraction of a GEMM's rate on a CPU, so one rate for both misprices either.
        compute = TermSpec(COMPUTE, note=(
            f"dense GEMMs {dense_flops / 1e9:.3g} GFLOP at {rt.cpu_gemm_gflops:.3g} GFLOP/s, attention "
            f"{attn_flops / 1e9:.3g} GFLOP at {rt.cpu_attention_gflops:.3g} GFLOP/s ({rt.tflops_source})"))
        compute.add("family.compute_eff", (dense_flops / rt.cpu_gemm_gflops + attn_flops / rt.cpu_attention_gflops)
                    / 1e9 * MS)
    else:
        compute = TermSpec(COMPUTE, note=f"{flops / 1e12:.1f} TFLOP/rank at {rt.tflops:.0f} TFLOPs ({rt.tflops_source})")
        compute.add("family.compute_eff", flops / (rt.tflops * 1e12) * MS)

    # Weights each chunk must read at least once.
    union = expected_union(curve, E, K, chunk)
    exp_b = L * union * model.expert_read_bytes("2bit", tp)
    floor = TermSpec(WEIGHTS, note=(f"{n_chunks} chunk(s) x {dense_b / GB:.3g} GB of dense weights" if cpu
                                    else f"{n_chunks} chunk(s) x {(dense_b + exp_b) / GB:.1f} GB/rank"))
    floor.add("family.dense_bw_eff", n_chunks * dense_b / (rt.mem_bw_gbps * GB) * MS)
    if not cpu:
        floor.add("family.expert_bw_eff", n_chunks * exp_b / (rt.mem_bw_gbps * GB) * MS)

    terms: list[TermSpec] = []
    # Compute and the bandwidth floor overlap: the chunk costs the larger one.
    terms.append(compute if compute.ms(calib, hw) >= floor.ms(calib, hw) else floor)
    if cpu:
        terms.append(cpu_expert_term(model, rt, calib, hw, P * K * L / tp, n_chunks * exp_b))

    if tp > 1:
        n_ar = 2 * NL * n_chunks
        ring = 2.0 * (tp - 1) / tp * P * model.hidden_size * 2 * 2 * NL
        t = TermSpec(AR, note=f"{ring / GB:.1f} GB of activations per rank over {rt.pcie_gbps:.0f} GB/s")
        t.add("family.allreduce_latency_us", float(n_ar * (tp - 1)))
        t.add("family.allreduce_bw_eff", ring / (rt.pcie_gbps * GB) * MS)
        terms.append(t)

    if placement.expert_tier != "resident":
        _, x_cached = cached_shares(model, placement)
        cold = miss_stats(curve, E, K, L, chunk, x_cached, 0.0)
        rank_b = n_chunks * cold.misses_per_step * model.expert_bytes("2bit", tp)
        full_b = n_chunks * cold.misses_per_step * model.expert_bytes("2bit", 1)
        stream = TermSpec(STREAM, note=f"{rank_b / GB:.1f} GB/rank streamed over {rt.h2d_gbps:.0f} GB/s")
        per_full = L * E * model.expert_bytes("2bit", 1)
        if placement.expert_tier == "host":
            stream.add("link.h2d_eff", rank_b / (rt.h2d_gbps * GB) * MS)
        else:
            if placement.host_arena_gib > 0:
                x_a, link = placement.host_arena_gib * GIB / per_full, "link.h2d_eff"
            else:
                x_a, link = r.page_cache_share * rt.host_ram_gib * GIB / per_full, "link.pageable_eff"
            # The rows the arena lacks: the distinct experts among the coldest (beyond the cache and the arena)
            # that a chunk touches, over all the uncached ones it touches (the coverage curve's union, as the
            # misses themselves). A chunk that touched every expert would make this the share by expert count; a
            # 512-token chunk of a skewed router touches far fewer of the coldest than of the arena's.
            u_all = expected_union(curve, E, K, chunk)
            u_cached = expected_union_hot(curve, E, K, chunk, x_cached)
            u_held = expected_union_hot(curve, E, K, chunk, min(1.0, x_cached + x_a))
            beyond = max(0.0, u_all - u_held) / (u_all - u_cached) if u_all - u_cached > 1e-12 else 0.0
            link_ms = rank_b / (rt.h2d_gbps * GB) * MS
            pack_ms = full_b * beyond / (rt.nvme_gbps * GB) * MS
            # As a decode step's fetch (terms._fetch_term): the pack read and the link's copies of the rows already
            # in RAM overlap (the store reads ahead while the link copies), so the slower path sets the time, a
            # roofline at the factors in hand (the fit re-linearises). The pack holds every TP shard of a row: a
            # miss reads the whole row.
            via_link = link_ms * linear_value(link, calib.value(link, None))
            via_pack = (pack_ms * linear_value("link.nvme_read_eff", calib.value("link.nvme_read_eff", None))
                        + beyond * via_link)
            if beyond > 0 and via_pack > via_link:
                stream.add("link.nvme_read_eff", pack_ms)
                stream.add(link, beyond * link_ms)
                stream.note += (f"; {full_b * beyond / GB:.1f} GB ({beyond:.0%} of the rows) from NVMe at "
                                f"{rt.nvme_gbps:.1f} GB/s, the pack path the slower")
            else:
                stream.add(link, link_ms)
                if beyond > 0:
                    stream.note += (f"; {full_b * beyond / GB:.1f} GB ({beyond:.0%} of the rows) from NVMe at "
                                    f"{rt.nvme_gbps:.1f} GB/s, overlapped with the link")
        # Streaming overlaps the chunk's compute; only the excess over it adds time.
        busy = terms[0]
        if stream.ms(calib, hw) > busy.ms(calib, hw):
            terms[0] = stream
            stream.note += " (streaming-bound: compute hides under it)"
    t = TermSpec(CHUNK, note=f"{n_chunks} chunk(s) of {chunk} tokens")
    t.add("family.prefill_chunk_overhead_ms", float(n_chunks))
    t.add("family.layer_overhead_us", float(NL * n_chunks))
    terms.append(t)
    return PrefillRun(P, n_chunks, terms, rt)


"""Decode step time on one GPU rank as a sum of named terms.

Every term is physics (bytes, counts) times a calibration factor: `parts` maps a registered parameter
(calibration.PARAMS) to the coefficient the step time is linear in — ideal milliseconds for an efficiency (time =
coef / eff), an event count for an overhead (time = count x overhead). predict() evaluates the terms; the fit in
calibration.py solves for the factors from the very same parts, so fitting and predicting can never disagree.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from moetplan.cost_model.calibration import PARAMS, Calibration, linear_value
from moetplan.cost_model.coverage import (
    CoverageCurve,
    MissStats,
    curve_for,
    expected_union,
    expected_union_hot,
    miss_stats,
)
from moetplan.cost_model.cpu_compute import layer_split
from moetplan.cost_model.hardware import GB, Rates, rates
from moetplan.contract.errors import UsageError
from moetplan.contract.model import DENSE_BYTES_PER_PARAM, GIB, ModelSpec
from moetplan.contract import HardwareProfile, Placement
from moetplan.contract.vocab import MOE_GRAPHS, MoeGraphs

MS = 1e3

# Term names (shown to people; the bottleneck is one of these).
DENSE = "dense weight reads"
EXPERTS = "routed expert reads"
KV = "KV cache reads"
DRAFT = "speculative draft passes"
ALLREDUCE = "TP all-reduce over PCIe"
PIPELINE = "pipeline stage hand-off"
LAYER_OVH = "per-layer launch overhead"
STEP_OVH = "per-step overhead (scheduler, sampler)"
SEQ_OVH = "per-sequence overhead (sampling, verification, metadata)"
MLA_ATTN = "dense MLA decode kernels"
MISS_HOST = "expert misses (host RAM -> GPU over PCIe)"
MISS_NVME = "expert misses (NVMe pack -> RAM -> GPU)"
MISS_REPLAY = "miss replays (the step's graph run again)"
MOE_GRAPH = "tiered MoE graph overhead"
GATE = "confidence-gate recomputes"
CPU_EXPERT_CALLS = "MoE expert calls (CPU expert path)"
# How a tiered step keeps its MoE layers: "replay" (inside the CUDA graphs; a step that missed is fetched in one
# batch and run again: vLLM-Moet's design, behind every published tiered row) or "split" (every MoE layer out of
# the graphs, reading its routed ids on the host each step).
MOE_GRAPH_MODES = MOE_GRAPHS  # contract.vocab: the one declaration
# Terms a CUDA-graph replay of the step repeats: the forward pass, not the host-side scheduling around it.
GRAPH_TERMS = (DENSE, EXPERTS, KV, MLA_ATTN, "TP all-reduce over PCIe", "pipeline stage hand-off",
               "per-layer launch overhead")


@dataclass
class TermSpec:
    name: str
    parts: dict[str, float] = field(default_factory=dict)
    const_ms: float = 0.0
    note: str = ""

    def ms(self, calib: Calibration, hw: HardwareProfile | None) -> float:
        return self.const_ms + sum(c * linear_value(p, calib.value(p, hw)) for p, c in self.parts.items())

    def add(self, param: str, coef: float) -> None:
        assert param in PARAMS, param
        if coef:
            self.parts[param] = self.parts.get(param, 0.0) + coef


@dataclass
class DecodeStep:
    concurrency: int
    tokens_per_step: float  # emitted per stream per step (MTP acceptance)
    tokens_per_layer: float  # tokens each MoE layer processes per step (all streams, incl. drafts verified)
    union_per_layer: float  # expected distinct experts read per MoE layer
    terms: list[TermSpec]
    miss: MissStats | None
    rates: Rates
    notes: list[str] = field(default_factory=list)
    gate_fire_share: float | None = None
    cpu_miss_share: float | None = None  # tiered: share of the misses computed on the CPU (cpu_compute)

    def term_ms(self, calib: Calibration, hw: HardwareProfile | None) -> list[tuple[TermSpec, float]]:
        return [(t, t.ms(calib, hw)) for t in self.terms]

    def step_ms(self, calib: Calibration, hw: HardwareProfile | None) -> float:
        return sum(ms for _, ms in self.term_ms(calib, hw))


# --------------------------------------------------------------------------- model byte helpers


def bytes_per_param(model: ModelSpec) -> float:
    return DENSE_BYTES_PER_PARAM.get(model.dense_precision, 2.0)


def embedding_bytes(model: ModelSpec) -> float:
    return model.vocab_size * model.hidden_size * bytes_per_param(model)


def dense_read_bytes(model: ModelSpec) -> float:
    """Non-routed weights one forward pass reads (all ranks together): everything but the embedding table.

    From the parameter count, not `dense_gib_published`: published stacks include the MTP layer (and its experts at
    checkpoint precision) or a vision tower, neither of which the main decode pass reads. The input embedding is a
    row lookup; the LM head is read in full.
    """
    if model.non_routed_params_b > 0:
        total = model.non_routed_params_b * 1e9 * bytes_per_param(model)
    else:
        total = model.dense_bytes()
    return max(total - embedding_bytes(model), 0.0)


def acceptance(model: ModelSpec, placement: Placement) -> float:
    """Tokens emitted per decode step: the placement's figure when it states one, else the model fact."""
    if placement.mtp <= 0:
        return 1.0
    if placement.mtp_acceptance and placement.mtp_acceptance > 1.0:
        return min(placement.mtp_acceptance, placement.mtp + 1.0)
    return model.mtp_accept(placement.mtp)


def reserve_slots(model: ModelSpec, placement: Placement) -> int:
    if placement.fp4_reserve_slots:
        return placement.fp4_reserve_slots
    return int(placement.fp4_reserve_gib * GIB // model.expert_bytes("fp4", placement.tp))


def cached_shares(model: ModelSpec, placement: Placement) -> tuple[float, float]:
    """(share of experts in the FP4 reserve, share cached on the GPU in any format) per rank."""
    total = model.moe_layers * model.n_routed_experts
    x_r = min(1.0, reserve_slots(model, placement) / total)
    if placement.expert_tier == "resident":
        return x_r, 1.0
    return x_r, min(1.0, x_r + placement.gpu_expert_cache_slots / total)


def kv_read_tokens(model: ModelSpec, context_tokens: float, calib: Calibration) -> float:
    """Context tokens whose KV a decode step reads: all of them, or top-k plus the indexer for sparse attention."""
    kind = model.attention.kind
    if kind in ("mla_sparse", "csa"):
        topk = getattr(model.attention, "index_topk", None) or calib.routing.default_index_topk
        return min(context_tokens, float(topk)) + calib.routing.sparse_index_share * context_tokens
    return context_tokens


def filled_tokens(placement: Placement, calib: Calibration, kv_tokens: float | None = None) -> float:
    """Context each stream has filled when decode is predicted: a measurement's own figure when it states one, else
    routing.decode_filled_tokens (short-prompt decode, as the published benchmarks ran it), capped by the window."""
    if kv_tokens is not None:
        return float(kv_tokens)
    return float(min(placement.context, calib.routing.decode_filled_tokens))


def kv_read_bytes(model: ModelSpec, placement: Placement, calib: Calibration, seqs: int,
                  filled: float | None = None) -> float:
    kv_dtype = placement.kv_dtype
    if kv_dtype not in model.kv_bytes_per_token:
        known = ", ".join(model.kv_bytes_per_token) or "none"
        raise UsageError(f"{model.id} has no KV layout '{kv_dtype}' (known: {known}); set kv_dtype to one of them")
    filled = filled_tokens(placement, calib, filled)
    tokens = kv_read_tokens(model, filled, calib)
    return model.kv_bytes(kv_dtype, int(tokens), placement.tp, seqs=1) * seqs


def _ms(nbytes: float, gbps: float) -> float:
    return nbytes / (gbps * GB) * MS


# --------------------------------------------------------------------------- the decode step


def decode_step(model: ModelSpec, hw: HardwareProfile, placement: Placement, calib: Calibration,
                concurrency: int | None = None, curve: CoverageCurve | None = None,
                kv_tokens: float | None = None, moe_graphs: MoeGraphs | None = None) -> DecodeStep:
    """Terms of one decode step on the slowest rank, with `concurrency` streams batched (default: 1).

    kv_tokens: context tokens each stream has filled; default filled_tokens()'s rule.
    moe_graphs: how a tiered plan runs its MoE layers (MOE_GRAPH_MODES); default the placement's own;
    resident plans ignore it.
    """
    rt = rates(hw, placement)
    if rt.mem_bw_gbps <= 0 or rt.h2d_gbps <= 0 or rt.nvme_gbps <= 0 or rt.tflops <= 0:
        raise UsageError(
            f"The hardware profile has a zero rate (memory {rt.mem_bw_gbps} GB/s, host link {rt.h2d_gbps} GB/s, "
            f"NVMe {rt.nvme_gbps} GB/s, {rt.tflops} TFLOPs); re-run `moetplan probe` or fix the field in hw.json"
        )
    if model.n_routed_experts <= 0 or model.top_k <= 0 or model.moe_layers <= 0:
        raise UsageError(f"{model.id} has no routed experts (n_routed_experts / top_k / moe_layers is 0); "
                         "moetplan plans MoE models only")
    r = calib.routing
    curve = curve or curve_for(model, r)
    fam_hw = hw
    c = max(1, int(concurrency or 1))
    k_spec = max(0, placement.mtp)
    tp, pp = placement.tp, placement.pp
    L, NL, E, K = model.moe_layers, model.num_layers, model.n_routed_experts, model.top_k
    acc = acceptance(model, placement)
    tokens_layer = c * (1 + k_spec)
    # Drafted tokens of one sequence route much like their predecessor (per-stream effective tokens); other
    # streams follow the coverage curve only in part (stream_overlap).
    tokens_eff = 1 + k_spec * (1.0 - r.token_overlap)
    so = r.stream_overlap
    bpp = bytes_per_param(model)
    terms: list[TermSpec] = []
    notes: list[str] = []

    def roofline(term: TermSpec, mem_param: str, mem_ms: float, flops: float) -> None:
        comp_ms = flops / (rt.tflops * 1e12) * MS
        mem_t = mem_ms * linear_value(mem_param, calib.value(mem_param, fam_hw))
        comp_t = comp_ms * linear_value("family.compute_eff", calib.value("family.compute_eff", fam_hw))
        if comp_t > mem_t:
            term.add("family.compute_eff", comp_ms)
            term.note += " (compute-bound at this batch)"
        else:
            term.add(mem_param, mem_ms)

    # Dense stack: read once per step whatever the batch; compute grows with the tokens.
    dense_b = dense_read_bytes(model) / tp
    t = TermSpec(DENSE, note=f"{dense_b / GB:.2f} GB/rank at {rt.mem_bw_gbps:.0f} GB/s")
    roofline(t, "family.dense_bw_eff", _ms(dense_b, rt.mem_bw_gbps), 2.0 * dense_b / bpp * tokens_layer)
    terms.append(t)

    # Routed experts: the union of what all tokens of the step route to, at the format each is read in.
    union = expected_union(curve, E, K, tokens_eff, c, so)
    x_r, x_cached = cached_shares(model, placement)
    union_fp4 = expected_union_hot(curve, E, K, tokens_eff, x_r, c, so) if x_r > 0 else 0.0
    b2, b4 = model.expert_read_bytes("2bit", tp), model.expert_read_bytes("fp4", tp)
    exp_b = L * (union_fp4 * b4 + (union - union_fp4) * b2)
    t = TermSpec(EXPERTS, note=f"{union:.1f} of {E} experts/layer x {L} layers = {exp_b / GB:.2f} GB/rank"
                 + (f", {union_fp4:.1f}/layer from the FP4 reserve" if union_fp4 > 0.05 else ""))
    roofline(t, "family.expert_bw_eff", _ms(exp_b, rt.mem_bw_gbps),
             2.0 * tokens_layer * K * model.expert_params * L / tp)
    terms.append(t)

    if not hw.gpus:
        # vLLM's CPU backend runs the MoE op eagerly: every expert a layer routes to is its own gather, dequantize
        # and matmuls (the expert path); their bytes are the routed expert reads above, their launches this.
        t = TermSpec(CPU_EXPERT_CALLS, note=f"{union:.1f} experts/layer x {L} MoE layers")
        t.add("family.expert_call_us", union * L / pp)
        terms.append(t)

    # KV cache at the filled context (filled_tokens' rule), one read per sequence per step.
    kv_b = kv_read_bytes(model, placement, calib, c, kv_tokens)
    t = TermSpec(KV, note=f"{kv_b / GB:.3f} GB/rank at {filled_tokens(placement, calib, kv_tokens):.0f} filled "
                 f"tokens x {c} seq")
    t.add("family.dense_bw_eff", _ms(kv_b, rt.mem_bw_gbps))
    terms.append(t)
    if model.attention.kind == "mla":
        # Dense MLA decodes through vLLM's Triton kernel (one pipeline stage on sm_120): a latency floor per layer
        # that the KV bytes alone do not show.
        t = TermSpec(MLA_ATTN, note=f"{NL} layers")
        t.add("family.mla_attention_us", float(NL))
        terms.append(t)

    # Speculative drafts: each drafted token is one sequential pass of the MTP layer (or drafter) plus the LM head.
    if k_spec > 0:
        t = TermSpec(DRAFT, note=f"{k_spec} draft pass(es)/step, {acc:.2f} tokens emitted/step")
        if model.mtp_layers > 0:
            mtp_params = model.mtp_params_b * 1e9
            experts_in = model.mtp_layers * model.n_routed_experts * model.expert_params
            if mtp_params > experts_in:
                mtp_params -= experts_in  # published MTP sizes include the layer's routed experts
            if mtp_params <= 0:
                mtp_params = dense_read_bytes(model) / bpp / max(NL, 1)
            d_b = (mtp_params * bpp + embedding_bytes(model)) / tp
            draft_union = expected_union(curve, E, K, 1.0, c, so)
            e_b = draft_union * b2
            t.add("family.expert_bw_eff", k_spec * _ms(e_b, rt.mem_bw_gbps))
        elif model.drafter_gib > 0:
            # A separate drafter (Eagle3: one decoder layer, an fc over the target's hidden states, a small-vocab LM
            # head) reads its weights once per drafted token; its checkpoint carries a copy of the target's
            # embedding table, which a pass only looks rows up in.
            d_bytes = model.drafter_gib * GIB
            emb = embedding_bytes(model)
            d_b = (d_bytes - emb if d_bytes > emb else d_bytes) / tp
        else:
            d_b = embedding_bytes(model) / tp
            notes.append(f"{model.id} has no MTP head or drafter; draft passes costed as an LM-head read only")
        t.add("family.dense_bw_eff", k_spec * _ms(d_b, rt.mem_bw_gbps))
        t.add("family.layer_overhead_us", float(k_spec))
        # The proposer's bookkeeping per drafted token (draft sampling, rejection sampling, metadata) is vLLM's one
        # speculative-decoding path whether an MTP head or a separate drafter proposes: the MTP rows pin it.
        t.add("family.draft_overhead_ms", float(k_spec))
        if tp > 1:
            t.add("family.allreduce_latency_us", 2.0 * k_spec * (tp - 1))
        terms.append(t)

    # Tensor parallel: two all-reduces per layer (attention out, MoE out), tiny and latency-bound at decode.
    if tp > 1:
        n_ar = 2 * NL
        ring = 2.0 * (tp - 1) / tp * tokens_layer * model.hidden_size * 2
        t = TermSpec(ALLREDUCE, note=f"{n_ar} all-reduces of {tokens_layer * model.hidden_size * 2 / 1024:.0f} KiB"
                     + ("" if hw.p2p else f" through host memory (no P2P, {rt.pcie_gbps:.0f} GB/s)"))
        # Small all-reduces run NCCL's ring/LL path: 2(tp-1) latency-bound hops, so the latency grows with tp - 1.
        t.add("family.allreduce_latency_us", float(n_ar * (tp - 1)))
        t.add("family.allreduce_bw_eff", n_ar * _ms(ring, rt.pcie_gbps))
        terms.append(t)
    if pp > 1:
        t = TermSpec(PIPELINE, note=f"{pp - 1} activation hand-off(s) per step")
        t.add("family.allreduce_latency_us", float(pp - 1))
        t.add("family.allreduce_bw_eff", (pp - 1) * _ms(tokens_layer * model.hidden_size * 2, rt.pcie_gbps))
        terms.append(t)

    t = TermSpec(LAYER_OVH, note=f"{NL} layers")
    t.add("family.layer_overhead_us", float(NL))
    terms.append(t)
    t = TermSpec(STEP_OVH)
    t.add("family.step_overhead_ms", 1.0)
    terms.append(t)
    t = TermSpec(SEQ_OVH, note=f"{c} sequence(s)")
    t.add("family.seq_overhead_us", float(c))
    terms.append(t)

    # A replay re-runs the step's CUDA graph: the forward-pass terms at the factors in hand (the fit re-linearises).
    graph = sum(tm.ms(calib, fam_hw) for tm in terms if tm.name in GRAPH_TERMS)
    miss: MissStats | None = None
    cpu_share: float | None = None
    if placement.expert_tier != "resident":
        miss = miss_stats(curve, E, K, L, tokens_eff, x_cached, r.miss_correlation, c, so)
        mode = moe_graphs or placement.moe_graphs
        cpu_share = cpu_miss_split(placement, miss, mode)[0]
        if mode == "replay" and cpu_miss_split(placement, miss, "split")[0] > 0:
            notes.append(f"the split path (moe_graphs=split) would compute "
                         f"{cpu_miss_split(placement, miss, 'split')[0]:.0%} of the misses on the CPU; the replay "
                         "path fetches every miss")
        terms.append(moe_graph_overhead(model, placement, mode))
        terms.append(_fetch_term(model, placement, calib, rt, curve, miss, x_cached, mode))
        if mode == "replay":  # split computes a missing layer after its fetch: no step runs twice
            t = TermSpec(MISS_REPLAY, note=f"{miss.p_step_miss:.0%} of steps miss and run again")
            t.add("family.miss_replay_factor", miss.p_step_miss * graph)
            terms.append(t)

    gate_share: float | None = None
    if placement.gate.enabled and x_r > 0:
        # A step the gate does not trust is recomputed (one more graph replay) with its experts promoted to FP4; a
        # degraded gate (reserve below its floor) caps promotions but still recomputes.
        gate_share = calib.gate_share(placement.gate.tau)
        t = TermSpec(GATE, note=f"{gate_share:.0%} of steps recomputed with FP4 experts (tau {placement.gate.tau}"
                     + (", degraded: promotions capped" if placement.gate.degraded else "") + ")")
        t.add("routing.gate_recompute_share", max(placement.gate.tau, 0.0) ** r.gate_tau_exponent * graph)
        terms.append(t)

    return DecodeStep(c, acc, tokens_layer, union, terms, miss, rt, notes, gate_share, cpu_miss_share=cpu_share)


def moe_graph_overhead(model: ModelSpec, placement: Placement, moe_graphs: str = "replay") -> TermSpec:
    """What keeping the MoE layers tiered costs every step, miss or not.

    replay: one host read of the step's device-side record (what it used, what had no slot) and the sync before it.
    split: every MoE layer runs between piecewise graphs and reads its routed ids on the host, looks them up and
    launches eagerly (bench/results/graph_overhead_cpu.json measured that host work per layer).
    The replay path's own term (issue 38) plugs in here: this is the one place the tiered step's graph mode is
    priced."""
    if moe_graphs not in MOE_GRAPH_MODES:
        raise UsageError(f"moe_graphs={moe_graphs}: one of {', '.join(MOE_GRAPH_MODES)}")
    layers = math.ceil(model.moe_layers / placement.pp)
    if moe_graphs == "split":
        t = TermSpec(MOE_GRAPH, note=f"split: {layers} MoE layers out of the CUDA graphs, host work each")
        t.add("family.moe_split_us", float(layers))
        return t
    t = TermSpec(MOE_GRAPH, note="replay: one read of the step's miss record per step")
    t.add("family.tiered_step_us", 1.0)
    return t


def cpu_miss_split(placement: Placement, miss: MissStats, moe_graphs: str) -> tuple[float, float]:
    """(share of the misses computed on the CPU, link time relative to fetching all) for a tiered step: each layer
    that misses splits its misses between the CPU and the link (cpu_compute.layer_split) at the plan's
    cpu_miss_ratio. Tier host only (the pinned host store holds every row where the CPU reads it), and the split
    path only: that is where the runtime does it (runtime/vllm/layer.py, _cpu_miss_forward)."""
    if placement.expert_tier != "host" or moe_graphs != "split" or miss.layers_with_miss <= 0:
        return 0.0, 1.0
    return layer_split(miss.misses_per_step / miss.layers_with_miss, placement.cpu_miss_ratio)


def _fetch_term(model: ModelSpec, placement: Placement, calib: Calibration, rt: Rates, curve: CoverageCurve,
                miss: MissStats, x_cached: float, moe_graphs: str = "replay") -> TermSpec:
    """The fetch of a step's missing rows: per MoE layer that misses, one batch and its round trip; every row's
    bytes over the host link. For tier nvme, what the pinned arena (the host's share) lacks is read from the pack,
    overlapped with the link's copies of the rows the arena holds."""
    r = calib.routing
    L, E, tp = model.moe_layers, model.n_routed_experts, placement.tp
    row = model.expert_bytes("2bit", tp)
    rank_bytes = miss.misses_per_step * row
    note = (f"{miss.misses_per_step:.1f} rows/step ({rank_bytes / 2**20:.0f} MiB/rank) over {rt.h2d_gbps:.1f} GB/s; "
            f"{miss.p_step_miss:.0%} of steps miss (independent model: {miss.p_step_miss_independent:.0%});"
            f" token hit rate {miss.token_hit_rate:.2%}")
    t = TermSpec(MISS_HOST if placement.expert_tier == "host" else MISS_NVME, note=note)
    # Every MoE layer whose rows miss fetches them as one batch and waits for it: a host round trip (ids to the
    # host, lookup and eviction, copy launches) plus the rows' small copies (planes and scales of gate/up/down),
    # in link time: vLLM-Moet's RTX 5090 box (26.6 GiB/s under load) pays 2x the misses of its PRO 6000 (51.6).
    t.add("link.fetch_overhead_mib", miss.layers_with_miss * _ms(2**20, rt.h2d_gbps))
    if placement.expert_tier == "host":
        # Misses the CPU computes from the host rows meanwhile leave the link (and finish no later than it).
        share, factor = cpu_miss_split(placement, miss, moe_graphs)
        t.add("link.h2d_eff", factor * _ms(rank_bytes, rt.h2d_gbps))
        if share > 0:
            t.note += (f"; {share:.0%} of misses computed on the CPU from the host rows while the link fetches the "
                       f"rest (CPU {placement.cpu_miss_ratio:.2f}x the link's speed per miss)")
        return t
    rank_experts = L * E * model.expert_bytes("2bit", tp)
    if placement.host_arena_gib > 0:
        # Each rank's arena holds its own TP shard of the rows.
        x_a, pinned = placement.host_arena_gib * GIB / rank_experts, True
    else:
        # No arena: the kernel page cache is the only RAM tier, and its pages are pageable.
        x_a, pinned = r.page_cache_share * rt.host_ram_gib * GIB / (L * E * model.expert_bytes("2bit", 1)), False
    link = "link.h2d_eff" if pinned else "link.pageable_eff"
    miss_mass = 1.0 - curve(x_cached)
    beyond = (1.0 - curve(min(1.0, x_cached + x_a))) / miss_mass if miss_mass > 1e-12 else 0.0
    if beyond <= 0:
        t.add(link, _ms(rank_bytes, rt.h2d_gbps))
        return t
    # The pack read and the copies of rows already in RAM overlap (the store reads ahead while the link copies):
    # the slower of the two paths sets the fetch, as a roofline at the factors in hand (the fit re-linearises).
    # The pack holds every TP shard of a row together: a miss reads the whole row.
    p_nvme = miss.p_step_miss * (1.0 - (1.0 - beyond) ** max(1.0, miss.misses_per_step / max(miss.p_step_miss,
                                                                                             1e-12)))
    nvme_bytes = miss.misses_per_step * model.expert_bytes("2bit", 1) * beyond
    link_ms = _ms(rank_bytes, rt.h2d_gbps)
    pack_ms = _ms(nvme_bytes, rt.nvme_gbps)
    via_link = link_ms * linear_value(link, calib.value(link, None))
    via_pack = (pack_ms * linear_value("link.nvme_read_eff", calib.value("link.nvme_read_eff", None))
                + p_nvme * linear_value("link.nvme_latency_us", calib.value("link.nvme_latency_us", None))
                + beyond * via_link)
    if via_pack > via_link:
        t.add("link.nvme_read_eff", pack_ms)
        t.add("link.nvme_latency_us", p_nvme)
        t.add(link, beyond * link_ms)
        t.note += f"; {beyond:.0%} of misses read from NVMe ({rt.nvme_gbps:.1f} GB/s), the pack path the slower"
    else:
        t.add(link, link_ms)
        t.note += f"; {beyond:.0%} of misses read from NVMe ({rt.nvme_gbps:.1f} GB/s), overlapped with the link"
    return t

"""The memory ledger: where every byte of a placement lives (per GPU rank, host RAM, disk) and the guards.

Pure arithmetic over ModelSpec + HardwareProfile + Placement; the solver calls it for every candidate, so it
stays cheap. Every constant is a fact or a policy in hwdb/guards.yaml; the geometry it reproduces is
hwdb/sources/vllm_moet_memory.md (tests/test_ledger_published.py checks every configuration there).

A GPU rank, as vLLM and vLLM-Moet lay it out:

- inside vLLM's budget (gpu_memory_utilization x VRAM): dense weights, the routed experts (resident planes or the
  GPU expert cache), the FP4 reserve where the headroom above the budget cannot hold it, CUDA graphs and
  workspaces, the activation peak of max_num_batched_tokens, communicator buffers, and the KV pool, which takes
  whatever is left (vLLM sizes it after profiling);
- above it: the CUDA context, transients vLLM's profiling run does not see, and the FP4 reserve as far as it fits
  above a fixed headroom (vLLM-Moet's automatic pool is "free after KV - 3 GiB").
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from moetplan.contract import GPURankMemory, HardwareProfile, LedgerItem, MemoryLedger, Placement
from moetplan.contract.model import DENSE_BYTES_PER_PARAM, GIB, ModelSpec
from moetplan.contract.sizing import gate_floor_slots, step_working_set
from moetplan.plan.ledger_host import guards, host_and_disk, host_reserve_gib, host_usable_gib


# The solver rounds sizes down to this step; comparisons allow it, so a rounded pool is never refused for being
# a rounding step below its own need.
ROUND_GIB = 1e-3


def spec_tokens(model: ModelSpec, p: Placement) -> int:
    return p.mtp if p.mtp > 0 else 0


def step_working_set_slots(model: ModelSpec, p: Placement) -> int:
    """One decode step's routed (layer, expert) pairs: MoE layers x top_k x (1 + spec) x min(seqs, cap)."""
    g = guards()["expert_cache"]
    # The streams the plan decodes together: vLLM-Moet's published cache-11 recipe booted at max_num_seqs 2, below
    # a floor counted over max_num_seqs.
    seqs = min(max(p.concurrency, 1), max(p.max_num_seqs, 1), g["seqs_cap"])
    return step_working_set(model.moe_layers, model.top_k, spec_tokens(model, p), seqs)


def cache_floor_slots(model: ModelSpec, p: Placement, comfortable: bool = False) -> int:
    g = guards()["expert_cache"]
    f = g["comfortable_factor"] if comfortable else g["floor_factor"]
    # PP ranks hold only their layers.
    return math.ceil(f * step_working_set_slots(model, p) / p.pp)


def fp4_gate_floor_slots(model: ModelSpec, p: Placement) -> int:
    return gate_floor_slots(step_working_set_slots(model, p), guards()["fp4_gate"]["floor_factor"], p.pp)


def gpu_memory_utilization_default(vram_gib: float) -> float:
    return float(guards()["gpu"]["gpu_memory_utilization"])


def gpu_memory_utilization_for(model: ModelSpec, p: Placement, vram: float) -> float:
    """The default utilization, lowered (in 0.01 steps) until what stays above vLLM's budget holds the CUDA context
    and the transients its profiling does not see."""
    need = guards()["gpu"]["cuda_context_gib"] + unprofiled_gib(model, p)
    util = gpu_memory_utilization_default(vram)
    return min(util, math.floor((1.0 - need / vram) * 100) / 100)


# --------------------------------------------------------------------------- what one rank holds


def replicated_gib(model: ModelSpec) -> float:
    """Non-routed weights every TP rank holds whole: vLLM keeps the MoE router gates, MLA's down-projections
    (q_a, kv_a) and the DSA indexer's projections replicated, plus what the model entry names (a vision tower)."""
    att = model.attention
    extra = att.model_extra or {}
    h = model.hidden_size
    params = model.moe_layers * model.n_routed_experts * h
    if att.kind in ("mla", "mla_sparse"):
        q_lora = int(extra.get("q_lora_rank") or 0)
        params += model.num_layers * h * (q_lora + (att.kv_lora_rank or 0) + (att.qk_rope_head_dim or 0))
    if att.kind == "mla_sparse":
        heads, dim = int(extra.get("index_n_heads") or 0), int(extra.get("index_head_dim") or 0)
        layers = int(extra.get("indexer_layers") or model.num_layers)
        params += layers * (int(extra.get("q_lora_rank") or 0) * heads * dim + h * dim + h * heads)
    return model.dense_replicated_gib + params * DENSE_BYTES_PER_PARAM.get(model.dense_precision, 2.0) / GIB


def mtp_layer_gib(model: ModelSpec) -> float:
    """The MTP layer as the runtime holds it (routed experts at 2-bit), one rank of TP1, whether or not the
    published dense figure already includes it."""
    if model.mtp_layers <= 0:
        return 0.0
    return model.model_copy(update={"dense_includes_mtp": False}).mtp_bytes_per_rank(1) / GIB


def dense_gib(model: ModelSpec, p: Placement) -> float:
    """Non-routed weights on one rank: the sharded part over TP, the replicated part whole, split over PP stages.
    A published stack that includes the MTP layer loses it when speculation is off (vLLM does not load it)."""
    total = model.dense_bytes() / GIB
    if model.dense_includes_mtp and p.mtp <= 0:
        total = max(total - mtp_layer_gib(model), 0.0)
    rep = min(replicated_gib(model), total)
    return ((total - rep) / p.tp + rep) / p.pp


def activation_gib(model: ModelSpec, p: Placement) -> float:
    """Activation peak of a forward over max_num_batched_tokens that vLLM's profiling run measures: the permuted
    MoE inputs and the expert FFN intermediates, plus the hidden-state buffers."""
    h, i = model.hidden_size, model.moe_intermediate_size / p.tp
    per_token = model.top_k * (2 * h + 6 * i) + guards()["gpu"]["activation_hidden_bytes_per_unit"] * h
    return p.max_num_batched_tokens * per_token / GIB


def sampler_gib(model: ModelSpec, p: Placement) -> float:
    """The sampler's peak in vLLM's profiling run: logits over the vocabulary for every scheduled token of every
    sequence (max_num_seqs x (1 + speculative tokens), the rejection sampler's batch), in fp32 with the
    probabilities and the top-k/top-p sort's values and indices beside them. Small at a few sequences; at 192 it is
    GiB that the KV pool does not get."""
    tokens = max(p.max_num_seqs, 1) * (1 + max(p.mtp, 0))
    return tokens * model.vocab_size * guards()["gpu"]["sampler_bytes_per_logit"] / p.tp / GIB


def unprofiled_gib(model: ModelSpec, p: Placement) -> float:
    """Transients above vLLM's budget: the FP32 unpermute scatter of the fused-MoE output (1.83 GiB at 9,984
    batched tokens, top-8, H 6144 in vLLM-Moet) and dense MLA's chunked-context up-projection workspace."""
    out = p.max_num_batched_tokens * model.top_k * model.hidden_size * 4 / GIB
    att = model.attention
    if att.kind == "mla":
        extra = att.model_extra or {}
        width = int(extra.get("qk_nope_head_dim") or 0) + int(extra.get("v_head_dim") or 0)
        heads = max(att.num_heads // p.tp, 1)
        tokens = min(guards()["gpu"]["mla_chunked_context_tokens"], 8 * p.context)
        out += tokens * heads * width * 2 / GIB
    return out


def fp4_outside_gib(p: Placement, vram: float, reserve_gib: float | None = None) -> float:
    """The share of the FP4 reserve (the plan's, or `reserve_gib`) that fits above vLLM's budget, keeping
    vLLM-Moet's headroom."""
    g = guards()["gpu"]
    # vLLM-Moet's "free after KV" is measured with the CUDA context already resident above the budget.
    room = (1.0 - p.gpu_memory_utilization) * vram - g["cuda_context_gib"] - g["fp4_outside_headroom_gib"]
    return min(p.fp4_reserve_gib if reserve_gib is None else reserve_gib, max(room, 0.0))


def drafter_gib(model: ModelSpec, p: Placement) -> float:
    return model.drafter_gib / p.tp if p.mtp > 0 and model.mtp_layers == 0 and model.drafter_gib > 0 else 0.0


def experts_resident_gib(model: ModelSpec, p: Placement) -> float:
    return model.routed_gib("2bit", p.tp) / p.pp


def fixed_gpu_items(model: ModelSpec, p: Placement) -> list[LedgerItem]:
    """Everything on a GPU rank except experts, FP4 reserve and KV."""
    g = guards()["gpu"]
    items = [LedgerItem(name="dense", gib=dense_gib(model, p),
                        note=f"non-routed stack at {model.dense_precision}, TP{p.tp} x PP{p.pp}"
                        + (f" (MLA down-projections{' and vision tower' if model.dense_replicated_gib else ''}"
                           " replicated)" if replicated_gib(model) else ""))]
    if p.mtp > 0 and model.mtp_layers > 0 and not model.dense_includes_mtp:
        items.append(LedgerItem(name="mtp_layer", gib=model.mtp_bytes_per_rank(p.tp) / GIB,
                                note="MTP layer, routed experts at 2-bit"))
    if drafter_gib(model, p):
        items.append(LedgerItem(name="drafter", gib=drafter_gib(model, p), note="separate drafter (Eagle3)"))
    items.append(LedgerItem(name="cuda_graphs_workspace", gib=g["cuda_graphs_workspace_gib"],
                            note="CUDA graphs + workspaces"))
    items.append(LedgerItem(name="activations", gib=activation_gib(model, p),
                            note=f"peak of {p.max_num_batched_tokens} batched tokens"))
    items.append(LedgerItem(name="sampler", gib=sampler_gib(model, p),
                            note=f"logits of {max(p.max_num_seqs, 1)} sequence(s) x {1 + max(p.mtp, 0)} token(s)"))
    if p.tp * p.pp > 1:
        items.append(LedgerItem(name="comm_buffers", gib=g["comm_buffers_gib"], note="NCCL communicators"))
    return items


def kv_clamped(p: Placement) -> bool:
    """The KV pool is given to vLLM (--kv-cache-memory-bytes), not what gpu_memory_utilization leaves."""
    return p.kv_cache_clamped or p.kv_cache_memory_bytes > 0


def inflight_kv_bytes_per_token(model: ModelSpec, p: Placement) -> float:
    """Bytes per rank the KV pool must hold for each token in flight (max_num_batched_tokens) beyond the window
    (hwdb kv_inflight_bytes_per_token, in the layout vLLM serves)."""
    per_token = model.kv_inflight_bytes_per_token.get(model.kv_layout(p.kv_dtype), 0.0)
    return per_token / p.tp if model.kv_shards_with_tp else per_token


def kv_note(model: ModelSpec, p: Placement) -> str:
    """The KV pool's line in the ledger: its layout (as vLLM serves it), bytes per token and tokens."""
    served = model.kv_layout(p.kv_dtype)
    forced = (f"; vLLM serves {model.vllm_arch or model.name}'s KV only as {served} (hwdb kv_dtype_forced)"
              if model.kv_dtype_forced else "")
    per_token = model.kv_bytes(p.kv_dtype, 1, tp=p.tp, seqs=0) / p.pp
    return (f"{served} KV, {per_token:,.0f} B/token x {kv_tokens(model, p):,} "
            f"tokens{forced}")


def kv_needed_gib(model: ModelSpec, p: Placement) -> float:
    """KV per rank vLLM needs to admit one sequence at the full window (it shares one pool across sequences),
    plus the per-sequence fixed part of every scheduled sequence. Not one window per stream: vLLM-Moet's batch
    curves ran 16-32 streams in pools that hold far fewer full windows (short prompts; vLLM preempts when
    they grow)."""
    seqs = max(p.max_num_seqs, 1)
    inflight = inflight_kv_bytes_per_token(model, p) * min(p.max_num_batched_tokens, p.context)
    return (model.kv_bytes(p.kv_dtype, p.context, tp=p.tp, seqs=seqs) + inflight) / p.pp / GIB


def kv_floor_gib(model: ModelSpec, p: Placement) -> float:
    """The smallest KV pool that boots: the window's need, and with speculation vLLM-Moet's observed floor."""
    floor = guards()["gpu"]["speculative_kv_floor_gib"] if p.mtp > 0 else 0.0
    return max(kv_needed_gib(model, p), floor)


def kv_tokens(model: ModelSpec, p: Placement, kv_gib: float | None = None) -> int:
    """Tokens a KV pool of kv_gib per rank holds (vLLM's "GPU KV cache size: N tokens")."""
    per_token = model.kv_bytes(p.kv_dtype, 1, tp=p.tp, seqs=0) / p.pp
    gib = p.kv_cache_gib if kv_gib is None else kv_gib
    return max(int(gib * GIB // per_token), 0) if per_token > 0 else 0


def resident_guard(model: ModelSpec, p: Placement, vram: float) -> tuple[float, float]:
    """vLLM-Moet's boot guard for resident planes: planes <= free - (2 GiB + 1.7 GiB when speculating + 16 KiB x
    max_model_len), free being the budget after the dense stack and the FP4 pool. Returns (planes, allowed)."""
    g = guards()["gpu"]
    free = p.gpu_memory_utilization * vram - dense_gib(model, p) - p.fp4_reserve_gib - drafter_gib(model, p)
    margin = (g["resident_guard_margin_gib"] + (g["resident_guard_speculative_gib"] if p.mtp > 0 else 0.0)
              + g["resident_guard_kv_bytes_per_token"] * p.context / GIB)
    return experts_resident_gib(model, p), free - margin


def arena_budget_gib(hw: HardwareProfile, ranks: int) -> float:
    """Pinned arena per rank the host can give: usable RAM after the OS and workers, leaving the page cache its
    share (it serves the pack reads the arena misses)."""
    g = guards()["host"]
    total = host_usable_gib(hw) - host_reserve_gib(hw) - g["page_cache_share"] * hw.host.ram_gib
    return max(total, 0.0) / max(ranks, 1)


@dataclass
class LedgerCheck:
    ledger: MemoryLedger
    ok: bool
    problems: list[str] = field(default_factory=list)
    short: list[str] = field(default_factory=list)  # the ledger item each problem is about, in order
    warnings: list[str] = field(default_factory=list)  # guards a pinned placement goes past (it still plans)


# A guard line that a pinned placement goes past starts with this (the plan carries it as a warning).
PAST_GUARD = "WARN past a guard"


def build_ledger(model: ModelSpec, hw: HardwareProfile, p: Placement, pinned: frozenset[str] | set[str] = frozenset()
                 ) -> LedgerCheck:
    """Account every byte of placement `p`; `ok` is False with named problems when something does not fit.

    `pinned`: knobs the user fixed (--set). vLLM-Moet's resident guard is its own margin, not a byte count (its
    production recipe forces a pool past it): with the tier pinned, going past it is a warning that names the
    guard; what is physically short (VRAM, the KV pool's floor, the room above the budget) is refused always."""

    problems: list[str] = []
    short: list[str] = []
    guards_out: list[str] = []
    warnings: list[str] = []

    def fail(item: str, text: str) -> None:
        problems.append(f"{item}: {text}")
        short.append(item)

    ranks = p.tp * p.pp
    if ranks > hw.num_gpus:
        fail("gpus", f"TP{p.tp} x PP{p.pp} needs {ranks} GPUs, this machine has {hw.num_gpus}")
        return LedgerCheck(MemoryLedger(), False, problems, short)
    g = guards()["gpu"]
    fixed = fixed_gpu_items(model, p)
    kv_floor = kv_floor_gib(model, p)
    gpus: list[GPURankMemory] = []
    for r in range(ranks):
        gpu = hw.gpus[r]
        vram = gpu.vram_gib
        items = list(fixed)
        if p.expert_tier == "resident":
            items.append(LedgerItem(name="experts_2bit", gib=experts_resident_gib(model, p),
                                    note="all routed experts at 2-bit, resident"))
        else:
            items.append(LedgerItem(name="expert_cache", gib=p.gpu_expert_cache_gib,
                                    note=f"{p.gpu_expert_cache_slots} slots of 2-bit rows"))
        outside = fp4_outside_gib(p, vram)
        if p.fp4_reserve_gib > 0:
            items.append(LedgerItem(name="fp4_reserve", gib=p.fp4_reserve_gib,
                                    note=f"{p.fp4_reserve_slots} hot experts at FP4"
                                    + (f"; {outside:.2f} GiB of it above the util budget" if outside > 0 else "")))
        items.append(LedgerItem(name="kv_cache", gib=p.kv_cache_gib, note=kv_note(model, p)))
        used = sum(i.gib for i in items)
        if kv_clamped(p):
            # vLLM takes the KV size it is given; the rank is bounded by the card itself.
            outside = 0.0
            budget = vram - g["cuda_context_gib"] - unprofiled_gib(model, p)
        else:
            budget = vram * p.gpu_memory_utilization + outside
        gpus.append(GPURankMemory(rank=r, gpu=gpu.hwdb_id or gpu.name, total_gib=vram, budget_gib=budget,
                                  used_gib=used, items=items))
        name = f"GPU {r} ({gpu.name})"
        if used > budget + 0.005:
            fail("vram", f"{name}: needs {used:.1f} GiB, budget {budget:.1f} GiB ({p.gpu_memory_utilization:.2f} x "
                 f"{vram:.2f}{f' + {outside:.1f} reserve above it' if outside else ''}); short {used - budget:.1f} "
                 f"GiB (largest pool: {_largest_pool(items)})")
        above = (1.0 - p.gpu_memory_utilization) * vram - outside
        need_above = g["cuda_context_gib"] + unprofiled_gib(model, p)
        if kv_clamped(p):
            above = need_above
        if r == 0:
            guards_out.append(f"headroom above the util budget: {above:.2f} GiB >= CUDA context "
                              f"{g['cuda_context_gib']:.1f} + unprofiled transients {unprofiled_gib(model, p):.2f}: "
                              f"{'ok' if above + 1e-9 >= need_above else 'FAIL'}")
        if above + 1e-9 < need_above:
            fail("gpu_memory_utilization",
                 f"{name}: gpu_memory_utilization {p.gpu_memory_utilization:.2f} leaves {above:.2f} GiB above vLLM's "
                 f"budget{' after the FP4 reserve' if outside else ''}; the CUDA context and the transients its "
                 f"profiling does not see ({p.max_num_batched_tokens} batched tokens) need {need_above:.2f}: lower "
                 "gpu_memory_utilization or max_num_batched_tokens")

    if p.kv_cache_gib + ROUND_GIB < kv_floor:
        spec_floor = g["speculative_kv_floor_gib"] if p.mtp > 0 else 0.0
        why = (f"the {spec_floor:.1f} GiB speculative decoding needs (MTP floor)" if spec_floor >= kv_floor - 1e-9
               else f"one {p.context}-token sequence at {model.kv_layout(p.kv_dtype)}")
        fail("kv_cache", f"KV pool {p.kv_cache_gib:.2f} GiB/rank is below {kv_floor:.2f} GiB, {why}; "
             f"short {kv_floor - p.kv_cache_gib:.2f} GiB")
    guards_out.append(f"KV pool {p.kv_cache_gib:.2f} GiB = {kv_tokens(model, p):,} tokens >= "
                      f"{kv_floor:.2f} GiB: {'ok' if p.kv_cache_gib + ROUND_GIB >= kv_floor else 'FAIL'}")
    if p.expert_tier == "resident":
        planes, allowed = resident_guard(model, p, hw.gpus[0].vram_gib)
        ok = planes <= allowed + 1e-6
        advisory = not ok and "expert_tier" in pinned
        guards_out.append(f"resident fit (vLLM-Moet guard): experts {planes:.1f} <= free - margin {allowed:.1f} GiB: "
                          f"{'ok' if ok else 'WARN (pinned past the guard)' if advisory else 'FAIL'}")
        if advisory:
            warnings.append(
                f"{PAST_GUARD}: vLLM-Moet's resident guard (planes <= free - (2 GiB + 1.7 GiB when speculating + "
                f"16 KiB x max_model_len)) allows {allowed:.1f} GiB/rank, the pinned placement holds {planes:.1f}: "
                f"{planes - allowed:.2f} GiB past it. It plans because every byte fits the card (vLLM-Moet's own "
                "recipes force their pool past this guard); if the boot fails, lower fp4_reserve_gib or context")
        elif not ok:
            fail("experts_2bit", f"resident 2-bit experts ({planes:.1f} GiB/rank) exceed what vLLM-Moet's resident "
                 f"guard allows ({allowed:.1f} GiB: budget less dense, FP4 reserve, 2 GiB workspace"
                 f"{', 1.7 GiB speculation' if p.mtp else ''} and 16 KiB x {p.context} tokens); short "
                 f"{planes - allowed:.2f} GiB")
    else:
        floor = cache_floor_slots(model, p)
        comfy = cache_floor_slots(model, p, comfortable=True)
        ok = p.gpu_expert_cache_slots >= floor
        guards_out.append(f"expert cache floor: {p.gpu_expert_cache_slots} slots >= 1.15 x working set = {floor}: "
                          f"{'ok' if ok else 'FAIL'}" + ("" if p.gpu_expert_cache_slots >= comfy or not ok
                                                         else f" (below comfortable {comfy})"))
        if not ok:
            fail("expert_cache", f"GPU expert cache of {p.gpu_expert_cache_slots} slots is below the floor of one "
                 f"step's working set x 1.15 = {floor} slots ({floor * model.expert_bytes('2bit', p.tp) / GIB:.1f} "
                 "GiB/rank)")
    if p.gate.enabled:
        gfloor = fp4_gate_floor_slots(model, p)
        gok = p.fp4_reserve_slots >= gfloor
        guards_out.append(f"fp4 gate floor: {p.fp4_reserve_slots} slots >= 1.7 x working set = {gfloor}: "
                          f"{'ok' if gok else 'degraded (promotions capped)'}")

    host = host_and_disk(model, hw, p)
    for item, text in host.problems:
        fail(item, text)
    ledger = MemoryLedger(gpus=gpus, host_gib=host.host_gib, host_total_gib=hw.host.ram_gib,
                          host_items=host.host_items, disk_gib=host.disk_gib, disk_free_gib=hw.storage.free_gib,
                          disk_items=host.disk_items, guards=guards_out + warnings)
    return LedgerCheck(ledger, not problems, problems, short, warnings)


def _largest_pool(items: list[LedgerItem]) -> str:
    pools = [i for i in items if i.name in ("experts_2bit", "expert_cache", "fp4_reserve")]
    return max(pools, key=lambda i: i.gib).name if pools else "dense"

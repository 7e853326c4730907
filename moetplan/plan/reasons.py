"""Why the chosen plan looks the way it does: one reason per knob, the alternatives worth knowing, warnings."""
from __future__ import annotations

import math
from typing import Any

from moetplan.contract import Alternative, Goals, HardwareProfile, Placement, Reason
from moetplan.contract.model import GIB, ModelSpec
from moetplan.plan import ledger as L
from moetplan.plan import support
from moetplan.plan.candidates import BudgetOption, Candidate, context_tradeoff, goal_context, pareto


def _summary(p: Placement) -> dict[str, Any]:
    return {k: getattr(p, k) for k in ("tp", "pp", "expert_tier", "gpu_expert_cache_gib", "fp4_reserve_gib",
                                       "host_arena_gib", "kv_dtype", "context", "mtp", "max_num_seqs")}


def label(p: Placement) -> str:
    s = f"TP{p.tp}" + (f"xPP{p.pp}" if p.pp > 1 else "") + f" {p.expert_tier}"
    if p.expert_tier != "resident":
        s += f" cache {p.gpu_expert_cache_gib:.1f}G"
    return s + f" kv={p.kv_dtype} mtp={p.mtp} ctx={p.context // 1024}K"


def alternatives(cands: list[Candidate], chosen: Candidate, n: int = 6) -> list[Alternative]:
    """The whole Pareto front (context vs decode tok/s) and the best of up to `n` other (tier, TP, PP) families."""
    front = pareto(cands)
    front_ids = {id(c) for c in front}
    # Best of each (tier, tp) family too, so the user sees why the others lost.
    fams: dict[tuple, Candidate] = {}
    for c in cands:
        k = (c.placement.expert_tier, c.placement.tp, c.placement.pp)
        if k not in fams or c.prediction.decode_tok_s > fams[k].prediction.decode_tok_s:
            fams[k] = c
    picked: list[Candidate] = [c for c in front if c is not chosen]
    others = 0
    for c in sorted(fams.values(), key=lambda c: -c.prediction.decode_tok_s):
        if others < n and c is not chosen and all(c is not q for q in picked):
            picked.append(c)
            others += 1
    return [Alternative(label=label(c.placement), placement=_summary(c.placement), context=c.placement.context,
                        decode_tok_s=round(c.prediction.decode_tok_s, 2),
                        aggregate_tok_s=round(c.prediction.aggregate_tok_s, 2),
                        bottleneck=c.prediction.bottleneck, pareto=id(c) in front_ids) for c in picked]


def _gpu_use(model: ModelSpec, hw: HardwareProfile, ch: Candidate, cands: list[Candidate]) -> str:
    """Why this many GPUs: all of them when that is faster; when not, what using all would have predicted."""
    p = ch.placement
    ranks, n = p.tp * p.pp, hw.num_gpus
    head = (f"one GPU of {n}: " if ranks == 1 else
            f"TP{p.tp}" + (f" x PP{p.pp}" if p.pp > 1 else "") + f" over {ranks} of {n} GPUs: ")
    text = (head + f"dense {model.dense_bytes() / GIB:.1f} GiB and 2-bit experts {model.routed_gib():.1f} GiB"
            + ("" if ranks == 1 else f" are split {ranks} ways")
            + (" (PCIe all-reduce per layer; no NVLink)" if p.tp > 1 and not hw.p2p else ""))
    if ranks < n:
        full = [c for c in cands if c.placement.tp * c.placement.pp == n]
        if full:
            best = max(full, key=lambda c: c.prediction.decode_tok_s)
            text += (f"; all {n} GPUs ({label(best.placement)}) predict {best.prediction.decode_tok_s:.1f} tok/s vs "
                     f"{ch.prediction.decode_tok_s:.1f} here: {best.prediction.bottleneck} costs more than the "
                     "extra GPUs save")
        else:
            text += f"; no placement over all {n} GPUs fits these goals (TP must divide the expert FFN into 32-wide " \
                    "blocks; PP is used only to fill every GPU)"
    return text


def reasons(model: ModelSpec, hw: HardwareProfile, goals: Goals, ch: Candidate,
            cands: list[Candidate]) -> list[Reason]:
    p, pins = ch.placement, goals.pinned
    gpu = hw.gpus[0]
    r: list[Reason] = []

    def add(knob: str, text: str) -> None:
        r.append(Reason(knob=knob, text=("pinned (--set). " if knob in pins else "") + text))

    exp_rank = L.experts_resident_gib(model, p)
    add("tp", _gpu_use(model, hw, ch, cands))
    if p.expert_tier == "resident":
        add("expert_tier", f"resident: the 2-bit experts ({exp_rank:.1f} GiB/rank) fit in VRAM "
            f"({gpu.vram_gib:.1f} GiB x {p.gpu_memory_utilization:.2f}) beside dense and KV; no expert misses")
    else:
        where = ("pinned host RAM" if p.expert_tier == "host" else
                 f"NVMe packs with a {p.host_arena_gib:.0f} GiB pinned RAM arena per rank")
        add("expert_tier", f"{p.expert_tier}: the 2-bit experts ({exp_rank:.1f} GiB/rank) do not fit in VRAM beside "
            f"dense and KV; the base lives in {where}, the GPU holds an expert cache")
        floor = L.cache_floor_slots(model, p)
        cov = p.gpu_expert_cache_slots / (math.ceil(model.moe_layers / p.pp) * model.n_routed_experts)
        add("gpu_expert_cache_gib", f"{p.gpu_expert_cache_gib:.1f} GiB = {p.gpu_expert_cache_slots} slots "
            f"({cov:.0%} of experts, {p.gpu_expert_cache_slots / floor * 1.15:.2f}x one step's working set; "
            f"floor 1.15x): all VRAM left after dense, KV for {p.context} tokens and workspaces; predicted "
            f"zero-miss steps {(ch.prediction.zero_miss_step_share or 0):.0%}")
        if p.expert_tier == "nvme":
            add("host_arena_gib", f"{p.host_arena_gib:.0f} GiB pinned arena per rank: usable RAM after OS and "
                f"workers ({L.host_usable_gib(hw):.0f} GiB usable of {hw.host.ram_gib:.0f}), leaving "
                f"{L.guards()['host']['page_cache_share']:.0%} of RAM to the page cache for the pack reads the "
                f"arena misses; host RAM cannot pin all {model.routed_gib():.1f} GiB")
    rule = support.serving_rules(model)
    if p.fp4_reserve_gib > 0:
        add("fp4_reserve_gib", f"{p.fp4_reserve_gib:.1f} GiB = {p.fp4_reserve_slots} hottest experts at FP4 "
            "(quality where routing concentrates)"
            + (f"; {rule['why']}" if rule.get("fp4_reserve_min_gib") else "")
            + (" — gate degraded: below 1.7x working set, promotions capped" if p.gate.degraded else ""))
    else:
        add("fp4_reserve_gib", "0: no VRAM to spare for FP4 rows" if p.expert_tier != "resident"
            else "0: slack too small for a useful FP4 reserve")
    alts_kv = sorted({c.placement.kv_dtype for c in cands})
    add("kv_dtype", f"{p.kv_dtype}: {model.kv_bytes(p.kv_dtype, 1, seqs=0) / 1024:.1f} KiB/token "
        + (f"(the only layout vLLM serves {model.vllm_arch or model.name}'s KV in, whatever --kv-cache-dtype says: "
           "hwdb kv_dtype_forced)" if model.kv_dtype_forced else f"(options here: {', '.join(alts_kv)})"))
    lo = goal_context(goals, model)
    full = p.kv_tokens // max(p.context, 1)
    add("context", f"{p.context} tokens: objective '{goals.objective}' (minimum {lo}); KV pool "
        f"{p.kv_cache_gib:.1f} GiB/rank = {p.kv_tokens:,} tokens ({full} full-window sequence(s) at once)"
        + (f"; {tradeoff}" if (tradeoff := context_tradeoff(ch, cands)) else ""))
    if p.mtp and model.mtp_layers == 0:
        add("mtp", f"{p.mtp} tokens drafted by the separate drafter ({model.drafter_hf_repo or 'drafter'}, "
            f"{model.drafter_gib:.1f} GiB, downloaded at first launch): {p.mtp_acceptance:.2f} tokens per step")
    elif p.mtp:
        add("mtp", f"MTP depth {p.mtp}: {p.mtp_acceptance:.2f} tokens per step expected")
    else:
        tiered = p.expert_tier != "resident" and model.has_speculation
        add("mtp", "no speculation" + (" (the model has no MTP head or drafter)" if not model.has_speculation else
                                       " (every drafted token widens the step's expert set; on a tiered store "
                                       "deeper MTP costs misses)" if tiered else ""))
    add("max_num_seqs", f"{p.max_num_seqs} (concurrency {p.concurrency}); the expert-cache floor scales "
        "with min(seqs, 4)")
    add("max_num_batched_tokens", _budget_reason(model, goals, ch))
    add("gpu_memory_utilization", f"{p.gpu_memory_utilization:.2f} of {gpu.vram_gib:.2f} GiB: the rest holds the "
        "CUDA context and the transients vLLM's profiling does not see")
    return r


def _budget_reason(model: ModelSpec, goals: Goals, ch: Candidate) -> str:
    """Why this many batched tokens: vLLM's default, halved to fit, or the budget the objective weighed."""
    p = ch.placement
    head = f"{p.max_num_batched_tokens}: activation peak {p.activation_peak_gib:.2f} GiB/rank"
    if "max_num_batched_tokens" in goals.pinned:
        return head
    default = ch.default_budget or p.max_num_batched_tokens
    if not ch.budgets:
        if p.max_num_batched_tokens < default:
            return head + f" (vLLM's default for the card, {default}, halved while it did not fit)"
        why = ("; a smaller budget only slows prefill: it frees no expert cache on a resident plan"
               if p.expert_tier == "resident" else "")
        return head + f" (vLLM's default for the card{why})"
    first, chosen = ch.budgets[0], next(o for o in ch.budgets if o.max_num_batched_tokens == p.max_num_batched_tokens)
    fastest = max(ch.budgets, key=lambda o: o.decode_tok_s)
    start = ("vLLM's default for the card" if first.max_num_batched_tokens == default
             else f"the largest that fits; vLLM's default is {default}")
    inflight = L.inflight_kv_bytes_per_token(model, p)
    shrink = "the activation peak" + (f" and the in-flight KV floor ({inflight / 2**20:.2f} MiB per batched token)"
                                      if inflight else "")
    rule = ("the fastest decode" if goals.objective == "decode" else
            f"the fastest prefill within {1 - L.guards()['planner']['balanced_keep_decode']:.0%} of the best decode")

    def hits(a: BudgetOption, b: BudgetOption) -> str:
        if a.token_hit_rate is None or b.token_hit_rate is None:
            return ""
        return f"; token hit rate {a.token_hit_rate:.1%} -> {b.token_hit_rate:.1%}"

    text = (f"{head}. Weighed {', '.join(str(t) for t in ch.budgets_sized)} ({start} first): fewer "
            f"batched tokens shrink {shrink}, which the GPU expert cache gets, and cost prefill (more chunks)")
    to = fastest if chosen is first else chosen
    floor = (f"KV floor {first.kv_floor_gib:.2f} -> {to.kv_floor_gib:.2f} GiB, "
             if abs(first.kv_floor_gib - to.kv_floor_gib) >= 0.005 else "")
    change = (f"{floor}expert cache {first.gpu_expert_cache_gib:.1f} -> {to.gpu_expert_cache_gib:.1f} GiB "
              f"({to.gpu_expert_cache_gib - first.gpu_expert_cache_gib:+.1f}{hits(first, to)}), decode "
              f"{first.decode_tok_s:.1f} -> {to.decode_tok_s:.1f} tok/s, prefill {first.prefill_tok_s:.0f} -> "
              f"{to.prefill_tok_s:.0f} tok/s")
    if chosen is first:
        text += f"; {to.max_num_batched_tokens} would give {change}"
    else:
        text += f"; {chosen.max_num_batched_tokens} vs {first.max_num_batched_tokens}: {change}"
    return text + f"; objective '{goals.objective}' takes {rule}"


def warnings(model: ModelSpec, hw: HardwareProfile, goals: Goals, ch: Candidate) -> list[str]:
    w = list(hw.warnings)
    p = ch.placement
    if p.expert_tier in ("host", "nvme") and hw.host.memlock_bytes is not None:
        w.append(f"memlock limit is {hw.host.memlock_bytes / 2**20:.0f} MiB: pinned host buffers may fail; "
                 "run `ulimit -l unlimited`")
    if p.expert_tier == "nvme" and hw.storage.warnings:
        w.extend(hw.storage.warnings)
    if p.expert_tier == "nvme" and p.host_arena_gib == 0:
        w.append("no pinned arena: the page cache is the only RAM tier (vLLM-Moet measured ~22% slower decode)")
    if p.concurrency > 1 and p.kv_tokens < p.concurrency * p.context:
        w.append(f"the KV pool holds {p.kv_tokens:,} tokens: {p.concurrency} streams fit at once while they average "
                 f"{p.kv_tokens // p.concurrency:,} tokens each; vLLM preempts streams beyond that")
    rule = support.serving_rules(model)
    if rule.get("fp4_reserve_min_gib") and p.fp4_reserve_gib < rule["fp4_reserve_min_gib"]:
        w.append(f"FP4 reserve {p.fp4_reserve_gib:g} GiB: {rule['why']}")
    return w

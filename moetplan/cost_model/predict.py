"""predict(): a Placement's decode / aggregate / prefill speed, its per-term breakdown and its bottleneck."""
from __future__ import annotations

from moetplan.cost_model.calibration import Calibration, load_calibration
from moetplan.cost_model.coverage import curve_for
from moetplan.cost_model.prefill import prefill_run
from moetplan.cost_model.terms import (
    ALLREDUCE,
    DENSE,
    DRAFT,
    EXPERTS,
    GATE,
    KV,
    LAYER_OVH,
    MLA_ATTN,
    MISS_HOST,
    MISS_NVME,
    MISS_REPLAY,
    MOE_GRAPH,
    CPU_EXPERT_CALLS,
    PIPELINE,
    SEQ_OVH,
    STEP_OVH,
    DecodeStep,
    decode_step,
)
from moetplan.contract.model import ModelSpec
from moetplan.contract import HardwareProfile, Placement, Prediction, Term
from moetplan.contract.vocab import MoeGraphs


def streams(placement: Placement) -> int:
    """Streams decoded together: the planned concurrency, bounded by the scheduler's max_num_seqs."""
    return max(1, min(placement.concurrency, max(placement.max_num_seqs, 1)))


def _terms(step: DecodeStep, calib: Calibration, hw: HardwareProfile) -> tuple[list[Term], float, str]:
    rows = step.term_ms(calib, hw)
    total = sum(ms for _, ms in rows)
    terms = [Term(name=t.name, ms=round(ms, 4), share=round(ms / total, 4) if total > 0 else 0.0,
                  note=t.note.strip() or None) for t, ms in rows]
    return terms, total, bottleneck_of(terms)


def predict(model: ModelSpec, hw: HardwareProfile, placement: Placement,
            calib: Calibration | None = None, moe_graphs: MoeGraphs | None = None) -> Prediction:
    """Predicted performance of `placement` for `model` on `hw`.

    decode_tok_s: one stream decoding alone. aggregate_tok_s: all planned streams (concurrency, bounded by
    max_num_seqs) batched. step_ms, terms and bottleneck describe the step at the planned concurrency — the operating
    point the plan is for (with concurrency 1, the single-stream step); the other operating point is named in notes.
    Miss statistics are those of the planned step. moe_graphs: how a tiered plan runs its MoE layers
    (terms.MOE_GRAPH_MODES: "replay", vLLM-Moet's design, or "split").
    """
    calib = calib or load_calibration(hw)
    curve = curve_for(model, calib.routing)
    one = decode_step(model, hw, placement, calib, 1, curve, moe_graphs=moe_graphs)
    one_terms, one_ms, one_bottleneck = _terms(one, calib, hw)
    decode_tok_s = one.tokens_per_step / one_ms * 1e3

    n = streams(placement)
    notes = list(one.notes)
    if n > 1:
        step = decode_step(model, hw, placement, calib, n, curve, moe_graphs=moe_graphs)
        terms, step_ms, bottleneck = _terms(step, calib, hw)
        aggregate = n * step.tokens_per_step / step_ms * 1e3
        notes.append(f"terms are for the {n}-stream step ({aggregate / n:.1f} tok/s per stream, "
                     f"{step.union_per_layer:.0f} experts/layer read); one stream alone: step {one_ms:.1f} ms, "
                     f"bottleneck {one_bottleneck}")
    else:
        step, terms, step_ms, bottleneck = one, one_terms, one_ms, one_bottleneck
        aggregate = decode_tok_s

    pre = prefill_run(model, hw, placement, calib, curve=curve)
    pre_ms = pre.ms(calib, hw)
    prefill_tok_s = pre.prompt_tokens / pre_ms * 1e3
    pre_main = max(pre.terms, key=lambda t: t.ms(calib, hw))
    notes.append(f"prefill of {pre.prompt_tokens} tokens: {pre_ms:.0f} ms, bound by {pre_main.name}")
    notes.append(resource_split(terms))

    miss = step.miss
    if miss is not None and miss.p_step_miss > 0:
        notes.append(f"steps with >= 1 expert miss: {miss.p_step_miss:.0%} (correlated misses); independent "
                     f"routing would give {miss.p_step_miss_independent:.0%}")
    return Prediction(
        decode_tok_s=round(decode_tok_s, 3),
        aggregate_tok_s=round(aggregate, 3),
        prefill_tok_s=round(prefill_tok_s, 2),
        ttft_ms=round(pre_ms + one_ms, 2),
        prefill_prompt_tokens=int(pre.prompt_tokens),
        bottleneck=bottleneck,
        step_ms=round(step_ms, 4),
        tokens_per_step=round(step.tokens_per_step, 4),
        terms=terms,
        token_hit_rate=None if miss is None else round(miss.token_hit_rate, 6),
        zero_miss_step_share=None if miss is None else round(1.0 - miss.p_step_miss, 6),
        misses_per_step=None if miss is None else round(miss.misses_per_step, 4),
        replay_rate=None if miss is None or (moe_graphs or placement.moe_graphs) != "replay" else round(miss.p_step_miss, 6),
        gate_fire_share=step.gate_fire_share,
        cpu_miss_share=None if step.cpu_miss_share is None else round(step.cpu_miss_share, 4),
        notes=notes,
    )


# Which resource each term spends: for the one-line summary under the term table.
RESOURCE = {
    "memory bandwidth": (DENSE, EXPERTS, KV, DRAFT),
    "attention kernels": (MLA_ATTN,),
    "host link / NVMe": (MISS_HOST, MISS_NVME),
    "recomputation": (GATE, MISS_REPLAY),
    "GPU interconnect": (ALLREDUCE, PIPELINE),
    "fixed overheads": (LAYER_OVH, STEP_OVH, SEQ_OVH, MOE_GRAPH, CPU_EXPERT_CALLS),
}


def bottleneck_of(terms: list[Term]) -> str:
    """The resource that most of the step waits on. Dense, expert and KV reads share one memory bus, so they are
    judged together: a step is memory-bandwidth bound when their sum is the largest, even if a single other term
    (say the all-reduce) is larger than each of them alone. One dominant term keeps its own name."""
    if not terms:
        return ""
    groups = [(res, sorted((t for t in terms if t.name in names), key=lambda t: -t.ms))
              for res, names in RESOURCE.items()]
    named = {n for names in RESOURCE.values() for n in names}
    groups += [(t.name, [t]) for t in terms if t.name not in named]
    res, ts = max(groups, key=lambda g: sum(t.ms for t in g[1]))
    total = sum(t.ms for t in ts)
    if len(ts) == 1 or ts[0].ms >= 0.8 * total:
        return ts[0].name
    return f"{res}: " + " + ".join(t.name for t in ts if t.ms >= 0.2 * total)


def resource_split(terms: list[Term]) -> str:
    total = sum(t.ms for t in terms) or 1.0
    parts = []
    for res, names in RESOURCE.items():
        ms = sum(t.ms for t in terms if t.name in names)
        if ms > 0:
            parts.append(f"{res} {ms / total:.0%}")
    return "step by resource: " + ", ".join(parts)

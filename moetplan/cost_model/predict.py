"""predict(): a Placement's decode / aggregate / prefill speed, its per-term breakdown and its bottleneck."""
from __future__ import annotations

from moetplan.cost_model.calibration import Calibration, load_calibration
from moetplan.cost_model.coverage import curve_for
from moetplan.cost_model.prefill import prefill_run
from moetplan.cost_model.terms import DecodeStep, decode_step
from moetplan.models.spec import ModelSpec
from moetplan.plan.schema import HardwareProfile, Placement, Prediction, Term


def streams(placement: Placement) -> int:
    """Streams decoded together: the planned concurrency, bounded by the scheduler's max_num_seqs."""
    return max(1, min(placement.concurrency, max(placement.max_num_seqs, 1)))


def _terms(step: DecodeStep, calib: Calibration, hw: HardwareProfile) -> tuple[list[Term], float, str]:
    rows = step.term_ms(calib, hw)
    total = sum(ms for _, ms in rows)
    terms = [Term(name=t.name, ms=round(ms, 4), share=round(ms / total, 4) if total > 0 else 0.0,
                  note=t.note.strip() or None) for t, ms in rows]
    bottleneck = max(rows, key=lambda r: r[1])[0].name if rows else ""
    return terms, total, bottleneck


def predict(model: ModelSpec, hw: HardwareProfile, placement: Placement,
            calib: Calibration | None = None) -> Prediction:
    """Predicted performance of `placement` for `model` on `hw`.

    decode_tok_s: one stream alone; aggregate_tok_s: all `concurrency` streams batched; terms and bottleneck are
    those of the single-stream step (the headline number); the batched step's bottleneck is named in notes.
    """
    calib = calib or load_calibration(hw)
    curve = curve_for(model, calib.routing)
    one = decode_step(model, hw, placement, calib, 1, curve)
    terms, step_ms, bottleneck = _terms(one, calib, hw)
    decode_tok_s = one.tokens_per_step / step_ms * 1e3

    n = streams(placement)
    notes = list(one.notes)
    if n > 1:
        batch = decode_step(model, hw, placement, calib, n, curve)
        b_terms, b_ms, b_bottleneck = _terms(batch, calib, hw)
        aggregate = n * batch.tokens_per_step / b_ms * 1e3
        notes.append(f"at {n} streams: step {b_ms:.1f} ms, {aggregate / n:.1f} tok/s per stream, "
                     f"{batch.union_per_layer:.0f} experts/layer read, bottleneck: {b_bottleneck}")
    else:
        aggregate = decode_tok_s

    pre = prefill_run(model, hw, placement, calib, curve=curve)
    pre_ms = pre.ms(calib, hw)
    prefill_tok_s = pre.prompt_tokens / pre_ms * 1e3
    pre_main = max(pre.terms, key=lambda t: t.ms(calib, hw))
    notes.append(f"prefill of {pre.prompt_tokens} tokens: {pre_ms:.0f} ms, bound by {pre_main.name}")

    miss = one.miss
    if miss is not None and miss.p_step_miss > 0:
        notes.append(f"steps with >= 1 expert miss: {miss.p_step_miss:.0%} (correlated misses); independent "
                     f"routing would give {miss.p_step_miss_independent:.0%}")
    return Prediction(
        decode_tok_s=round(decode_tok_s, 3),
        aggregate_tok_s=round(aggregate, 3),
        prefill_tok_s=round(prefill_tok_s, 2),
        ttft_ms=round(pre_ms + step_ms, 2),
        bottleneck=bottleneck,
        step_ms=round(step_ms, 4),
        tokens_per_step=round(one.tokens_per_step, 4),
        terms=terms,
        token_hit_rate=None if miss is None else round(miss.token_hit_rate, 6),
        zero_miss_step_share=None if miss is None else round(1.0 - miss.p_step_miss, 6),
        misses_per_step=None if miss is None else round(miss.misses_per_step, 4),
        notes=notes,
    )

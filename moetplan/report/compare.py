"""Predicted vs measured, metric by metric: the data behind `moetplan diff plan.json run.json`.

The plan predicts in `Prediction`; a run record carries speed in `measured` (from `moetplan bench` or the
runtime) and store KPIs in `runtime`. Both use the same names, so lining them up is a lookup; the only
subtlety is aggregate throughput, which is compared at the plan's concurrency when the run measured it there.
"""
from __future__ import annotations

import math
from typing import Any, TypedDict

from moetplan.contract import Plan, RunRecord

# (metric, unit); order is the order rows are shown in.
COMPARED_METRICS: tuple[tuple[str, str], ...] = (
    ("decode_tok_s", "tok/s"),
    ("aggregate_tok_s", "tok/s"),
    ("prefill_tok_s", "tok/s"),
    ("ttft_ms", "ms"),
    ("token_hit_rate", "share"),
    ("zero_miss_step_share", "share"),
    ("misses_per_step", "experts"),
    ("replay_rate", "share"),
    ("gate_fire_share", "share"),
)


class CompareRow(TypedDict):
    metric: str
    unit: str
    predicted: float | None
    measured: float | None
    error_pct: float | None  # (measured - predicted) / predicted x 100; None when either side is missing
    source: str | None  # where the measured value came from: "measured", "runtime", "measured.batch_curve[4]"
    note: str


def _num(v: Any) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _lookup(run: RunRecord, metric: str) -> tuple[float | None, str | None]:
    for section in ("measured", "runtime"):
        v = _num(getattr(run, section).get(metric))
        if v is not None:
            return v, section
    return None, None


def _aggregate(plan: Plan, run: RunRecord) -> tuple[float | None, str | None, str]:
    want = plan.placement.concurrency
    curve = run.measured.get("batch_curve")
    if isinstance(curve, dict) and _num(curve.get(str(want))) is not None:
        return _num(curve[str(want)]), f"measured.batch_curve[{want}]", f"at concurrency {want}"
    value, source = _lookup(run, "aggregate_tok_s")
    at = run.measured.get("aggregate_concurrency")
    note = ""
    if value is not None and at is not None and int(at) != want:
        note = f"measured at concurrency {at}, plan serves {want}: not like for like"
    return value, source, note


def _at_length(plan: Plan, run: RunRecord, metric: str) -> tuple[float | None, str | None, str] | None:
    """Prefill tok/s and TTFT depend on the prompt length: compare the run's measurement at the length closest
    to the one the plan predicts for (None when the run has no per-length figures or the plan no length)."""
    want = plan.prediction.prefill_prompt_tokens
    table = run.measured.get("prefill_by_len" if metric == "prefill_tok_s" else "ttft_ms_by_len")
    lens = run.measured.get("prefill_prompt_tokens") or {}
    if not want or not isinstance(table, dict) or not table:
        return None
    def length(k: str) -> int:
        return int(lens.get(k) or k)
    key = min(table, key=lambda k: abs(math.log(length(k) / want)))
    got = length(key)
    note = f"at {got} prompt tokens (plan: {want})"
    if max(got, want) / min(got, want) > 1.25:
        note += ": not like for like, measure with --prompt-lens " + str(want)
    return _num(table[key]), f"measured.{'prefill_by_len' if metric == 'prefill_tok_s' else 'ttft_ms_by_len'}[{key}]", note


def error_pct(predicted: float | None, measured: float | None) -> float | None:
    if predicted is None or measured is None or predicted == 0:
        return None
    return round((measured - predicted) / abs(predicted) * 100.0, 2)


def compare(plan: Plan, run: RunRecord) -> list[CompareRow]:
    """One row per metric in COMPARED_METRICS, missing sides as None (the row is kept so gaps show)."""
    rows: list[CompareRow] = []
    for metric, unit in COMPARED_METRICS:
        predicted = _num(getattr(plan.prediction, metric, None))
        by_len = _at_length(plan, run, metric) if metric in ("prefill_tok_s", "ttft_ms") else None
        if metric == "aggregate_tok_s":
            measured, source, note = _aggregate(plan, run)
        elif by_len is not None:
            measured, source, note = by_len
        else:
            (measured, source), note = _lookup(run, metric), ""
            if metric == "prefill_tok_s" and source == "measured" and "prefill_len" in run.measured:
                note = f"at {run.measured['prefill_len']} prompt tokens"
            if metric == "ttft_ms" and source == "measured" and "ttft_prompt_tokens" in run.measured:
                note = f"at ~{run.measured['ttft_prompt_tokens']} prompt tokens"
        if measured is None:
            note = note or "not measured by this run"
        elif predicted is None:
            note = note or "not predicted by this plan"
        rows.append(CompareRow(metric=metric, unit=unit, predicted=predicted, measured=measured,
                               error_pct=error_pct(predicted, measured), source=source, note=note))
    return rows


def check_same_model(plan: Plan, run: RunRecord, plan_name: str = "plan", run_name: str = "run") -> None:
    """A run of another model says nothing about this plan: refuse, naming both."""
    if not run.model_id:
        return
    names = {plan.model.id, plan.model.name, plan.launch.served_model_name, plan.model.id.split(":", 1)[-1]}
    if run.model_id not in names:
        from moetplan.contract import UsageError

        raise UsageError(f"{run_name} measured model '{run.model_id}' but {plan_name} plans '{plan.model.id}'; "
                         "compare a run with the plan it served (`moetplan bench --plan plan.json`)")


def placement_mismatches(plan: Plan, run: RunRecord) -> list[str]:
    """Knobs where the run's recorded placement differs from the plan's (then the comparison is not fair)."""
    if not run.placement:
        return []
    mine = plan.placement.model_dump(mode="json")
    return [f"{k}: plan {mine[k]!r}, run {v!r}" for k, v in sorted(run.placement.items())
            if k in mine and mine[k] != v]

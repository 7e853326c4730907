"""Fit the calibration factors on measurements and report predicted vs measured per row."""
from __future__ import annotations

import statistics
from dataclasses import dataclass
from datetime import datetime, timezone

import numpy as np

from moetplan.cost_model.calibration import (
    Calibration,
    FitRow,
    PARAMS,
    Prior,
    apply_values,
    family_key,
    fit_linear,
    load_priors,
    measurement_sigma,
    priors_calibration,
)
from moetplan.cost_model.dataset import Measurement
from moetplan.cost_model.prefill import prefill_run
from moetplan.cost_model.terms import DecodeStep, TermSpec, decode_step

FIT_ITERATIONS = 4  # roofline / overlap choices depend on the factors: re-linearise a few times


@dataclass
class RowResult:
    row_id: str
    label: str
    metric: str  # "decode_tok_s" | "aggregate_tok_s" | "prefill_tok_s"
    measured: float
    predicted: float
    held_out: bool
    bottleneck: str

    @property
    def error(self) -> float:
        """Signed relative error of the prediction."""
        return self.predicted / self.measured - 1.0


def _fit_row(label: str, terms: list[TermSpec], measured_ms: float) -> FitRow:
    coefs: dict[str, float] = {}
    const = 0.0
    for t in terms:
        const += t.const_ms
        for p, c in t.parts.items():
            coefs[p] = coefs.get(p, 0.0) + c
    return FitRow(label, coefs, const, measured_ms)


def _decode(m: Measurement, calib: Calibration) -> DecodeStep:
    return decode_step(m.model, m.hw, m.placement, calib, m.concurrency, kv_tokens=m.kv_tokens)


def fit_rows(measurements: list[Measurement], calib: Calibration) -> list[FitRow]:
    rows: list[FitRow] = []
    for m in measurements:
        if m.decode_tok_s:
            step = _decode(m, calib)
            measured_ms = m.concurrency * step.tokens_per_step / m.decode_tok_s * 1e3
            rows.append(_fit_row(f"{m.row_id} decode", step.terms, measured_ms))
        if m.prefill_tok_s:
            run = prefill_run(m.model, m.hw, m.placement, calib, m.prompt_tokens)
            rows.append(_fit_row(f"{m.row_id} prefill", run.terms, run.prompt_tokens / m.prefill_tok_s * 1e3))
    return rows


def evaluate(measurements: list[Measurement], calib: Calibration, held_out: set[str] | None = None) -> list[RowResult]:
    held_out = held_out or set()
    out: list[RowResult] = []
    for m in measurements:
        if m.decode_tok_s:
            step = _decode(m, calib)
            rows = step.term_ms(calib, m.hw)
            ms = sum(x for _, x in rows)
            pred = m.concurrency * step.tokens_per_step / ms * 1e3
            metric = "aggregate_tok_s" if m.concurrency > 1 else "decode_tok_s"
            out.append(RowResult(m.row_id, m.label, metric, m.decode_tok_s, pred, m.row_id in held_out,
                                 max(rows, key=lambda r: r[1])[0].name))
        if m.prefill_tok_s:
            run = prefill_run(m.model, m.hw, m.placement, calib, m.prompt_tokens)
            ms = run.ms(calib, m.hw)
            main = max(run.terms, key=lambda t: t.ms(calib, m.hw)).name
            out.append(RowResult(m.row_id, m.label, "prefill_tok_s", m.prefill_tok_s,
                                 run.prompt_tokens / ms * 1e3, m.row_id in held_out, main))
    return out


def summarize(results: list[RowResult]) -> dict[str, float | int | None]:
    def med(rs: list[RowResult]) -> float | None:
        return statistics.median(abs(r.error) for r in rs) if rs else None

    fit = [r for r in results if not r.held_out]
    held = [r for r in results if r.held_out]
    return {
        "rows": len(results),
        "median_abs_error": med(results),
        "max_abs_error": max((abs(r.error) for r in results), default=None),
        "median_abs_error_fitted_rows": med(fit),
        "median_abs_error_held_out_rows": med(held),
        "median_abs_error_decode": med([r for r in results if r.metric != "prefill_tok_s"]),
        "median_abs_error_prefill": med([r for r in results if r.metric == "prefill_tok_s"]),
    }


def free_params(measurements: list[Measurement], calib: Calibration, priors: dict[str, Prior] | None = None,
                all_touched: bool = False) -> list[str]:
    """Parameters the measurements actually touch (the rest stay at their prior); priors marked `fit: false`
    stay too, unless all_touched (a machine's own records may pin what the published rows cannot)."""
    touched: set[str] = set()
    for r in fit_rows(measurements, calib):
        touched.update(p for p, c in r.coefs.items() if c > 0)
    priors = priors if priors is not None else load_priors()
    return [p for p in PARAMS if p in touched and (all_touched or p not in priors or priors[p].fit)]


# How far other streams' routing follows one stream's hot set is not linear in the step time: scanned, with a weak
# pull toward the middle so rows without batches leave it there.
STREAM_OVERLAP_GRID = (0.3, 0.5, 0.7, 0.85, 1.0)
STREAM_OVERLAP_PRIOR = (0.5, 0.5)  # centre, width


def _fit_at(train: list[Measurement], calib: Calibration, priors: dict[str, Prior], fam: str,
            all_touched: bool = False) -> Calibration:
    for _ in range(FIT_ITERATIONS):
        rows = fit_rows(train, calib)
        values = fit_linear(rows, priors, free_params(train, calib, priors, all_touched), measurement_sigma())
        calib = apply_values(calib, values, fam)
    return calib


def objective(train: list[Measurement], calib: Calibration, priors: dict[str, Prior]) -> float:
    """What the fit minimises: squared relative errors of every row (at the measurement scatter) plus the priors."""
    sig = measurement_sigma()
    err = sum((r.error / sig) ** 2 for r in evaluate(train, calib))
    for p, pr in priors.items():
        v = calib.value(p, train[0].hw)
        err += ((v - pr.value) / (pr.sigma * pr.value)) ** 2 if pr.value else 0.0
    so = calib.routing.stream_overlap
    return err + ((so - STREAM_OVERLAP_PRIOR[0]) / STREAM_OVERLAP_PRIOR[1]) ** 2


def fit(measurements: list[Measurement], held_out: set[str] | None = None, base: Calibration | None = None,
        priors: dict[str, Prior] | None = None, family: str | None = None, source: str = "",
        scan_stream_overlap: bool = True, all_touched: bool = False) -> Calibration:
    """Fit the factors of one GPU family (and the links) on the measurements not held out.

    Starts from the priors (or `base` when refitting a machine), re-linearises FIT_ITERATIONS times; with batched
    rows among them, stream_overlap is scanned and the best objective kept.
    """
    held_out = held_out or set()
    priors = priors or load_priors()
    train = [m for m in measurements if m.row_id not in held_out and not m.check]
    if not train:
        raise ValueError("no measurements left to fit on")
    fam = family or family_key(train[0].hw)
    calib = base.model_copy(deep=True) if base else priors_calibration(priors)
    if base is not None:
        # Refit around the current values: they become the prior centres, with the same widths.
        priors = {p: Prior(calib.value(p, train[0].hw), pr.sigma, pr.why, pr.fit) for p, pr in priors.items()}
    grid = STREAM_OVERLAP_GRID if scan_stream_overlap and any(m.concurrency > 1 for m in train) \
        else (calib.routing.stream_overlap,)
    best: tuple[float, Calibration] | None = None
    for so in grid:
        start = calib.model_copy(update={"routing": calib.routing.model_copy(update={"stream_overlap": so})})
        trial = _fit_at(train, start, priors, fam, all_touched)
        obj = objective(train, trial, priors) if len(grid) > 1 else 0.0
        if best is None or obj < best[0]:
            best = (obj, trial)
    assert best is not None
    return best[1].model_copy(update={
        "fitted_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "fitted_on": sorted({m.row_id for m in train}),
        "held_out": sorted(held_out & {m.row_id for m in measurements}),
        "source": source or best[1].source,
    })


def leave_one_out(measurements: list[Measurement], **kw: object) -> list[RowResult]:
    """Every row predicted by a fit on all the others (a row's decode and prefill figures leave together)."""
    out: list[RowResult] = []
    checks = [m for m in measurements if m.check]
    for rid in dict.fromkeys(m.row_id for m in measurements if not m.check):
        calib = fit(measurements, held_out={rid}, **kw)  # type: ignore[arg-type]
        out.extend(evaluate([m for m in measurements if m.row_id == rid], calib, {rid}))
    if checks:  # never fitted: judged by the fit on every other row
        out.extend(evaluate(checks, fit(measurements, **kw), {m.row_id for m in checks}))  # type: ignore[arg-type]
    return out


def zero_miss_rows(measurements: list[Measurement], calib: Calibration) -> list[tuple[str, float, float]]:
    """(row, measured, predicted) zero-miss step share for tiered runs whose runtime reported it."""
    out = []
    for m in measurements:
        meas = m.extra.get("zero_miss_step_share")
        if meas is None or m.placement.expert_tier == "resident" or m.concurrency != 1:
            continue
        step = _decode(m, calib)
        if step.miss is not None:
            out.append((m.row_id, float(meas), 1.0 - step.miss.p_step_miss))
    return out


def fit_miss_correlation(measurements: list[Measurement], calib: Calibration) -> float | None:
    """The beta-binomial correlation that best reproduces the measured zero-miss step shares (None: no data).

    Runtime KPIs pin what tok/s cannot: with the same hit rate, stronger correlation means more steps without a miss.
    """
    if not zero_miss_rows(measurements, calib):
        return None
    best: tuple[float, float] | None = None
    for rho in [0.0, *np.exp(np.linspace(np.log(1e-4), np.log(0.5), 60))]:
        trial = calib.model_copy(update={"routing": calib.routing.model_copy(update={"miss_correlation": rho})})
        err = sum((meas - pred) ** 2 for _, meas, pred in zero_miss_rows(measurements, trial))
        if best is None or err < best[0] - 1e-12:
            best = (err, float(rho))
    assert best is not None
    return best[1]

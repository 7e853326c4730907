"""Refit this machine's cost-model factors from measured run records (`moetplan calibrate` calls `calibrate_runs`):
written only when the refit fits the records at least as well as the factors it started from."""
from __future__ import annotations

from datetime import datetime, timezone
from pathlib import Path

import yaml

from moetplan.cost_model.calibration import (
    Prior,
    load_priors,
    Calibration,
    read_yaml_mapping,
    family_key,
    load_calibration,
    user_calibration_path,
)
from moetplan.cost_model.dataset import Measurement, from_run_record
from moetplan.cost_model.fitting import (
    RowResult,
    evaluate,
    fit,
    fit_miss_correlation,
    summarize,
    zero_miss_rows,
)
from moetplan.contract.errors import UsageError
from moetplan.contract import HardwareProfile, RunRecord, SchemaError, atomic_write_text, load_json


def _hardware(box: str | None, hw_path: Path | None) -> HardwareProfile | None:
    if box and hw_path:
        raise UsageError("Give either --box or --hw, not both")
    if box:
        from moetplan import hwdb

        return hwdb.box_profile(box)
    if hw_path:
        try:
            return load_json(HardwareProfile, hw_path)
        except SchemaError as e:
            raise UsageError(str(e)) from None
    return None


def measurements_from_runs(paths: list[Path], hw: HardwareProfile | None = None,
                           model_name: str | None = None) -> list[Measurement]:
    model = None
    if model_name:
        from moetplan.models.by_name import spec_for_name

        model = spec_for_name(model_name)
    out: list[Measurement] = []
    for p in paths:
        try:
            run = load_json(RunRecord, p)
        except SchemaError as e:
            raise UsageError(f"{e}; pass run records written by `moetplan bench` or the runtime") from None
        out.extend(from_run_record(run, str(p), hw=hw, model=model))
    return out


def refit(measurements: list[Measurement], current: Calibration) -> tuple[Calibration, list[RowResult],
                                                                            list[RowResult]]:
    """Refit around the current factors; returns (new calibration, results before, results after).

    The miss correlation is fitted first (from runtime zero-miss shares, when the runs report them), because the
    miss term's size depends on it; the efficiency factors are then fitted with it in place.
    """
    before = evaluate(measurements, current)
    rho = fit_miss_correlation(measurements, current)
    base = current
    if rho is not None:
        base = current.model_copy(update={"routing": current.routing.model_copy(update={"miss_correlation": rho})})
    # The gate's recompute share is measured directly (runtime counters of gated runs): the median over the runs,
    # taken back to tau = 1 through the sweep's tau dependence.
    gamma = base.routing.gate_tau_exponent
    fires = sorted(m.extra["gate_fire_share"] / max(m.placement.gate.tau, 1e-3) ** gamma
                   for m in measurements if "gate_fire_share" in m.extra)
    if fires:
        mid = len(fires) // 2
        share = min(1.0, fires[mid] if len(fires) % 2 else 0.5 * (fires[mid - 1] + fires[mid]))
        base = base.model_copy(update={"routing": base.routing.model_copy(update={"gate_recompute_share": share})})
    priors = load_priors()
    fixed = {"routing.gate_recompute_share"} if fires else set()
    priors = {k: Prior(p.value, p.sigma, p.why, fit=k not in fixed) for k, p in priors.items()}
    # A machine's own records may pin what the published rows could not (every touched factor is free, around its
    # current value), except what was measured directly; how batched streams share experts stays as checked in.
    new = fit(measurements, base=base, priors=priors, source="moetplan calibrate", scan_stream_overlap=False)
    after = evaluate(measurements, new)
    return new, before, after


def write_user_calibration(new: Calibration, hw: HardwareProfile, path: Path, runs: list[str],
                           routing_fitted: bool = False, gate_measured: bool = False) -> None:
    """Only this machine's GPU family and the links are written: other families keep the checked-in factors."""
    fam = family_key(hw)
    existing = read_yaml_mapping(path) if path.exists() else {}
    families = dict(existing.get("families") or {})
    families[fam] = new.families[fam].model_dump()
    data = {
        "schema_version": 1,
        "source": "moetplan calibrate",
        "fitted_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": hw.description or hw.box_id or (hw.gpus[0].name if hw.gpus else "unknown"),
        "runs": runs,
        "families": families,
        "links": new.links.model_dump(),
    }
    routing = dict(existing["routing"]) if isinstance(existing.get("routing"), dict) else {}
    if routing_fitted:
        routing["miss_correlation"] = new.routing.miss_correlation
    if gate_measured:
        routing["gate_recompute_share"] = new.routing.gate_recompute_share
    if routing:
        data["routing"] = routing
    header = ("# moetplan calibrate: this machine's cost-model factors (layered over hwdb/calibration/cost_model.yaml"
              " by load_calibration).\n# Delete this file to return to the checked-in factors.\n")
    atomic_write_text(path, header + yaml.safe_dump(data, sort_keys=False))


def calibrate_runs(runs: list[Path], *, box: str | None = None, hw_path: Path | None = None,
                   model: str | None = None, out: Path | None = None, dry_run: bool = False,
                   force: bool = False) -> dict:
    """Refit from run records and write the result unless it fits them worse than the factors it started from
    (then the old file stays, unless `force`). Returns the report (`written_to` is None when nothing was written)."""
    for p in runs:
        if not p.exists():
            raise UsageError(f"{p}: no such run record; run `moetplan bench --out {p}` first")
    hw = _hardware(box, hw_path)
    meas = measurements_from_runs(runs, hw, model)
    hw_used = meas[0].hw
    current = load_calibration(hw_used)
    new, before, after = refit(meas, current)
    zm_before, zm_after = zero_miss_rows(meas, current), zero_miss_rows(meas, new)
    target = out or user_calibration_path()
    worse = _worse(summarize(before), summarize(after))
    written = not dry_run and (not worse or force)
    if written:
        write_user_calibration(new, hw_used, target, [str(p) for p in runs], routing_fitted=bool(zm_after),
                               gate_measured=any("gate_fire_share" in m.extra for m in meas))
    family = family_key(hw_used)
    result = {
        "family": family,
        "written_to": str(target) if written else None,
        "kept_previous": bool(worse and not force and not dry_run),
        "worse_than_before": worse,
        "rows": [
            {"row": b.row_id, "metric": b.metric, "measured": b.measured, "predicted_before": b.predicted,
             "error_before": b.error, "predicted_after": a.predicted, "error_after": a.error}
            for b, a in zip(before, after)
        ],
        "before": summarize(before),
        "after": summarize(after),
        "factors": {"family": new.families[family].model_dump(), "links": new.links.model_dump()},
        "miss_correlation": {
            "before": current.routing.miss_correlation, "after": new.routing.miss_correlation,
            "zero_miss_step_share": [{"row": r, "measured": m, "predicted_before": pb, "predicted_after": pa}
                                     for (r, m, pb), (_, _, pa) in zip(zm_before, zm_after)],
        },
        "gate_recompute_share": {
            "before": current.routing.gate_recompute_share, "after": new.routing.gate_recompute_share,
            "measured": [{"row": m.row_id, "share": m.extra["gate_fire_share"], "tau": m.placement.gate.tau}
                         for m in meas if "gate_fire_share" in m.extra],
        },
    }
    return result


def _worse(before: dict, after: dict) -> bool:
    """The refit fits the records worse: a larger median |error| (ties broken by the largest error)."""
    mb, ma = before["median_abs_error"], after["median_abs_error"]
    if ma is None or mb is None:
        return False
    return ma > mb + 1e-9 or (abs(ma - mb) <= 1e-9 and (after["max_abs_error"] or 0) > (before["max_abs_error"] or 0))

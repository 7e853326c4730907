"""Fit the cost model on every published vLLM-Moet measurement and judge it out of sample (leave-one-out).

    .venv/bin/python bench/calibrate.py            # fit, leave-one-out, print per row, write bench/results/calibrate.json
    .venv/bin/python bench/calibrate.py --write    # ... and write hwdb/calibration/cost_model.yaml
    .venv/bin/python bench/calibrate.py --check    # evaluate the checked-in constants only (no fit, no LOO)
    .venv/bin/python bench/calibrate.py --no-loo   # fit and in-sample figures only

Data: hwdb/calibration/vllm_moet_measurements.csv (rows r01..), vllm_moet_measurements_more.csv (m01..) and
vllm_moet_measurements_facts.csv (f01..: figures FACTS.md states in prose, with their recipe's knobs).
Fit: regularised least squares of the relative step-time error over all rows, every fitted factor pulled toward
its physics prior (hwdb/calibration/priors.yaml; `fit: false` factors stay there), stream_overlap scanned.
Leave-one-out: each row is predicted by a fit on all the other rows (a row's decode and prefill leave together);
the leave-one-out median over the decode and aggregate figures is the number that counts, reported per expert tier
(resident / host / nvme) as well, with the worst row named.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from moetplan.contract import atomic_write_text  # noqa: E402
from moetplan.cost_model.calibration import (  # noqa: E402
    CALIBRATION_FILE,
    CPU_FAMILY,
    DEFAULT_FAMILY,
    FamilyFactors,
    calibration_dir,
    load_calibration,
    load_cpu_family,
    load_priors,
    save_calibration,
)
from moetplan.cost_model.dataset import REFERENCE_CSVS, Measurement, load_reference  # noqa: E402
from moetplan.cost_model.fitting import RowResult, evaluate, fit, leave_one_out  # noqa: E402
from moetplan.contract.machine import machine_info  # noqa: E402


def _group(m: Measurement) -> str:
    p = m.placement
    if p.expert_tier != "resident":
        return f"{p.expert_tier} tier"
    if m.concurrency > 1:
        return "batched (aggregate)"
    if p.gate.enabled:
        return "confidence gate"
    return f"resident TP{p.tp}" + (f"xPP{p.pp}" if p.pp > 1 else "")


def _stats(rs: list[RowResult]) -> dict[str, float | int | None]:
    if not rs:
        return {"rows": 0, "median_abs_error": None, "max_abs_error": None}
    errs = [abs(r.error) for r in rs]
    return {"rows": len(rs), "median_abs_error": round(statistics.median(errs), 4), "max_abs_error": round(max(errs), 4)}


def summary(results: list[RowResult], meas: list[Measurement]) -> dict:
    """Median and worst |error| over the decode and aggregate figures, and the same per expert tier (so a tiered
    regression cannot hide in a good median), per group, per model; the worst row named."""
    by_row = {m.row_id: m for m in meas}
    checks = [r for r in results if by_row[r.row_id].check]
    results = [r for r in results if not by_row[r.row_id].check]
    dec = [r for r in results if r.metric != "prefill_tok_s"]
    groups: dict[str, list[RowResult]] = {}
    models: dict[str, list[RowResult]] = {}
    tiers: dict[str, list[RowResult]] = {}
    for r in dec:
        groups.setdefault(_group(by_row[r.row_id]), []).append(r)
        models.setdefault(by_row[r.row_id].model.id, []).append(r)
        tiers.setdefault(by_row[r.row_id].placement.expert_tier, []).append(r)
    tiered = [r for r in dec if by_row[r.row_id].placement.expert_tier != "resident"]
    worst = max(dec, key=lambda r: abs(r.error)) if dec else None
    with_checks = dec + [r for r in checks if r.metric != "prefill_tok_s"]
    return {"decode_and_aggregate": _stats(dec), "prefill": _stats([r for r in results if r.metric == "prefill_tok_s"]),
            "with_check_rows": _stats(with_checks),
            "by_tier": {k: _stats(tiers.get(k, [])) for k in ("resident", "host", "nvme")},
            "tiered": _stats(tiered),
            "worst_row": None if worst is None else {"row": worst.row_id, "configuration": worst.label,
                                                     "error": round(worst.error, 4)},
            "by_group": {k: _stats(v) for k, v in sorted(groups.items())},
            "by_model": {k: _stats(v) for k, v in sorted(models.items())},
            "check_rows": {r.row_id: {"configuration": r.label, "measured": r.measured, "predicted": round(r.predicted, 2),
                                      "error": round(r.error, 4), **_implied(by_row[r.row_id], r)} for r in checks}}


def _implied(m: Measurement, r: RowResult) -> dict[str, float]:
    """What a speculating check row's figure implies, at the modelled step cost: the tokens each step emitted."""
    from moetplan.cost_model.terms import acceptance

    if m.placement.mtp <= 0 or r.metric == "prefill_tok_s":
        return {}
    acc = acceptance(m.model, m.placement)
    if acc * r.measured / r.predicted > m.placement.mtp + 1:  # more than k drafts can emit: not an acceptance question
        return {}
    return {"acceptance_used": round(acc, 2), "implied_tokens_per_step": round(acc * r.measured / r.predicted, 2)}


def _print_tiers(title: str, summ: dict) -> None:
    print(f"\n{title}: median / worst |error| of decode and aggregate tok/s")
    rows = [("all", summ["decode_and_aggregate"]), *summ["by_tier"].items(), ("tiered (host + nvme)", summ["tiered"]),
            ("all + check rows", summ["with_check_rows"])]
    for name, st in rows:
        if st["rows"]:
            print(f"  {name:22s} {st['rows']:3d} rows  {st['median_abs_error']:7.1%}  {st['max_abs_error']:7.1%}")
    if summ["worst_row"]:
        w = summ["worst_row"]
        print(f"  worst row: {w['row']} {w['configuration']} ({w['error']:+.1%})")
    for rid, c in summ["check_rows"].items():
        implied = (f"; at the modelled step cost the figure implies {c['implied_tokens_per_step']:.2f} tokens/step "
                   f"where {c['acceptance_used']:.2f} was used" if "implied_tokens_per_step" in c else "")
        print(f"  check row (never fitted): {rid} {c['configuration']}: {c['measured']:g} vs {c['predicted']:g} "
              f"({c['error']:+.1%}){implied}")
    if summ["check_rows"]:
        print("  check rows carry an assumed knob the published rows cannot pin (measurement_annotations.yaml says "
              "which); counted only in 'all + check rows'")


def _print(title: str, results: list[RowResult]) -> None:
    w = max(len(r.label) for r in results)
    print(f"\n{title}")
    print(f"{'row':4s} {'configuration':{w}s} {'metric':16s} {'measured':>9s} {'predicted':>9s} {'error':>7s}  "
          "bottleneck")
    for r in results:
        print(f"{r.row_id:4s} {r.label:{w}s} {r.metric:16s} {r.measured:9.1f} {r.predicted:9.1f} "
              f"{r.error:+7.1%}  {r.bottleneck}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--write", action="store_true", help="write hwdb/calibration/cost_model.yaml")
    ap.add_argument("--check", action="store_true", help="evaluate the checked-in constants, no fit")
    ap.add_argument("--no-loo", action="store_true", help="skip leave-one-out")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "calibrate.json"))
    args = ap.parse_args()

    t0 = time.perf_counter()
    meas = load_reference()
    if args.check:
        calib = load_calibration(user=False)
    else:
        calib = fit(meas, source="bench/calibrate.py on hwdb/calibration/" + " + ".join(REFERENCE_CSVS))
        fam = calib.families[[k for k in calib.families if k not in (DEFAULT_FAMILY, CPU_FAMILY)][0]]
        # Unmeasured GPU families start from the same factors: the overheads belong to the software stack, and the
        # efficiencies to kernels of the same design. Documented in docs/COST_MODEL.md.
        calib.families[DEFAULT_FAMILY] = fam.model_copy()
        calib.families[CPU_FAMILY] = FamilyFactors.model_validate(load_cpu_family())
    insample = evaluate(meas, calib)
    loo = [] if (args.check or args.no_loo) else leave_one_out(meas)
    report_summary = {"in_sample": summary(insample, meas)}
    if loo:
        report_summary["leave_one_out"] = summary(loo, meas)
    if not args.check:
        calib = calib.model_copy(update={"summary": {
            "in_sample_median_abs_error": report_summary["in_sample"]["decode_and_aggregate"]["median_abs_error"],
            "in_sample_max_abs_error": report_summary["in_sample"]["decode_and_aggregate"]["max_abs_error"],
            **({"leave_one_out_median_abs_error": report_summary["leave_one_out"]["decode_and_aggregate"][
                "median_abs_error"],
                "leave_one_out_tiered_median_abs_error": report_summary["leave_one_out"]["tiered"][
                "median_abs_error"],
                "leave_one_out_max_abs_error": report_summary["leave_one_out"]["decode_and_aggregate"][
                "max_abs_error"]} if loo else {}),
        }})

    _print("in sample (fitted on every row)", insample)
    if loo:
        _print("leave-one-out (each row predicted by a fit without it)", loo)
    _print_tiers("in sample", report_summary["in_sample"])
    if loo:
        _print_tiers("leave-one-out", report_summary["leave_one_out"])

    loo_by = {(r.row_id, r.metric): r for r in loo}
    report = {
        "kind": "calibrate",
        "created_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "mode": "check" if args.check else "fit",
        "command": "python bench/calibrate.py" + (" --check" if args.check else "") + (" --no-loo" if args.no_loo
                                                                                     else ""),
        "machine": machine_info(),
        "data": [f"hwdb/calibration/{f}" for f in REFERENCE_CSVS],
        "summary": report_summary,
        "rows": [{"row": r.row_id, "configuration": r.label, "metric": r.metric, "measured": r.measured,
                  "predicted": round(r.predicted, 2), "error": round(r.error, 4),
                  "loo_predicted": round(loo_by[(r.row_id, r.metric)].predicted, 2) if loo else None,
                  "loo_error": round(loo_by[(r.row_id, r.metric)].error, 4) if loo else None,
                  "bottleneck": r.bottleneck} for r in insample],
        "factors": {"families": {k: v.model_dump() for k, v in calib.families.items()},
                    "links": calib.links.model_dump(),
                    "routing": {k: getattr(calib.routing, k) for k in ("stream_overlap", "gate_recompute_share",
                                                                       "gate_tau_exponent", "miss_correlation")}},
        "priors": {k: {"value": p.value, "sigma": p.sigma, "fitted": p.fit} for k, p in load_priors().items()},
        "seconds": round(time.perf_counter() - t0, 1),
    }
    atomic_write_text(args.out, json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")
    if args.write and not args.check:
        path = calibration_dir() / CALIBRATION_FILE
        save_calibration(calib, path)
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

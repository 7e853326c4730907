"""How long `moetplan plan` takes to search (the issue promises an answer in under a second).

Times solve() (search + prediction + launch) for the issue's examples and every reference box x target model,
median of several runs after one warm-up, and writes JSON with machine info.
Usage: python bench/plan_speed.py [--out bench/results/plan_speed.json] [--runs 5]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

from moetplan import __version__, hwdb
from moetplan.contract.errors import InfeasibleError
from moetplan.contract import Goals, atomic_write_text
from moetplan.plan.solver import solve
from moetplan.contract.machine import machine_info

CASES = [("glm-5.2", "box", "rtx-pro-6000x2"), ("deepseek-v4-flash", "inline", ("1xrtx-5090", 96)),
         ("kimi-k2.7-code", "inline", ("1xrtx-4090", 32))]
CASES += [(m, "box", b) for m in ("glm-5.2", "deepseek-v4-flash", "kimi-k2.7-code") for b in hwdb.box_ids()]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results/plan_speed.json")
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    rows = []
    for model, kind, hwarg in CASES:
        spec = hwdb.model_spec(model)
        hw = hwdb.box_profile(hwarg) if kind == "box" else hwdb.inline_profile(hwarg[0], hwarg[1], None, None)
        times, outcome = [], ""
        for i in range(args.runs + 1):
            t = time.perf_counter()
            try:
                plan = solve(spec, hw, Goals())
                outcome = f"{plan.placement.expert_tier} {plan.prediction.decode_tok_s:.1f} tok/s"
            except InfeasibleError:
                outcome = "infeasible (diagnosed)"
            if i:
                times.append(time.perf_counter() - t)
        med = statistics.median(times)
        rows.append({"model": model, "hardware": hwarg if kind == "box" else f"{hwarg[0]} + {hwarg[1]} GiB RAM",
                     "median_s": round(med, 4), "max_s": round(max(times), 4), "outcome": outcome})
        print(f"{model:18s} {str(rows[-1]['hardware']):26s} {med * 1000:7.1f} ms  {outcome}")
    doc = {"bench": "plan_speed", "moetplan": __version__, "runs": args.runs,
           "machine": machine_info(),
           "rows": rows, "max_median_s": max(r["median_s"] for r in rows)}
    atomic_write_text(args.out, json.dumps(doc, indent=2) + "\n")
    print(f"slowest median {doc['max_median_s'] * 1000:.0f} ms; wrote {args.out}")


if __name__ == "__main__":
    main()

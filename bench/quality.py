"""Quality of 2-bit experts, + FP4 reserve, + confidence gate against the float model, on a trained tiny MoE.

    .venv/bin/python bench/quality.py                      # train (cached) + evaluate, write bench/results/quality_tiny.json
    .venv/bin/python bench/quality.py --tau 0.5 --eval-tokens 1024
    .venv/bin/python bench/quality.py --eval-tokens 2048 --sweep 0.05,0.1,0.2,0.5 --reserve-sweep 0,0.125  # checked in

Teacher-forced on held-out stdlib source the model never trained on, one token per decode step with a KV cache.
The reserve's promotion rounds run inline after each step (same policy as the server's worker thread, but
reproducible). Runs single-threaded: this is a shared 2-core box and intra-op threads only contend.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict, replace
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from moetplan import hwdb  # noqa: E402
from moetplan.contract import atomic_write_text  # noqa: E402
from moetplan.runtime.offline import quality as Q  # noqa: E402


def machine_info() -> dict[str, object]:
    from moetplan.contract.machine import machine_info as base

    try:
        load = os.getloadavg()  # a shared box: the load says how busy it was
    except OSError:
        load = None
    return base(torch_threads=torch.get_num_threads(), loadavg=load)


def markdown(d: dict) -> str:
    """The tables docs/GATE.md shows, from a result document."""
    r = d["results"]
    g = r["reserve_gate"]["gate"]
    rerun = g["recomputes"] / g["steps"]
    out = ["| variant | agreement | KL(ref \\|\\| variant), nats | FP4 routing share | steps re-run |",
           "| --- | --- | --- | --- | --- |",
           f"| 2-bit experts | {r['two_bit']['agreement']:.4f} | {r['two_bit']['kl']:.4f} | 0 | - |",
           f"| 2-bit + FP4 reserve ({r['setup']['reserve_slots']} of {r['setup']['expert_rows']} rows) | "
           f"{r['reserve']['agreement']:.4f} | {r['reserve']['kl']:.4f} | "
           f"{r['reserve']['reserve']['fp4_routing_share']:.3f} | - |",
           f"| 2-bit + reserve + gate (tau {g['tau']}) | {r['reserve_gate']['agreement']:.4f} | "
           f"{r['reserve_gate']['kl']:.4f} | {r['reserve_gate']['reserve']['fp4_routing_share']:.3f} | "
           f"{rerun:.3f} (fired {g['fire_share']:.3f}) |",
           f"| every expert at FP4 (ceiling) | {r['fp4_all']['agreement']:.4f} | {r['fp4_all']['kl']:.4f} | 1 | - |",
           ""]
    sw = dict(d.get("tau_sweep", {}))
    sw[str(g["tau"])] = {"agreement": r["reserve_gate"]["agreement"], "kl": r["reserve_gate"]["kl"],
                         "fire_share": g["fire_share"], "recompute_share": rerun, "promotions": g["promotions"]}
    out += ["| tau | agreement | KL | steps fired | steps re-run | gate promotions |", "| --- | --- | --- | --- | --- | --- |"]
    for t in sorted(sw, key=float):
        v = sw[t]
        out.append(f"| {t} | {v['agreement']:.4f} | {v['kl']:.4f} | {v['fire_share']:.3f} | "
                   f"{v['recompute_share']:.3f} | {v['promotions']} |")
    rs = dict(d.get("reserve_sweep", {}))
    rs[str(d["config"]["reserve_share"])] = {
        "reserve_slots": r["setup"]["reserve_slots"], "two_bit": r["two_bit"], "reserve": r["reserve"],
        "reserve_gate": r["reserve_gate"], "fp4_routing_share": r["reserve"]["reserve"]["fp4_routing_share"],
        "gate_recompute_share": rerun}
    out += ["", "| reserve rows | 2-bit | + reserve | + reserve + gate | FP4 routing share (reserve) | steps re-run |",
            "| --- | --- | --- | --- | --- | --- |"]
    for k in sorted(rs, key=float):
        v = rs[k]
        out.append(f"| {v['reserve_slots']} | {v['two_bit']['agreement']:.4f} | {v['reserve']['agreement']:.4f} | "
                   f"{v['reserve_gate']['agreement']:.4f} | {v['fp4_routing_share']:.3f} | "
                   f"{v['gate_recompute_share']:.3f} |")
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tau", type=float, default=0.3)
    ap.add_argument("--eval-tokens", type=int, default=2048)
    ap.add_argument("--reserve-share", type=float, default=0.25)
    ap.add_argument("--train-steps", type=int, default=Q.TinyMoeSpec.train_steps)
    ap.add_argument("--sweep", default="", help="comma-separated extra tau values for the gated variant")
    ap.add_argument("--reserve-sweep", default="", help="comma-separated extra reserve shares (all three variants)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--cache", default=None, help="checkpoint cache dir (default: user cache / MOETPLAN_QUALITY_CACHE)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "quality_tiny.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    spec = replace(Q.TinyMoeSpec(), train_steps=args.train_steps)
    t0 = time.perf_counter()
    model, tok, info = Q.load_or_train(spec, args.cache, log=lambda s: print(f"  train {s}", flush=True))
    load_s = time.perf_counter() - t0
    floor = float(hwdb.guards()["fp4_gate"]["floor_factor"])  # the planner's gate floor, as a plan would size it
    q = Q.QualityConfig(tau=args.tau, eval_tokens=args.eval_tokens, reserve_share=args.reserve_share,
                        gate_floor_factor=floor)
    res = Q.run_quality(model, tok, q, log=lambda s: print(s, flush=True))
    sweep = {}
    for tau in [float(t) for t in args.sweep.split(",") if t.strip()]:
        r = Q.run_quality(model, tok, replace(q, tau=tau))
        sweep[str(tau)] = {"agreement": r["reserve_gate"]["agreement"], "kl": r["reserve_gate"]["kl"],
                           "fire_share": r["reserve_gate"]["gate"]["fire_share"],
                           "recompute_share": r["reserve_gate"]["gate"]["recomputes"] / r["reserve_gate"]["gate"]["steps"],
                           "promotions": r["reserve_gate"]["gate"]["promotions"]}
        print(f"tau {tau}: {sweep[str(tau)]}", flush=True)

    reserve_sweep = {}
    for share in [float(t) for t in args.reserve_sweep.split(",") if t.strip()]:
        r = Q.run_quality(model, tok, replace(q, reserve_share=share))
        reserve_sweep[str(share)] = {
            "reserve_slots": r["setup"]["reserve_slots"],
            **{k: {"agreement": r[k]["agreement"], "kl": r[k]["kl"]} for k in ("two_bit", "reserve", "reserve_gate")},
            "fp4_routing_share": r["reserve"]["reserve"]["fp4_routing_share"],
            "gate_recompute_share": r["reserve_gate"]["gate"]["recomputes"] / r["reserve_gate"]["gate"]["steps"],
            "monotonic": r["monotonic"]}
        print(f"reserve share {share}: {reserve_sweep[str(share)]}", flush=True)

    out = {
        "benchmark": "moetplan quality: 2-bit vs +FP4 reserve vs +reserve+gate",
        "created_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([".venv/bin/python", "bench/quality.py", *sys.argv[1:]]),
        "machine": machine_info(),
        "model": {"spec": asdict(spec), "training": info, "load_or_train_s": load_s,
                  "train_corpus": list(Q.TRAIN_MODULES), "architecture": "Qwen3MoeForCausalLM (transformers)"},
        "config": {k: v for k, v in asdict(q).items() if k != "extra"},
        "results": res,
        "tau_sweep": sweep,
        "reserve_sweep": reserve_sweep,
    }
    atomic_write_text(args.out, json.dumps(out, indent=1) + "\n")
    a = [res[k]["agreement"] for k in ("two_bit", "reserve", "reserve_gate")]
    print(f"agreement 2-bit {a[0]:.4f} < +reserve {a[1]:.4f} < +gate {a[2]:.4f}: monotonic={res['monotonic']}")
    print(markdown(out))
    print(f"wrote {args.out}")
    return 0 if res["monotonic"] else 1


if __name__ == "__main__":
    sys.exit(main())

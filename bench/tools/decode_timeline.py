"""Where a decode step's time goes, per kernel: the bench/moe_kernels.py decode step (all MoE layers back to back in one
CUDA graph) replayed under the CUDA profiler (CUPTI through torch.profiler); per kernel name the count per layer and
the mean / total duration, and how much of the step the kernels cover (the union of their intervals: with PDL
consecutive kernels overlap, the rest is launch gaps).

    PYTHONPATH=. python3 bench/tools/decode_timeline.py --models DeepSeek-V4-Flash --tokens 1,8 \
        --out decode_timeline_h200.json
"""
from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.moe_kernels import (atomic_write_json, capture, machine_info, model_shapes, resident_layer,  # noqa: E402
                           time_events)
from moetplan.contract.runtime import KernelPolicy  # noqa: E402
from moetplan.runtime.op import kernels as kmod, ops  # noqa: E402
from moetplan.runtime.format.format import RowLayout  # noqa: E402


def union_us(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals."""
    total, cur_s, cur_e = 0.0, None, None
    for s, e in sorted(intervals):
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        total += cur_e - cur_s
    return total


def short_name(name: str) -> str:
    for key, short in (("gemv_stage_kernel<true", "gemv w13"), ("gemv_stage_kernel<false", "gemv w2"),
                       ("xprep8_kernel", "xprep8"), ("xprep_kernel", "xprep"), ("combine_kernel", "combine"),
                       ("rowdot", "rowdot"), ("moe_stage_kernel", "mma stage")):
        if key in name:
            return short
    return name[:60]


def timeline(m: dict[str, Any], T: int, layers_in_step: int, gen: torch.Generator,
             policy: KernelPolicy = KernelPolicy()) -> dict[str, Any]:
    H, I, k, E = m["H"], m["I"], m["k"], m["E"]
    lay = RowLayout.for_expert(H, I, fmt="2bit")
    NL = 16  # distinct layers (16 x 6 experts x 14 MB >> L2 at the smallest case)
    layers = [resident_layer(lay, T, k, E, gen) for _ in range(NL)]
    x = (torch.randn(T, H, device="cuda", generator=gen) * 0.3).to(torch.bfloat16)
    outs = [torch.empty_like(x) for _ in range(NL)]
    L = layers_in_step

    def step():
        for li in range(L):
            d = layers[li % NL]
            ops.moe_forward(x, d["ids"], d["w"], d["pool"], d["slot_of"], lay, out=outs[li % NL], policy=policy)

    g = capture(step)
    t = time_events(g.replay, reps=10)
    bytes_layer = sum(layers[li % NL]["used"] for li in range(L)) * lay.payload_bytes / L
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            g.replay()
        torch.cuda.synchronize()
    ev = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    kern = [e for e in ev if "memcpy" not in e.name.lower() and "memset" not in e.name.lower()]
    per: dict[str, list[float]] = defaultdict(list)
    for e in kern:
        per[short_name(e.name)].append(e.time_range.end - e.time_range.start)
    span = (max(e.time_range.end for e in kern) - min(e.time_range.start for e in kern)) if kern else 0.0
    covered = union_us([(e.time_range.start, e.time_range.end) for e in kern])
    reps = 3 * L
    return {
        "model": m["name"], "tokens": T, "layers_in_step": L, "bytes_per_layer": bytes_layer,
        "step_ms": t["median_ms"], "per_layer_us": t["median_ms"] * 1e3 / L,
        "kernels_recorded": len(kern),
        "per_kernel": {n: {"per_layer": len(v) / reps, "mean_us": sum(v) / len(v), "per_layer_us": sum(v) / reps}
                       for n, v in sorted(per.items())},
        "profiled_span_us_per_layer": span / reps, "kernel_union_us_per_layer": covered / reps,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="decode_timeline_h200.json")
    ap.add_argument("--models", default="DeepSeek-V4-Flash")
    ap.add_argument("--tokens", default="1,8")
    ap.add_argument("--layers", type=int, default=32, help="MoE layers per captured step")
    ap.add_argument("--pdl", default="1,0", help="launch modes to profile: 1 = PDL (the default path), 0 = plain "
                    "launches (kernels then do not overlap: their durations are their own)")
    args = ap.parse_args()
    if kmod.get_module() is None:
        raise SystemExit(f"kernels unavailable: {kmod.fallback_reason()}")
    gen = torch.Generator(device="cuda").manual_seed(0)
    want = {s.strip() for s in args.models.split(",") if s.strip()}
    res: dict[str, Any] = {"benchmark": "decode_timeline", "machine": machine_info(), "command": " ".join(sys.argv),
                           "cases": []}
    for m in model_shapes():
        if want and m["name"] not in want:
            continue
        for T, pdl in [(int(s), p) for s in args.tokens.split(",") for p in args.pdl.split(",")]:
            r = {"pdl": pdl == "1", **timeline(m, T, args.layers, gen, KernelPolicy(pdl=pdl == "1"))}
            res["cases"].append(r)
            kk = "  ".join(f"{n} {v['mean_us']:.1f}" for n, v in r["per_kernel"].items())
            print(f"{m['name']:18s} T={T} pdl={pdl}: {r['per_layer_us']:.1f} us/layer (graph), kernels cover "
                  f"{r['kernel_union_us_per_layer']:.1f} of {r['profiled_span_us_per_layer']:.1f} us/layer "
                  f"profiled; mean us: {kk}", flush=True)
            atomic_write_json(Path(args.out), res)


if __name__ == "__main__":
    main()

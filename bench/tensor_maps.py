"""Host cost of the decode TMA ring's tensor maps in eager steps (issue 8; docs/KERNELS.md, H26).

The TMA ring needs two tensor maps per stage launch (code rows and scale rows). Inside a CUDA graph the launch is
recorded once, so they cost nothing there; an eager step (vLLM's `enforce_eager`, the first steps before capture,
batch sizes outside the captured set) encodes them at every launch unless the extension's cache has them. This
times eager `ops.moe_forward` calls of one MoE layer with the cache on and off, interleaved, in one run:

- host microseconds per call (the Python + launch work, measured around a loop without synchronizing; the GPU
  queue never fills in that many calls), and the saving per stage launch ((off - on) / 2: two stages a call);
- microseconds per call when the loop is synchronized (what an eager step waits for: the larger of host and GPU);
- the CUDA-graph time of the same call for reference.

    python3 bench/tensor_maps.py --out bench/results/tensor_maps_h200.json
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.kernels import atomic_write_json, capture, machine_info, model_shapes, resident_layer  # noqa: E402
from moetplan.runtime import kernels, ops  # noqa: E402
from moetplan.runtime.format import RowLayout  # noqa: E402


def host_and_wall_us(fn, calls: int) -> tuple[float, float]:
    """(host us per call without synchronizing, wall us per call including the GPU finishing)."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    return (t1 - t0) / calls * 1e6, (t2 - t0) / calls * 1e6


def case(m: dict[str, Any], T: int, calls: int, reps: int, gen: torch.Generator) -> dict[str, Any]:
    mod = kernels.get_module()
    lay = RowLayout.for_expert(m["H"], m["I"], fmt="2bit")
    d = resident_layer(lay, T, m["k"], m["E"], gen)
    x = (torch.randn(T, m["H"], device="cuda", generator=gen) * 0.3).to(torch.bfloat16)

    def fn() -> None:
        ops.moe_forward(x, d["ids"], d["w"], d["pool"], d["slot_of"], lay)

    rings = sorted({mod.gemv_ring(m["H"]), mod.gemv_ring(m["I"])})
    res: dict[str, list[float]] = {"host_on": [], "host_off": [], "wall_on": [], "wall_off": []}
    counts = {}
    for _ in range(reps):
        for mode in ("on", "off"):
            mod.stage_map_cache_reset(mode == "on")
            for _ in range(3):
                fn()  # warm-up (and, cache on, the two encodes)
            mod.stage_map_cache_reset(mode == "on")
            h, w = host_and_wall_us(fn, calls)
            counts[mode] = dict(zip(("hits", "encodes", "entries"), mod.stage_map_cache_stats()))
            res[f"host_{mode}"].append(h)
            res[f"wall_{mode}"].append(w)
    mod.stage_map_cache_reset(True)
    g = capture(fn)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        g.replay()
    torch.cuda.synchronize()
    graph_us = (time.perf_counter() - t0) / calls * 1e6
    med = {k: statistics.median(v) for k, v in res.items()}
    out = {
        "model": m["name"], "tokens": T, "rings": rings, "calls": calls, "reps": reps,
        "host_us_per_call": {"cache_on": med["host_on"], "cache_off": med["host_off"]},
        "wall_us_per_call": {"cache_on": med["wall_on"], "cache_off": med["wall_off"]},
        "graph_us_per_call": graph_us,
        "saving_us_per_stage_launch": (med["host_off"] - med["host_on"]) / 2,
        "cache_counts_last_rep": counts,
        "all": res,
    }
    print(f"{m['name']:18s} T={T}: host/call on {med['host_on']:6.1f} us  off {med['host_off']:6.1f} us  "
          f"(saving {out['saving_us_per_stage_launch']:.2f} us per stage launch)  wall on {med['wall_on']:6.1f}  "
          f"off {med['wall_off']:6.1f}  graph {graph_us:6.1f} us  rings {rings}  counts {counts}")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", default="1,8")
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", type=Path, default=Path("bench/results/tensor_maps.json"))
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("tensor_maps: needs a CUDA GPU", file=sys.stderr)
        return 2
    mod = kernels.get_module()
    if not mod.decode_bulk_available():
        print("tensor_maps: the TMA ring does not run on this GPU (sm_90+ needed): nothing to measure", file=sys.stderr)
        return 2
    ops.DECODE_RING = "tma"
    gen = torch.Generator(device="cuda").manual_seed(0)
    cases = [case(m, T, args.calls, args.reps, gen) for m in model_shapes()
             for T in (int(t) for t in args.tokens.split(","))]
    atomic_write_json(args.out, {"bench": "tensor_maps", "machine": machine_info(), "cases": cases})
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Read-pattern ceiling of the decode stages: pure-read kernels (bench/cuda/read_pattern.cu) that touch the same
bytes in the order the decode stages do, against a tile-major order and torch.sum, in one run.

    python3 bench/tools/read_pattern.py --out read_pattern_h200.json
    python3 bench/tools/read_pattern.py --patterns ring_gemv,ring_tile --warps 16 [--pdl] --out read_pattern_ring.json

The ring_* patterns replay the cp.async ring's memory side (a per-warp ring, no decode), in the stages' row-major
order and in a tile-major one (docs/KERNELS.md, "What was tried": a tile-major pool); "stream" reads each warp's
share of the bytes front to back (bench/layer_ceiling.py times a decode layer's launches with it). Per pattern and
row length (1024 B = K 4096 2-bit codes, 512 B = K 2048): GB/s over a 4 GiB buffer in one launch, and over slices
of a decode step's size (back to back in one CUDA graph), as a share of torch.sum's rate.

--pdl runs every pattern twice, without and with programmatic dependent launch (the kernels issue their first
two rounds, then wait for the previous one and release the next, as the decode stages do), both with shared
memory padded so that only warps/4 blocks fit per SM, as the stages' registers allow: how much of the slices'
launch gaps the stages' PDL overlap can hide.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch.utils.cpp_extension import load

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench.moe_kernels import GIB, MIB, atomic_write_json, capture, machine_info, time_events  # noqa: E402

PATTERNS = {0: "tile_linear", 1: "gemv", 2: "quad256", 3: "gemv+scales", 4: "ring_gemv", 5: "ring_tile",
            6: "ring_gemv+pf", 7: "ring_gemv+pfn", 8: "ring_gemv+pf4", 9: "stream"}


def load_module():
    """Build (or take from torch's extension cache) bench/cuda/read_pattern.cu for sm_90."""
    return load("moetplan_read_pattern", [str(Path(__file__).resolve().parents[1] / "cuda" / "read_pattern.cu")],
                extra_cuda_cflags=["-O3", "-gencode=arch=compute_90,code=sm_90"], verbose=False)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--gib", type=float, default=4.0)
    ap.add_argument("--patterns", default=",".join(PATTERNS.values()),
                    help=f"comma-separated subset of {', '.join(PATTERNS.values())}")
    ap.add_argument("--warps", default="16,32", help="warps per SM to run each pattern at (comma-separated)")
    ap.add_argument("--pdl", action="store_true",
                    help="run each pattern without and with PDL, residency capped at warps/4 blocks per SM")
    args = ap.parse_args()
    chosen = [x for x in args.patterns.split(",") if x]
    unknown = sorted(set(chosen) - set(PATTERNS.values()))
    if unknown:
        raise SystemExit(f"read_pattern: unknown pattern(s) {unknown}; choose from {list(PATTERNS.values())}")
    warps = [int(w) for w in args.warps.split(",") if w]
    mod = load_module()
    n = int(args.gib * GIB)
    buf = torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda")
    scales = torch.randint(0, 256, (n // 8,), dtype=torch.uint8, device="cuda")
    f32 = buf.view(torch.float32)
    o = torch.empty((), device="cuda")
    t = time_events(lambda: torch.sum(f32, dim=0, out=o), reps=10)
    sum_gbps = n / (t["median_ms"] * 1e-3) / 1e9
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    res = {"machine": machine_info(), "command": "python3 " + " ".join(sys.argv), "torch_sum_gbps": sum_gbps,
           "patterns": []}
    print(f"torch.sum {sum_gbps:.0f} GB/s", flush=True)
    out = torch.empty(sms * 16 * 128, dtype=torch.int32, device="cuda")
    pdl_runs = (False, True) if args.pdl else (False,)
    for rb in (1024, 512):
        for mode, name in PATTERNS.items():
            if name not in chosen:
                continue
            for wps in warps:
                blocks = sms * wps // 4
                pad = mod.smem_pad(mode, wps // 4) if args.pdl else 0
                for pdl in pdl_runs:
                    res["patterns"].append(measure(mod, mode, name, buf, scales, rb, wps, blocks, pdl, pad, out,
                                                   n, sum_gbps))
                    atomic_write_json(args.out, res)


def measure(mod, mode: int, name: str, buf, scales, rb: int, wps: int, blocks: int, pdl: bool, pad: int, out,
            n: int, sum_gbps: float) -> dict:
    """One pattern at one row length, warps per SM and launch form: the whole buffer, then step-sized slices."""
    def launch(b, s):
        mod.read_pattern(mode, b, s, rb, blocks, out, pdl, pad)

    tw = time_events(lambda: launch(buf, scales), reps=5)
    whole = n / (tw["median_ms"] * 1e-3) / 1e9
    row = {"pattern": name, "row_bytes": rb, "warps_per_sm": wps, "pdl": pdl, "smem_pad_bytes": pad,
           "whole_gbps": whole, "whole_share": whole / sum_gbps}
    # Step-sized launches: 28 MiB (DS4-Flash w13 at 1 token) and 150 MiB, back to back in a graph.
    for sl_mib in (28, 150):
        sl = sl_mib * MIB
        k = n // sl
        views = [(buf[i * sl:(i + 1) * sl], scales[i * sl // 8:(i + 1) * sl // 8]) for i in range(k)]

        def run():
            for b, s in views:
                launch(b, s)

        g = capture(run)
        ts = time_events(g.replay, reps=5)
        row[f"slices_{sl_mib}mib_gbps"] = k * sl / (ts["median_ms"] * 1e-3) / 1e9
        row[f"slices_{sl_mib}mib_share"] = row[f"slices_{sl_mib}mib_gbps"] / sum_gbps
        del g
    print({k_: (round(v, 3) if isinstance(v, float) else v) for k_, v in row.items()}, flush=True)
    return row


if __name__ == "__main__":
    main()

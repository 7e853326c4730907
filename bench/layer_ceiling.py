"""Launch-structure ceiling of decode: the bytes of each decode step read by pure streaming kernels
(bench/cuda/read_pattern.cu, pattern "stream": no rows, no decode, no MMA) in the launch structure of a layer, all
MoE layers of a step back to back in one CUDA graph, as a share of the large-read bandwidth measured in the same
run (the issue's 80% reference) and next to the real decode stages timed in the same run.

    python3 bench/layer_ceiling.py --out bench/results/layer_ceiling_h200.json

Per model shape and token count, every layer reads its routed experts' bytes (the experts a random top-k routing
of T tokens uses, times the 2-bit row's w13 and w2 bytes: what the decode stages read) from its own region of a
multi-GiB buffer, in one of these launch structures (STRUCTURES):
  one       one launch per layer of all its bytes (what a single persistent kernel per layer could read at best);
  two       a w13 launch, then a w2 launch (the decode's two dependent stages, nothing else);
  stages    the op's five launches: xprep8, w13, xprep8 between the stages, w2, combine, the small ones as empty
            one-block kernels in the stages' PDL order (the launch between the stages triggers before its wait);
  stages-X  the five less one small launch (X = xprep, between, combine): what folding it into a stage could buy.
With PDL every read launch loads its first step before waiting for the previous kernel, as the stages issue their
first rounds. Residency "stages": dynamic shared memory pads each SM to 4 blocks of 4 warps, as the stages'
registers allow; "free": no pad (the next launch's blocks may share an SM with the running ones). The pad also
takes the SM's L1 (the shared-memory carve-out goes to its maximum), which the stream's in-flight loads use; the
stages' TMA copies land in shared memory instead, so for them the truth lies between the two residencies.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.moe_kernels import (MIB, atomic_write_json, capture, decode_case, machine_info, model_shapes,  # noqa: E402
                           read_bandwidth, routing, time_events)
from bench.tools.read_pattern import PATTERNS, load_module  # noqa: E402
from moetplan.runtime.format.format import RowLayout  # noqa: E402

STREAM = next(m for m, n in PATTERNS.items() if n == "stream")
ROW_BYTES = 1024  # the kernel reads whole 16 x ROW_BYTES tiles: regions are rounded to 16 KiB
TILE = 16 * ROW_BYTES
# A layer's launches: "all" / "w13" / "w2" read that many bytes; "wait" / "trigger" are the empty one-block links
# (wait first, or trigger first as the launch between the stages does).
STRUCTURES = {
    "one": ("all",),
    "two": ("w13", "w2"),
    "stages": ("wait", "w13", "trigger", "w2", "wait"),
    # The op's launches less one of its small ones (timed with the stages' residency and PDL only): what taking
    # that launch into a stage could buy at most.
    "stages-xprep": ("w13", "trigger", "w2", "wait"),
    "stages-between": ("wait", "w13", "w2", "wait"),
    "stages-combine": ("wait", "w13", "trigger", "w2"),
}
FULL = ("one", "two", "stages")  # timed in every residency and launch form


def layer_regions(w13_bytes: list[int], w2_bytes: list[int], buf_bytes: int) -> list[tuple[int, int, int]]:
    """(offset, w13 bytes, w2 bytes) per layer, each rounded to whole tiles, laid out back to back in a buffer of
    `buf_bytes` and wrapping to its start where the next layer would not fit: consecutive layers never share
    bytes, so with a buffer many times the L2 every layer reads from DRAM."""
    out, off = [], 0
    for a, b in zip(w13_bytes, w2_bytes):
        a, b = max(TILE, a // TILE * TILE), max(TILE, b // TILE * TILE)
        if a + b > buf_bytes:
            raise ValueError(f"a layer of {a + b} bytes does not fit the {buf_bytes}-byte buffer; raise --gib")
        if off + a + b > buf_bytes:
            off = 0
        out.append((off, a, b))
        off += a + b
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--tokens", default="1,2,4,8")
    ap.add_argument("--models", default="", help="comma-separated subset of model names")
    ap.add_argument("--gib", type=float, default=4.0, help="buffer the layers' regions cycle through")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--no-stages", action="store_true", help="skip timing the real decode stages (bench/moe_kernels.py)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench/layer_ceiling.py needs a CUDA GPU", file=sys.stderr)
        return 2
    models = [m for m in model_shapes() if not args.models or m["name"] in args.models.split(",")]
    if args.models and not models:
        raise SystemExit(f"layer_ceiling: no model among {args.models!r}; choose from "
                         f"{[m['name'] for m in model_shapes()]}")
    mod = load_module()
    gen = torch.Generator(device="cuda").manual_seed(0)
    bw = read_bandwidth(quick=True)
    ref = bw["large_sum"]["gbps"]
    print(f"read bandwidth (large sum) {ref:.0f} GB/s", flush=True)
    res: dict[str, Any] = {"benchmark": "decode launch-structure ceiling", "machine": machine_info(),
                           "command": "python3 " + " ".join(sys.argv), "read_bandwidth": bw, "points": []}
    buf_bytes = int(args.gib * 1024**3) // TILE * TILE
    buf = torch.randint(0, 256, (buf_bytes,), dtype=torch.uint8, device="cuda")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    blocks = sms * 4  # 4 blocks of 4 warps per SM: the stages' grid
    sink = torch.zeros(blocks * 128, dtype=torch.int32, device="cuda")
    pads = {"stages": mod.smem_pad(STREAM, 4), "free": 0}
    for m in models:
        lay = RowLayout.for_expert(m["H"], m["I"], fmt="2bit")
        per13, per2 = lay.w13_q_size + lay.w13_s_size, lay.w2_q_size + lay.w2_s_size
        for T in [int(v) for v in args.tokens.split(",")]:
            used = [len(torch.unique(routing(T, m["k"], m["E"], gen)[0])) for _ in range(m["L"])]
            regions = layer_regions([u * per13 for u in used], [u * per2 for u in used], buf_bytes)
            step_bytes = sum(a + b for _, a, b in regions)
            point: dict[str, Any] = {"model": m["name"], "tokens": T, "layers_in_step": m["L"],
                                     "experts_read_per_layer": sum(used) / len(used),
                                     "bytes_per_layer": step_bytes / len(regions), "ceilings": {}}
            for structure, launches in STRUCTURES.items():
                forms = [(r, pdl) for r in pads for pdl in (True, False)] if structure in FULL else [("stages", True)]
                for residency, pdl in forms:
                    pad = pads[residency]

                    def step() -> None:
                        for off, a, b in regions:
                            for kind in launches:
                                if kind in ("wait", "trigger"):
                                    mod.link(kind == "trigger", sink, pdl)
                                    continue
                                o, n = {"all": (off, a + b), "w13": (off, a), "w2": (off + a, b)}[kind]
                                v = buf[o:o + n]
                                mod.read_pattern(STREAM, v, v, ROW_BYTES, blocks, sink, pdl, pad)

                    g = capture(step)
                    t = time_events(g.replay, reps=args.reps)
                    del g
                    gbps = step_bytes / (t["median_ms"] * 1e-3) / 1e9
                    point["ceilings"][f"{structure}_{residency}_{'pdl' if pdl else 'no_pdl'}"] = {
                        "step_ms": t["median_ms"], "per_layer_us": t["median_ms"] * 1e3 / len(regions),
                        "gbps": gbps, "share_of_read_bw": gbps / ref}
            if not args.no_stages:
                r = decode_case(m, T, ref, gen, quick=True, decode_kernels=("gemv",), baselines=False)
                if "error" in r:
                    point["stages"] = {"error": r["error"]}
                else:
                    point["stages"] = {k: r[k] for k in ("per_layer_us", "gbps", "share_of_read_bw", "variant",
                                                         "bytes_per_layer")}
                    st = point["ceilings"]["stages_stages_pdl"]["share_of_read_bw"]
                    point["stages"]["share_of_stages_ceiling"] = r["share_of_read_bw"] / st
            res["points"].append(point)
            atomic_write_json(args.out, res)
            c = point["ceilings"]
            line = "  ".join(f"{s} {100 * c[f'{s}_stages_pdl']['share_of_read_bw']:.0f}%"
                             + (f" ({100 * c[f'{s}_free_pdl']['share_of_read_bw']:.0f}% free)" if s in FULL else "")
                             for s in STRUCTURES)
            ours = point.get("stages", {})
            timed = f"  the stages {100 * ours['share_of_read_bw']:.0f}%" if "share_of_read_bw" in ours else ""
            print(f"{m['name']:18s} T={T}: {point['bytes_per_layer'] / MIB:6.1f} MiB/layer  ceilings {line}{timed}",
                  flush=True)
    res["finished"] = True
    atomic_write_json(args.out, res)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

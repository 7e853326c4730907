"""How far the e4m3 w13 decode stage (KernelPolicy.e4m3_decode) moves the w13 result from the bf16 stage's, on one GPU.

The bf16 stage is exact up to fp32 sums and the bf16 hi + lo intermediate (~2^-16); the e4m3 one adds x's hi/lo
e4m3 split (exact within 2^13 of a token's largest element), the per-round block-scale flush (blocks > 12 binades
below the round's largest) and the fp8 MMA's accumulation. Measured per model shape for x ~ N(0, 0.3) with one
outlier channel of `ratio` x 0.3 (0 = none), and for scale bytes spread over 40 binades (the flush).

    PYTHONPATH=. python3 bench/e4m3_precision.py --out bench/results/e4m3_precision_h200.json
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moe_kernels import atomic_write_json, machine_info, model_shapes, resident_layer  # noqa: E402
from moetplan.runtime.op import kernels as kmod  # noqa: E402
from moetplan.runtime.format.format import RowLayout  # noqa: E402


def w13_act(mod, x, ids, pool, slot_of, lay, f8: bool) -> torch.Tensor:
    """The gemv w13 stage's intermediate (hi + lo) through the e4m3 (xprep8) or the bf16 (xprep) operand."""
    T, H = x.shape
    act = torch.empty(ids.numel(), 2, lay.inter_per_rank, dtype=torch.bfloat16, device="cuda")
    flag = torch.zeros(1, dtype=torch.int32, device="cuda")
    xinv = None
    if f8:
        xp = torch.empty(T, 2, H, dtype=torch.uint8, device="cuda")
        xinv = torch.empty(T, dtype=torch.float32, device="cuda")
        mod.xprep8(x, xp, xinv, None, False)
    else:
        xp = torch.empty(T, 1, H, dtype=torch.bfloat16, device="cuda")
        mod.xprep(x, xp, None, False)
    mod.gemv_stage(True, f8, pool, slot_of, None, lay.w13_q_off, lay.w13_s_off, H, lay.inter_per_rank, ids,
                   ids.shape[1], xp, act, None, None, None, None, 0.0, False, flag, False, xinv, -1, -1)
    torch.cuda.synchronize()
    if int(flag.item()) != 0:
        raise RuntimeError(f"stage error flag {int(flag.item())}")
    return act.float().sum(dim=1)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm(a.double() - b.double()) / torch.linalg.vector_norm(b.double()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench/results/e4m3_precision_h200.json")
    ap.add_argument("--tokens", type=int, default=8)
    args = ap.parse_args()
    mod = kmod.get_module()
    if mod is None or not mod.decode_fp8_available():
        raise SystemExit("needs the kernels on an sm_89+ GPU")
    gen = torch.Generator(device="cuda").manual_seed(0)
    res: dict[str, Any] = {"benchmark": "e4m3_precision", "machine": machine_info(), "command": " ".join(sys.argv),
                           "metric": "relative L2 distance of the e4m3 w13 stage's result from the bf16 stage's",
                           "cases": []}
    for m in model_shapes():
        lay = RowLayout.for_expert(m["H"], m["I"], fmt="2bit")
        d = resident_layer(lay, args.tokens, m["k"], m["E"], gen)
        ids, slot_of, pool = d["ids"], d["slot_of"], d["pool"]
        for ratio in (0, 30, 100, 300, 1000, 3000, 10000):
            x = torch.randn(args.tokens, m["H"], device="cuda", generator=gen) * 0.3
            if ratio:
                x[:, 17] = 0.3 * ratio
            x = x.to(torch.bfloat16)
            r = rel(w13_act(mod, x, ids, pool, slot_of, lay, True), w13_act(mod, x, ids, pool, slot_of, lay, False))
            res["cases"].append({"model": m["name"], "outlier_ratio": ratio, "scale_spread_binades": 8, "rel": r})
            print(f"{m['name']:18s} outlier {ratio:6d}x: {r:.2e}", flush=True)
        wide = pool.clone()
        off, size = lay.w13_s_off, lay.w13_s_size
        wide[:, off:off + size] = torch.randint(100, 140, (wide.shape[0], size), dtype=torch.uint8, device="cuda",
                                                generator=gen)
        x = (torch.randn(args.tokens, m["H"], device="cuda", generator=gen) * 0.3).to(torch.bfloat16)
        r = rel(w13_act(mod, x, ids, wide, slot_of, lay, True), w13_act(mod, x, ids, wide, slot_of, lay, False))
        res["cases"].append({"model": m["name"], "outlier_ratio": 0, "scale_spread_binades": 40, "rel": r})
        print(f"{m['name']:18s} scales over 40 binades: {r:.2e}", flush=True)
        atomic_write_json(Path(args.out), res)


if __name__ == "__main__":
    main()

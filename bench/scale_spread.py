"""How often the int8 decode stages need their two-pass rounds, on weights quantized by the project's quantizer.

The int8 A operand (docs/KERNELS.md, "int8 A operand") carries each block's UE8M0 scale as a shift of at most 4
binades below the largest block of its row in a 512-weight round; a warp's round (16 rows x 512 weights) where some
row spans more takes a second pass. This quantizes synthetic expert rows of several weight distributions with
`quantize_2bit` and reports, per distribution, the share of row rounds and of warp rounds spanning more than 4
binades, and the largest span. CPU only.

    python3 bench/scale_spread.py --out bench/results/scale_spread_cpu.json
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moe_kernels import atomic_write_json  # noqa: E402
from moetplan.contract.machine import machine_info  # noqa: E402
from moetplan.runtime.format.format import quantize_2bit  # noqa: E402


def distributions(rows: int, cols: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    def t(dof: float) -> torch.Tensor:  # Student-t from normals and a chi-square (torch's sampler has no generator)
        z = torch.randn(rows, cols, generator=gen)
        chi2 = torch.randn(rows, cols, int(dof), generator=gen).pow(2).sum(-1)
        return z / torch.sqrt(chi2 / dof)

    lap = torch.rand(rows, cols, generator=gen) - 0.5
    return {
        "gauss": torch.randn(rows, cols, generator=gen),
        "laplace": -torch.sign(lap) * torch.log1p(-2 * lap.abs()),
        "student_t3": t(3),
        "student_t2": t(2),
        "gauss_x_lognormal_cols_0.5": torch.randn(rows, cols, generator=gen) * torch.exp(
            0.5 * torch.randn(1, cols, generator=gen)),
        "gauss_x_lognormal_cols_1.0": torch.randn(rows, cols, generator=gen) * torch.exp(
            torch.randn(1, cols, generator=gen)),
    }


def spread(w: torch.Tensor) -> dict[str, float]:
    _, scales = quantize_2bit(w)
    s = scales.to(torch.int32).view(w.shape[0], -1, 16)  # [rows, rounds, 16 blocks of 32]
    row_span = s.amax(-1) - s.amin(-1)
    warp_span = row_span.view(-1, 16, row_span.shape[1]).amax(1)  # 16 rows per warp round
    return {"row_rounds_over_4": float((row_span > 4).float().mean()),
            "warp_rounds_over_4": float((warp_span > 4).float().mean()),
            "largest_span": int(row_span.max())}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=1024)
    ap.add_argument("--cols", type=int, default=4096)
    ap.add_argument("--out", default="bench/results/scale_spread_cpu.json")
    args = ap.parse_args()
    gen = torch.Generator().manual_seed(0)
    res = {"benchmark": "int8 w13 stage: share of rounds spanning more than 4 binades", "machine": machine_info(),
           "command": " ".join(["python3"] + sys.argv), "rows": args.rows, "cols": args.cols,
           "distributions": {n: spread(w) for n, w in distributions(args.rows, args.cols, gen).items()}}
    for n, r in res["distributions"].items():
        print(f"{n:28s} warp rounds over 4 binades {100 * r['warp_rounds_over_4']:5.1f}%   "
              f"row rounds {100 * r['row_rounds_over_4']:5.1f}%   largest span {r['largest_span']}")
    atomic_write_json(Path(args.out), res)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

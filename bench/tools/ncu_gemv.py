"""Driver for Nsight Compute on the MoE stages: a few eager calls of one MoE layer at the given model
shape and token count, so that ncu has launches to profile: the decode stages at few tokens, the prefill stages
(`-k regex:prefill_stage`) at many.

    ncu --set full --clock-control none -k regex:gemv_stage --launch-skip 2 --launch-count 2 \
        -o gemv python3 bench/tools/ncu_gemv.py --model DeepSeek-V4-Flash --tokens 8
    ncu --set full --clock-control none -k regex:prefill_stage --launch-count 2 \
        -o prefill python3 bench/tools/ncu_gemv.py --tokens 8192 --calls 1
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench.moe_kernels import model_shapes, resident_layer  # noqa: E402
from moetplan.contract.runtime import KernelPolicy  # noqa: E402
from moetplan.runtime.op import ops  # noqa: E402
from moetplan.runtime.format.format import RowLayout  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="DeepSeek-V4-Flash")
    ap.add_argument("--tokens", type=int, default=8)
    ap.add_argument("--calls", type=int, default=3)
    ap.add_argument("--decode-kernel", default="auto", help="KernelPolicy.decode of the calls")
    ap.add_argument("--prefill-kernel", default="auto", help="KernelPolicy.prefill of the calls")
    args = ap.parse_args()
    policy = KernelPolicy(decode=args.decode_kernel, prefill=args.prefill_kernel)
    m = next(s for s in model_shapes() if s["name"] == args.model)
    gen = torch.Generator(device="cuda").manual_seed(0)
    lay = RowLayout.for_expert(m["H"], m["I"], fmt="2bit")
    d = resident_layer(lay, args.tokens, m["k"], m["E"], gen)
    ids, w, slot_of, pool = d["ids"], d["w"], d["slot_of"], d["pool"]
    x = (torch.randn(args.tokens, m["H"], device="cuda", generator=gen) * 0.3).to(torch.bfloat16)
    for _ in range(args.calls):
        ops.moe_forward(x, ids, w, pool, slot_of, lay, policy=policy)
    torch.cuda.synchronize()
    print(f"{args.model} T={args.tokens}: {d['used']} experts, {d['used'] * lay.payload_bytes / 1e6:.1f} MB, "
          f"weights={d['used'] * 3 * m['H'] * m['I']}")


if __name__ == "__main__":
    main()

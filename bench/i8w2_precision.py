"""How far the int8 w2 decode stage (KernelPolicy.i8_w2) moves a layer from the bf16 w2 stage's, on bench-like data (one GPU).

The int8 w2 stage reads the w13 stage's float32 intermediate as three int8 planes under a per-pair power-of-two
scale (xprep8), exact within 2^12 of the pair's largest element (within 2^-20 of it below); the bf16 w2 stage
reads it as bf16 hi + lo (~2^-16 of each element). Per model shape and token count, on the data bench/moe_kernels.py
times (Gaussian-like scale bytes, x ~ N(0, 0.3) in bf16, random routing): the intermediate's quantization error,
the w2 partial rows of both stages (worst pair), and the layer output of both against the float32 reference.

    PYTHONPATH=. python3 bench/i8w2_precision.py --out bench/results/i8w2_precision_h200.json
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
from moetplan.contract.runtime import KernelPolicy  # noqa: E402
from moetplan.runtime.op import ops  # noqa: E402
from moetplan.runtime.format.format import RowLayout  # noqa: E402
from moetplan.runtime.op.reference import expert_weights, moe_forward_reference  # noqa: E402


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    den = torch.linalg.vector_norm(b.double()).clamp_min(1e-300)
    return float(torch.linalg.vector_norm(a.double() - b.double()) / den)


def stages(mod, x, ids, pool, slot_of, lay, i8w2: bool) -> dict[str, torch.Tensor]:
    """The int8 w13 stage, then the w2 stage on the int8 planes (i8w2) or the bf16 hi/lo intermediate."""
    T, H = x.shape
    P, Ir, k = ids.numel(), lay.inter_per_rank, ids.shape[1]
    flag = torch.zeros(1, dtype=torch.int32, device="cuda")
    xp = torch.empty(T, 3, H, dtype=torch.int8, device="cuda")
    xinv = torch.empty(T, dtype=torch.float32, device="cuda")
    mod.xprep8(x, xp, xinv, None, False)
    act = (torch.empty(P, Ir, dtype=torch.float32, device="cuda") if i8w2 else
           torch.empty(P, 2, Ir, dtype=torch.bfloat16, device="cuda"))
    mod.gemv_stage(True, True, pool, slot_of, None, lay.w13_q_off, lay.w13_s_off, H, Ir, ids, k, xp, act,
                   None, None, None, None, 0.0, False, flag, False, xinv, -1, -1)
    out: dict[str, torch.Tensor] = {"act": act}
    b, inv = act, None
    if i8w2:
        b = torch.empty(P, 3, Ir, dtype=torch.int8, device="cuda")
        inv = torch.empty(P, dtype=torch.float32, device="cuda")
        mod.xprep8(act, b, inv, None, False)
        out.update(planes=b, inv=inv)
    partial = torch.empty(P, H, dtype=torch.float32, device="cuda")
    mod.gemv_stage(False, True, pool, slot_of, None, lay.w2_q_off, lay.w2_s_off, H, Ir, ids, k, b, None,
                   partial, None, None, None, 0.0, False, flag, False, inv, -1, -1)
    torch.cuda.synchronize()
    if int(flag.item()) != 0:
        raise RuntimeError(f"stage error flag {int(flag.item())}")
    out["partial"] = partial
    return out


def case(mod, m: dict[str, Any], T: int, gen: torch.Generator) -> dict[str, Any]:
    H, I, k, E = m["H"], m["I"], m["k"], m["E"]
    lay = RowLayout.for_expert(H, I, fmt="2bit")
    d = resident_layer(lay, T, k, E, gen)
    x = (torch.randn(T, H, device="cuda", generator=gen) * 0.3).to(torch.bfloat16)
    s8, s16 = (stages(mod, x, d["ids"], d["pool"], d["slot_of"], lay, f) for f in (True, False))
    act = s8["act"]  # float32 [P, Ir], natural order
    act16 = s16["act"].float().sum(dim=1)  # hi + lo, in the w2 stage's order: compare as sorted rows
    q = s8["planes"].float()
    deq = (q[:, 0] + q[:, 1] / 128 + q[:, 2] / 16384) * s8["inv"][:, None]
    amax = act.abs().amax(dim=1)
    quant_err = ((deq.sort(dim=1).values - act.sort(dim=1).values).abs().amax(dim=1) / amax.clamp_min(1e-30))
    per_pair = [rel(a, b) for a, b in zip(s8["partial"], s16["partial"])]
    worst = max(range(len(per_pair)), key=per_pair.__getitem__)
    res: dict[str, Any] = {
        "model": m["name"], "tokens": T, "pairs": int(d["ids"].numel()),
        "act_f32_vs_bf16_hilo_sorted": rel(act.sort(dim=1).values, act16.sort(dim=1).values),
        "planes_max_err_over_pair_max": float(quant_err.max()),
        "act_max_over_rms": float((amax / act.pow(2).mean(dim=1).sqrt().clamp_min(1e-30)).max()),
        "partial_rel_err_i8_vs_bf16": {"all": rel(s8["partial"], s16["partial"]), "worst_pair": per_pair[worst],
                                       "worst_pair_index": worst},
    }
    outs = {}
    for name, flag in (("i8w2", True), ("bf16w2", False)):
        outs[name] = ops.moe_forward(x, d["ids"], d["w"], d["pool"], d["slot_of"], lay,
                                     policy=KernelPolicy(decode="gemv", i8_w2=flag))
    ref = moe_forward_reference(x.float(), d["ids"], d["w"], d["pool"], d["slot_of"], lay)
    res["out_rel_err_vs_fp32_reference"] = {n: rel(o.float(), ref) for n, o in outs.items()}
    res["out_rel_i8w2_vs_bf16w2"] = rel(outs["i8w2"].float(), outs["bf16w2"].float())
    return res


def diagnose(mod, m: dict[str, Any], T: int, seed: int, scales: str) -> dict[str, Any]:
    """Where the int8 w2 stage's partial rows leave the float64 product of the dequantized W2 and the float32
    intermediate: per bad row, its position in the 16-row tile and its round's scale bytes."""
    import moe_kernels as kb
    kb.SCALES = scales
    gen = torch.Generator(device="cuda").manual_seed(seed)
    H, I, k, E = m["H"], m["I"], m["k"], m["E"]
    lay = RowLayout.for_expert(H, I, fmt="2bit")
    d = resident_layer(lay, T, k, E, gen)
    x = (torch.randn(T, H, device="cuda", generator=gen) * 0.3).to(torch.bfloat16)
    s8, s16 = (stages(mod, x, d["ids"], d["pool"], d["slot_of"], lay, f) for f in (True, False))
    kb.SCALES = "gauss"
    flat = d["ids"].reshape(-1).long()
    bad_rows, worst = [], None
    errs8, errs16 = [], []
    for p in range(flat.numel()):
        slot = int(d["slot_of"][flat[p]])
        _, w2 = expert_weights(d["pool"][slot], lay)
        emul = (w2.double() @ s8["act"][p].double())
        rms = emul.pow(2).mean().sqrt()
        e8 = (s8["partial"][p].double() - emul).abs() / rms
        e16 = (s16["partial"][p].double() - emul).abs() / rms
        errs8.append(float(e8.max()))
        errs16.append(float(e16.max()))
        rows = torch.nonzero(e8 > 1e-3).flatten().tolist()
        s_off = lay.w2_s_off
        for h in rows[:64]:
            sc = d["pool"][slot, s_off + h * (I // 32): s_off + (h + 1) * (I // 32)].tolist()
            bad_rows.append(dict(pair=p, row=h, row_in_tile=h % 16, err=float(e8[h]), scale_bytes=sc))
        if rows and (worst is None or float(e8.max()) > worst["err"]):
            worst = dict(pair=p, err=float(e8.max()), bad_rows=len(rows))
    return dict(model=m["name"], tokens=T, seed=seed, scales=scales, max_err_i8=max(errs8), max_err_bf16=max(errs16),
                n_bad_rows=len(bad_rows), worst=worst, bad_rows=bad_rows[:24],
                row_in_tile_hist=torch.bincount(torch.tensor([b["row_in_tile"] for b in bad_rows] or [0]),
                                                minlength=16).tolist())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench/results/i8w2_precision_h200.json")
    ap.add_argument("--tokens", default="1,2,4,8")
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--diagnose", action="store_true", help="locate the rows where the int8 w2 stage is off")
    args = ap.parse_args()
    mod = kmod.get_module()
    if mod is None or not mod.decode_i8_available():
        raise SystemExit("needs the kernels on an sm_90+ GPU (the int8 stages run on the TMA ring)")
    if args.diagnose:
        m = model_shapes()[0]
        res = [diagnose(mod, m, 1, 0, sc) for sc in ("gauss", "uniform")]
        for r in res:
            print({k: v for k, v in r.items() if k != "bad_rows"}, flush=True)
            for b in r["bad_rows"][:6]:
                print("  ", b, flush=True)
        atomic_write_json(Path(args.out), {"benchmark": "i8w2_precision --diagnose", "machine": machine_info(),
                                           "cases": res})
        return
    cases = []
    for seed in range(args.seeds):
        gen = torch.Generator(device="cuda").manual_seed(seed)
        for m in model_shapes():
            for T in (int(t) for t in args.tokens.split(",")):
                r = dict(case(mod, m, T, gen), seed=seed)
                print(r, flush=True)
                cases.append(r)
    atomic_write_json(Path(args.out), {"benchmark": "i8w2_precision", "machine": machine_info(),
                                       "command": " ".join(sys.argv), "cases": cases})


if __name__ == "__main__":
    main()

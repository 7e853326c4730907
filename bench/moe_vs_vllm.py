"""moetplan's routed-expert op against vLLM's own MoE kernels, at the same routing and shapes, on one CUDA GPU.

Per model shape (DeepSeek-V4-Flash and GLM-5.2 from hwdb: hidden, expert FFN, top-k, experts, MoE layers) and
decode step size (1, 4, 16 tokens), every backend runs the same routed step of all MoE layers back to back in one
CUDA graph (eager where a backend cannot be captured; the result says which), each layer with its own routing and
its weights taken from enough copies that the step's bytes come from DRAM, not the L2:

  moetplan_2bit     moetplan.runtime.op.ops.moe_forward, 2-bit rows (docs/FORMAT.md), the default kernel policy;
  vllm_triton_bf16  vLLM's fused_experts (Triton fused_moe), bf16 weights: what an unquantized checkpoint runs;
  vllm_marlin_w4a16 vLLM's fused_marlin_moe, GPTQ int4 (uint4b8) weights, group 128 bf16 scales: a w4a16 checkpoint;
  vllm_marlin_mxfp4 vLLM's fused_marlin_moe, FP4 e2m1 weights, group 32 e8m0 scales: what stock vLLM 0.26 runs for
                    DeepSeek-V4-Flash's MXFP4 experts on sm_90 (its MXFP4 oracle falls through to Marlin there);
  vllm_wna16_2bit   vLLM's 2-bit WNA16 MoE (the Humming backend, package humming-kernels) when it is installed,
                    else recorded as skipped with the reason.

Weights are random (the kernels' time does not depend on the values); each backend's bytes/s counts the weight
bytes its routed experts hold in its own format (codes + scales), so the figures compare how fast each reads what
it must. No swiglu clamp on any backend (DeepSeek-V4's limit is a few ALU ops per element).

    PYTHONPATH=. python3 bench/moe_vs_vllm.py --out bench/results/moe_vs_vllm_h200.json [--tokens 1,4,16]
"""
from __future__ import annotations

import argparse
import importlib.util
import math
import sys
import traceback
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.moe_kernels import GIB, atomic_write_json, capture, machine_info, random_pool, time_events  # noqa: E402
from moetplan.contract.layout import RowLayout  # noqa: E402
from moetplan.contract.runtime import KernelPolicy  # noqa: E402
from moetplan.runtime.op import ops  # noqa: E402

MODELS = ("deepseek-v4-flash", "glm-5.2")
# Weight copies per backend: enough that one step's weights total at least this much (the H200's L2 is 60 MB).
MIN_DISTINCT_BYTES = 4 * GIB


def shapes(names: list[str]) -> list[dict[str, Any]]:
    from moetplan import hwdb

    out = []
    for n in names:
        s = hwdb.model_spec(n)
        out.append(dict(name=s.name, id=n, H=s.hidden_size, I=s.moe_intermediate_size, k=s.top_k,
                        E=s.n_routed_experts, L=s.moe_layers))
    return out


def routings(T: int, k: int, E: int, L: int, gen: torch.Generator) -> list[tuple[torch.Tensor, torch.Tensor]]:
    out = []
    for _ in range(L):
        w, ids = torch.rand(T, E, device="cuda", generator=gen).topk(k, dim=-1)
        out.append((ids.to(torch.int32), torch.softmax(w, dim=-1).float()))
    return out


def copies(bytes_per_copy: int) -> int:
    return max(1, math.ceil(MIN_DISTINCT_BYTES / max(bytes_per_copy, 1)))


# ------------------------------------------------------------------------------------------------ backends
# Each maker returns (step_fn(x, ids, w, layer) -> out, expert_bytes, notes) for one model shape.


def make_moetplan(m: dict[str, Any], gen: torch.Generator):
    lay = RowLayout.for_expert(m["H"], m["I"], fmt="2bit")
    n = copies(m["E"] * lay.stride)
    pools = [random_pool(lay, m["E"], gen) for _ in range(n)]
    slot_of = torch.arange(m["E"], dtype=torch.int32, device="cuda")
    policy = KernelPolicy(check_residency=False)  # inside a graph the check is skipped anyway

    def step(x, ids, w, li):
        return ops.moe_forward(x, ids, w, pools[li % n], slot_of, lay, policy=policy)

    return step, lay.payload_bytes, {"format": "moetplan 2-bit rows", "row_bytes": lay.stride, "copies": n}


def make_triton_bf16(m: dict[str, Any], gen: torch.Generator):
    from vllm.model_executor.layers.fused_moe.fused_moe import fused_experts

    H, I, E = m["H"], m["I"], m["E"]
    per = E * 3 * H * I * 2
    n = copies(per)
    ws = [(torch.randn(E, 2 * I, H, device="cuda", dtype=torch.bfloat16, generator=gen).mul_(0.02),
           torch.randn(E, H, I, device="cuda", dtype=torch.bfloat16, generator=gen).mul_(0.02)) for _ in range(n)]

    def step(x, ids, w, li):
        w1, w2 = ws[li % n]
        return fused_experts(x, w1, w2, w, ids)

    return step, 3 * H * I * 2, {"format": "bf16", "copies": n}


def _marlin(m: dict[str, Any], gen: torch.Generator, kind: str):
    from vllm.model_executor.layers.fused_moe.experts.marlin_moe import fused_marlin_moe
    from vllm.scalar_type import scalar_types

    H, I, E = m["H"], m["I"], m["E"]
    if kind == "w4a16":
        qtype, group, sdtype = scalar_types.uint4b8, 128, torch.bfloat16
    else:
        qtype, group, sdtype = scalar_types.float4_e2m1f, 32, torch.float8_e8m0fnu
    # Marlin's packed layouts (vLLM marlin_moe: w1 [E, K/16, 2N*2], w2 [E, N/16, 2K] int32 for 4 bits), scales
    # [E, K/group, 2N] and [E, N/group, K].
    code_bytes = 3 * H * I // 2
    scale_bytes = (H // group * 2 * I + I // group * H) * (2 if sdtype == torch.bfloat16 else 1)
    n = copies(E * (code_bytes + scale_bytes))

    def scales(shape):
        if sdtype == torch.bfloat16:
            return (torch.rand(*shape, device="cuda", generator=gen) * 0.01 + 0.005).to(torch.bfloat16)
        raw = torch.randint(118, 124, shape, device="cuda", generator=gen, dtype=torch.uint8)
        return raw.view(torch.float8_e8m0fnu)

    ws = []
    for _ in range(n):
        w1 = torch.randint(-2**31, 2**31 - 1, (E, H // 16, 4 * I), device="cuda", dtype=torch.int32, generator=gen)
        w2 = torch.randint(-2**31, 2**31 - 1, (E, I // 16, 2 * H), device="cuda", dtype=torch.int32, generator=gen)
        ws.append((w1, w2, scales((E, H // group, 2 * I)), scales((E, I // group, H))))

    def step(x, ids, w, li):
        w1, w2, s1, s2 = ws[li % n]
        return fused_marlin_moe(x, w1, w2, None, None, s1, s2, w, ids, quant_type_id=qtype.id)

    return step, code_bytes + scale_bytes, {"format": f"{qtype} group {group}", "copies": n}


def make_marlin_w4a16(m, gen):
    return _marlin(m, gen, "w4a16")


def make_marlin_mxfp4(m, gen):
    return _marlin(m, gen, "mxfp4")


def make_wna16_2bit(m, gen):
    if importlib.util.find_spec("humming") is None and importlib.util.find_spec("humming_kernels") is None:
        raise SkipBackend("vLLM 0.26's 2-bit WNA16 MoE is the Humming backend (experts/fused_humming_moe.py), "
                          "which needs the humming-kernels package; it is not in the carried wheel set")
    raise SkipBackend("humming-kernels is installed but this bench has no driver for it yet")


class SkipBackend(Exception):
    pass


BACKENDS: dict[str, Callable] = {
    "moetplan_2bit": make_moetplan,
    "vllm_triton_bf16": make_triton_bf16,
    "vllm_marlin_w4a16": make_marlin_w4a16,
    "vllm_marlin_mxfp4": make_marlin_mxfp4,
    "vllm_wna16_2bit": make_wna16_2bit,
}


# ------------------------------------------------------------------------------------------------ timing


def time_backend(step, expert_bytes: int, m: dict[str, Any], T: int, routes, x, reps: int) -> dict[str, Any]:
    L = m["L"]
    outs: list[torch.Tensor | None] = [None]

    def run_step():
        for li in range(L):
            ids, w = routes[li]
            outs[0] = step(x, ids, w, li)

    used = [int(torch.unique(routes[li][0]).numel()) for li in range(L)]
    bytes_step = sum(used) * expert_bytes
    res: dict[str, Any] = {"tokens": T, "experts_read_per_layer": sum(used) / L, "bytes_per_layer": bytes_step / L}
    run_step()
    torch.cuda.synchronize()
    try:
        g = capture(run_step)
        t = time_events(g.replay, reps=reps)
        res["timed"] = "cuda_graph"
        del g
    except Exception as e:  # noqa: BLE001 - a backend that cannot be captured is timed eagerly, and says so
        torch.cuda.synchronize()
        res["graph_error"] = f"{type(e).__name__}: {str(e)[:200]}"
        t = time_events(run_step, reps=reps)
        res["timed"] = "eager"
    res.update(step_ms=t["median_ms"], min_ms=t["min_ms"], per_layer_us=t["median_ms"] * 1e3 / L,
               gbps=bytes_step / (t["median_ms"] * 1e-3) / 1e9)
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=Path("bench/results/moe_vs_vllm_h200.json"))
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--tokens", default="1,4,16")
    ap.add_argument("--backends", default=",".join(BACKENDS))
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("moe_vs_vllm needs a CUDA GPU", file=sys.stderr)
        return 2
    try:
        import vllm
        vllm_version = vllm.__version__
    except Exception as e:  # noqa: BLE001
        vllm_version = f"not importable: {e}"
    tokens = [int(t) for t in args.tokens.split(",") if t]
    doc: dict[str, Any] = {"machine": machine_info(), "vllm": vllm_version, "command": " ".join(sys.argv),
                           "tokens": tokens, "models": {}, "skipped": {}}
    gen = torch.Generator(device="cuda").manual_seed(0)
    try:  # vLLM's MoE entry points read the current config (chunk sizes, kernel options); give them the default
        from vllm.config import VllmConfig, set_current_vllm_config
        ctx = set_current_vllm_config(VllmConfig())
        ctx.__enter__()
    except Exception as e:  # noqa: BLE001 - the moetplan backend needs no vLLM
        doc["vllm_config"] = f"default config not set: {type(e).__name__}: {e}"
    for m in shapes([s for s in args.models.split(",") if s]):
        entry = doc["models"][m["name"]] = {"shape": m, "backends": {}}
        # One routing per (T, layer), shared by every backend.
        routes = {T: routings(T, m["k"], m["E"], m["L"], gen) for T in tokens}
        xs = {T: (torch.randn(T, m["H"], device="cuda", generator=gen) * 0.3).to(torch.bfloat16) for T in tokens}
        for name in [b for b in args.backends.split(",") if b]:
            try:
                step, expert_bytes, notes = BACKENDS[name](m, gen)
            except SkipBackend as e:
                doc["skipped"][name] = str(e)
                continue
            except Exception as e:  # noqa: BLE001 - keep the other backends' numbers
                entry["backends"][name] = {"error": f"{type(e).__name__}: {str(e)[:400]}",
                                           "trace": traceback.format_exc()[-1500:]}
                print(f"{m['name']} {name}: setup failed: {e}", flush=True)
                continue
            b = entry["backends"][name] = {**notes, "expert_bytes": expert_bytes, "cases": {}}
            for T in tokens:
                try:
                    r = time_backend(step, expert_bytes, m, T, routes[T], xs[T], args.reps)
                except Exception as e:  # noqa: BLE001
                    r = {"error": f"{type(e).__name__}: {str(e)[:400]}"}
                b["cases"][str(T)] = r
                print(f"{m['name']:18s} {name:18s} T={T:3d} " + (
                    f"{r['per_layer_us']:8.1f} us/layer {r['gbps']:7.0f} GB/s ({r['timed']})" if "error" not in r
                    else r["error"]), flush=True)
            del step
            torch.cuda.empty_cache()
            atomic_write_json(args.out, doc)
        # Speed-ups of the 2-bit op over each vLLM backend (per-layer time ratio).
        ours = entry["backends"].get("moetplan_2bit", {}).get("cases", {})
        entry["moetplan_speedup"] = {
            n: {T: round(v["cases"][T]["per_layer_us"] and ours[T]["per_layer_us"] and
                         v["cases"][T]["per_layer_us"] / ours[T]["per_layer_us"], 3)
                for T in v.get("cases", {}) if "per_layer_us" in v["cases"][T] and "per_layer_us" in ours.get(T, {})}
            for n, v in entry["backends"].items() if n != "moetplan_2bit"}
        atomic_write_json(args.out, doc)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

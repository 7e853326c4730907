"""Kernel benchmark: MoE decode and prefill through moetplan.runtime.op.ops on one CUDA GPU.

In one run:
  1. the device's streaming-read bandwidth: a large torch.sum over several GB, and a CUDA graph of back-to-back
     sums over 40 MiB slices of a larger buffer;
  2. decode at 1, 2, 4, 8 tokens for the DeepSeek-V4-Flash, GLM-5.2 and Kimi-K2.7-Code expert shapes: all MoE
     layers of a step back to back in one CUDA graph, every layer with its own expert rows (cycled over enough
     distinct layers that the data is many times the L2), bytes read, bandwidth as a share of (1); plus the naive
     torch bf16 baseline (gather + einsum) and the torch 2-bit reference on the same routing;
  3. prefill tokens/s at 512..8192-token chunks against a torch bf16 grouped matmul over the same experts.

    PYTHONPATH=. python3 bench/moe_kernels.py --out bench/results/kernels_h200.json [--quick]

Results are written (atomically) after every section, so a run cut short keeps what it measured.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moetplan.contract.runtime import KernelPolicy  # noqa: E402
from moetplan.runtime.op import cuda_paths, kernels, ops  # noqa: E402
from moetplan.runtime.op.reference import moe_forward_reference  # noqa: E402
from moetplan.runtime.format.format import RowLayout  # noqa: E402

GIB = 1024**3
MIB = 1024**2


def model_shapes() -> list[dict[str, Any]]:
    """Expert geometry per model: from hwdb when its loader exists, else this table (copied from
    hwdb/sources/models.yaml: hidden_size, moe_intermediate_size, num_experts_per_tok, n_routed_experts,
    moe_layers)."""
    names = {"deepseek-v4-flash": "DeepSeek-V4-Flash", "glm-5.2": "GLM-5.2", "kimi-k2.7-code": "Kimi-K2.7-Code"}
    try:  # pragma: no cover - depends on the hwdb loader landing
        from moetplan.models import hwdb_models  # type: ignore

        out = []
        for mid, name in names.items():
            s = hwdb_models.model_spec(mid)
            out.append(dict(name=name, H=s.hidden_size, I=s.moe_intermediate_size, k=s.num_experts_per_tok,
                            E=s.n_routed_experts, L=s.moe_layers, source="hwdb"))
        return out
    except Exception:
        table = [  # source: hwdb/sources/models.yaml (fallback table, used when the hwdb loader is absent)
            dict(name="DeepSeek-V4-Flash", H=4096, I=2048, k=6, E=256, L=43),
            dict(name="GLM-5.2", H=6144, I=2048, k=8, E=256, L=75),
            dict(name="Kimi-K2.7-Code", H=7168, I=2048, k=8, E=384, L=60),
        ]
        return [dict(t, source="bench table (models.yaml)") for t in table]


# ------------------------------------------------------------------------------------------------ helpers


def atomic_write_json(path: Path, obj: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2))
    os.replace(tmp, path)


def machine_info() -> dict[str, Any]:
    p = torch.cuda.get_device_properties(0)
    info: dict[str, Any] = {
        "gpu": p.name, "sm_count": p.multi_processor_count, "capability": f"{p.major}.{p.minor}",
        "memory_gib": round(p.total_memory / GIB, 1), "l2_mib": round(getattr(p, "L2_cache_size", 0) / MIB, 1),
        "torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
        "host": platform.node(), "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    try:
        q = "driver_version,clocks.sm,clocks.max.sm,clocks.mem,power.limit"
        info["nvidia_smi"] = subprocess.run(["nvidia-smi", f"--query-gpu={q}", "--format=csv,noheader"],
                                            capture_output=True, text=True, timeout=10).stdout.strip()
    except Exception as e:  # pragma: no cover
        info["nvidia_smi"] = f"unavailable: {e}"
    return info


def time_events(fn: Callable[[], None], reps: int, warmup: int = 3) -> dict[str, float]:
    """Median / min milliseconds of `fn` over `reps` event-timed runs."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b))
    ts.sort()
    return {"median_ms": ts[len(ts) // 2], "min_ms": ts[0], "reps": reps}


def capture(fn: Callable[[], None]) -> torch.cuda.CUDAGraph:
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()  # warm-up: allocations and lazy init outside the graph
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g


# How the benchmark's scale bytes are drawn (--scales). "gauss" (the default): the UE8M0 exponent of the largest
# |w| of 32 standard-normal weights per block, what the quantizer gives Gaussian rows (within a 512-weight round the
# blocks span at most 2-3 binades; heavier tails: bench/scale_spread.py). "uniform": every block independently
# uniform over 8 binades (116..123). The bf16 decode is data-independent, but the int8 stages take a second pass
# over a round whose rows span more than 4 binades, which "uniform" makes almost every round.
SCALES = "gauss"


def random_scales(n: int, size: int, gen: torch.Generator) -> torch.Tensor:
    if SCALES == "gauss":
        # max |N(0, 1)| of 32 draws by its inverse CDF: P(max <= a) = (2 Phi(a) - 1)^32. In float64: in float32
        # u^(1/32) rounds to 1 for u above ~1 - 2e-6, ndtri(1) is inf, and such blocks would get byte 140 (the
        # clamp), 19 binades above their row.
        u = torch.rand(n, size, device=gen.device, generator=gen, dtype=torch.float64).clamp_(1e-12, 1 - 1e-7)
        amax = torch.special.ndtri((u.pow(1 / 32) + 1) / 2)
        return (120 + torch.floor(torch.log2(amax))).clamp_(100, 140).to(torch.uint8)
    return torch.randint(116, 124, (n, size), dtype=torch.uint8, device=gen.device, generator=gen)


def random_pool(layout: RowLayout, n: int, gen: torch.Generator) -> torch.Tensor:
    """Random codes (every byte is a valid code) with scale bytes drawn as SCALES says; random, never zeros."""
    pool = torch.randint(0, 256, (n, layout.stride), dtype=torch.uint8, device="cuda", generator=gen)
    for name in ("w13_s", "w2_s"):
        off, size = getattr(layout, f"{name}_off"), getattr(layout, f"{name}_size")
        pool[:, off:off + size] = random_scales(n, size, gen)
    return pool


def routing(T: int, k: int, E: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    scores = torch.rand(T, E, device="cuda", generator=gen)
    w, ids = scores.topk(k, dim=-1)
    return ids, torch.softmax(w, dim=-1).float()


def resident_layer(lay: RowLayout, T: int, k: int, E: int, gen: torch.Generator) -> dict[str, Any]:
    """One layer of a step: a routing of T tokens and a slot pool holding exactly the experts it uses."""
    ids, w = routing(T, k, E, gen)
    used = torch.unique(ids)
    slot_of = torch.full((E,), -1, dtype=torch.int32, device="cuda")
    slot_of[used] = torch.arange(len(used), dtype=torch.int32, device="cuda")
    return dict(ids=ids, w=w, slot_of=slot_of, pool=random_pool(lay, len(used), gen), used=len(used))


# ------------------------------------------------------------------------------------------------ 1. bandwidth


def read_bandwidth(quick: bool) -> dict[str, Any]:
    n_bytes = (4 if quick else 8) * GIB
    buf = torch.rand(n_bytes // 4, device="cuda", dtype=torch.float32)
    out = torch.empty((), device="cuda")
    t = time_events(lambda: torch.sum(buf, dim=0, out=out), reps=10)  # noqa: F821 (runs before the del below)
    big = {"bytes": n_bytes, **t, "gbps": n_bytes / (t["median_ms"] * 1e-3) / 1e9}
    # Graph of back-to-back 40 MiB slice sums: the access pattern of a decode step (many medium reads).
    sl = 40 * MIB // 4
    nsl = buf.numel() // sl
    outs = torch.empty(nsl, device="cuda")

    def slices():
        for i in range(nsl):
            torch.sum(buf[i * sl:(i + 1) * sl], dim=0, out=outs[i])  # noqa: F821 (runs before the del below)

    g = capture(slices)
    t2 = time_events(g.replay, reps=10)
    sliced = {"slices": nsl, "slice_bytes": sl * 4, **t2,
              "gbps": nsl * sl * 4 / (t2["median_ms"] * 1e-3) / 1e9}
    del buf
    torch.cuda.empty_cache()
    return {"large_sum": big, "graph_40mib_slices": sliced, "reference_gbps": max(big["gbps"], sliced["gbps"])}


# ------------------------------------------------------------------------------------------------ 2. decode


def decode_case(m: dict[str, Any], T: int, ref_gbps: float, gen: torch.Generator, quick: bool,
                decode_kernels: tuple[str, ...] = ("gemv", "mma", "rowdot"), baselines: bool = True) -> dict[str, Any]:
    H, I, k, E, L = m["H"], m["I"], m["k"], m["E"], m["L"]
    lay = RowLayout.for_expert(H, I, fmt="2bit")
    # Distinct data per layer, cycled over NL layers whose rows total >= 6 GiB (100x the H200's L2).
    probe_ids = [routing(T, k, E, gen) for _ in range(4)]
    used_avg = sum(len(torch.unique(i)) for i, _ in probe_ids) / 4
    per_layer = used_avg * lay.stride
    NL = int(min(L, max(4, math.ceil((3 if quick else 6) * GIB / per_layer))))
    layers = [resident_layer(lay, T, k, E, gen) for _ in range(NL)]
    x = (torch.randn(T, H, device="cuda", generator=gen) * 0.3).to(torch.bfloat16)
    outs = [torch.empty_like(x) for _ in range(NL)]

    # "+l2": the same steps with every routed expert of a layer read from that layer's slot 0, so the stages run
    # the same units and instructions while their rows come from the L2 (one expert per layer, ~7-14 MB): how fast
    # the stages decode when memory is not what they wait for. Its share is of the bytes the real step reads.
    l2_layers = [dict(d, slot_of=torch.where(d["slot_of"] >= 0, 0, -1).to(torch.int32)) for d in layers]

    def make_step(src: list[dict[str, Any]], policy: KernelPolicy) -> Callable[[], None]:
        def step():
            for li in range(L):
                d = src[li % NL]
                ops.moe_forward(x, d["ids"], d["w"], d["pool"], d["slot_of"], lay, out=outs[li % NL], policy=policy)
        return step

    bytes_step = sum(layers[li % NL]["used"] for li in range(L)) * lay.payload_bytes
    res: dict[str, Any] = {
        "model": m["name"], "tokens": T, "layers_in_step": L, "distinct_layers": NL,
        "experts_read_per_layer": bytes_step / L / lay.payload_bytes, "bytes_per_layer": bytes_step / L,
    }
    # How the default gemv stages spread this step's units over warps (balanced or plain, blocks, the longest
    # warp's rounds), for the stage forms bf16 x takes here (the int8 stages have their own bound, gemv_plan_for).
    mod = kernels.get_module()
    if hasattr(mod, "gemv_plan"):
        P = T * k
        xb = torch.empty(0, dtype=torch.bfloat16)  # use_i8_* look at x's dtype only
        default = KernelPolicy()
        i8 = {True: cuda_paths.use_i8_w13(mod, xb, H, default), False: cuda_paths.use_i8_w2(mod, xb, H, I, default)}

        def plan(w13: bool, mode: int) -> dict[str, Any]:
            K, units = (H, P * I // 8) if w13 else (I, P * H // 16)
            got = mod.gemv_plan(w13, not w13 or i8[w13], False, K, units, mode, -1, i8[w13])
            return {**dict(zip(("balanced", "blocks", "rounds"), got)), "int8": i8[w13]}

        res["gemv_plan"] = {"w13": plan(True, -1), "w2": plan(False, -1),
                            "w13_plain": plan(True, 0), "w2_plain": plan(False, 0)}
    if hasattr(mod, "gemv_ring"):  # the ring the default gemv stages take (TMA on sm_90+ for K % 512 == 0)
        res["gemv_ring"] = {"w13": mod.gemv_ring(H), "w2": mod.gemv_ring(I)}
    # The same step per decode kernel (KernelPolicy.decode), each with and without programmatic dependent
    # launch between the op's kernels (sm_90+); outputs of layer 0 are compared across the variants.
    variants: dict[str, Any] = {}
    outs0: dict[str, torch.Tensor] = {}
    d0 = layers[0]
    for i, dk in enumerate(decode_kernels):
        base, *suffixes = dk.split("+")
        src = l2_layers if "l2" in suffixes else layers
        policy = decode_policy(dk)
        # Both launch modes for the headline kernel; the others with the default (PDL on sm_90+).
        for pdl_name, pdl in ((("pdl", True), ("no_pdl", False)) if i == 0 else (("pdl", True),)):
            name = f"{dk}_{pdl_name}"
            pol = dataclasses.replace(policy, pdl=pdl)
            try:
                o = ops.moe_forward(x, src[0]["ids"], src[0]["w"], src[0]["pool"], src[0]["slot_of"], lay, policy=pol)
                torch.cuda.synchronize()
                g = capture(make_step(src, pol))
                t = time_events(g.replay, reps=5 if quick else 10)
                del g
            except Exception as e:  # noqa: BLE001 - keep the other variants' numbers
                variants[name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
                continue
            if src is layers:  # "+l2" computes other weights: not compared
                outs0[name] = o
            variants[name] = {"decode_kernel": dk, "policy": pol.describe(), "pdl": pdl, "step_ms": t["median_ms"],
                              "min_ms": t["min_ms"], "per_layer_us": t["median_ms"] * 1e3 / L,
                              "gbps": bytes_step / (t["median_ms"] * 1e-3) / 1e9,
                              "share_of_read_bw": bytes_step / (t["median_ms"] * 1e-3) / 1e9 / ref_gbps}
    # Deterministic across launch modes (bit-identical), and the decode kernels agree with each other and with
    # the float32 torch reference on layer 0.
    res["pdl_equals_no_pdl"] = {dk: bool(torch.equal(outs0[f"{dk}_pdl"], outs0[f"{dk}_no_pdl"]))
                                for dk in decode_kernels if f"{dk}_pdl" in outs0 and f"{dk}_no_pdl" in outs0}
    ref0 = moe_forward_reference(x.float(), d0["ids"], d0["w"], d0["pool"], d0["slot_of"], lay)
    res["rel_err_vs_fp32_reference"] = {
        n: float(torch.linalg.vector_norm(o.double() - ref0.double()) / torch.linalg.vector_norm(ref0.double()))
        for n, o in outs0.items()}
    ok = {n: v for n, v in variants.items() if "error" not in v}
    if not ok:
        res.update(variants=variants, error="every decode variant failed")
        return res
    # The headline figure is the default decode kernel's best launch mode; every variant is kept.
    default = [n for n in ok if n in (f"{decode_kernels[0]}_pdl", f"{decode_kernels[0]}_no_pdl")] or \
        [n for n in ok if "+l2" not in n] or list(ok)
    best = min(default, key=lambda n: ok[n]["step_ms"])
    res.update(ok[best], variant=best, variants=variants)
    if not baselines:
        return res
    # Torch 2-bit reference (dequantize + fp32 matmul), eager, a few layers.
    nref = min(NL, 3)

    def ref_layers():
        for li in range(nref):
            d = layers[li]  # noqa: F821 (runs before the del below)
            moe_forward_reference(x, d["ids"], d["w"], d["pool"], d["slot_of"], lay, out=outs[li])

    tr = time_events(ref_layers, reps=2, warmup=1)
    res["torch_2bit_reference_per_layer_us"] = tr["median_ms"] * 1e3 / nref
    # Naive bf16: gather the routed experts' bf16 weights and einsum (the FACTS.md baseline).
    nb = int(min(L, max(2, math.ceil((6 if quick else 12) * GIB / (used_avg * 3 * H * I * 2)))))
    bl = []
    for li in range(nb):
        d = layers[li % NL]
        bl.append(dict(
            w13=torch.randn(d["used"], 2 * I, H, device="cuda", generator=gen, dtype=torch.bfloat16).mul_(0.02),
            w2=torch.randn(d["used"], H, I, device="cuda", generator=gen, dtype=torch.bfloat16).mul_(0.02),
            idx=d["slot_of"][d["ids"]].long(), w=d["w"], used=d["used"]))

    def naive_step():
        for li in range(L):
            d = bl[li % nb]  # noqa: F821 (runs before the del below)
            w13 = d["w13"][d["idx"]]  # [T, k, 2I, H]
            h = torch.einsum("th,tkih->tki", x, w13)
            a = torch.nn.functional.silu(h[..., :I]) * h[..., I:]
            y = torch.einsum("tki,tkhi->tkh", a, d["w2"][d["idx"]])
            outs[0].copy_(torch.einsum("tk,tkh->th", d["w"].to(y.dtype), y))

    try:
        gn = capture(naive_step)
        tn = time_events(gn.replay, reps=3 if quick else 5)
        bf16_bytes = sum(bl[li % nb]["used"] for li in range(L)) * 3 * H * I * 2
        res["naive_bf16"] = {"per_layer_us": tn["median_ms"] * 1e3 / L,
                             "effective_gbps": bf16_bytes / (tn["median_ms"] * 1e-3) / 1e9,
                             "distinct_layers": nb}
        del gn
    except torch.OutOfMemoryError as e:  # pragma: no cover
        res["naive_bf16"] = {"error": str(e)[:200]}
    del bl, layers
    torch.cuda.empty_cache()
    return res


def decode_policy(variant: str) -> KernelPolicy:
    """A decode variant name -> its policy. Suffixes: "+fused" the per-token sum folded into the w2 launch;
    "+e4m3" / "+bf16" the w13 stage's A operand (e4m3 / bf16; "+bf16" both stages), "+i8" the int8 one;
    "+i8w2" / "+bf16w2" the int8 w13 stage with the w2 stage's int8 / bf16 operand; "+plain" / "+balanced" how
    the gemv stages spread units over warps; "+cp.async" / "+tma" the gemv stages' ring; "+l2" (rows from the L2)
    changes the data, not the policy. Without one, the defaults."""
    base, *suffixes = variant.split("+")
    d = KernelPolicy()
    return KernelPolicy(
        decode=base, fused_combine="fused" in suffixes,
        e4m3_decode=True if "e4m3" in suffixes else False if "bf16" in suffixes else d.e4m3_decode,
        i8_decode=True if {"i8", "i8w2", "bf16w2"} & set(suffixes) else False if "bf16" in suffixes else d.i8_decode,
        i8_w2=True if "i8w2" in suffixes else False if "bf16w2" in suffixes else d.i8_w2,
        gemv_balance=True if "balanced" in suffixes else False if "plain" in suffixes else d.gemv_balance,
        decode_ring=next((r for r in ("cp.async", "tma") if r in suffixes), d.decode_ring))


# ------------------------------------------------------------------------------------------------ 0. smoke


def smoke(gen: torch.Generator) -> list[dict[str, Any]]:
    """Each decode kernel against the float32 torch reference on a few small steps (run first: a failing kernel
    shows here, with its shape, before the timed sections)."""
    out = []
    for H, I, k, T, dtype in ((4096, 2048, 6, 1, torch.bfloat16), (6144, 1024, 8, 3, torch.float32),
                              (7168, 512, 8, 8, torch.bfloat16), (4096, 1024, 8, 8, torch.float32)):
        E = 32
        lay = RowLayout.for_expert(H, I, fmt="2bit")
        pool = random_pool(lay, E, gen)
        slot_of = torch.randperm(E, device="cuda", generator=gen).to(torch.int32)
        ids, w = routing(T, k, E, gen)
        x = (torch.randn(T, H, device="cuda", generator=gen) * 0.3).to(dtype)
        ref = moe_forward_reference(x.float(), ids, w, pool, slot_of, lay)
        row: dict[str, Any] = {"H": H, "I": I, "k": k, "T": T, "x": str(dtype)}
        for dk in ("gemv", "rowdot", "mma"):
            try:
                got = ops.moe_forward(x, ids, w, pool, slot_of, lay, policy=KernelPolicy(decode=dk))
                torch.cuda.synchronize()
                row[dk] = float(torch.linalg.vector_norm(got.double() - ref.double()) /
                                torch.linalg.vector_norm(ref.double()))
            except Exception as e:  # noqa: BLE001 - a failing kernel shows in the smoke table
                row[dk] = f"{type(e).__name__}: {str(e)[:200]}"
        print(f"smoke {row}", flush=True)
        out.append(row)
    return out


# ------------------------------------------------------------------------------------------------ 3. prefill


def grouped_bf16(m, gen):
    """All experts of one layer in bf16 and a grouped matmul over token groups (torch._grouped_mm if present)."""
    H, I, E = m["H"], m["I"], m["E"]
    w13 = torch.randn(E, 2 * I, H, device="cuda", generator=gen, dtype=torch.bfloat16).mul_(0.02)
    w2 = torch.randn(E, H, I, device="cuda", generator=gen, dtype=torch.bfloat16).mul_(0.02)
    return w13, w2


def prefill_case(m, T, lay, pool, slot_of, w13, w2, gen, quick, prefill_kernels: tuple[str, ...]) -> dict[str, Any]:
    H, I, k, E = m["H"], m["I"], m["k"], m["E"]
    ids, w = routing(T, k, E, gen)
    x = (torch.randn(T, H, device="cuda", generator=gen) * 0.3).to(torch.bfloat16)
    out = torch.empty_like(x)
    res: dict[str, Any] = {"model": m["name"], "tokens": T, "variant": prefill_kernels[0], "variants": {}}
    mod = kernels.get_module()
    if mod is not None:  # what the default ("auto") resolves to for this step: wgmma, tiled, or None (warp tiles)
        res["auto_resolves_to"] = cuda_paths.use_tiled_prefill(mod, lay, T * k / E)
    # Each prefill path (KernelPolicy.prefill) on the same routing; the first is the headline figure.
    outs = {}
    for pk in prefill_kernels:  # "name" or "name:variant" (KernelPolicy.prefill_variant)
        name, _, variant = pk.partition(":")
        try:
            policy = KernelPolicy(prefill=name, prefill_variant=int(variant or 1))
            g = capture(lambda: ops.moe_forward(x, ids, w, pool, slot_of, lay, out=out, policy=policy))
        except Exception as e:  # e.g. wgmma asked for on a GPU without it
            res["variants"][pk] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
            continue
        tv = time_events(g.replay, reps=3 if quick else 5)
        outs[pk] = out.clone()
        res["variants"][pk] = {"ms": tv["median_ms"], "tok_s": T / (tv["median_ms"] * 1e-3)}
        del g
    if prefill_kernels[0] not in outs:
        res["error"] = res["variants"][prefill_kernels[0]]["error"]
        return res
    t = {"median_ms": res["variants"][prefill_kernels[0]]["ms"]}
    head = outs[prefill_kernels[0]].float()
    for pk, o in outs.items():  # agreement with the headline path (bf16 intermediate on both: ~1e-3)
        res["variants"][pk]["rel_diff_vs_headline"] = float((o.float() - head).norm() / head.norm())
    res["moet_ms"] = t["median_ms"]
    res["moet_tok_s"] = T / (t["median_ms"] * 1e-3)
    res["moet_weight_bytes"] = E * lay.payload_bytes
    # bf16 grouped matmul: tokens sorted by expert, one GEMM group per expert.
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=E)
    offs = torch.cumsum(counts, 0).to(torch.int32)
    xs = x[order // k]
    ws = w.reshape(-1)[order]
    outb = torch.zeros(T, H, device="cuda", dtype=torch.float32)
    has_grouped = hasattr(torch, "_grouped_mm")

    def bf16_layer():
        if has_grouped:
            h = torch._grouped_mm(xs, w13.transpose(1, 2), offs=offs)
            a = torch.nn.functional.silu(h[:, :I]) * h[:, I:]
            y = torch._grouped_mm(a, w2.transpose(1, 2), offs=offs)
        else:
            cl = counts.tolist()
            ys, s = [], 0
            for e in range(E):
                if cl[e]:
                    h = xs[s:s + cl[e]] @ w13[e].T
                    ys.append((torch.nn.functional.silu(h[:, :I]) * h[:, I:]) @ w2[e].T)
                    s += cl[e]
            y = torch.cat(ys)
        outb.index_add_(0, order // k, (y.float() * ws.unsqueeze(-1)))

    try:
        try:
            gb = capture(bf16_layer) if has_grouped else None
            method = "torch._grouped_mm (graph)" if has_grouped else "per-expert matmul loop"
        except Exception as e:  # grouped_mm refused these strides/arch: fall back to the loop
            res["grouped_mm_error"] = f"{type(e).__name__}: {str(e)[:200]}"
            has_grouped, gb, method = False, None, "per-expert matmul loop"
        tb = time_events(gb.replay if gb is not None else bf16_layer, reps=3 if quick else 5)
        res["bf16_grouped_ms"] = tb["median_ms"]
        res["bf16_grouped_tok_s"] = T / (tb["median_ms"] * 1e-3)
        res["bf16_method"] = method
        res["bf16_weight_bytes"] = E * 3 * H * I * 2
        res["speedup_vs_bf16"] = tb["median_ms"] / t["median_ms"]
    except Exception as e:
        res["bf16_error"] = f"{type(e).__name__}: {str(e)[:300]}"
    return res


# ------------------------------------------------------------------------------------------------ main


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench/results/kernels_h200.json")
    ap.add_argument("--quick", action="store_true", help="fewer repetitions and smaller buffers")
    ap.add_argument("--tokens", default="1,2,4,8")
    ap.add_argument("--prefill", default="512,2048,8192")
    ap.add_argument("--models", default="", help="comma-separated subset of model names")
    ap.add_argument("--sections", default="smoke,bw,decode,prefill")
    ap.add_argument("--decode-kernels", default="gemv,mma,rowdot",
                    help="KernelPolicy.decode values to time, suffixes '+fused' (the per-token sum folded into the "
                         "w2 launch), '+e4m3' / '+i8' / '+bf16' (the w13 stage's A operand, e4m3_decode / "
                         "i8_decode), '+i8w2' / '+bf16w2' (the w2 stage's behind the int8 w13 stage, i8_w2), "
                         "'+plain' / '+balanced' (units over warps, gemv_balance), '+cp.async' / '+tma' (the "
                         "gemv stages' ring, decode_ring), '+l2' (every routed expert of a layer read "
                         "from one slot: the stages' speed with their rows in the L2); the first (the default path) "
                         "is the headline figure")
    ap.add_argument("--scales", choices=("uniform", "gauss"), default="gauss",
                    help="how the expert rows' scale bytes are drawn: 'gauss' (the default: what Gaussian "
                         "weights quantize to) or 'uniform' over 8 binades per block")
    ap.add_argument("--prefill-kernels", default="auto,tiled:2,wgmma,warp",
                    help="KernelPolicy.prefill values to time, optionally name:variant (prefill_variant); the "
                         "first (the default path) is the headline figure")
    ap.add_argument("--no-baselines", action="store_true",
                    help="skip the naive bf16 and torch 2-bit reference timings of the decode section")
    args = ap.parse_args()
    global SCALES
    SCALES = args.scales
    if not torch.cuda.is_available():
        print("bench/moe_kernels.py needs a CUDA GPU", file=sys.stderr)
        return 2
    out = Path(args.out)
    mod = kernels.get_module()
    res: dict[str, Any] = {"benchmark": "moetplan kernels", "machine": machine_info(),
                           "command": " ".join(["python3"] + sys.argv), "kernels_built": mod is not None,
                           "scales": SCALES,
                           "fallback_reason": kernels.fallback_reason(),
                           "prefill_pairs_per_expert": cuda_paths.PREFILL_PAIRS_PER_EXPERT,
                           "gemv_max_pairs": mod.gemv_max_pairs() if mod is not None and
                           hasattr(mod, "gemv_max_pairs") else None}
    if mod is None:
        print(f"kernels unavailable: {kernels.fallback_reason()}", file=sys.stderr)
    gen = torch.Generator(device="cuda").manual_seed(0)
    models = [m for m in model_shapes() if not args.models or m["name"] in args.models.split(",")]
    res["models"] = models
    secs = args.sections.split(",")
    ref = 4000.0
    if "smoke" in secs:
        res["smoke"] = smoke(gen)
        atomic_write_json(out, res)
    if "bw" in secs:
        res["read_bandwidth"] = read_bandwidth(args.quick)
        ref = res["read_bandwidth"]["reference_gbps"]
        print(f"read bandwidth: large sum {res['read_bandwidth']['large_sum']['gbps']:.0f} GB/s, "
              f"40 MiB slices {res['read_bandwidth']['graph_40mib_slices']['gbps']:.0f} GB/s", flush=True)
        atomic_write_json(out, res)
    if "decode" in secs:
        res["decode"] = []
        for m in models:
            for T in [int(v) for v in args.tokens.split(",")]:
                r = decode_case(m, T, ref, gen, args.quick, tuple(args.decode_kernels.split(",")),
                                not args.no_baselines)
                res["decode"].append(r)
                atomic_write_json(out, res)
                if "error" in r:
                    print(f"decode {m['name']:18s} T={T}: {r['error']} {r['variants']}", flush=True)
                    continue
                nb = r.get("naive_bf16", {})
                others = "  ".join(f"{n} {v['per_layer_us']:.1f} us" if "error" not in v else f"{n} FAILED"
                                   for n, v in r["variants"].items())
                print(f"decode {m['name']:18s} T={T}: {r['per_layer_us']:7.1f} us/layer  {r['gbps']:6.0f} GB/s "
                      f"({100 * r['share_of_read_bw']:.0f}% of read BW, {r['variant']}) [{others}]  bf16 naive "
                      f"{nb.get('per_layer_us', float('nan')):7.1f} us  torch-2bit "
                      f"{r.get('torch_2bit_reference_per_layer_us', float('nan')):8.0f} us  "
                      f"err {r['rel_err_vs_fp32_reference']}", flush=True)
    if "prefill" in secs:
        res["prefill"] = []
        for m in models:
            lay = RowLayout.for_expert(m["H"], m["I"], fmt="2bit")
            pool = random_pool(lay, m["E"], gen)
            slot_of = torch.arange(m["E"], dtype=torch.int32, device="cuda")
            w13, w2 = grouped_bf16(m, gen)
            for T in [int(v) for v in args.prefill.split(",")]:
                r = prefill_case(m, T, lay, pool, slot_of, w13, w2, gen, args.quick,
                                 tuple(args.prefill_kernels.split(",")))
                res["prefill"].append(r)
                atomic_write_json(out, res)
                others = "  ".join(f"{n} {v['tok_s']:9.0f} tok/s (diff {v['rel_diff_vs_headline']:.1e})"
                                   if "error" not in v else f"{n} FAILED" for n, v in r["variants"].items())
                if "error" in r:
                    print(f"prefill {m['name']:18s} T={T}: {r['error']}", flush=True)
                    continue
                print(f"prefill {m['name']:18s} T={T}: moet {r['moet_tok_s']:9.0f} tok/s [{others}]  bf16 "
                      f"{r.get('bf16_grouped_tok_s', float('nan')):9.0f} tok/s  "
                      f"x{r.get('speedup_vs_bf16', float('nan')):.2f} {r.get('bf16_error', '')}", flush=True)
            del pool, w13, w2
            torch.cuda.empty_cache()
    res["finished"] = True
    atomic_write_json(out, res)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

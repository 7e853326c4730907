"""CPU kernels (csrc/cpu/moe_cpu.cpp) for routed 2-bit experts: GB/s of 2-bit rows against this machine's measured
memory read bandwidth (one thread and all threads) and against the torch reference, per model shape, batch 1/4/16;
and one Qwen3-30B-A3B decode step (the routed MoE of all its MoE layers) kernel vs reference, side by side.

Shapes come from hwdb (ModelSpec), never from this file. Each op call routes experts that the previous calls did
not read (rows rotate through a pool several times the last-level cache), so rows come from DRAM as a miss would.
GB/s counts the code and scale bytes of every distinct expert a call reads (w13 + w2), i.e. what must cross the
memory bus. The machine may be shared: each figure is the best of --reps runs, and the load average is recorded.

    python bench/cpu_experts.py [--reps 5] [--out bench/results/cpu_experts_<cpu>.json]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from moetplan import hwdb  # noqa: E402
from moetplan.contract import atomic_write_text  # noqa: E402
from moetplan.contract.layout import RowLayout  # noqa: E402
from moetplan.contract.runtime import KernelPolicy  # noqa: E402
from moetplan.runtime.op import cpu_kernels, ops  # noqa: E402

GB = 1e9
MODELS = ("deepseek-v4-flash", "glm-5.2", "kimi-k2.7-code", "qwen3-30b-a3b")
DECODE_MODEL = "qwen3-30b-a3b"
POOL_BYTES = 320 << 20  # rows rotate through this much memory (10x this VM's 32 MiB L3)
REF = KernelPolicy(cpu=False)


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info() -> dict:
    from moetplan.contract.machine import machine_info as base

    info = base()
    info.update(cpu=cpu_name(), threads=torch.get_num_threads(), torch=torch.__version__)
    return info


def clocks() -> tuple[float, float]:
    """(wall, CPU seconds of this process): on a shared machine the CPU time is what the work itself took."""
    return time.perf_counter(), time.process_time()


def read_bandwidth(threads: int, reps: int) -> tuple[float, float]:
    """GB/s of a streaming read (torch sum over 512 MiB of int64), best of reps: per wall second, and per CPU
    second times the threads (what the threads read while they ran)."""
    torch.set_num_threads(threads)
    buf = torch.ones(64 << 20, dtype=torch.int64)
    best, best_cpu = float("inf"), float("inf")
    for _ in range(reps):
        w, c = clocks()
        buf.sum()
        w2, c2 = clocks()
        best, best_cpu = min(best, w2 - w), min(best_cpu, (c2 - c) / threads)
    return buf.numel() * 8 / best / GB, buf.numel() * 8 / best_cpu / GB


def bandwidths(all_threads: int, reps: int) -> dict[str, float]:
    out = {}
    for n in (1, all_threads):
        out[f"read_{n}t_GBps"], out[f"read_{n}t_cpu_GBps"] = read_bandwidth(n, reps)
    return out


def row_bytes(lay: RowLayout) -> int:
    return lay.w13_q_size + lay.w13_s_size + lay.w2_q_size + lay.w2_s_size


def make_pool(lay: RowLayout, rows: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    pool = torch.randint(0, 256, (rows, lay.stride), dtype=torch.uint8, generator=g)
    for off, size in ((lay.w13_s_off, lay.w13_s_size), (lay.w2_s_off, lay.w2_s_size)):
        pool[:, off:off + size] = torch.randint(118, 133, (rows, size), dtype=torch.uint8, generator=g)
    return pool


class Rotation:
    """Routing for successive calls: each call's experts are the next distinct rows of the pool."""

    def __init__(self, rows: int) -> None:
        self.rows, self.next = rows, 0

    def ids(self, T: int, k: int) -> torch.Tensor:
        n = min(T * k, self.rows)
        experts = (torch.arange(n) + self.next) % self.rows
        self.next = (self.next + n) % self.rows
        flat = torch.cat([experts, experts[torch.randperm(n)]])[: T * k] if T * k > n else experts
        return flat.view(T, k)


def time_op(x, k, pool, lay, rot, reps, policy, limit=None, planes=None) -> tuple[float, float, int]:
    """Best wall seconds of one op call, best CPU seconds / threads, and the 2-bit bytes a call reads. `planes`:
    call the CPU kernels directly with that many int8 activation planes per stage (default: the op's choice)."""
    mod = cpu_kernels.get_module() if planes else None
    best, best_cpu = float("inf"), float("inf")
    slot_of = torch.arange(pool.shape[0])
    w = torch.full((x.shape[0], k), 1.0 / k)
    threads = torch.get_num_threads()
    nbytes = min(x.shape[0] * k, pool.shape[0]) * row_bytes(lay)  # Rotation: distinct experts per call
    for _ in range(reps):
        ids = rot.ids(x.shape[0], k)
        w0, c0 = clocks()
        if planes:
            cpu_kernels.moe_cpu(mod, x, ids, w, pool, slot_of, lay, None, None, None, limit, None, planes=planes)
        else:
            ops.moe_forward(x, ids, w, pool, slot_of, lay, swiglu_limit=limit, policy=policy)
        w1, c1 = clocks()
        best, best_cpu = min(best, w1 - w0), min(best_cpu, (c1 - c0) / threads)
    return best, best_cpu, nbytes


def shapes(reps: int, ref_reps: int, all_threads: int) -> list[dict]:
    out = []
    for name in MODELS:
        spec = hwdb.model_spec(name)
        lay = RowLayout.for_expert(spec.hidden_size, spec.moe_intermediate_size, 1, "2bit")
        rows = max(2 * 16 * spec.top_k // 4, POOL_BYTES // lay.stride)
        pool = make_pool(lay, rows)
        rot = Rotation(rows)
        for T in (1, 4, 16):
            x = torch.randn(T, spec.hidden_size) * 0.1
            rec = {"model": spec.id, "hidden": spec.hidden_size, "inter": spec.moe_intermediate_size,
                   "top_k": spec.top_k, "batch": T, "row_bytes": row_bytes(lay)}
            for threads in (1, all_threads):
                torch.set_num_threads(threads)
                s, sc, b = time_op(x, spec.top_k, pool, lay, rot, reps, ops.DEFAULT_POLICY)
                rec[f"kernel_{threads}t_s"], rec[f"kernel_{threads}t_GBps"] = s, b / s / GB
                rec[f"kernel_{threads}t_cpu_GBps"] = b / sc / GB
            if T == 1:  # the float32-class two-plane kernels, side by side (docs/CPU_KERNELS.md, "Tolerance")
                torch.set_num_threads(1)
                s, sc, b = time_op(x, spec.top_k, pool, lay, rot, reps, ops.DEFAULT_POLICY, planes=(2, 2))
                rec["kernel_1t_2planes_GBps"], rec["kernel_1t_2planes_cpu_GBps"] = b / s / GB, b / sc / GB
            torch.set_num_threads(all_threads)
            s, sc, b = time_op(x, spec.top_k, pool, lay, rot, ref_reps, REF)
            rec["reference_s"], rec["reference_GBps"] = s, b / s / GB
            rec["kernel_vs_reference"] = rec["reference_s"] / rec[f"kernel_{all_threads}t_s"]
            print(json.dumps(rec), flush=True)
            out.append(rec)
        del pool
    return out


def decode_step(reps: int, ref_reps: int) -> dict:
    """The routed MoE of one decode token through every MoE layer of the model, kernel vs reference."""
    spec = hwdb.model_spec(DECODE_MODEL)
    lay = RowLayout.for_expert(spec.hidden_size, spec.moe_intermediate_size, 1, "2bit")
    rows = max(4 * spec.top_k, POOL_BYTES // lay.stride)
    pool = make_pool(lay, rows, seed=1)
    x = torch.randn(1, spec.hidden_size) * 0.1

    def step(policy, rot) -> tuple[float, float]:
        slot_of = torch.arange(rows)
        w = torch.full((1, spec.top_k), 1.0 / spec.top_k)
        ids = [rot.ids(1, spec.top_k) for _ in range(spec.moe_layers)]
        w0, c0 = clocks()
        for layer in range(spec.moe_layers):
            ops.moe_forward(x, ids[layer], w, pool, slot_of, lay, policy=policy)
        w1, c1 = clocks()
        return w1 - w0, c1 - c0

    rot = Rotation(rows)
    runs = {"kernel": [step(ops.DEFAULT_POLICY, rot) for _ in range(reps)],
            "reference": [step(REF, rot) for _ in range(ref_reps)]}
    kernel, reference = (min(r[0] for r in runs[n]) for n in ("kernel", "reference"))
    kernel_cpu, reference_cpu = (min(r[1] for r in runs[n]) for n in ("kernel", "reference"))
    nbytes = spec.moe_layers * spec.top_k * row_bytes(lay)
    return {"model": spec.id, "moe_layers": spec.moe_layers, "top_k": spec.top_k, "bytes_per_step": nbytes,
            "threads": torch.get_num_threads(), "kernel_s": kernel, "reference_s": reference,
            "speedup": reference / kernel, "kernel_cpu_s": kernel_cpu, "reference_cpu_s": reference_cpu,
            "speedup_cpu": reference_cpu / kernel_cpu,
            "kernel_GBps": nbytes / kernel / GB, "reference_GBps": nbytes / reference / GB}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--ref-reps", type=int, default=2)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    mod = cpu_kernels.get_module()
    if mod is None:
        raise SystemExit(f"CPU kernels unavailable: {cpu_kernels.fallback_reason()}")
    all_threads = os.cpu_count() or 1
    load_before = os.getloadavg()
    bw = bandwidths(all_threads, a.reps)
    print(json.dumps(bw), flush=True)
    recs = shapes(a.reps, a.ref_reps, all_threads)
    dec = {}
    for n in (all_threads, 1):  # all threads (what serving uses), and one (immune to a descheduled thread)
        torch.set_num_threads(n)
        dec[f"{n}t"] = decode_step(a.reps, a.ref_reps)
        print(json.dumps(dec[f"{n}t"]), flush=True)
    torch.set_num_threads(all_threads)
    bw_after = bandwidths(all_threads, a.reps)
    b1 = [r for r in recs if r["batch"] == 1]
    summary = {f"decode_step_{n}_speedup": d["speedup"] for n, d in dec.items()}
    for n in (1, all_threads):
        for kind in ("", "_cpu"):  # per wall second; per CPU second (what the work took where it ran)
            summary[f"batch1_kernel_{n}t{kind}_vs_read_{n}t{kind}"] = {
                r["model"]: r[f"kernel_{n}t{kind}_GBps"] / max(bw[f"read_{n}t{kind}_GBps"],
                                                                bw_after[f"read_{n}t{kind}_GBps"]) for r in b1}
    res = {"bench": "cpu_experts", "when": datetime.now(timezone.utc).isoformat(timespec="seconds"),
           "machine": machine_info(), "isa": cpu_kernels.best_isa(mod), "isas": list(mod.isas_available()),
           "planes": [cpu_kernels.PLANES_W13, cpu_kernels.PLANES_W2],
           "loadavg_before": load_before, "loadavg_after": os.getloadavg(), "reps": a.reps,
           "read_bandwidth": bw, "read_bandwidth_after": bw_after, "shapes": recs, "decode_step": dec,
           "summary": summary, "command": "python bench/cpu_experts.py " + " ".join(sys.argv[1:])}
    slug = re.sub(r"[^a-z0-9]+", "_", cpu_name().lower()).strip("_") or "cpu"
    out = Path(a.out) if a.out else ROOT / "bench" / "results" / f"cpu_experts_{slug}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out, json.dumps(res, indent=2) + "\n")
    print(json.dumps(summary, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

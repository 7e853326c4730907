"""When nothing fits: what is short, and what would fit — every suggestion re-solved before it is printed, and
written as the flags that reproduce it."""
from __future__ import annotations

import math
from typing import Any, Callable

from moetplan.contract import Goals, HardwareProfile, Placement
from moetplan.contract.errors import InfeasibleError
from moetplan.contract.model import GIB, ModelSpec
from moetplan.plan import ledger as L

# The solver's own check (solver.feasible), handed down so that what is printed as fitting is what it finds.
Feasible = Callable[[ModelSpec, HardwareProfile, Goals], bool]

MIN_CONTEXT = 4096


def _shortfalls(model: ModelSpec, hw: HardwareProfile, kv_dtype: str) -> list[str]:
    gpu, n = hw.gpus[0], hw.num_gpus
    out: list[str] = []
    # VRAM: what the smallest configuration needs per GPU, at the widest TP available.
    tp = max(t for t in (1, 2, 4, 8) if t <= n and model.splits_over(t))
    probe = Placement(tp=tp, pp=1, context=MIN_CONTEXT, kv_dtype=kv_dtype, max_num_seqs=1,
                      max_num_batched_tokens=256)
    dense = L.dense_gib(model, probe)
    fixed = sum(i.gib for i in L.fixed_gpu_items(model, probe)) + L.kv_floor_gib(model, probe)
    floor_gib = L.cache_floor_slots(model, probe) * model.expert_bytes("2bit", tp) / GIB
    budget = gpu.vram_gib * L.gpu_memory_utilization_default(gpu.vram_gib)
    need_gpu = fixed + floor_gib
    if need_gpu > budget:
        out.append(f"VRAM: even with the base off the GPU, each of {n}x {gpu.name} needs {need_gpu:.1f} GiB "
                   f"(dense {dense:.1f} + minimal expert cache {floor_gib:.1f} + KV/workspace {fixed - dense:.1f}) "
                   f"of a {budget:.1f} GiB budget; short {need_gpu - budget:.1f} GiB")
    host_need = model.routed_gib() + L.host_reserve_gib(hw)
    host_usable = L.host_usable_gib(hw)
    if host_need > host_usable:
        out.append(f"host RAM: a pinned 2-bit store needs {host_need:.0f} GiB usable, {host_usable:.0f} GiB usable "
                   f"of {hw.host.ram_gib:.0f}; short {host_need - host_usable:.0f}")
    disk_need = model.routed_gib()
    free = hw.storage.free_gib
    if free is None:
        out.append(f"NVMe: no pack directory given; the nvme tier needs {disk_need:.0f} GiB of packs "
                   "(give --pack-dir DIR, or --pack-dir-free-gib)")
    elif free < disk_need:
        out.append(f"NVMe: pack dir has {free:.0f} GiB free, packs need {disk_need:.0f} GiB")
    return out


def _flags(model: ModelSpec, goals: Goals, gpu_id: str, k: int, ram: float, free: float | None,
           nvme: float | None) -> str:
    parts = [f"moetplan plan --model {model.id}", f"--gpus {k}x{gpu_id}", f"--host-ram-gib {ram:g}"]
    if free is not None:
        parts.append(f"--pack-dir-free-gib {free:g}")
    if nvme is not None:
        parts.append(f"--nvme-gbps {nvme:g}")
    if goals.context:
        parts.append(f"--context {goals.context}")
    if goals.concurrency != 1:
        parts.append(f"--concurrency {goals.concurrency}")
    if goals.objective != "balanced":
        parts.append(f"--objective {goals.objective}")
    parts += [f"--set {key}={v}" for key, v in goals.pinned.items() if key not in ("tp", "pp")]
    return " ".join(parts)


def suggestions(model: ModelSpec, hw: HardwareProfile, goals: Goals, feasible: Feasible) -> list[str]:
    """Cheapest change first: more GPUs of this kind; then a pinned-RAM base, or an NVMe pack dir, on this many
    GPUs or the fewest more that make it fit. Each is solved on exactly the hardware its flags describe."""
    from moetplan import hwdb

    gpu, n = hw.gpus[0], hw.num_gpus
    gid = gpu.hwdb_id
    if gid is None:
        return []
    ram_need = model.routed_gib() + L.host_reserve_gib(hw)
    ram = float(math.ceil(ram_need / L.guards()["host"]["usable_fraction"] / 16) * 16)
    disk = float(math.ceil(model.routed_gib() * 1.05))
    free = hw.storage.free_gib
    nvme = hw.storage.rand_read_gbps or hw.storage.seq_read_gbps
    options: list[tuple[str, float, float | None, float | None]] = [("", hw.host.ram_gib, free, nvme)]
    if ram > hw.host.ram_gib:
        options.append((f"host RAM >= {ram:g} GiB (2-bit base pinned in RAM, tier host)", ram, free, nvme))
    if free is None or free < model.routed_gib():
        options.append((f"an NVMe pack dir with >= {disk:g} GiB free (tier nvme)", hw.host.ram_gib, disk,
                        nvme or 3.5))
    goals = goals.model_copy(update={"pinned": {k: v for k, v in goals.pinned.items() if k not in ("tp", "pp")}})
    out: list[str] = []
    plain_k: int | None = None  # GPUs that suffice with nothing else changed: options needing as many are moot
    for what, r, f, nv in options:
        for k in (n, 2, 4, 8):
            if k < n or (k == n and not what) or (plain_k is not None and k >= plain_k):
                continue
            cand = hwdb.inline_profile(f"{k}x{gid}", r, nv if f is not None else None, f)
            if feasible(model, cand, goals):
                head = f"{k}x {gid}" + (f" + {what}" if what else f" with {r:g} GiB RAM"
                                        + (f" and a {f:g} GiB pack dir" if f is not None else ""))
                if k == n:
                    head = what
                out.append(f"{head}: {_flags(model, goals, gid, k, r, f, nv if f is not None else None)}")
                if not what:
                    plain_k = k
                break
    return out


def diagnose(model: ModelSpec, hw: HardwareProfile, goals: Goals, pins: dict[str, Any],
             problems: dict[str, list[str]], feasible: Feasible, kv_dtype: str) -> InfeasibleError:
    """The InfeasibleError of a search that found nothing; `kv_dtype`: the KV cache dtype the solver would plan."""
    gpu, n = hw.gpus[0], hw.num_gpus
    shortfalls = _shortfalls(model, hw, kv_dtype)
    if not shortfalls or pins:
        # With knobs pinned the generic picture is not the point: say what the pinned placement ran into.
        seen: list[str] = []
        for tier, why in problems.items():
            for w in why:
                text = w if w.startswith(tier) else f"{tier}: {w}"
                if text not in seen and len(seen) < 4:
                    seen.append(text)
        shortfalls = seen + shortfalls
    sugg = suggestions(model, hw, goals, feasible)
    if "context" in pins and pins["context"] > MIN_CONTEXT:
        shorter = goals.model_copy(update={"pinned": {**goals.pinned, "context": MIN_CONTEXT}})
        if feasible(model, hw, shorter):
            sugg.append(f"a shorter context (--set context={MIN_CONTEXT})")
    msg = f"{model.name} does not fit on {n}x {gpu.name} with {hw.host.ram_gib:.0f} GiB RAM"
    if "context" in pins:
        msg += f" at context {pins['context']}"
    return InfeasibleError(msg, shortfalls, sugg or [f"GPUs with more VRAM than {n}x {gpu.hwdb_id or gpu.name}"])

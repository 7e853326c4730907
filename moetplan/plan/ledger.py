"""The memory ledger: where every byte of a placement lives (per GPU rank, host RAM, disk) and the guards.

Pure arithmetic over ModelSpec + HardwareProfile + Placement; the solver calls it for every candidate, so it
stays cheap. Guard constants are facts in hwdb/guards.yaml.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from moetplan.contract.model import GIB, ModelSpec
from moetplan.contract.sizing import gate_floor_slots, step_working_set
from moetplan.contract import (
    GPURankMemory,
    HardwareProfile,
    LedgerItem,
    MemoryLedger,
    Placement,
)


@lru_cache(maxsize=1)
def guards() -> dict[str, Any]:
    from moetplan.hwdb import guards as _g

    return _g()


def spec_tokens(model: ModelSpec, p: Placement) -> int:
    return p.mtp if p.mtp > 0 else 0


def step_working_set_slots(model: ModelSpec, p: Placement) -> int:
    """One decode step's routed (layer, expert) pairs: MoE layers x top_k x (1 + spec) x min(seqs, cap)."""
    g = guards()["expert_cache"]
    seqs = min(max(p.max_num_seqs, p.concurrency, 1), g["seqs_cap"])
    return step_working_set(model.moe_layers, model.top_k, spec_tokens(model, p), seqs)


def cache_floor_slots(model: ModelSpec, p: Placement, comfortable: bool = False) -> int:
    g = guards()["expert_cache"]
    f = g["comfortable_factor"] if comfortable else g["floor_factor"]
    # A layer never needs more slots than it has experts; PP ranks hold only their layers.
    return math.ceil(f * step_working_set_slots(model, p) / p.pp)


def fp4_gate_floor_slots(model: ModelSpec, p: Placement) -> int:
    return gate_floor_slots(step_working_set_slots(model, p), guards()["fp4_gate"]["floor_factor"], p.pp)


def gpu_memory_utilization_default(vram_gib: float) -> float:
    g = guards()["gpu"]
    return g["gpu_memory_utilization_small_card"] if vram_gib < g["small_card_gib"] else g["gpu_memory_utilization"]


def fixed_gpu_items(model: ModelSpec, p: Placement) -> list[LedgerItem]:
    """Everything on a GPU rank except experts, FP4 reserve and KV."""
    g = guards()["gpu"]
    shards = p.tp * p.pp
    items = [LedgerItem(name="dense", gib=model.dense_bytes() / shards / GIB,
                        note=f"non-routed stack at {model.dense_precision}, split over TP{p.tp} x PP{p.pp}")]
    if p.mtp > 0 and model.mtp_layers == 0 and model.drafter_gib > 0:
        items.append(LedgerItem(name="drafter", gib=model.drafter_gib / p.tp, note="separate drafter"))
    items.append(LedgerItem(name="cuda_graphs_workspace", gib=g["cuda_graphs_workspace_gib"],
                            note="CUDA graphs + workspaces"))
    if p.mtp > 0:
        # vLLM-Moet's speculation allowance (1.7 GiB) covers the MTP layer with its routed experts at 2-bit for
        # DS4-sized models; a larger MTP layer (DeepSeek-V3: ~5 GiB) is counted at its real size.
        mtp = model.mtp_bytes_per_rank(p.tp) / GIB
        items.append(LedgerItem(name="speculation", gib=max(g["speculative_extra_gib"], mtp),
                                note=f"MTP layer ({mtp:.1f} GiB, experts at 2-bit) + drafting workspace"))
    items.append(LedgerItem(name="activations", gib=g["activation_bytes_per_context_token"] * p.context / GIB,
                            note="16 KiB x max_model_len"))
    return items


def kv_needed_gib(model: ModelSpec, p: Placement) -> float:
    """KV per rank for `concurrency` sequences at full context (the plan's promise)."""
    seqs = max(p.concurrency, 1)
    return model.kv_bytes(p.kv_dtype, p.context * seqs, tp=p.tp, seqs=seqs) / p.pp / GIB


def experts_resident_gib(model: ModelSpec, p: Placement) -> float:
    return model.routed_gib("2bit", p.tp) / p.pp


def host_reserve_gib(hw: HardwareProfile) -> float:
    g = guards()["host"]
    return g["os_reserve_gib"] + g["per_gpu_reserve_gib"] * max(hw.num_gpus, 1)


def host_usable_gib(hw: HardwareProfile) -> float:
    return hw.host.ram_gib * guards()["host"]["usable_fraction"]


def pack_disk_gib(model: ModelSpec, p: Placement) -> tuple[float, float]:
    """(2-bit packs, FP4 packs) on disk, all ranks. FP4 packs only when a reserve is planned."""
    base = model.routed_gib("2bit", 1)
    fp4 = model.routed_gib("fp4", 1) if p.fp4_reserve_gib > 0 else 0.0
    return base, fp4


@dataclass
class LedgerCheck:
    ledger: MemoryLedger
    ok: bool
    problems: list[str] = field(default_factory=list)


def build_ledger(model: ModelSpec, hw: HardwareProfile, p: Placement) -> LedgerCheck:
    """Account every byte of placement `p`; `ok` is False with named problems when something does not fit."""
    problems: list[str] = []
    guards_out: list[str] = []
    ranks = p.tp * p.pp
    if ranks > hw.num_gpus:
        problems.append(f"TP{p.tp} x PP{p.pp} needs {ranks} GPUs, this machine has {hw.num_gpus}")
        return LedgerCheck(MemoryLedger(), False, problems)

    fixed = fixed_gpu_items(model, p)
    gpus: list[GPURankMemory] = []
    for r in range(ranks):
        gpu = hw.gpus[r]
        items = list(fixed)
        if p.expert_tier == "resident":
            items.append(LedgerItem(name="experts_2bit", gib=experts_resident_gib(model, p),
                                    note="all routed experts at 2-bit, resident"))
        else:
            items.append(LedgerItem(name="expert_cache", gib=p.gpu_expert_cache_gib,
                                    note=f"{p.gpu_expert_cache_slots} slots of 2-bit rows"))
        if p.fp4_reserve_gib > 0:
            items.append(LedgerItem(name="fp4_reserve", gib=p.fp4_reserve_gib,
                                    note=f"{p.fp4_reserve_slots} hot experts at FP4"))
        items.append(LedgerItem(name="kv_cache", gib=p.kv_cache_gib, note=f"{p.kv_dtype} KV"))
        used = sum(i.gib for i in items)
        budget = gpu.vram_gib * p.gpu_memory_utilization
        gpus.append(GPURankMemory(rank=r, gpu=gpu.hwdb_id or gpu.name, total_gib=gpu.vram_gib, budget_gib=budget,
                                  used_gib=used, items=items))
        if used > budget + 0.005:
            problems.append(f"GPU {r} ({gpu.name}): needs {used:.1f} GiB, budget {budget:.1f} GiB "
                            f"({p.gpu_memory_utilization:.2f} x {gpu.vram_gib:.1f}); short {used - budget:.1f} GiB")

    # Guards (FACTS.md "Where the bytes go").
    kv_need = kv_needed_gib(model, p)
    if p.kv_cache_gib + 1e-6 < kv_need:
        problems.append(f"KV pool {p.kv_cache_gib:.2f} GiB/rank is below {kv_need:.2f} GiB needed for "
                        f"{p.concurrency} x {p.context} tokens at {p.kv_dtype}")
    if p.expert_tier == "resident":
        g = guards()["gpu"]
        free = gpus[0].budget_gib - sum(i.gib for i in fixed if i.name in ("dense", "drafter"))
        margin = g["cuda_graphs_workspace_gib"] + (g["speculative_extra_gib"] if p.mtp else 0) + \
            g["activation_bytes_per_context_token"] * p.context / GIB
        exp = experts_resident_gib(model, p)
        guards_out.append(f"resident fit: experts {exp:.1f} <= free {free:.1f} - margin {margin:.1f} GiB: "
                          f"{'ok' if exp <= free - margin else 'FAIL'}")
    else:
        floor = cache_floor_slots(model, p)
        comfy = cache_floor_slots(model, p, comfortable=True)
        ok = p.gpu_expert_cache_slots >= floor
        guards_out.append(f"expert cache floor: {p.gpu_expert_cache_slots} slots >= 1.15 x working set = {floor}: "
                          f"{'ok' if ok else 'FAIL'}" + ("" if p.gpu_expert_cache_slots >= comfy or not ok
                                                         else f" (below comfortable {comfy})"))
        if not ok:
            problems.append(f"GPU expert cache of {p.gpu_expert_cache_slots} slots is below one step's working set "
                            f"x 1.15 = {floor} slots ({floor * model.expert_bytes('2bit', p.tp) / GIB:.1f} GiB/rank)")
    if p.gate.enabled:
        gfloor = fp4_gate_floor_slots(model, p)
        gok = p.fp4_reserve_slots >= gfloor
        guards_out.append(f"fp4 gate floor: {p.fp4_reserve_slots} slots >= 1.7 x working set = {gfloor}: "
                          f"{'ok' if gok else 'degraded (promotions capped)'}")

    # Host RAM.
    host_items: list[LedgerItem] = [LedgerItem(name="os_and_processes", gib=host_reserve_gib(hw),
                                               note="OS, API server, one worker per GPU")]
    if p.expert_tier == "host":
        host_items.append(LedgerItem(name="pinned_expert_store", gib=model.routed_gib("2bit", 1),
                                     note="all 2-bit experts, pinned (every TP shard)"))
    elif p.expert_tier == "nvme":
        host_items.append(LedgerItem(name="pinned_arena", gib=p.host_arena_gib, note="pinned RAM arena over packs"))
    host_used = sum(i.gib for i in host_items)
    usable = host_usable_gib(hw)
    if host_used > usable + 0.05:
        problems.append(f"host RAM: needs {host_used:.1f} GiB, {usable:.1f} GiB usable of {hw.host.ram_gib:.0f} GiB; "
                        f"short {host_used - usable:.1f} GiB")
    pinned = sum(i.gib for i in host_items if i.name in ("pinned_expert_store", "pinned_arena"))
    if pinned > 0 and hw.host.memlock_bytes is not None and hw.host.memlock_bytes < pinned * GIB:
        problems.append(f"memlock limit {hw.host.memlock_bytes / 2**20:.0f} MiB cannot pin {pinned:.1f} GiB; "
                        "raise it (`ulimit -l unlimited`, or LimitMEMLOCK=infinity for a service)")

    # Disk: packs are the quantization cache for every tier, and the expert store itself for tier nvme.
    base, fp4 = pack_disk_gib(model, p)
    disk_items = [LedgerItem(name="packs_2bit", gib=base, note="2-bit packs (quantization cache" +
                             (", expert store)" if p.expert_tier == "nvme" else ")"))]
    if fp4:
        disk_items.append(LedgerItem(name="packs_fp4", gib=fp4, note="FP4 reserve source rows"))
    disk_used = sum(i.gib for i in disk_items)
    disk_free = hw.storage.free_gib
    if p.expert_tier == "nvme":
        if disk_free is None:
            problems.append("tier nvme needs a pack directory; give --pack-dir-free-gib / probe a --pack-dir")
        elif disk_used > disk_free:
            problems.append(f"pack dir: needs {disk_used:.0f} GiB, {disk_free:.0f} GiB free; "
                            f"short {disk_used - disk_free:.0f} GiB")
    ledger = MemoryLedger(gpus=gpus, host_gib=host_used, host_total_gib=hw.host.ram_gib, host_items=host_items,
                          disk_gib=disk_used, disk_free_gib=disk_free, disk_items=disk_items, guards=guards_out)
    return LedgerCheck(ledger, not problems, problems)

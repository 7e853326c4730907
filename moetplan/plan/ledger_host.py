"""Host RAM and disk side of the memory ledger: the pinned expert store or arena, and the pack files."""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from moetplan.contract import HardwareProfile, LedgerItem, Placement
from moetplan.contract.model import GIB, ModelSpec


@lru_cache(maxsize=1)
def guards() -> dict[str, Any]:
    """hwdb/guards.yaml, read once per process (the solver asks on every sizing)."""
    from moetplan.hwdb import guards as _g

    return _g()


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
class HostSide:
    host_items: list[LedgerItem]
    host_gib: float
    disk_items: list[LedgerItem]
    disk_gib: float
    problems: list[tuple[str, str]] = field(default_factory=list)  # (item, text)


def host_and_disk(model: ModelSpec, hw: HardwareProfile, p: Placement) -> HostSide:
    problems: list[tuple[str, str]] = []
    ranks = p.tp * p.pp
    host_items = [LedgerItem(name="os_and_processes", gib=host_reserve_gib(hw),
                             note="OS, API server, one worker per GPU")]
    if p.expert_tier == "host":
        host_items.append(LedgerItem(name="pinned_expert_store", gib=model.routed_gib("2bit", 1),
                                     note="all 2-bit experts, pinned (every TP shard)"))
    elif p.expert_tier == "nvme":
        host_items.append(LedgerItem(name="pinned_arena", gib=p.host_arena_gib * ranks,
                                     note=f"pinned RAM arena over packs, {p.host_arena_gib:g} GiB x {ranks} rank(s)"))
    host_used = sum(i.gib for i in host_items)
    usable = host_usable_gib(hw)
    if host_used > usable + 0.05:
        item = host_items[-1].name if len(host_items) > 1 else "os_and_processes"
        problems.append((item, f"host RAM: needs {host_used:.1f} GiB, {usable:.1f} GiB usable of "
                               f"{hw.host.ram_gib:.0f} GiB; short {host_used - usable:.1f} GiB"))
    pinned = sum(i.gib for i in host_items if i.name in ("pinned_expert_store", "pinned_arena"))
    if pinned > 0 and hw.host.memlock_bytes is not None and hw.host.memlock_bytes < pinned * GIB:
        problems.append(("memlock", f"memlock limit {hw.host.memlock_bytes / 2**20:.0f} MiB cannot pin {pinned:.1f} "
                                    "GiB; raise it (`ulimit -l unlimited`, or LimitMEMLOCK=infinity for a service)"))

    # Packs are the quantization cache for every tier, and the expert store itself for tier nvme.
    base, fp4 = pack_disk_gib(model, p)
    disk_items = [LedgerItem(name="packs_2bit", gib=base, note="2-bit packs (quantization cache" +
                             (", expert store)" if p.expert_tier == "nvme" else ")"))]
    if fp4:
        disk_items.append(LedgerItem(name="packs_fp4", gib=fp4, note="FP4 reserve source rows"))
    disk_used = sum(i.gib for i in disk_items)
    disk_free = hw.storage.free_gib
    if p.expert_tier == "nvme":
        if disk_free is None:
            problems.append(("packs_2bit", "tier nvme needs a pack directory: give --pack-dir DIR (its free space is "
                                           "measured) or --pack-dir-free-gib"))
        elif disk_used > disk_free:
            problems.append(("packs_2bit", f"pack dir: needs {disk_used:.0f} GiB, {disk_free:.0f} GiB free; "
                                           f"short {disk_used - disk_free:.0f} GiB"))
    return HostSide(host_items, host_used, disk_items, disk_used, problems)

"""Where a plan's HardwareProfile comes from: --hw file, --box, inline --gpus, or this machine (quick probe)."""
from __future__ import annotations

from moetplan.contract.errors import UsageError
from moetplan.contract import HardwareProfile, load_json


def resolve_hardware(hw_path: str | None = None, box: str | None = None, gpus: str | None = None,
                     host_ram_gib: float | None = None, nvme_gbps: float | None = None,
                     pack_dir_free_gib: float | None = None, pack_dir: str | None = None,
                     probe_progress: bool = False) -> tuple[HardwareProfile, list[str]]:
    """Return (profile, notes). Exactly one of hw_path / box / gpus may be given; none = probe this machine."""
    from moetplan import hwdb

    given = [n for n, v in (("--hw", hw_path), ("--box", box), ("--gpus", gpus)) if v]
    if len(given) > 1:
        raise UsageError(f"give one hardware source, not {' and '.join(given)}")
    notes: list[str] = []
    if hw_path:
        hw = load_json(HardwareProfile, hw_path)
        hw.source = hw.source if hw.source.startswith("probe") else f"file:{hw_path}"
    elif box:
        hw = hwdb.box_profile(box)
    elif gpus:
        if host_ram_gib is None:
            raise UsageError("--gpus needs --host-ram-gib (host RAM decides whether a RAM expert store fits)")
        hw = hwdb.inline_profile(gpus, host_ram_gib, nvme_gbps, pack_dir_free_gib, pack_dir)
    else:
        from moetplan.hw.probe import probe

        hw = probe(pack_dir=pack_dir, quick=True, progress=probe_progress)
        if not hw.gpus:
            default = hwdb.guards()["planner"]["default_box"]
            notes.append(f"this machine has no NVIDIA GPU to plan for; planning for the default box '{default}' "
                         "(use --box, --gpus or --hw for another)")
            hw = hwdb.box_profile(default)
        return hw, notes
    # Inline overrides on top of a file or box.
    if host_ram_gib is not None and not gpus:
        hw.host.ram_gib = host_ram_gib
        hw.host.sources["ram_gib"] = "user"
    if pack_dir_free_gib is not None and not gpus:
        hw.storage.free_gib = pack_dir_free_gib
        hw.storage.sources["free_gib"] = "user"
    if nvme_gbps is not None and not gpus:
        hw.storage.seq_read_gbps = hw.storage.rand_read_gbps = nvme_gbps
        hw.storage.sources.update(seq_read_gbps="user", rand_read_gbps="user")
    if pack_dir and not gpus:
        hw.storage.path = pack_dir
    return hw, notes

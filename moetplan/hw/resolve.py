"""Where a plan's HardwareProfile comes from: --hw file, --box, inline --gpus, or this machine (quick probe)."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

from moetplan.contract import HardwareProfile, load_json
from moetplan.contract.errors import UsageError


def measure_pack_dir_free(pack_dir: str) -> tuple[float, str]:
    """Free GiB of the filesystem a pack dir lives on (its nearest existing parent when it does not exist yet),
    and the path measured."""
    p = Path(pack_dir).expanduser().resolve()
    probe = p
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if probe.exists() and not probe.is_dir():
        raise UsageError(f"--pack-dir {pack_dir}: {probe} is a file, not a directory; give a directory for the packs")
    return shutil.disk_usage(probe).free / 2**30, str(probe)


def resolve_hardware(hw_path: str | None = None, box: str | None = None, gpus: str | None = None,
                     host_ram_gib: float | None = None, nvme_gbps: float | None = None,
                     pack_dir_free_gib: float | None = None, pack_dir: str | None = None,
                     probe_progress: bool = False) -> tuple[HardwareProfile, list[str]]:
    """Return (profile, notes). Exactly one of hw_path / box / gpus may be given; none = probe this machine.

    A --pack-dir given without --pack-dir-free-gib is measured here (the free space of its filesystem)."""
    from moetplan import hwdb

    given = [n for n, v in (("--hw", hw_path), ("--box", box), ("--gpus", gpus)) if v]
    if len(given) > 1:
        raise UsageError(f"give one hardware source, not {' and '.join(given)}")
    notes: list[str] = []
    measured_free: float | None = None
    if pack_dir and pack_dir_free_gib is None:
        measured_free, where = measure_pack_dir_free(pack_dir)
        if where != str(Path(pack_dir).expanduser().resolve()):
            notes.append(f"--pack-dir {pack_dir} does not exist yet: measured the free space of {where}")
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
        from moetplan.hw.gpus import has_nvidia_gpu

        # No GPU, nothing to measure: the storage and DRAM tests would only describe a machine not planned for.
        if not has_nvidia_gpu():
            default = hwdb.guards()["planner"]["default_box"]
            notes.append(f"this machine has no NVIDIA GPU to plan for; planning for the default box '{default}' "
                         "(use --box, --gpus or --hw for another)")
            return hwdb.box_profile(default), notes
        from moetplan.hw.profile_probe import probe

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
    if pack_dir:
        hw.storage.path = os.fspath(pack_dir)
    if measured_free is not None:
        hw.storage.free_gib = round(measured_free, 1)
        hw.storage.sources["free_gib"] = "measured"
    return hw, notes

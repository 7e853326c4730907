"""Keep only the GPU code one architecture can load in a CUDA extension's fat binary (like nvprune, no CUDA here).

    python bench/tools/fatbin_prune.py IN.so OUT.so --arch 90

A CUDA shared object carries its device code in the ELF section `.nv_fatbin`: one fat binary per translation
unit (a 16-byte header: magic 0xBA55ED50, version, header size, payload size), each holding entries of one kind
(2 = cubin, 1 = PTX) for one architecture. The CUDA runtime registers each unit through a pointer to its header
and the driver picks, per unit, the cubin of the device's architecture, else PTX it can compile. On sm_90 a
cubin for any other architecture is never loaded (cubins run only within their major version), nor is PTX of a
unit that has an sm_90 cubin.

Pruning rewrites each unit in place: its header stays where the registration pointer expects it, the kept
entries move up behind it, its payload size shrinks, and the bytes freed at the end of the unit become zeros
(which compress to nearly nothing). Kept per unit: the cubins of `arch`; if there is none, the PTX entries of
architectures <= `arch` (what the driver would compile); if there is none of those either, the unit is left as
it is (no code for this GPU before or after). The file size and every other byte are unchanged.
"""
from __future__ import annotations

import argparse
import struct
import subprocess
from dataclasses import dataclass
from pathlib import Path

FATBIN_MAGIC = 0xBA55ED50
KIND_PTX, KIND_CUBIN = 1, 2


@dataclass
class Entry:
    offset: int  # of its header, in the file
    kind: int
    arch: int
    size: int  # header + padded payload


@dataclass
class Unit:
    offset: int
    header_size: int
    payload_size: int
    entries: list[Entry]


def fatbin_sections(path: Path) -> list[tuple[int, int]]:
    """(file offset, size) of each `.nv_fatbin` section (readelf)."""
    out = subprocess.run(["readelf", "-SW", str(path)], capture_output=True, text=True, check=True).stdout
    found = []
    for line in out.splitlines():
        fields = line.replace("]", "] ").split()
        if ".nv_fatbin" in fields:
            i = fields.index(".nv_fatbin")
            found.append((int(fields[i + 3], 16), int(fields[i + 4], 16)))
    return found


def units(data: bytes | bytearray, start: int, size: int) -> list[Unit]:
    pos, end, found = start, start + size, []
    while pos + 16 <= end:
        magic, _version, hsz, fsz = struct.unpack_from("<IHHQ", data, pos)
        if magic != FATBIN_MAGIC:
            pos += 8  # units are 8-byte aligned; padding between them
            continue
        entries, e, eend = [], pos + hsz, pos + hsz + fsz
        while e < eend:
            kind, _v, ehsz, padded = struct.unpack_from("<HHII", data, e)
            arch = struct.unpack_from("<I", data, e + 28)[0]
            entries.append(Entry(e, kind, arch, ehsz + padded))
            e += ehsz + padded
        found.append(Unit(pos, hsz, fsz, entries))
        pos = eend
    return found


def keep(unit: Unit, arch: int) -> list[Entry] | None:
    """The entries an `arch` GPU can load from this unit, or None to leave the unit untouched."""
    cubins = [e for e in unit.entries if e.kind == KIND_CUBIN and e.arch == arch]
    if cubins:
        return cubins
    ptx = [e for e in unit.entries if e.kind == KIND_PTX and e.arch <= arch]
    return ptx or None


@dataclass
class PruneReport:
    units: int
    pruned_units: int
    bytes_before: int
    bytes_after: int


def prune(data: bytearray, arch: int, sections: list[tuple[int, int]]) -> PruneReport:
    n = pruned = before = after = 0
    for start, size in sections:
        for unit in units(data, start, size):
            n += 1
            before += unit.payload_size
            kept = keep(unit, arch)
            if kept is None or len(kept) == len(unit.entries):
                after += unit.payload_size
                continue
            body = b"".join(bytes(data[e.offset:e.offset + e.size]) for e in kept)
            first = unit.offset + unit.header_size
            data[first:first + len(body)] = body
            data[first + len(body):first + unit.payload_size] = bytes(unit.payload_size - len(body))
            struct.pack_into("<Q", data, unit.offset + 8, len(body))
            pruned += 1
            after += len(body)
    return PruneReport(n, pruned, before, after)


def prune_file(src: Path, dst: Path, arch: int) -> PruneReport:
    data = bytearray(src.read_bytes())
    report = prune(data, arch, fatbin_sections(src))
    dst.write_bytes(bytes(data))
    return report


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("src", type=Path)
    ap.add_argument("dst", type=Path)
    ap.add_argument("--arch", type=int, default=90, help="SM version to keep (90 = H100/H200)")
    a = ap.parse_args(argv)
    r = prune_file(a.src, a.dst, a.arch)
    print(f"{a.src.name}: {r.pruned_units}/{r.units} units pruned, device code {r.bytes_before / 2**20:.1f} -> "
          f"{r.bytes_after / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()

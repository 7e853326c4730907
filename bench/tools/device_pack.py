"""Pack vLLM's CUDA wheel, trimmed for one GPU architecture, and the dependency wheels the GPU machine lacks into
carry pieces of at most BUDGET MiB each (bench/tools/device_wheels.sh runs it, bench/tools/device_install.sh
installs them).

    python bench/tools/device_pack.py --vllm-wheel vllm-0.26.0-...whl --deps DIR [--ds4-deps DIR] --out .whl

vLLM is repacked as xz tar archives (LZMA packs CUDA device code 2-4x better than the wheel's deflate) holding
the wheel's files minus what an sm_90 GPU never loads:
- `vllm_flash_attn/_vllm_fa2_C` (FlashAttention 2: the sm_8x / sm_120 path; on sm_90 vLLM picks FA3, the FA2
  import is optional) unless --with-fa2;
- `vllm-rs` (the Rust frontend, used only with VLLM_USE_RUST_FRONTEND), `third_party/fmha_sm100` (Blackwell
  attention), `_qutlass_C` (Blackwell FP4 kernels, an optional import), DeepGEMM's host module for the Pythons
  that are not 3.12;
- in every CUDA extension kept, the device code of other architectures (bench/tools/fatbin_prune.py).
Dependency wheels travel as they are. Pieces are filled largest first, the core group before the `ds4` one
(TileLang, which DeepSeek-V4's hyper-connection kernels need), which takes what room the core pieces leave.

Writes OUT/p1, OUT/p2, ... and OUT/manifest.json (files, sizes, pieces).
"""
from __future__ import annotations

import argparse
import io
import json
import tarfile
import tempfile
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

try:  # bench/ is not a package: run as a script or loaded by path
    from fatbin_prune import fatbin_sections, prune
except ImportError:  # pragma: no cover
    from bench.tools.fatbin_prune import fatbin_sections, prune

MiB = 2**20
DROP_ALWAYS = ("vllm/vllm-rs", "vllm/_qutlass_C.abi3.so")
DROP_PREFIXES = ("vllm/third_party/fmha_sm100/",)
FA2 = "vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so"
DEEP_GEMM_HOST = "vllm/third_party/deep_gemm/_C.cpython-"
KEEP_PYTHON = "312"


def dropped(name: str, with_fa2: bool) -> bool:
    if name in DROP_ALWAYS or name.startswith(DROP_PREFIXES):
        return True
    if name == FA2 and not with_fa2:
        return True
    return name.startswith(DEEP_GEMM_HOST) and not name.startswith(DEEP_GEMM_HOST + KEEP_PYTHON)


@dataclass
class Item:
    path: Path  # the file that travels
    group: str  # "core" or "ds4"
    size: int = 0

    def __post_init__(self) -> None:
        self.size = self.path.stat().st_size


@dataclass
class Piece:
    items: list[Item] = field(default_factory=list)

    @property
    def size(self) -> int:
        return sum(i.size for i in self.items)


def _xz_tar(members: list[tuple[str, bytes, int]], dst: Path) -> None:
    with tarfile.open(dst, "w:xz", preset=6) as tar:
        for name, data, mode in members:
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(data), mode
            tar.addfile(info, io.BytesIO(data))


def repack_vllm(wheel: Path, work: Path, arch: int, with_fa2: bool, chunk: int) -> tuple[list[Path], dict]:
    """The trimmed wheel as xz tars: one per CUDA extension, the rest in tars of about `chunk` raw bytes."""
    stats = {"dropped": [], "pruned": {}}
    big: list[Path] = []
    small: list[tuple[str, bytes, int]] = []
    small_bytes, n_small = 0, 0
    with zipfile.ZipFile(wheel) as zf:
        for info in zf.infolist():
            name = info.filename
            if name.endswith("/"):
                continue
            if dropped(name, with_fa2):
                stats["dropped"].append(name)
                continue
            data = zf.read(info)
            mode = (info.external_attr >> 16) & 0o777 or 0o644
            if name.endswith(".so") and len(data) > 1 * MiB:
                tmp = Path(tempfile.mkstemp(dir=work, suffix=".so")[1])
                tmp.write_bytes(data)
                sections = fatbin_sections(tmp)
                tmp.unlink()
                if sections:
                    buf = bytearray(data)
                    r = prune(buf, arch, sections)
                    data = bytes(buf)
                    stats["pruned"][name] = [round(r.bytes_before / MiB, 1), round(r.bytes_after / MiB, 1)]
                out = work / (Path(name).name + ".tar.xz")
                _xz_tar([(name, data, mode)], out)
                big.append(out)
                continue
            small.append((name, data, mode))
            small_bytes += len(data)
            if small_bytes >= chunk:
                n_small += 1
                out = work / f"vllm-py-{n_small}.tar.xz"
                _xz_tar(small, out)
                big.append(out)
                small, small_bytes = [], 0
    if small:
        n_small += 1
        out = work / f"vllm-py-{n_small}.tar.xz"
        _xz_tar(small, out)
        big.append(out)
    return big, stats


def fill(items: list[Item], budget: int) -> list[Piece]:
    """First-fit decreasing into pieces of at most `budget` bytes: the core items first, so a run without
    DeepSeek-V4 carries only the pieces they fill; the ds4 items then take the room left in those before new
    pieces (fewest pieces for the whole set)."""
    pieces: list[Piece] = []
    for group in ("core", "ds4"):
        for item in sorted((i for i in items if i.group == group), key=lambda i: -i.size):
            if item.size > budget:
                raise SystemExit(f"{item.path.name} is {item.size / MiB:.1f} MiB, over the {budget / MiB:.0f} "
                                 "MiB piece budget")
            target = next((p for p in pieces if p.size + item.size <= budget), None)
            if target is None:
                target = Piece()
                pieces.append(target)
            target.items.append(item)
    return pieces


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--vllm-wheel", type=Path, required=True)
    ap.add_argument("--deps", type=Path, required=True, help="folder of dependency wheels (core group)")
    ap.add_argument("--ds4-deps", type=Path, help="folder of wheels only DeepSeek-V4 needs (own pieces)")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--budget-mib", type=float, required=True, help="largest piece")
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("--with-fa2", action="store_true")
    a = ap.parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    work = a.out / "build"
    work.mkdir(exist_ok=True)
    archives, stats = repack_vllm(a.vllm_wheel, work, a.arch, a.with_fa2, chunk=64 * MiB)
    items = [Item(p, "core") for p in archives] + [Item(p, "core") for p in sorted(a.deps.glob("*.whl"))]
    if a.ds4_deps:
        items += [Item(p, "ds4") for p in sorted(a.ds4_deps.glob("*.whl"))]
    pieces = fill(items, int(a.budget_mib * MiB))
    manifest = {"vllm_wheel": a.vllm_wheel.name, "arch": f"sm_{a.arch}", "budget_mib": a.budget_mib,
                "vllm": stats, "pieces": []}
    for n, piece in enumerate(pieces, 1):
        folder = a.out / f"p{n}"
        folder.mkdir(exist_ok=True)
        for item in piece.items:
            if item.path.parent == work:  # built here: move
                item.path.replace(folder / item.path.name)
            else:  # a downloaded wheel: the cache keeps its copy
                (folder / item.path.name).write_bytes(item.path.read_bytes())
        group = "core" if any(i.group == "core" for i in piece.items) else "ds4"
        manifest["pieces"].append({"name": f"p{n}", "group": group, "mib": round(piece.size / MiB, 1),
                                   "files": {i.path.name: round(i.size / MiB, 2) for i in piece.items}})
    work.rmdir()
    total = sum(p["mib"] for p in manifest["pieces"])
    manifest["total_mib"] = round(total, 1)
    text = json.dumps(manifest, indent=1) + "\n"
    (a.out / "manifest.json").write_text(text)
    for p in manifest["pieces"]:  # each piece says how many there are (bench/tools/device_install.sh)
        (a.out / p["name"] / "manifest.json").write_text(text)
    for p in manifest["pieces"]:
        print(f"{p['name']} ({p['group']}): {p['mib']} MiB, {len(p['files'])} files")
    print(f"total {total:.1f} MiB in {len(pieces)} pieces")


if __name__ == "__main__":
    main()

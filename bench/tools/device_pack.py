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
Dependency wheels are repacked the same way (one xz tar of the wheel's files each, as `pip install --target`
would lay them out: `*.data/purelib|platlib` at the top, the wheel's scripts/data/headers dropped), less what
WHEEL_DROPS names (a duplicate libz3, AMD's composable_kernel headers, aarch64 stubs). An archive larger than a
piece is split into byte parts (`NAME.tar.xz.part1-of-2`, ...) that bench/tools/device_install.sh joins once all
have arrived. Pieces are filled largest first, the core group before the `ds4` one (TileLang, CuTe-DSL and quack,
which DeepSeek-V4's kernels need), which takes what room the core pieces leave. With --cache, archives are kept
between runs (xz of ~600 MB takes minutes on two cores).

Writes OUT/p1, OUT/p2, ... and OUT/manifest.json (files, sizes, pieces).
"""
from __future__ import annotations

import argparse
import hashlib
import io
import json
import math
import re
import shutil
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
# Files of dependency wheels an sm_90 serving run never opens (prefixes of the installed path), by wheel name:
# z3's library is there twice (tilelang's libtvm and z3core load `libz3.so`); TileLang's HIP headers (AMD);
# CuTe-DSL's aarch64 link stubs.
WHEEL_DROPS: dict[str, tuple[str, ...]] = {
    "z3_solver": ("z3/lib/libz3.so.4.15",),
    "tilelang": ("tilelang/3rdparty/composable_kernel/",),
    "nvidia_cutlass_dsl_libs_cu13": ("nvidia_cutlass_dsl/cu13/lib/stubs/",),
    "nvidia_cutlass_dsl_libs_cu12": ("nvidia_cutlass_dsl/cu12/lib/stubs/",),
}
PART_RE = re.compile(r"^(?P<name>.+)\.part(?P<k>\d+)-of-(?P<n>\d+)$")


def dropped(name: str, with_fa2: bool) -> bool:
    if name in DROP_ALWAYS or name.startswith(DROP_PREFIXES):
        return True
    if name == FA2 and not with_fa2:
        return True
    return name.startswith(DEEP_GEMM_HOST) and not name.startswith(DEEP_GEMM_HOST + KEEP_PYTHON)


def wheel_member(name: str) -> str | None:
    """Where a wheel's file lands under `pip install --target` (None: not installed there)."""
    parts = name.split("/")
    if parts[0].endswith(".data"):
        if len(parts) > 2 and parts[1] in ("purelib", "platlib"):
            return "/".join(parts[2:])
        return None  # scripts, data, headers: outside the target's import path
    return name


def wheel_dropped(wheel_name: str, member: str) -> bool:
    drops = WHEEL_DROPS.get(wheel_name.split("-")[0], ())
    return member.startswith(drops)


def _rules_tag(*rules: object) -> str:
    """A short hash of the rules an archive was made with (its cache key changes with them)."""
    return hashlib.sha1(json.dumps([str(r) for r in rules]).encode()).hexdigest()[:10]


def repack_wheel(wheel: Path, dst_dir: Path) -> Path:
    """The wheel's installed files as one xz tar (`<wheel stem>.tar.xz`)."""
    members: list[tuple[str, bytes, int]] = []
    with zipfile.ZipFile(wheel) as zf:
        for info in zf.infolist():
            if info.filename.endswith("/"):
                continue
            member = wheel_member(info.filename)
            if member is None or wheel_dropped(wheel.name, member):
                continue
            mode = (info.external_attr >> 16) & 0o777 or 0o644
            members.append((member, zf.read(info), mode))
    out = dst_dir / (wheel.name[:-len(".whl")] + ".tar.xz")
    tmp = out.with_suffix(".tmp")
    _xz_tar(members, tmp)
    tmp.replace(out)
    return out


def cached(cache: Path | None, key: str, make) -> list[Path]:
    """`make(folder)` -> files, kept under cache/key (made once per key); without a cache, in a temp folder."""
    if cache is None:
        folder = Path(tempfile.mkdtemp(prefix="device-pack-"))
        return make(folder)
    folder = cache / key
    done = folder / ".done"
    if done.exists():
        return [folder / n for n in done.read_text().split()]
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    files = make(folder)
    done.write_text("\n".join(f.name for f in files) + "\n")
    return files


def split_parts(path: Path, part_bytes: int, work: Path) -> list[Path]:
    """`path` cut into parts of at most `part_bytes` (cat joins them): NAME.part1-of-N, ..."""
    size = path.stat().st_size
    n = math.ceil(size / part_bytes)
    out = []
    with path.open("rb") as f:
        for k in range(1, n + 1):
            part = work / f"{path.name}.part{k}-of-{n}"
            part.write_bytes(f.read(part_bytes))
            out.append(part)
    return out


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


def split_oversize(items: list[Item], budget: int, work: Path) -> list[Item]:
    """Items over the piece budget become byte parts: full-budget parts and the rest, so first-fit packs the
    remainder beside other items."""
    out = []
    for item in items:
        if item.size <= budget:
            out.append(item)
            continue
        out += [Item(p, item.group) for p in split_parts(item.path, budget, work)]
    return out


# What `moetplan build-kernels` imports that the GPU image lacks: kept in one piece, so the first call can start the
# kernel build (bench/tools/device_install.sh MOETPLAN_BUILD_KERNELS=1).
MOETPLAN_NEEDS = ("pydantic-", "pydantic_core-", "annotated_types-", "typing_inspection-", "platformdirs-")


def gather(pieces: list[Piece], prefixes: tuple[str, ...], budget: int) -> None:
    """Move the items named by `prefixes` into one piece that can hold them all (the one already holding most of
    their bytes); left as they are where none can."""
    named = [(piece, item) for piece in pieces for item in piece.items if item.path.name.startswith(prefixes)]
    if not named:
        return
    total = sum(i.size for _, i in named)

    def held(pc: Piece) -> int:
        return sum(i.size for q, i in named if q is pc)

    fits = [pc for pc in pieces if pc.size - held(pc) + total <= budget]
    if not fits:
        return
    home = max(fits, key=held)
    for piece, item in named:
        if piece is not home:
            piece.items.remove(item)
            home.items.append(item)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--vllm-wheel", type=Path, required=True)
    ap.add_argument("--deps", type=Path, required=True, help="folder of dependency wheels (core group)")
    ap.add_argument("--ds4-deps", type=Path, help="folder of wheels only DeepSeek-V4 needs (own pieces)")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--budget-mib", type=float, required=True, help="largest piece")
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("--with-fa2", action="store_true")
    ap.add_argument("--cache", type=Path, help="keep the xz archives here between runs")
    a = ap.parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    work = a.out / "build"
    work.mkdir(exist_ok=True)
    stats_box: dict = {}

    def make_vllm(folder: Path) -> list[Path]:
        files, stats = repack_vllm(a.vllm_wheel, folder, a.arch, a.with_fa2, chunk=64 * MiB)
        (folder / "stats.json").write_text(json.dumps(stats))
        return files

    key = f"{a.vllm_wheel.name}.sm{a.arch}{'.fa2' if a.with_fa2 else ''}.{_rules_tag(DROP_ALWAYS, DROP_PREFIXES)}"
    archives = cached(a.cache, key, make_vllm)
    stats_file = archives[0].parent / "stats.json"
    stats = json.loads(stats_file.read_text()) if stats_file.exists() else stats_box

    def deps(folder: Path, group: str) -> list[Item]:
        return [Item(cached(a.cache, f"{w.name}.{_rules_tag(WHEEL_DROPS.get(w.name.split('-')[0]))}", lambda d, w=w: [repack_wheel(w, d)])[0], group)
                for w in sorted(folder.glob("*.whl"))]

    items = [Item(p, "core") for p in archives] + deps(a.deps, "core")
    if a.ds4_deps:
        items += deps(a.ds4_deps, "ds4")
    budget = int(a.budget_mib * MiB)
    items = split_oversize(items, budget, work)
    pieces = fill(items, budget)
    gather(pieces, MOETPLAN_NEEDS, budget)
    manifest = {"vllm_wheel": a.vllm_wheel.name, "arch": f"sm_{a.arch}", "budget_mib": a.budget_mib,
                "vllm": stats, "pieces": []}
    for n, piece in enumerate(pieces, 1):
        folder = a.out / f"p{n}"
        folder.mkdir(exist_ok=True)
        for item in piece.items:
            if item.path.parent == work or a.cache is None:  # built for this run: move
                shutil.move(str(item.path), folder / item.path.name)
            else:  # the cache keeps its copy
                shutil.copyfile(item.path, folder / item.path.name)
        group = "core" if any(i.group == "core" for i in piece.items) else "ds4"
        manifest["pieces"].append({"name": f"p{n}", "group": group, "mib": round(piece.size / MiB, 1),
                                   "files": {i.path.name: round(i.size / MiB, 2) for i in piece.items}})
    shutil.rmtree(work)
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

"""bench/tools/fatbin_prune.py and bench/tools/device_pack.py: what an sm_90 GPU keeps of a fat binary, what of vLLM's wheel
travels, and how the carry pieces are filled."""
from __future__ import annotations

import struct
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench" / "tools"))

import device_pack  # noqa: E402
import fatbin_prune as fp  # noqa: E402

ENTRY_HEADER = 64


def _entry(kind: int, arch: int, payload: bytes) -> bytes:
    head = bytearray(ENTRY_HEADER)
    struct.pack_into("<HHII", head, 0, kind, 0x0101, ENTRY_HEADER, len(payload))
    struct.pack_into("<I", head, 28, arch)
    return bytes(head) + payload


def _unit(*entries: bytes) -> bytes:
    body = b"".join(entries)
    return struct.pack("<IHHQ", fp.FATBIN_MAGIC, 1, 16, len(body)) + body


def _archs(data, start, size):
    return [[(e.kind, e.arch) for e in u.entries] for u in fp.units(data, start, size)]


def test_prune_keeps_what_sm90_loads_in_place():
    C, P = fp.KIND_CUBIN, fp.KIND_PTX
    units = [
        _unit(_entry(C, 80, b"a" * 64), _entry(C, 90, b"b" * 32), _entry(C, 120, b"c" * 96), _entry(P, 90, b"p" * 8)),
        _unit(_entry(C, 86, b"d" * 16), _entry(P, 80, b"e" * 24), _entry(P, 100, b"f" * 8)),  # PTX for the JIT
        _unit(_entry(C, 100, b"g" * 40), _entry(C, 120, b"h" * 40)),  # no sm_90 code: left as it is
    ]
    prefix = b"\x7fELF" + bytes(12)
    data = bytearray(prefix + b"".join(units) + b"tail")
    start, size = len(prefix), sum(map(len, units))
    offsets = [u.offset for u in fp.units(data, start, size)]
    before = bytes(data)
    r = fp.prune(data, 90, [(start, size)])
    assert len(data) == len(before) and data[:start] == before[:start] and data[-4:] == b"tail"
    assert [u.offset for u in fp.units(data, start, size)] == offsets  # registration pointers still valid
    assert _archs(data, start, size) == [[(C, 90)], [(P, 80)], [(C, 100), (C, 120)]]
    kept = fp.units(data, start, size)[0].entries[0]
    assert bytes(data[kept.offset + ENTRY_HEADER:kept.offset + ENTRY_HEADER + 32]) == b"b" * 32
    assert r.units == 3 and r.pruned_units == 2 and r.bytes_after < r.bytes_before
    # the freed bytes of unit 0 are zeros, up to where unit 1 starts
    end0 = offsets[0] + 16 + ENTRY_HEADER + 32
    assert set(data[end0:offsets[1]]) == {0}


@pytest.mark.parametrize("name, with_fa2, gone", [
    ("vllm/vllm-rs", False, True),
    ("vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so", False, True),
    ("vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so", True, False),
    ("vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so", False, False),
    ("vllm/third_party/fmha_sm100/cutlass/include/cute/arch/mma_sm90_gmma.hpp", False, True),
    ("vllm/third_party/deep_gemm/include/cute/arch/mma_sm90_gmma.hpp", False, False),
    ("vllm/third_party/deep_gemm/_C.cpython-313-x86_64-linux-gnu.so", False, True),
    ("vllm/third_party/deep_gemm/_C.cpython-312-x86_64-linux-gnu.so", False, False),
    ("vllm/_qutlass_C.abi3.so", False, True),
    ("vllm/_C_stable_libtorch.abi3.so", False, False),
])
def test_what_of_the_wheel_travels(name, with_fa2, gone):
    assert device_pack.dropped(name, with_fa2) is gone


def test_pieces_fill_largest_first_within_the_budget_core_before_ds4(tmp_path):
    def item(name, mib, group="core"):
        p = tmp_path / name
        p.write_bytes(bytes(int(mib * device_pack.MiB)))
        return device_pack.Item(p, group)

    items = [item("a", 30), item("b", 25), item("c", 20), item("d", 5), item("t", 40, "ds4"), item("z", 10, "ds4")]
    pieces = device_pack.fill(items, int(55 * device_pack.MiB))
    # core in the first pieces (a run without DeepSeek-V4 carries only those); ds4 fills their room first
    assert [[i.path.name for i in p.items] for p in pieces] == [["a", "b"], ["c", "d", "z"], ["t"]]
    assert all(p.size <= 55 * device_pack.MiB for p in pieces)
    with pytest.raises(SystemExit, match="over the 10 MiB"):
        device_pack.fill([item("big", 11)], int(10 * device_pack.MiB))


def test_import_scan_sorts_imports_by_when_they_run():
    import ast
    import textwrap

    import vllm_imports as vi

    src = textwrap.dedent('''
        import fastapi
        from . import sibling
        from typing import TYPE_CHECKING
        if TYPE_CHECKING:
            import never_at_runtime
        if has_flashinfer():
            import flashinfer
        try:
            import xxhash
        except ImportError:
            xxhash = None
        with contextlib.suppress(ImportError):
            import qutlass
        class A:
            import in_class_body
            def f(self):
                import tilelang
    ''')
    got = vi.scan_module(ast.parse(src), "vllm.utils.hashing", is_pkg=False)
    assert {"fastapi", "vllm.utils.sibling", "in_class_body"} <= got.eager
    assert "never_at_runtime" not in got.eager | got.conditional
    assert got.conditional == {"flashinfer"}
    assert got.optional == {"xxhash", "qutlass"}
    assert got.lazy == {"tilelang"}


def test_dependency_wheels_travel_as_installed_less_what_sm90_never_opens(tmp_path):
    import tarfile
    import zipfile

    whl = tmp_path / "z3_solver-4.15.4.0-py3-none-manylinux_2_17_x86_64.whl"
    with zipfile.ZipFile(whl, "w") as zf:
        zf.writestr("z3/__init__.py", "x = 1\n")
        zf.writestr("z3/lib/libz3.so", b"\x7fELF lib")
        zf.writestr("z3/lib/libz3.so.4.15", b"\x7fELF lib")  # the same library again
        zf.writestr("z3_solver-4.15.4.0.data/data/bin/z3", b"\x7fELF binary")  # a script dir: not installed
        zf.writestr("z3_solver-4.15.4.0.data/platlib/z3_extra.py", "y = 2\n")  # installed at the top
        zf.writestr("z3_solver-4.15.4.0.dist-info/METADATA", "Name: z3-solver\nVersion: 4.15.4.0\n")
    out = device_pack.repack_wheel(whl, tmp_path)
    assert out.name == "z3_solver-4.15.4.0-py3-none-manylinux_2_17_x86_64.tar.xz"
    with tarfile.open(out) as tar:
        assert sorted(tar.getnames()) == ["z3/__init__.py", "z3/lib/libz3.so", "z3_extra.py",
                                          "z3_solver-4.15.4.0.dist-info/METADATA"]
        assert tar.extractfile("z3_extra.py").read() == b"y = 2\n"


def test_an_archive_over_the_budget_travels_as_parts_that_join_back(tmp_path):
    work = tmp_path / "w"
    work.mkdir()
    data = bytes(range(256)) * 4096 * 11  # 11 MiB
    big = tmp_path / "libs.tar.xz"
    big.write_bytes(data)
    small = tmp_path / "small.tar.xz"
    small.write_bytes(b"s" * 1000)
    budget = 4 * device_pack.MiB
    items = device_pack.split_oversize([device_pack.Item(big, "ds4"), device_pack.Item(small, "core")], budget, work)
    names = [i.path.name for i in items]
    assert names == ["libs.tar.xz.part1-of-3", "libs.tar.xz.part2-of-3", "libs.tar.xz.part3-of-3", "small.tar.xz"]
    assert [i.size for i in items[:3]] == [budget, budget, len(data) - 2 * budget]
    assert all(i.group == "ds4" for i in items[:3])
    assert b"".join(i.path.read_bytes() for i in items[:3]) == data
    m = device_pack.PART_RE.match(names[1])
    assert (m["name"], m["k"], m["n"]) == ("libs.tar.xz", "2", "3")
    pieces = device_pack.fill(items, budget)
    assert all(p.size <= budget for p in pieces) and len(pieces) == 3  # the 3 MiB tail shares a piece with small


def test_install_check_follows_deepseek_v4s_function_level_imports(tmp_path):
    import vllm_imports as vi

    pkg = tmp_path / "vllm" / "models" / "deepseek_v4"
    for d in ("", "nvidia", "nvidia/ops", "amd"):
        (pkg / d).mkdir(parents=True, exist_ok=True)
        (pkg / d / "__init__.py").write_text("")
    (tmp_path / "vllm" / "__init__.py").write_text("")
    (tmp_path / "vllm" / "models" / "__init__.py").write_text("")
    (pkg / "compressor.py").write_text(
        "import torch\n"
        "def forward(self):\n"
        "    if cuda:\n"
        "        from .nvidia.ops.sparse_attn_compress_cutedsl import compress\n"
        "    import quack.compile_utils\n"
        "    from aiter import x\n")
    (pkg / "amd" / "model.py").write_text("def f():\n    import aiter_only_here\n")
    got = vi.function_imports(vi.Tree(tmp_path), "vllm.models.deepseek_v4")
    assert got == {"vllm.models.deepseek_v4.nvidia.ops.sparse_attn_compress_cutedsl": "vllm.models.deepseek_v4.compressor",
                   "quack.compile_utils": "vllm.models.deepseek_v4.compressor"}


def test_moetplans_own_needs_end_up_in_one_piece(tmp_path):
    def item(name, mib):
        p = tmp_path / name
        p.write_bytes(bytes(int(mib * device_pack.MiB)))
        return device_pack.Item(p, "core")

    items = [item("big-a.tar.xz", 50), item("pydantic-2.tar.xz", 2), item("big-b.tar.xz", 40),
             item("pydantic_core-2.tar.xz", 3), item("platformdirs-4.tar.xz", 1)]
    budget = int(55 * device_pack.MiB)
    pieces = device_pack.fill(items, budget)
    device_pack.gather(pieces, device_pack.MOETPLAN_NEEDS, budget)
    homes = {i.path.name: n for n, p in enumerate(pieces) for i in p.items}
    assert homes["pydantic-2.tar.xz"] == homes["pydantic_core-2.tar.xz"] == homes["platformdirs-4.tar.xz"]
    assert all(p.size <= budget for p in pieces)

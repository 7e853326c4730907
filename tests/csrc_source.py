"""Compile-time constants of the decode stages, read from csrc/moe_decode.cuh's text, and a host C++ build of pieces
of that text: the tests that check host logic (the launch plan, the fast division) against the source take them
from here rather than repeating the numbers or the build."""
from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

CSRC = Path(__file__).resolve().parents[1] / "csrc"


def _constant(name: str, file: str, ctype: str) -> int:
    m = re.search(rf"constexpr {ctype} {name} = (\d+);", (CSRC / file).read_text())
    assert m, f"{name} not found in csrc/{file}"
    return int(m.group(1))


def decode_constant(name: str) -> int:
    """The value of `constexpr int NAME = N;` in csrc/moe_decode.cuh."""
    return _constant(name, "moe_decode.cuh", "int")


def kernels_constant(name: str) -> int:
    """The value of `constexpr int64_t NAME = N;` in csrc/moe_kernels.cu (host-side launch constants)."""
    return _constant(name, "moe_kernels.cu", "int64_t")


def compile_host(cpp: str, out: Path) -> Path:
    """Build `cpp` (host C++ cut from csrc/ plus a main) into the executable `out` with the system compiler; skips
    the calling test where there is none."""
    cxx = shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")
    if cxx is None:
        pytest.skip("no C++ compiler")
    src = out.with_suffix(".cpp")
    src.write_text(cpp)
    subprocess.run([cxx, "-std=c++17", "-O2", str(src), "-o", str(out)], check=True, capture_output=True)
    return out

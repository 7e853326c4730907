"""bench/tools/read_pattern.py: its pattern table matches the CUDA dispatch, and bad --patterns fail before any
build."""
from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.tools import read_pattern  # noqa: E402

CU = (ROOT / "bench" / "cuda" / "read_pattern.cu").read_text()


def test_every_pattern_has_a_kernel_and_a_description():
    # kernel_of() indexes its table by mode, so the table's order is the PATTERNS keys
    table = re.search(r"kernels\[\] = \{(.*?)\};", CU, re.S).group(1)
    assert [int(m) for m in re.findall(r"read_kernel<(\d+)>", table)] == sorted(read_pattern.PATTERNS), \
        "PATTERNS and the .cu kernel table disagree"
    for mode, name in read_pattern.PATTERNS.items():
        # the header comment documents each mode as `N "name"`
        assert re.search(rf'//\s+{mode} "{re.escape(name)}"', CU), f"mode {mode} ({name}) is not described in the .cu"


def test_unknown_pattern_is_rejected_before_building(monkeypatch, tmp_path):
    def no_build(*a, **k):  # the extension must not be built for a bad command line
        raise AssertionError("built the extension")

    monkeypatch.setattr(read_pattern, "load", no_build)
    monkeypatch.setattr(sys, "argv", ["read_pattern.py", "--out", str(tmp_path / "x.json"),
                                      "--patterns", "ring_gemv,ring_tiles"])
    with pytest.raises(SystemExit, match=r"unknown pattern\(s\) \['ring_tiles'\].*ring_tile"):
        read_pattern.main()

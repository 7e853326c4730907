"""Compile-time constants of the decode stages, read from csrc/moe_decode.cuh's text: the tests that check host
logic (the launch plan) against the source take them from here rather than repeating the numbers."""
from __future__ import annotations

import re
from pathlib import Path

CSRC = Path(__file__).resolve().parents[1] / "csrc"


def decode_constant(name: str) -> int:
    """The value of `constexpr int NAME = N;` in csrc/moe_decode.cuh."""
    m = re.search(rf"constexpr int {name} = (\d+);", (CSRC / "moe_decode.cuh").read_text())
    assert m, f"{name} not found in csrc/moe_decode.cuh"
    return int(m.group(1))

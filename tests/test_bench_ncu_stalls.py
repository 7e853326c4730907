"""bench/ncu_stalls.py: the stall summary of an Nsight Compute SASS page (a small csv written here)."""
from __future__ import annotations

import csv
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.ncu_stalls import kernels, summary  # noqa: E402

HEADER = ["Address", "Source", "Warp Stall Sampling (All Samples)", "stall_wait", "stall_long_sb",
          "stall_barrier", "stall_wait (Not Issued)"]


def _write(path: Path) -> None:
    rows = [
        ["Kernel Name", "void k1(int)"], HEADER,
        ["0x0", "      PRMT R1, R2, R3, R4", "6", "2", "0", "0", "99"],
        ["0x10", "  @!P0 PRMT R5, R2, R3, R4", "2", "2", "0", "0", "99"],
        ["0x20", "      HMMA.16816.F32.BF16 R8, R4, R6, R8", "6", "0", "6", "0", "99"],
        ["0x30", "      UMOV UR4, 0x0", "", "0", "0", "", "99"],
        ["Kernel Name", "void k1(int)"], HEADER,  # the same kernel's second launch: skipped by main()
        ["0x0", "      PRMT R1, R2, R3, R4", "1", "1", "0", "0", "0"],
        ["Kernel Name", "void k2(int)"], HEADER,
        ["0x0", "      BAR.SYNC 0x0", "4", "0", "0", "4", "0"],
    ]
    with open(path, "w", newline="") as f:
        csv.writer(f).writerows(rows)


def test_sections_and_shares(tmp_path):
    p = tmp_path / "sass.csv"
    _write(p)
    secs = list(kernels(str(p)))
    assert [s["name"] for s in secs] == ["void k1(int)", "void k1(int)", "void k2(int)"]
    assert len(secs[0]["rows"]) == 4
    text = summary(secs[0])
    # 10 samples: wait 4 (PRMT, predicated or not, counted under one opcode), long_sb 6 (HMMA); the
    # "(Not Issued)" columns are a subset and not added again.
    assert "(10 samples)" in text
    assert "long_sb 60.0%, wait 40.0%" in text
    lines = text.splitlines()
    assert lines[2].split()[:2] == ["HMMA.16816.F32.BF16", "60.0%"]
    assert lines[3].split()[:2] == ["PRMT", "40.0%"]
    assert "barrier 100.0%" in summary(secs[2])

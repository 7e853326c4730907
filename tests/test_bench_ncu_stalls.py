"""bench/tools/ncu_stalls.py: the stall summary of an Nsight Compute SASS page (a small csv written here)."""
from __future__ import annotations

import csv
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.tools.ncu_stalls import kernels, summary  # noqa: E402

HEADER = ["Address", "Source", "Warp Stall Sampling (All Samples)", "stall_wait", "stall_long_sb",
          "stall_barrier", "stall_wait (Not Issued)"]


def _write(path: Path, rows: list[list[str]]) -> Path:
    with open(path, "w", newline="") as f:
        csv.writer(f).writerows(rows)
    return path


TWO_KERNELS = [
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


def test_sections_and_shares(tmp_path):
    p = _write(tmp_path / "sass.csv", TWO_KERNELS)
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


def test_samples_before_inside_and_after_the_main_loop(tmp_path):
    # Prologue 0x0-0x10 (5 samples), main loop 0x20-0x50 (its backward branch at 0x50 holds the HMMA; the outer
    # branch at 0x70 is not the innermost), epilogue 0x60-0x80 (2 samples).
    rows = [
        ["Kernel Name", "void k3(int)"], HEADER,
        ["0x0", "      LDGSTS.E.BYPASS.128 [R1], [R2.64]", "3", "3", "0", "0", "0"],
        ["0x10", "      UMOV UR4, 0x400", "2", "0", "0", "2", "0"],
        ["0x20", "      PRMT R1, R2, R3, R4", "4", "4", "0", "0", "0"],
        ["0x30", "  @P1 HMMA.16816.F32.BF16 R8, R4, R6, R8", "8", "0", "8", "0", "0"],
        ["0x40", "      IADD3 R1, R1, 0x1, RZ", "1", "1", "0", "0", "0"],
        ["0x50", "  @!P0 BRA 0x20", "0", "0", "0", "0", "0"],
        ["0x60", "      STG.E [R2.64], R8", "1", "1", "0", "0", "0"],
        ["0x70", "  @!P2 BRA 0x0", "0", "0", "0", "0", "0"],
        ["0x80", "      EXIT", "1", "0", "0", "1", "0"],
        ["Kernel Name", "void k4(int)"], HEADER,  # no MMA: no loop line
        ["0x0", "      BRA 0x0", "1", "1", "0", "0", "0"],
    ]
    k3, k4 = kernels(str(_write(tmp_path / "loop.csv", rows)))
    assert "before the main loop 25.0%, in it 65.0%, after it 10.0%" in summary(k3)
    assert "main loop" not in summary(k4)

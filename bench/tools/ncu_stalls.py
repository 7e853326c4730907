"""Stall-reason summary of an Nsight Compute SASS page: per kernel, the share of warp stall samples
by reason and the instructions (by opcode) that collect them. Input: the csv that

    ncu -i REPORT.ncu-rep --page source --csv --print-source sass > sass.csv

writes (bench/gpu_session.sh's ncu step does). Usage: python3 bench/tools/ncu_stalls.py sass.csv [more.csv ...]
"""
from __future__ import annotations

import argparse
import collections
import csv
import re
from collections.abc import Iterator
from typing import Any


def kernels(path: str) -> Iterator[dict[str, Any]]:
    """The csv's kernel sections: name, header row and instruction rows (one section per profiled launch)."""
    cur: dict[str, Any] | None = None
    with open(path, newline="") as f:
        for row in csv.reader(f):
            if not row:
                continue
            if row[0] == "Kernel Name":
                if cur is not None:
                    yield cur
                cur = {"name": row[1], "header": None, "rows": []}
            elif row[0] == "Address" and cur is not None:
                cur["header"] = row
            elif cur is not None and cur["header"] is not None:
                cur["rows"].append(row)
    if cur is not None:
        yield cur


def _opcode(src: str) -> str:
    """The opcode of a SASS line, without its predicate (@P0, @!UP1)."""
    return re.sub(r"^@!?U?P\w+\s+", "", src).split(" ")[0] if src else "?"


def loop_shares(section: dict[str, Any], samples: list[int]) -> tuple[float, float, float] | None:
    """Shares of the samples before, inside and after the kernel's main loop: the innermost backward branch whose
    range holds the first MMA instruction. None without an MMA or such a loop."""
    h = {k: i for i, k in enumerate(section["header"])}
    addr = [int(r[h["Address"]], 16) for r in section["rows"]]
    srcs = [r[h["Source"]].strip() for r in section["rows"]]
    mma = next((a for a, src in zip(addr, srcs) if "MMA" in _opcode(src)), None)
    if mma is None:
        return None
    loops = []
    for a, src in zip(addr, srcs):
        m = re.search(r"\bBRA\b.*?(0x[0-9a-fA-F]+)", src)
        if m and int(m.group(1), 16) <= mma <= a:
            loops.append((int(m.group(1), 16), a))
    if not loops:
        return None
    lo, hi = min(loops, key=lambda r: r[1] - r[0])
    n = sum(samples) or 1
    before = sum(v for a, v in zip(addr, samples) if a < lo)
    inside = sum(v for a, v in zip(addr, samples) if lo <= a <= hi)
    return before / n, inside / n, (n - before - inside) / n


def summary(section: dict[str, Any], top: int = 8) -> str:
    h = {k: i for i, k in enumerate(section["header"])}
    reasons = [k for k in section["header"] if k.startswith("stall_") and "(Not Issued)" not in k]
    total: collections.Counter[str] = collections.Counter()
    by_op: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    per_row: list[int] = []
    for r in section["rows"]:
        src = r[h["Source"]].strip()
        op = _opcode(src)
        row = 0
        for k in reasons:
            v = int(r[h[k]] or 0)
            total[k] += v
            by_op[op][k] += v
            row += v
        per_row.append(row)
    n = sum(total.values()) or 1
    lines = [f"{section['name']}  ({n} samples)",
             "  " + ", ".join(f"{k[6:]} {100 * v / n:.1f}%" for k, v in total.most_common(10))]
    shares = loop_shares(section, per_row)
    if shares is not None:  # where the warps wait: a kernel's prologue can be a large share at few tokens
        b, i, a = (100 * x for x in shares)
        lines.append(f"  before the main loop {b:.1f}%, in it {i:.1f}%, after it {a:.1f}%")
    ops = collections.Counter({op: sum(c.values()) for op, c in by_op.items()})
    for op, v in ops.most_common(top):
        why = ", ".join(f"{k[6:]} {100 * c / n:.1f}" for k, c in by_op[op].most_common(3))
        lines.append(f"    {op:28s} {100 * v / n:5.1f}%  ({why})")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("csv", nargs="+")
    ap.add_argument("--top", type=int, default=8, help="opcodes listed per kernel")
    args = ap.parse_args()
    for path in args.csv:
        seen = set()
        for sec in kernels(path):
            if sec["name"] in seen:  # --launch-count 2 profiles each stage twice; the first is representative
                continue
            seen.add(sec["name"])
            print(f"{path}: {summary(sec, args.top)}\n")


if __name__ == "__main__":
    main()

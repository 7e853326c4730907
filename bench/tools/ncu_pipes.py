"""Pipe utilization of the decode stages from Nsight Compute's raw CSV (docs/KERNELS.md).

Why: on Hopper the integer ALU pipe (PRMT, LOP3, SHF: the 2-bit decode) executes 16 lanes per cycle per SM
sub-partition, half the issue rate, so a stage whose instructions are mostly ALU work is bound by that pipe before
it is bound by issue slots. This pulls, per profiled kernel, the pipe shares, the issue share, eligible warps, the
SM clock and the DRAM share out of `ncu --page raw --csv`, adds the ALU instructions per weight where the
instruction counts were collected, and writes JSON.

    ncu --section ComputeWorkloadAnalysis --section SpeedOfLight --section SchedulerStats --clock-control none \\
        --metrics sm__inst_executed_pipe_alu.sum,sm__inst_executed.sum -k regex:gemv_stage --launch-skip 2 \\
        --launch-count 2 --page raw --csv python3 bench/tools/ncu_gemv.py --tokens 8 > raw.csv
    python3 bench/tools/ncu_pipes.py raw.csv --label DS4-T8 --weights 302e6 --out pipes.json
"""
from __future__ import annotations

import argparse
import csv
import io
import json
import re
import sys
from pathlib import Path
from typing import Any

KEEP = re.compile(r"(pipe_[a-z_0-9]+(cycles_active|inst_executed)[^,]*pct_of_peak_sustained_active"
                  r"|inst_executed_pipe_[a-z_0-9]+\.avg\.pct_of_peak_sustained_active"
                  r"|sm__issue_active\.avg\.pct_of_peak_sustained_active"
                  r"|smsp__warps_eligible\.avg\.per_cycle_active|smsp__warps_active\.avg\.per_cycle_active"
                  r"|sm__cycles_elapsed\.avg\.per_second|gpc__cycles_elapsed\.avg\.per_second"
                  r"|gpu__time_duration\.sum|dram__throughput\.avg\.pct_of_peak_sustained_elapsed"
                  r"|dram__bytes_read\.sum$|sm__inst_executed(_pipe_[a-z_0-9]+)?\.sum$|launch__grid_size"
                  r"|launch__registers_per_thread)")


def number(s: str) -> float | None:
    try:
        return float(s.replace(",", ""))
    except ValueError:
        return None


def parse(text: str) -> list[dict[str, Any]]:
    """One dict per profiled kernel: its name and the kept metrics (with their units)."""
    lines = text.splitlines()
    start = next((i for i, ln in enumerate(lines) if ln.startswith('"ID"')), None)
    if start is None:
        raise SystemExit("ncu_pipes: no raw CSV header (a line starting with \"ID\") in the input")
    rows = list(csv.reader(io.StringIO("\n".join(lines[start:]))))
    header, units, data = rows[0], rows[1], rows[2:]
    out = []
    for r in data:
        if len(r) != len(header):
            continue
        rec: dict[str, Any] = {"kernel": r[header.index("Kernel Name")] if "Kernel Name" in header else "?"}
        for name, unit, val in zip(header, units, r):
            if KEEP.search(name) and (v := number(val)) is not None:
                rec[name] = v
                if unit:
                    rec.setdefault("_units", {})[name] = unit
        out.append(rec)
    return out


def summary(recs: list[dict[str, Any]], weights: float | None) -> dict[str, Any]:
    """The busiest pipes per kernel, and the ALU instructions per weight over the profiled kernels (a warp
    instruction is 32 lanes, so per lane-weight it is 32 * count / weights)."""
    pipes = {}
    for i, r in enumerate(recs):
        shares = {k.split("__", 1)[1].split(".")[0]: v for k, v in r.items()
                  if "pct_of_peak_sustained_active" in k and "pipe" in k}
        pipes[f"{i}:{r['kernel'][:60]}"] = dict(sorted(shares.items(), key=lambda kv: -kv[1])[:6])
    s: dict[str, Any] = {"top_pipes": pipes}
    alu = sum(r.get("sm__inst_executed_pipe_alu.sum", 0.0) for r in recs)
    total = sum(r.get("sm__inst_executed.sum", 0.0) for r in recs)
    if weights and alu:
        s["alu_lane_ops_per_weight"] = 32 * alu / weights
    if weights and total:
        s["lane_instructions_per_weight"] = 32 * total / weights
    return s


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("csv", type=Path, nargs="+")
    ap.add_argument("--label", action="append", default=[], help="one per csv")
    ap.add_argument("--weights", type=float, action="append", default=[],
                    help="weights the profiled kernels read (one per csv), for per-weight instruction counts")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    res = {}
    for i, p in enumerate(args.csv):
        label = args.label[i] if i < len(args.label) else p.stem
        recs = parse(p.read_text(errors="replace"))
        w = args.weights[i] if i < len(args.weights) else None
        res[label] = {"kernels": recs, "summary": summary(recs, w)}
        print(label, json.dumps(res[label]["summary"], indent=1))
    tmp = args.out.with_suffix(args.out.suffix + ".tmp")
    tmp.write_text(json.dumps(res, indent=2))
    tmp.replace(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

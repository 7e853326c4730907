"""bench/tools/ncu_pipes.py reads Nsight Compute's raw CSV (no GPU needed: a CSV in the tool's layout)."""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("ncu_pipes", ROOT / "bench" / "tools" / "ncu_pipes.py")
ncu_pipes = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ncu_pipes)

RAW = '''==PROF== Connected to process 711
"ID","Process ID","Kernel Name","gpu__time_duration.sum","sm__pipe_alu_cycles_active.avg.pct_of_peak_sustained_active","sm__inst_executed_pipe_fma.avg.pct_of_peak_sustained_active","sm__issue_active.avg.pct_of_peak_sustained_active","sm__inst_executed_pipe_alu.sum","sm__inst_executed.sum","launch__block_size"
"","","","usecond","%","%","%","inst","inst",""
"0","711","void gemv_stage_kernel<1, 0, 1, 0, 1>(GemvArgs)","120.5","71.25","20.5","52.0","1,000,000","1,800,000","128"
"1","711","void gemv_stage_kernel<0, 1, 1, 0, 1>(GemvArgs)","60.0","68.00","18.0","50.0","500,000","900,000","128"
'''


def test_parse_keeps_pipe_shares_and_counts():
    recs = ncu_pipes.parse(RAW)
    assert [r["kernel"][:25] for r in recs] == ["void gemv_stage_kernel<1,", "void gemv_stage_kernel<0,"]
    assert recs[0]["sm__pipe_alu_cycles_active.avg.pct_of_peak_sustained_active"] == 71.25
    assert recs[1]["sm__inst_executed_pipe_alu.sum"] == 500_000  # thousands separators read
    assert "launch__block_size" not in recs[0]  # not a kept metric
    assert recs[0]["_units"]["gpu__time_duration.sum"] == "usecond"
    s = ncu_pipes.summary(recs, weights=32 * 1_500_000 / 1.25)
    assert abs(s["alu_lane_ops_per_weight"] - 1.25) < 1e-9
    assert abs(s["lane_instructions_per_weight"] - 2.25) < 1e-9
    top = s["top_pipes"]["0:void gemv_stage_kernel<1, 0, 1, 0, 1>(GemvArgs)"]
    assert list(top) == ["pipe_alu_cycles_active", "inst_executed_pipe_fma"]  # busiest first


def test_main_writes_json_and_rejects_other_text(tmp_path, monkeypatch):
    p = tmp_path / "raw.csv"
    p.write_text(RAW)
    out = tmp_path / "pipes.json"
    monkeypatch.setattr(sys, "argv", ["ncu_pipes", str(p), "--label", "DS4-T8", "--weights", "1e6", "--out", str(out)])
    assert ncu_pipes.main() == 0
    data = json.loads(out.read_text())
    assert set(data) == {"DS4-T8"} and len(data["DS4-T8"]["kernels"]) == 2
    bad = tmp_path / "bad.csv"
    bad.write_text("no profile here\n")
    with pytest.raises(SystemExit, match="no raw CSV header"):
        ncu_pipes.parse(bad.read_text())

"""bench/tools/extension_errors/probe_errors.py on the CPU: a g++-built extension's TORCH_CHECK with a number and torch's
own error reach Python as RuntimeError (the cases that crashed on the lent H200 need a GPU: docs/KERNELS.md,
"Calling it")."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROBE = ROOT / "bench" / "tools" / "extension_errors" / "probe_errors.py"


def test_probe_reports_how_errors_surface(tmp_path):
    out = tmp_path / "errors.json"
    p = subprocess.run([sys.executable, str(PROBE), "--cases", "cpp_num,torch_num", "--out", str(out)],
                       capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-2000:]
    res = json.loads(out.read_text())
    rows = {r["case"]: r for r in res["cases"]}
    assert set(rows) == {"cpp_num", "torch_num"}
    assert not rows["cpp_num"]["crashed"]
    assert rows["cpp_num"]["result"] == "raised RuntimeError: cpp torch_check with a number: 5"
    assert rows["torch_num"]["result"].startswith("raised RuntimeError: shape '[4]' is invalid")
    assert res["machine"] and res["command"].startswith("python3 ")


def test_probe_refuses_unknown_cases(tmp_path):
    p = subprocess.run([sys.executable, str(PROBE), "--cases", "cpp_num,bogus", "--out", str(tmp_path / "x.json")],
                       capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert p.returncode != 0 and "unknown case 'bogus'" in p.stderr
    assert not (tmp_path / "x.json").exists()  # refused before running anything

"""bench/tiers.py runs end to end (tiny batch) and writes its JSON; the numbers themselves are the bench's job."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_tiers_bench_smoke(tmp_path):
    out = tmp_path / "tiers.json"
    r = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "tiers.py"), "--model", "qwen3-30b-a3b", "--batch", "2",
         "--repeats", "1", "--readers", "2", "--dir", str(tmp_path / "work"), "--out", str(out), "--json"],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )
    assert r.returncode == 0, r.stderr
    doc = json.loads(out.read_text())
    assert json.loads(r.stdout) == doc
    assert doc["bench"] == "tiers" and doc["config"]["model"] == "qwen3-30b-a3b"
    assert doc["machine"]["cores"] >= 1 and "hostname" in doc["machine"]
    disk = doc["disk"]
    assert disk["bytes_check_ok"] is True
    assert disk["arena_miss_gbps"]["median"] > 0 and disk["raw_reference_gbps"] > 0
    assert doc["overhead"]["ensure_all_hit_us"] > 0
    if "skipped" in doc["h2d"]:
        assert doc["met"]["store_vs_raw_h2d"] is None
    else:
        assert doc["h2d"]["bytes_check_ok"] is True
    assert not (tmp_path / "work").exists() or not any((tmp_path / "work").iterdir())  # test file cleaned up

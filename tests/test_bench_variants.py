"""bench/tools/variants.py: bench runs of several source trees folded into one experiment file, ratios side by side."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.tools.variants import build, main, parse_spec  # noqa: E402


def _run(path: Path, us: dict[tuple[str, int], float]) -> str:
    decode = [{"model": m, "tokens": t, "variants": {"gemv_pdl": {"per_layer_us": v}}} for (m, t), v in us.items()]
    path.write_text(json.dumps({"decode": decode, "read_bandwidth": {"reference_gbps": 4000.0}}))
    return str(path)


def test_spec_parsing_and_errors():
    assert parse_spec("a=x.json,y.json") == ("a", "", ["x.json", "y.json"])
    assert parse_spec("s1@p/ns1.patch=z.json") == ("s1", "p/ns1.patch", ["z.json"])
    with pytest.raises(SystemExit, match="label"):
        parse_spec("a=")
    with pytest.raises(SystemExit, match="not label"):
        parse_spec("a.json")


def test_ratios_pair_runs_by_repetition_and_point(tmp_path):
    a1 = _run(tmp_path / "a1.json", {("DS4", 1): 40.0, ("DS4", 8): 200.0})
    a2 = _run(tmp_path / "a2.json", {("DS4", 1): 50.0, ("DS4", 8): 200.0})
    b1 = _run(tmp_path / "b1.json", {("DS4", 1): 30.0, ("DS4", 8): 180.0, ("GLM", 1): 9.0})  # GLM: no base point
    b2 = _run(tmp_path / "b2.json", {("DS4", 1): 40.0, ("DS4", 8): 190.0})
    exp = build([("a", "", [a1, a2]), ("b", "v/b.patch", [b1, b2])], "abc123", "test")
    assert [(r["label"], r["code"]) for r in exp["runs"]] == [
        ("a run 1", "abc123"), ("a run 2", "abc123"),
        ("b run 1", "abc123 + v/b.patch"), ("b run 2", "abc123 + v/b.patch")]
    # run i over base run i, not over the mean: 30/40 and 40/50
    assert exp["ratios_over_first_label"]["b"] == {"DS4 T=1 gemv_pdl": [0.75, 0.8], "DS4 T=8 gemv_pdl": [0.9, 0.95]}


def test_main_writes_one_file_and_prints_the_range(tmp_path, capsys):
    a = _run(tmp_path / "a.json", {("K", 2): 100.0})
    b = _run(tmp_path / "b.json", {("K", 2): 83.0})
    out = tmp_path / "exp.json"
    assert main(["--out", str(out), "--base", "c0ffee", "a=" + a, "s1@x.patch=" + b]) == 0
    assert "0.830-0.830x" in capsys.readouterr().out
    assert json.loads(out.read_text())["runs"][1]["code"] == "c0ffee + x.patch"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.json", "b.json", "exp.json"]  # no temp file left

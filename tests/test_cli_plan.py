"""`moetplan plan`, `diff`, `schema`, `models|gpus|boxes` through the CLI: outputs, files and exit codes."""
from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from moetplan.cli import app
from moetplan.contract.errors import EXIT_INFEASIBLE, EXIT_USAGE

runner = CliRunner()


def _plan(tmp_path, name: str, *args: str) -> dict:
    out = tmp_path / name
    r = runner.invoke(app, ["plan", *args, "--out", str(out), "--json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert json.loads(out.read_text()) == doc
    return doc


def test_plan_json_has_required_keys(tmp_path) -> None:
    doc = _plan(tmp_path, "p.json", "--model", "glm-5.2", "--box", "rtx-pro-6000x2")
    assert doc["model"]["id"] == "glm-5.2"
    assert doc["hardware"]["box_id"] == "rtx-pro-6000x2"
    assert doc["placement"]["expert_tier"] in ("host", "nvme")
    assert doc["launch"]["argv"] and "MOETPLAN_PLAN" in doc["launch"]["env"]
    assert isinstance(doc["memory"]["host_gib"], float) and isinstance(doc["memory"]["disk_gib"], float)


def test_plan_inline_gpus_human_output() -> None:
    r = runner.invoke(app, ["plan", "--model", "ds4-flash", "--gpus", "1xrtx-5090", "--host-ram-gib", "96",
                            "--explain"])
    assert r.exit_code == 0, r.output
    for needle in ("Placement", "Memory ledger", "Prediction", "bottleneck", "expert_cache"):
        assert needle in r.output


def test_plan_infeasible_exit_code_and_message() -> None:
    r = runner.invoke(app, ["plan", "--model", "kimi-k2.7-code", "--gpus", "1xrtx-4090", "--host-ram-gib", "32"])
    assert r.exit_code == EXIT_INFEASIBLE
    assert "does not fit" in r.output and "What would fit" in r.output


def test_plan_infeasible_json() -> None:
    r = runner.invoke(app, ["plan", "--model", "kimi-k2.7-code", "--gpus", "1xrtx-4090", "--host-ram-gib", "32",
                            "--json"])
    assert r.exit_code == EXIT_INFEASIBLE
    doc = json.loads(r.stdout)
    assert doc["shortfalls"] and doc["suggestions"]


@pytest.mark.parametrize("args,needle", [
    (["--model", "glm-9", "--box", "rtx-pro-6000x2"], "Unknown model"),
    (["--model", "glm-5.2", "--box", "rtx-pro-9000x2"], "Unknown box"),
    (["--model", "glm-5.2", "--gpus", "2xrtx-5099", "--host-ram-gib", "64"], "Unknown gpu"),
    (["--model", "glm-5.2", "--gpus", "2xrtx-5090"], "--host-ram-gib"),
    (["--model", "glm-5.2", "--box", "rtx-pro-6000x2", "--set", "tpp=2"], "unknown knob"),
    (["--model", "glm-5.2", "--box", "rtx-pro-6000x2", "--objective", "fast"], "--objective"),
    (["--model", "glm-5.2", "--box", "rtx-pro-6000x2", "--gpus", "1xrtx-5090"], "one hardware source"),
])
def test_plan_usage_errors(args, needle) -> None:
    r = runner.invoke(app, ["plan", *args])
    assert r.exit_code == EXIT_USAGE, r.output
    assert needle.lower() in r.output.lower()


def test_plan_from_hw_file_and_malformed_hw(tmp_path) -> None:
    from moetplan import hwdb
    from moetplan.contract import save_json

    hw = hwdb.box_profile("rtx-pro-6000x1")
    path = tmp_path / "hw.json"
    save_json(hw, path)
    r = runner.invoke(app, ["plan", "--model", "ds4-flash", "--hw", str(path), "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["hardware"]["gpus"][0]["hwdb_id"] == "rtx-pro-6000"
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"gpus": [], "host": {"ram_gib": "lots"}}))
    r = runner.invoke(app, ["plan", "--model", "ds4-flash", "--hw", str(bad)])
    assert r.exit_code == EXIT_USAGE and "host.ram_gib" in r.output


def test_diff_plans_table_markdown_json(tmp_path) -> None:
    _plan(tmp_path, "a.json", "--model", "glm-5.2", "--box", "rtx-pro-6000x2")
    _plan(tmp_path, "b.json", "--model", "glm-5.2", "--box", "rtx-pro-6000x4")
    a, b = str(tmp_path / "a.json"), str(tmp_path / "b.json")
    r = runner.invoke(app, ["diff", a, b])
    assert r.exit_code == 0, r.output
    assert "expert_tier" in r.output and "decode_tok_s" in r.output
    r = runner.invoke(app, ["diff", a, b, "--markdown"])
    assert r.output.startswith("| section | field | a.json | b.json | change |")
    assert "| placement | expert_tier |" in r.output
    r = runner.invoke(app, ["diff", a, b, "--json"])
    rows = {(x["section"], x["field"]): x for x in json.loads(r.stdout)}
    assert rows[("placement", "tp")]["a"] == 2 and rows[("placement", "tp")]["b"] == 4


def test_diff_across_models(tmp_path) -> None:
    _plan(tmp_path, "a.json", "--model", "ds4-flash", "--box", "rtx-pro-6000x1")
    _plan(tmp_path, "b.json", "--model", "kimi-k2.7-code", "--box", "rtx-pro-6000x4")
    r = runner.invoke(app, ["diff", str(tmp_path / "a.json"), str(tmp_path / "b.json"), "--markdown"])
    assert r.exit_code == 0
    assert "deepseek-v4-flash -> kimi-k2.7-code" in r.output


def test_diff_rejects_non_plan(tmp_path) -> None:
    p = tmp_path / "x.json"
    p.write_text("[1, 2]")
    r = runner.invoke(app, ["diff", str(p), str(p)])
    assert r.exit_code == EXIT_USAGE


def test_schema_and_lists() -> None:
    r = runner.invoke(app, ["schema", "plan"])
    assert r.exit_code == 0
    schema = json.loads(r.stdout)
    assert "placement" in schema["properties"] and "schema_version" in schema["properties"]
    for cmd, needle in (("models", "glm-5.2"), ("gpus", "rtx-5090"), ("boxes", "rtx-pro-6000x2")):
        r = runner.invoke(app, [cmd, "--json"])
        assert r.exit_code == 0, r.output
        assert needle in r.stdout


def test_plot_writes_png(tmp_path) -> None:
    pytest.importorskip("matplotlib")
    png = tmp_path / "pareto.png"
    r = runner.invoke(app, ["plan", "--model", "ds4-flash", "--box", "rtx-5090x1", "--plot", str(png)])
    assert r.exit_code == 0, r.output
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plan_without_hardware_on_a_gpu_less_machine(monkeypatch) -> None:
    """No --hw/--box/--gpus: a quick probe runs; with no NVIDIA GPU the plan says so and uses the default box."""
    from moetplan import hwdb
    from moetplan.hw import probe as probe_mod
    from moetplan.contract import HardwareProfile, HostInfo

    calls = []

    def fake_probe(pack_dir=None, quick=True, progress=True):
        calls.append(quick)
        return HardwareProfile(source="probe", host=HostInfo(ram_gib=24.0, cores=2))

    monkeypatch.setattr(probe_mod, "probe", fake_probe)
    r = runner.invoke(app, ["plan", "--model", "ds4-flash", "--json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    default = hwdb.guards()["planner"]["default_box"]
    assert calls == [True]
    assert doc["hardware"]["box_id"] == default
    assert any("no NVIDIA GPU" in w for w in doc["warnings"])

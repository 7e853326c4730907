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
    assert "argv" not in doc["launch"]  # the command is derived when served (`moetplan run --dry-run`)
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
    """No --hw/--box/--gpus and no NVIDIA GPU: nothing is probed (no disk or DRAM test), the default box is planned
    and the plan says so."""
    from moetplan import hwdb
    from moetplan.hw import gpus as gpus_mod
    from moetplan.hw import profile_probe as probe_mod

    calls = []
    monkeypatch.setattr(gpus_mod, "has_nvidia_gpu", lambda: False)
    monkeypatch.setattr(probe_mod, "probe", lambda *a, **k: calls.append(1))
    r = runner.invoke(app, ["plan", "--model", "ds4-flash", "--json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert calls == []
    assert doc["hardware"]["box_id"] == hwdb.guards()["planner"]["default_box"]
    assert any("no NVIDIA GPU" in w for w in doc["warnings"])


def test_driver_without_a_gpu_still_plans_the_default_box(monkeypatch) -> None:
    from moetplan import hwdb
    from moetplan.contract import HardwareProfile, HostInfo
    from moetplan.hw import gpus as gpus_mod
    from moetplan.hw import profile_probe as probe_mod

    monkeypatch.setattr(gpus_mod, "has_nvidia_gpu", lambda: True)
    monkeypatch.setattr(probe_mod, "probe", lambda *a, **k: HardwareProfile(source="probe", host=HostInfo(ram_gib=24)))
    r = runner.invoke(app, ["plan", "--model", "ds4-flash", "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["hardware"]["box_id"] == hwdb.guards()["planner"]["default_box"]


def test_no_gpu_infeasible_answer_says_it_planned_the_default_box(monkeypatch) -> None:
    from moetplan.hw import gpus as gpus_mod

    monkeypatch.setattr(gpus_mod, "has_nvidia_gpu", lambda: False)
    r = runner.invoke(app, ["plan", "--model", "glm-5.2", "--json"])
    assert r.exit_code == EXIT_INFEASIBLE, r.output
    doc = json.loads(r.stdout)
    assert "no NVIDIA GPU" in doc["error"] and "default box" in doc["error"]
    r = runner.invoke(app, ["plan", "--model", "glm-5.2"])
    assert r.exit_code == EXIT_INFEASIBLE and "default box" in r.output


def _suggested_commands(args: list[str]) -> list[list[str]]:
    r = runner.invoke(app, ["plan", *args, "--json"])
    assert r.exit_code == EXIT_INFEASIBLE, r.output
    cmds = [s.split(": moetplan ", 1)[1].split() for s in json.loads(r.stdout)["suggestions"] if ": moetplan " in s]
    assert cmds, json.loads(r.stdout)["suggestions"]
    return cmds


@pytest.mark.parametrize("args", [
    ["--model", "glm-5.2", "--box", "rtx-5090x1"],
    ["--model", "kimi-k2.7-code", "--gpus", "1xrtx-4090", "--host-ram-gib", "32"],
    ["--model", "glm-5.2", "--gpus", "1xrtx-5090", "--host-ram-gib", "64"],
])
def test_every_what_would_fit_suggestion_plans_when_followed(args) -> None:
    for cmd in _suggested_commands(args):
        assert cmd[0] == "plan"
        r = runner.invoke(app, [*cmd, "--json"])
        assert r.exit_code == 0, (cmd, r.output)


@pytest.mark.parametrize("conc", ["0", "-3"])
def test_concurrency_below_one_is_a_usage_error(conc) -> None:
    r = runner.invoke(app, ["plan", "--model", "ds4-flash", "--box", "rtx-5090x1", "--concurrency", conc])
    assert r.exit_code == EXIT_USAGE and "--concurrency" in r.output and "Traceback" not in r.output


def test_context_above_the_maximum_names_the_maximum_not_nvme() -> None:
    r = runner.invoke(app, ["plan", "--model", "kimi-k2.7-code", "--box", "rtx-pro-6000x4", "--context", "1m"])
    assert r.exit_code == EXIT_USAGE, r.output
    assert "at most 262144 tokens" in r.output and "NVMe" not in r.output


def test_pack_dir_without_its_free_space_is_measured(tmp_path) -> None:
    import shutil

    d = tmp_path / "packs"
    d.mkdir()
    # A model whose 2-bit packs (~8 GiB) fit any test disk, on the NVMe tier.
    args = ["plan", "--model", "qwen3-30b-a3b", "--gpus", "1xrtx-4090", "--host-ram-gib", "16",
            "--set", "expert_tier=nvme"]
    r = runner.invoke(app, [*args, "--pack-dir", str(d), "--json"])
    assert r.exit_code == 0, r.output
    st = json.loads(r.stdout)["hardware"]["storage"]
    assert st["free_gib"] == pytest.approx(shutil.disk_usage(d).free / 2**30, abs=1.0)
    assert st["sources"]["free_gib"] == "measured" and st["path"] == str(d)
    r = runner.invoke(app, [*args, "--pack-dir", str(tmp_path / "new" / "packs"), "--json"])
    assert r.exit_code == 0 and any("does not exist yet" in w for w in json.loads(r.stdout)["warnings"])
    (tmp_path / "file").write_text("x")
    r = runner.invoke(app, [*args, "--pack-dir", str(tmp_path / "file" / "packs")])
    assert r.exit_code == EXIT_USAGE and "is a file" in r.output


def test_unsupported_gpu_family_is_refused_with_the_reason() -> None:
    r = runner.invoke(app, ["plan", "--model", "glm-5.2", "--gpus", "2xrtx-4090", "--host-ram-gib", "256"])
    assert r.exit_code == EXIT_INFEASIBLE, r.output
    text = " ".join(r.output.split())
    assert "GLM-5.2 does not run on GeForce RTX 4090" in text and "RTX 40" in text and "current vLLM" in text
    assert "sm_120" in text


def test_gpus_for_a_model_shows_the_support_matrix() -> None:
    r = runner.invoke(app, ["gpus", "--model", "glm-5.2", "--json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    rows = {f["family"]: f for f in doc["families"]}
    assert not rows["sm_89"]["runs"] and "rtx-4090" in rows["sm_89"]["hwdb_gpus"]
    assert rows["sm_120"]["runs"] and rows["sm_120"]["backends"] == ["FLASHINFER_MLA_SPARSE_SM120"]
    r = runner.invoke(app, ["gpus", "--model", "kimi-k2.7-code"])
    assert r.exit_code == 0 and "TRITON_MLA" in r.output
    r = runner.invoke(app, ["gpus", "--model", "glm-9"])
    assert r.exit_code == EXIT_USAGE and "Unknown model" in r.output


def test_models_lists_the_tiny_models() -> None:
    r = runner.invoke(app, ["models", "--json"])
    ids = {m["id"]: m for m in json.loads(r.stdout)}
    assert {"tiny-moe", "tiny-moe-mla", "tiny-moe-fp8"} <= set(ids) and ids["tiny-moe"]["tiny"]
    assert not ids["glm-5.2"]["tiny"]


def test_an_unexpected_failure_is_one_line_and_exit_1(monkeypatch) -> None:
    from moetplan.plan import solver

    def boom(*a, **k):
        raise RuntimeError("disk on fire")

    monkeypatch.setattr(solver, "solve", boom)
    r = runner.invoke(app, ["plan", "--model", "ds4-flash", "--box", "rtx-5090x1"])
    assert r.exit_code == 1 and "disk on fire" in r.output and "Traceback" not in r.output

"""`plan` and `run` agree (issue 37): on a machine with no GPU, `plan --model` for a checkpoint the CPU backend
serves plans the CPU backend as `run --model` does (a GPU box only with --box / --gpus / --hw), and a plan written
with --pack-dir is served from that pack folder by `run plan.json`."""
from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from moetplan.cli import app


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    root = tmp_path_factory.mktemp("cache")
    mp.setenv("MOETPLAN_CACHE_DIR", str(root))
    import moetplan.hw.gpus as gpus

    mp.setattr(gpus, "local_gpu_count", lambda: 0)  # this test is about a GPU-less machine, wherever it runs
    mp.setattr(gpus, "has_nvidia_gpu", lambda: False)
    import moetplan.cli.run as run_cli

    mp.setattr(run_cli, "local_gpu_count", lambda: 0)
    yield root
    mp.undo()


def _invoke(*args: str):
    r = CliRunner().invoke(app, list(args))
    assert r.exit_code == 0, r.output
    return r


def test_plan_with_a_pack_dir_then_run_that_plan_serves_on_this_machine(cache, tmp_path):
    packs = tmp_path / "packs"
    _invoke("plan", "--model", "tiny-moe", "--pack-dir", str(packs), "--out", str(tmp_path / "p.json"))
    plan = json.loads((tmp_path / "p.json").read_text())
    assert plan["hardware"]["gpus"] == [] and "CPU backend" in plan["hardware"]["description"]
    assert plan["placement"]["pack_dir"] == str(packs.resolve())
    assert plan["serving"]["tool_call_parser"] == "hermes"
    r = _invoke("run", str(tmp_path / "p.json"), "--dry-run", "--json")
    d = json.loads(r.output)
    assert d["backend"] == "cpu" and d["plan"] == str((tmp_path / "p.json").resolve())
    assert "--tool-call-parser" in d["argv"] and "--enable-auto-tool-choice" in d["argv"]


def test_run_model_and_plan_model_make_the_same_placement(cache, tmp_path):
    _invoke("plan", "--model", "tiny-moe", "--out", str(tmp_path / "p.json"))
    r = _invoke("run", "--model", "tiny-moe", "--pack-dir", str(tmp_path / "packs"), "--run-dir",
                str(tmp_path / "run"), "--dry-run", "--json")
    served = json.loads((tmp_path / "run" / "plan.json").read_text())
    planned = json.loads((tmp_path / "p.json").read_text())
    assert json.loads(r.output)["backend"] == "cpu"
    for key in ("expert_tier", "context", "max_num_seqs", "expert_format", "tp"):
        assert served["placement"][key] == planned["placement"][key], key
    assert served["placement"]["pack_dir"] == str((tmp_path / "packs").resolve())


def test_a_gpu_box_only_when_asked(cache, tmp_path):
    _invoke("plan", "--model", "tiny-moe", "--box", "rtx-5090x1", "--out", str(tmp_path / "box.json"))
    assert json.loads((tmp_path / "box.json").read_text())["hardware"]["gpus"]
    # an hwdb model with no checkpoint here is still planned for the default box (nothing to serve here)
    _invoke("plan", "--model", "qwen3-30b-a3b", "--out", str(tmp_path / "q.json"))
    assert json.loads((tmp_path / "q.json").read_text())["hardware"]["gpus"]


def test_run_pack_dir_on_an_existing_plan_writes_a_new_plan_beside_it(cache, tmp_path):
    _invoke("plan", "--model", "tiny-moe", "--out", str(tmp_path / "p.json"))
    r = _invoke("run", str(tmp_path / "p.json"), "--pack-dir", str(tmp_path / "packs"), "--dry-run", "--json")
    path = json.loads(r.output)["plan"]
    assert path.endswith("p.packs.json")
    assert json.loads(open(path).read())["placement"]["pack_dir"] == str((tmp_path / "packs").resolve())

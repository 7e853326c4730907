"""Bad input on purpose: every case answers with a message that names the problem and the fix, an exit code, and
no traceback; a failed write leaves no partial file behind."""
from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from moetplan.cli import app


def _cli(*args: str):
    res = CliRunner().invoke(app, list(args))
    assert "Traceback" not in res.output
    assert res.exception is None or isinstance(res.exception, SystemExit), res.exception
    return res


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    d = tmp_path_factory.mktemp("ckpt") / "tiny-ckpt"
    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(vocab_size=64, hidden_size=64, intermediate_size=64, moe_intermediate_size=32,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                         num_experts=4, num_experts_per_tok=2, mlp_only_layers=[])
    Qwen3MoeForCausalLM(cfg).to(torch.bfloat16).save_pretrained(d)
    return d


@pytest.fixture
def junk(tmp_path) -> Path:
    p = tmp_path / "plan.json"
    p.write_bytes(os.urandom(4096) + b"\xff\xfe")
    return p


def test_binary_junk_given_to_run_and_diff(junk):
    r = _cli("run", str(junk), "--dry-run")
    assert r.exit_code == 2 and "binary data, not a JSON text file" in r.output
    r = _cli("diff", str(junk), str(junk))
    assert r.exit_code == 2 and "binary data" in r.output


def test_diff_of_a_run_and_a_plan_for_different_models_is_refused(tmp_path):
    from moetplan.contract import RunRecord, save_json

    plan = tmp_path / "plan.json"
    assert _cli("plan", "--model", "glm-5.2", "--box", "rtx-pro-6000x4", "--out", str(plan), "--json").exit_code == 0
    run = tmp_path / "run.json"
    save_json(RunRecord(model_id="deepseek-v4-flash", measured={"decode_tok_s": 30.0}), run)
    r = _cli("diff", str(plan), str(run))
    assert r.exit_code == 2
    assert "deepseek-v4-flash" in r.output and "glm-5.2" in r.output


def test_quantize_with_a_malformed_config(tmp_path, ckpt):
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in ckpt.iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    (bad / "config.json").write_text('{"hidden_size": 64,,}')
    r = _cli("quantize", "--model", str(bad), "--pack-dir", str(tmp_path / "packs"))
    assert r.exit_code == 2 and "config.json: not valid JSON at line 1" in r.output
    assert not (tmp_path / "packs").exists() or not any((tmp_path / "packs").iterdir())


def test_quantize_into_a_directory_it_cannot_write(tmp_path, ckpt):
    # /proc takes no new files, even for root (tests may run as root, which ignores mode bits).
    r = _cli("quantize", "--model", str(ckpt), "--pack-dir", "/proc/moetplan-packs")
    assert r.exit_code == 2 and "cannot write packs into /proc/moetplan-packs" in r.output
    assert "writable --pack-dir" in r.output


def test_quantize_onto_a_disk_without_room_says_how_much_is_needed(tmp_path, ckpt, monkeypatch):
    import shutil
    from collections import namedtuple

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10**9, 10**9 - 1000, 1000))
    packs = tmp_path / "packs"
    r = _cli("quantize", "--model", str(ckpt), "--pack-dir", str(packs))
    assert r.exit_code == 2
    assert "has 1000 B free; the packs need" in r.output and "choose another --pack-dir" in r.output
    assert list(packs.glob("*")) == []  # nothing half-written is left


def test_a_write_that_runs_out_of_space_leaves_no_partial_pack(tmp_path, ckpt, monkeypatch):
    from moetplan.runtime.format import packs as P

    real = os.pwrite
    calls = {"n": 0}

    def full_disk(fd, data, offset):
        calls["n"] += 1
        if calls["n"] > 3:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, data, offset)

    monkeypatch.setattr(P.os, "pwrite", full_disk)
    packs = tmp_path / "packs"
    r = _cli("quantize", "--model", str(ckpt), "--pack-dir", str(packs))
    assert r.exit_code == 2 and "ran out of space" in r.output and "Free at least" in r.output
    assert list(packs.glob("*")) == []


def test_probe_writes_hw_json_by_default(tmp_path, monkeypatch):
    from moetplan.contract import HardwareProfile, HostInfo
    from moetplan.hw import profile_probe as probe_mod

    class Result:
        profile = HardwareProfile(source="probe", host=HostInfo(ram_gib=8.0))
        details: dict = {}
        elapsed_s = 0.1

    monkeypatch.setattr(probe_mod, "run_probe", lambda *a, **k: Result())
    monkeypatch.chdir(tmp_path)
    r = _cli("probe", "--quick", "--json")
    assert r.exit_code == 0, r.output
    assert json.loads((tmp_path / "hw.json").read_text())["host"]["ram_gib"] == 8.0

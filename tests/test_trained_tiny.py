"""The trained tiny MoE (`--model tiny-moe-py`): trained once (here for 2 steps, to keep CI fast), exported as a
served checkpoint vLLM reads, planned like the other tiny models on a GPU-less machine."""
from __future__ import annotations

import json
from dataclasses import replace

import pytest
from typer.testing import CliRunner

from moetplan.cli import app

# Trains (2 steps) and builds its tokenizer from the standard library: ~45 s on 2 busy cores.
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def short_training(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    root = tmp_path_factory.mktemp("trained")
    mp.setenv("MOETPLAN_CACHE_DIR", str(root / "cache"))
    mp.setenv("MOETPLAN_QUALITY_CACHE", str(root / "quality"))
    from moetplan.runtime.offline import quality as Q

    short = replace(Q.TinyMoeSpec(), train_steps=2, batch=2)
    mp.setattr(Q, "TinyMoeSpec", lambda: short)
    import moetplan.cli.run as run_cli
    import moetplan.hw.gpus as gpus

    mp.setattr(run_cli, "local_gpu_count", lambda: 0)
    mp.setattr(gpus, "local_gpu_count", lambda: 0)
    yield root
    mp.undo()


def test_first_use_trains_then_exports_a_served_checkpoint(short_training, tmp_path):
    from moetplan.cli.run import trained_checkpoint

    ckpt = trained_checkpoint()
    cfg = json.loads((ckpt / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3MoeForCausalLM"] and cfg["num_experts"] == 16
    tok_cfg = json.loads((ckpt / "tokenizer_config.json").read_text())
    assert "<tool_call>" in (tok_cfg.get("chat_template") or (ckpt / "chat_template.jinja").read_text())
    assert json.loads((ckpt / "moetplan_tiny.json").read_text())["trained"]["steps"] == 2
    assert trained_checkpoint() == ckpt  # cached: the second use neither trains nor rewrites


def test_plan_and_run_dry_run_serve_it_on_the_cpu_backend(short_training, tmp_path):
    r = CliRunner().invoke(app, ["run", "--model", "tiny-moe-py", "--run-dir", str(tmp_path), "--dry-run",
                                 "--json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.output[r.output.index("{"):])
    assert d["backend"] == "cpu" and d["served_model_name"] == "tiny-moe-py"
    assert "tiny-moe-py-" in d["model_path"] and "--tool-call-parser" in d["argv"]
    r = CliRunner().invoke(app, ["plan", "--model", "tiny-moe-py", "--out", str(tmp_path / "p.json")])
    assert r.exit_code == 0, r.output
    assert json.loads((tmp_path / "p.json").read_text())["hardware"]["gpus"] == []

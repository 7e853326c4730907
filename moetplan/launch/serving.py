"""The model's chat format as vLLM flags: tool-call and reasoning parsers, tokenizer mode, chat template, and how
strictly tool calls follow their schema.

The conventions are facts of the model (hwdb/serving.yaml); the names are vLLM's and differ between releases, so
each is checked against the installed vLLM's own registries (`vllm_compat.serving_names`) when the plan is made and
again when the launch is built (a plan may be served by another vLLM than the one it was planned with). A user
overrides any of them (`--tool-call-parser NAME`, `none` switches it off), and flags given to vLLM after `--` win.
"""
from __future__ import annotations

from typing import Any

from moetplan import vllm_compat
from moetplan.contract import Serving
from moetplan.contract.errors import UsageError
from moetplan.contract.vocab import TOOL_STRICT_LEVELS, check_choice

KINDS = ("tool_call_parser", "reasoning_parser", "tokenizer_mode", "chat_template")
STRICT_FLAG = "--tool-strict-level"
# A user's word for "no such flag": the feature off.
OFF_WORDS = ("none", "off", "no", "")


def _model_key(plan: Any) -> str:
    # `moetplan run --model tiny-moe` keeps the tiny name as the spec's id; a checkpoint folder is `local:...`.
    mid = plan.model.id
    return plan.launch.served_model_name if mid.startswith("local:") and plan.launch.served_model_name else mid


def _installed_version() -> str | None:
    found = vllm_compat.installed_vllm()
    return f"{found[0]} {found[1]}" if found else None


def serving_for(plan: Any, overrides: dict[str, str | None] | None = None) -> Serving:
    """The plan's Serving section: hwdb's conventions for its model (or architecture), the user's overrides on
    top, every registry name checked (and renamed where needed) against the installed vLLM."""
    from moetplan import hwdb

    values, source = hwdb.serving_conventions(_model_key(plan), plan.model.vllm_arch)
    notes: list[str] = []
    strict: dict[str, Any] = {}
    for kind, val in (overrides or {}).items():
        if kind == "tool_strict_level":
            if val is not None:
                check_choice(STRICT_FLAG, val.strip().lower(), TOOL_STRICT_LEVELS)
                strict["tool_strict_level"] = val.strip().lower()
                source += "; tool_strict_level set by the user"
            continue
        if kind not in KINDS:
            raise UsageError(f"unknown serving setting {kind!r}; choose one of {', '.join((*KINDS, 'tool_strict_level'))}")
        if val is None:
            continue
        values[kind] = None if val.strip().lower() in OFF_WORDS else val.strip()
        source += f"; {kind} set by the user"
        wanted = values[kind]
        if kind != "chat_template" and wanted is not None:
            known = vllm_compat.serving_names(kind)
            if known is not None and wanted not in known and not any(
                    a in known for a in vllm_compat.VLLM_NAME_ALTERNATIVES.get(kind, {}).get(wanted, ())):
                flag = vllm_compat.SERVING_FLAGS[kind].lstrip("-")
                raise UsageError(f"--{flag} {wanted}: the installed vLLM has no such name; choose one of "
                                 f"{', '.join(sorted(known))} (or `none` to switch it off)")
    checked = resolve_names(values, notes)
    serving = Serving(**checked, **strict, source=source, checked_with=_installed_version(), notes=notes)
    if serving.tool_call_parser and serving.tool_strict_level != "auto" and vllm_compat.has_tool_strict_level() is False:
        serving.notes.append(f"{_installed_version()} has no {STRICT_FLAG}: forced tool calls (`required`, a named tool) "
                     f"follow the tool's schema, calls under tool_choice auto are not held to it")
    return serving


def resolve_names(values: dict[str, Any], notes: list[str]) -> dict[str, Any]:
    """Each registry name as the installed vLLM spells it (None where it has none; a note says so)."""
    out = dict(values)
    for kind in ("tool_call_parser", "reasoning_parser", "tokenizer_mode"):
        name = out.get(kind)
        if name is None:
            continue
        out[kind], note = vllm_compat.check_serving_name(kind, name, vllm_compat.serving_names(kind))
        if note:
            notes.append(note)
    return out


def _given(extra_args: list[str] | None, flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in extra_args or [])


def serving_args(serving: Serving | None, extra_args: list[str] | None = None) -> list[str]:
    """vLLM flags for a Serving section; a flag the user passes to vLLM directly (after `--`) is left to them.

    A tool-call parser comes with --enable-auto-tool-choice: `tool_choice: "auto"`, what coding agents send, is
    refused by vLLM (HTTP 400) without both."""
    if serving is None:
        return []
    values = resolve_names(serving.model_dump(include=set(KINDS)), [])
    args: list[str] = []
    user_tool = _given(extra_args, "--tool-call-parser")
    if values["tool_call_parser"] and not user_tool:
        args += ["--tool-call-parser", values["tool_call_parser"]]
    if (values["tool_call_parser"] or user_tool) and not _given(extra_args, "--enable-auto-tool-choice"):
        args += ["--enable-auto-tool-choice"]
    # The vLLM that serves may be older than the one that planned: the flag goes only where it is known.
    if (values["tool_call_parser"] or user_tool) and serving.tool_strict_level != "auto" \
            and not _given(extra_args, STRICT_FLAG) and vllm_compat.has_tool_strict_level():
        args += [STRICT_FLAG, serving.tool_strict_level]
    for kind in ("reasoning_parser", "tokenizer_mode", "chat_template"):
        flag = vllm_compat.SERVING_FLAGS[kind]
        if values[kind] and not _given(extra_args, flag):
            args += [flag, values[kind]]
    return args


_STRICT_WORDS = {"auto": "calls held to their schema for strict tools only",
                 "function": "calls held to a known tool and JSON arguments",
                 "parameter": "calls held to each tool's schema"}


def serving_line(serving: Serving | None) -> str:
    """One line for the plan view: what the launch tells vLLM about the chat format."""
    if serving is None:
        return "serving: no tool-call or reasoning parser (plan made before serving conventions)"
    tools = serving.tool_call_parser or "off"
    if serving.tool_call_parser:
        tools += f" ({_STRICT_WORDS[serving.tool_strict_level]})"
    parts = [f"tools {tools}", f"reasoning {serving.reasoning_parser or 'off'}"]
    if serving.tokenizer_mode:
        parts.append(f"tokenizer mode {serving.tokenizer_mode}")
    if serving.chat_template:
        parts.append(f"chat template {serving.chat_template}")
    checked = f", checked with {serving.checked_with}" if serving.checked_with else ""
    return f"serving: {', '.join(parts)} ({serving.source}{checked})"


"""The README's server as a user meets it (vLLM CPU backend, marker `vllm`): a short first prompt, chat completions
through httpx and the `openai` client, what a coding agent sends (tools with tool_choice auto and forced, a
three-turn tool loop, Anthropic-style /v1/messages), `moetplan bench` with its defaults twice (its decode rate next
to a stopwatch), `diff plan.json run.json` and `calibrate run.json` on what it measured; last, the engine SIGKILLed
mid-stream and the supervisor serving again with nobody touching it. One server for the whole module."""
from __future__ import annotations

import json
import os
import signal

import pytest
from typer.testing import CliRunner

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm")

from served import free_port, start_run  # noqa: E402


@pytest.fixture(scope="module")
def server(tmp_path_factory, e2e_env):
    """`moetplan run --model tiny-moe` (2-bit experts through the plugin), as the README's main job starts it."""
    run_dir = tmp_path_factory.mktemp("run")
    env = e2e_env
    port = free_port()
    proc, ready, events = start_run(["--model", "tiny-moe", "--port", str(port), "--run-dir", str(run_dir),
                                     "--timeout", "400"], env)
    if ready is None:
        pytest.fail(f"server did not come up: {events[-3:]}")
    import httpx

    # The first request a new user sends: a short prompt. On CPUs whose CPUID reports AMX this once killed the
    # server (vLLM's AMX attention ran before the process had the AMX tile permission; runtime/vllm/cpu_amx.py).
    first = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=120,
                       json={"model": ready["model"], "prompt": "Hello", "max_tokens": 8})
    yield {"url": f"http://127.0.0.1:{port}", "model": ready["model"], "plan": str(run_dir / "plan.json"),
           "env": env, "proc": proc, "first": first, "ready": ready}
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=120)


@pytest.fixture(scope="module")
def record(server, tmp_path_factory):
    """`moetplan bench --url URL --plan plan.json --out run.json` with every other setting at its default."""
    from moetplan.cli import app
    from moetplan.contract import RunRecord, load_json

    out = tmp_path_factory.mktemp("bench") / "run.json"
    r = CliRunner().invoke(app, ["bench", "--url", server["url"], "--plan", server["plan"], "--out", str(out)])
    return load_json(RunRecord, out), out, r


def _stopwatch_tok_s(url: str, model: str, max_tokens: int = 128) -> float:
    """What a plain client measures: generated tokens over the request's wall time."""
    import time

    import httpx

    body = {"model": model, "prompt": "the model of a tiny expert", "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    t0, tokens = time.perf_counter(), 0
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as resp:
        for line in resp.iter_lines():
            if line.startswith("data:") and "[DONE]" not in line:
                usage = json.loads(line[5:]).get("usage")
                tokens = usage["completion_tokens"] if usage else tokens
    return tokens / (time.perf_counter() - t0)


def test_a_short_first_prompt_is_answered_and_the_server_keeps_serving(server) -> None:
    import httpx

    first = server["first"]
    assert first.status_code == 200, first.text
    assert first.json()["choices"][0]["text"] != "" or first.json()["usage"]["completion_tokens"] > 0
    again = httpx.post(f"{server['url']}/v1/completions", timeout=120,
                       json={"model": server["model"], "prompt": "Hi", "max_tokens": 4})
    assert again.status_code == 200, again.text
    assert server["proc"].poll() is None


def test_chat_completions_through_httpx_and_the_openai_client(server) -> None:
    import httpx
    import openai

    r = httpx.post(f"{server['url']}/v1/chat/completions", timeout=120, json={
        "model": server["model"], "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 8})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["role"] == "assistant"
    client = openai.OpenAI(base_url=f"{server['url']}/v1", api_key="unused")
    done = client.chat.completions.create(model=server["model"], max_tokens=8,
                                          messages=[{"role": "user", "content": "Write a haiku"}])
    assert done.choices[0].finish_reason in ("length", "stop") and done.usage.completion_tokens > 0
    stream = client.chat.completions.create(model=server["model"], max_tokens=8, stream=True,
                                            messages=[{"role": "user", "content": "Count to three"}])
    chunks = list(stream)
    assert chunks and chunks[-1].choices[0].finish_reason in ("length", "stop")
    assert server["proc"].poll() is None


def test_bench_with_its_defaults_exits_0_and_its_decode_rate_matches_a_stopwatch(server, record) -> None:
    rec, out, result = record
    assert result.exit_code == 0, result.output
    assert rec.errors == []
    # The defaults (prefill 2048, needle 4096) do not fit the tiny model's 2048-token context: fitted, noted.
    assert any("to fit the server's max_model_len" in n for n in rec.notes)
    stopwatch = _stopwatch_tok_s(server["url"], server["model"])
    ratio = rec.measured["decode_tok_s"] / stopwatch
    assert 1 / 1.5 <= ratio <= 1.5, (rec.measured["decode_tok_s"], stopwatch)
    for bench_rate, wall in zip(rec.measured["decode_runs_tok_s"], rec.measured["decode_runs_wall_tok_s"]):
        assert wall <= bench_rate <= 1.5 * wall


def test_bench_record_has_every_metric_and_probe(record) -> None:
    rec, out, _ = record
    assert out.exists() and json.loads(out.read_text())["kind"] == "run"
    m = rec.measured
    for key in ("decode_tok_s", "prefill_tok_s", "ttft_ms", "aggregate_tok_s"):
        assert isinstance(m.get(key), (int, float)) and m[key] > 0, key
    assert set(map(int, m["batch_curve"])) >= {1, 4, 8}
    # Random weights answer nothing right; what matters is that every probe ran and gave a verdict.
    assert set(rec.probes["needle"].values()) <= {"PASS", "FAIL"} and rec.probes["needle"]
    assert rec.probes["arithmetic"] and rec.probes["coherence"]
    assert rec.placement.get("expert_tier") == "resident"
    assert rec.machine.get("python") and rec.server.get("url", "").startswith("http://127.0.0.1")


def test_diff_plan_vs_measured_run(server, record) -> None:
    from moetplan.cli import app

    _, out, _ = record
    r = CliRunner().invoke(app, ["diff", server["plan"], str(out), "--json"])
    assert r.exit_code == 0, r.output
    rows = {x["field"]: x for x in json.loads(r.stdout)}
    assert rows["decode_tok_s"]["b"] > 0 and rows["decode_tok_s"]["a"] > 0
    assert rows["decode_tok_s"]["change"].endswith("%")
    # Believable: same order of magnitude (the CPU factors are this VM's calibration, not a law).
    change = float(rows["decode_tok_s"]["change"].rstrip("%"))
    assert -90 < change < 900


def test_calibrate_on_the_measured_run(record, tmp_path) -> None:
    from moetplan.cli import app

    _, out, _ = record
    target = tmp_path / "calibration.yaml"
    r = CliRunner().invoke(app, ["calibrate", str(out), "--out", str(target), "--json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["written_to"] == str(target) and target.exists()
    rows = [x for x in doc["rows"] if x["metric"] == "decode_tok_s"]
    assert rows and not doc["worse_than_before"]
    # The refit is joint: one run's decode, prefill and aggregate rows share factors (compute, per-layer and per-step
    # overheads). What it promises is the run as a whole fitted no worse; a row may trade a few points (decode
    # 5.7% -> 11.8% while CPU prefill went 218% -> 6% in one CI run), never fall apart.
    assert doc["after"]["median_abs_error"] <= doc["before"]["median_abs_error"] + 1e-9
    assert abs(rows[0]["error_after"]) <= max(abs(rows[0]["error_before"]), 0.25)


# --------------------------------------------------------------------------- what a coding agent sends

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "days"],
                   "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]},
                                  "days": {"type": "integer", "enum": [1, 2, 3]}}}}}]
# Not marked strict, as coding agents send their tools: the launch's --tool-strict-level parameter holds the call
# to the schema anyway (vLLM 0.31+; older releases hold forced calls to it by themselves).
FORCED = {"type": "function", "function": {"name": "get_weather"}}


def _no_whitespace_bias(server) -> dict[str, int]:
    """logit_bias pushing down every whitespace-only token of the tiny model's vocabulary: inside a forced tool
    call's JSON a random-weight model otherwise writes whitespace (allowed there) until max_tokens, where a
    trained one writes the arguments (vLLM's disable_any_whitespace does not reach the tool-call grammar)."""
    from tokenizers import Tokenizer

    from moetplan.models.tiny import checkpoint_dir

    tok = Tokenizer.from_file(str(checkpoint_dir("tiny-moe", os.path.join(server["env"]["MOETPLAN_CACHE_DIR"],
                                                                          "tiny")) / "tokenizer.json"))
    return {str(i): -100 for i in range(tok.get_vocab_size())
            if (t := tok.decode([i])) and not t.strip()}


def _client(server):
    import openai

    return openai.OpenAI(base_url=f"{server['url']}/v1", api_key="unused", max_retries=0, timeout=120)


def _check_call(name: str, arguments: str) -> dict:
    assert name == "get_weather"
    args = json.loads(arguments)
    assert {"city", "days"} <= set(args), args
    return args


def test_tool_choice_auto_answers_200_streamed_and_not(server) -> None:
    c = _client(server)
    done = c.chat.completions.create(model=server["model"], tools=TOOLS, tool_choice="auto", max_tokens=16,
                                     messages=[{"role": "user", "content": "Weather in Rome?"}])
    assert done.choices[0].finish_reason in ("stop", "length", "tool_calls")
    chunks = list(c.chat.completions.create(model=server["model"], tools=TOOLS, tool_choice="auto", max_tokens=16,
                                            stream=True, messages=[{"role": "user", "content": "Weather?"}]))
    assert chunks and chunks[-1].choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_a_forced_tool_call_returns_json_arguments_with_the_required_keys(server) -> None:
    c = _client(server)
    bias = _no_whitespace_bias(server)
    done = c.chat.completions.create(model=server["model"], tools=TOOLS, tool_choice=FORCED, max_tokens=200,
                                     logit_bias=bias, messages=[{"role": "user", "content": "Weather in Rome?"}])
    calls = done.choices[0].message.tool_calls
    assert calls, done.choices[0].message
    _check_call(calls[0].function.name, calls[0].function.arguments)
    # streamed: the arguments arrive in pieces; joined they are the same kind of JSON
    name, parts = None, []
    for chunk in c.chat.completions.create(model=server["model"], tools=TOOLS, tool_choice=FORCED, max_tokens=200,
                                           stream=True, logit_bias=bias,
                                           messages=[{"role": "user", "content": "Weather?"}]):
        for tc in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            name = tc.function.name or name
            parts.append(tc.function.arguments or "")
    _check_call(name, "".join(parts))


def test_a_three_turn_agent_loop_answers_at_every_turn(server) -> None:
    c = _client(server)
    messages = [{"role": "system", "content": "You call tools."}, {"role": "user", "content": "Weather in Paris?"}]
    first = c.chat.completions.create(model=server["model"], tools=TOOLS, tool_choice=FORCED, max_tokens=200,
                                      logit_bias=_no_whitespace_bias(server), messages=messages)
    call = first.choices[0].message.tool_calls[0]
    args = _check_call(call.function.name, call.function.arguments)
    messages.append({"role": "assistant", "content": None, "tool_calls": [
        {"id": call.id, "type": "function", "function": {"name": call.function.name,
                                                         "arguments": call.function.arguments}}]})
    messages.append({"role": "tool", "tool_call_id": call.id, "content": json.dumps({"sky": "clear", **args})})
    answer = c.chat.completions.create(model=server["model"], tools=TOOLS, tool_choice="auto", max_tokens=16,
                                       messages=messages)
    assert answer.choices[0].finish_reason in ("stop", "length", "tool_calls")
    messages += [{"role": "assistant", "content": answer.choices[0].message.content or ""},
                 {"role": "user", "content": "And tomorrow?"}]
    third = c.chat.completions.create(model=server["model"], tools=TOOLS, tool_choice="auto", max_tokens=16,
                                      messages=messages)
    assert third.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_anthropic_style_messages_answer_200(server) -> None:
    import httpx

    body = {"model": server["model"], "max_tokens": 16, "messages": [{"role": "user", "content": "Hello"}],
            "tools": [{"name": "get_weather", "description": "weather",
                       "input_schema": TOOLS[0]["function"]["parameters"]}]}
    r = httpx.post(f"{server['url']}/v1/messages", json=body, timeout=120,
                   headers={"x-api-key": "unused", "anthropic-version": "2023-06-01"})
    assert r.status_code == 200, r.text
    assert r.json()["type"] == "message" and r.json()["role"] == "assistant"
    with httpx.stream("POST", f"{server['url']}/v1/messages", json={**body, "stream": True}, timeout=120) as resp:
        assert resp.status_code == 200
        events = [ln for ln in resp.iter_lines() if ln.startswith("event:")]
    assert "event: message_stop" in events, events[-3:]


def test_bench_with_its_defaults_exits_0_again(server, record, tmp_path) -> None:
    """Run after run: the second bench against the same server also exits 0 (prompt lengths from /tokenize)."""
    from moetplan.cli import app
    from moetplan.contract import RunRecord, load_json

    out = tmp_path / "run2.json"
    r = CliRunner().invoke(app, ["bench", "--url", server["url"], "--plan", server["plan"], "--out", str(out)])
    assert r.exit_code == 0, r.output
    rec = load_json(RunRecord, out)
    assert rec.errors == [] and rec.measured["prompt_count_source"] == "tokenize"
    assert rec.measured.get("decode_timing") in ("events", "wall clock less TTFT", "server inter-token histogram")


# --------------------------------------------------------------------------- supervision (last: it kills the engine)


def test_engine_sigkilled_mid_stream_is_serving_again_without_a_person(server) -> None:
    import threading
    import time

    import httpx
    import psutil

    proc = server["proc"]
    engine = [p for p in psutil.Process(server["ready"]["pid"]).children(recursive=True)
              if "EngineCore" in " ".join(p.cmdline())]
    assert engine, "no EngineCore process under the server"
    outcome: dict = {}

    def stream() -> None:  # a long generation the kill interrupts
        try:
            with httpx.stream("POST", f"{server['url']}/v1/completions", timeout=120, json={
                    "model": server["model"], "prompt": "the", "max_tokens": 1500, "ignore_eos": True,
                    "stream": True}) as resp:
                outcome["lines"] = sum(1 for _ in resp.iter_lines())
        except httpx.HTTPError as e:
            outcome["error"] = type(e).__name__

    t = threading.Thread(target=stream)
    t.start()
    time.sleep(2.0)
    engine[0].kill()
    t0 = time.monotonic()
    events = []
    while time.monotonic() - t0 < 300:  # the supervisor's own events: died -> restarting -> ready
        line = proc.stdout.readline()
        if not line:
            break
        if line.startswith("{"):
            events.append(json.loads(line))
            if events[-1]["event"] == "ready":
                break
    t.join(timeout=60)
    kinds = [e["event"] for e in events]
    assert "died" in kinds and "restarting" in kinds and kinds[-1] == "ready", kinds
    died = events[kinds.index("died")]
    assert "EngineCore" in died["process"], died
    assert not any("nanobind" in ln for ln in died["cause"]), died["cause"]
    r = httpx.post(f"{server['url']}/v1/completions", timeout=120,
                   json={"model": server["model"], "prompt": "Hello", "max_tokens": 4})
    assert r.status_code == 200, r.text
    assert time.monotonic() - t0 < 120 + 60  # serving again within the 2 minutes (plus a loaded CI)
    restarts = json.loads(open(server["plan"].replace("plan.json", "plan.restarts.json")).read())
    assert restarts[0]["process"] == died["process"] and restarts[0]["restarted"] is True

"""`moetplan bench` against the served tiny model (vLLM CPU backend, marker `vllm`), then `diff plan.json run.json`
and `calibrate run.json` on what it measured (issue 10's end-to-end check)."""
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
def server(tmp_path_factory):
    """`moetplan run --model tiny-moe` (2-bit experts through the plugin), as the README's main job starts it."""
    cache = tmp_path_factory.mktemp("cache")
    run_dir = tmp_path_factory.mktemp("run")
    env = {**os.environ, "MOETPLAN_CACHE_DIR": str(cache), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "VLLM_CPU_KVCACHE_SPACE": "1"}
    port = free_port()
    proc, ready, events = start_run(["--model", "tiny-moe", "--port", str(port), "--run-dir", str(run_dir),
                                     "--timeout", "400"], env)
    if ready is None:
        pytest.fail(f"server did not come up: {events[-3:]}")
    import httpx

    # The first request a new user sends: a short prompt. On CPUs whose CPUID reports AMX this once killed the
    # server (vLLM's AMX attention ran before the process had the AMX tile permission; runtime/cpu_amx.py).
    first = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=120,
                       json={"model": ready["model"], "prompt": "Hello", "max_tokens": 8})
    yield {"url": f"http://127.0.0.1:{port}", "model": ready["model"], "plan": str(run_dir / "plan.json"),
           "env": env, "proc": proc, "first": first}
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=120)


@pytest.fixture(scope="module")
def record(server, tmp_path_factory):
    from moetplan.bench.phases import run_bench

    out = tmp_path_factory.mktemp("bench") / "run.json"
    rec = run_bench(server["url"], model=server["model"], plan=server["plan"], prompt_lens=[64, 256],
                    concurrency=[1, 2], runs=2, max_tokens=24, needle_lens=[256], timeout=120, out=str(out),
                    progress=False)
    return rec, out


def test_a_short_first_prompt_is_answered_and_the_server_keeps_serving(server) -> None:
    import httpx

    first = server["first"]
    assert first.status_code == 200, first.text
    assert first.json()["choices"][0]["text"] != "" or first.json()["usage"]["completion_tokens"] > 0
    again = httpx.post(f"{server['url']}/v1/completions", timeout=120,
                       json={"model": server["model"], "prompt": "Hi", "max_tokens": 4})
    assert again.status_code == 200, again.text
    assert server["proc"].poll() is None


def test_bench_record_has_every_metric_and_probe(record) -> None:
    rec, out = record
    assert out.exists() and json.loads(out.read_text())["kind"] == "run"
    m = rec.measured
    for key in ("decode_tok_s", "prefill_tok_s", "ttft_ms", "aggregate_tok_s"):
        assert isinstance(m.get(key), (int, float)) and m[key] > 0, key
    assert set(map(int, m["batch_curve"])) >= {1, 2}
    # Random weights answer nothing right; what matters is that every probe ran and gave a verdict.
    assert set(rec.probes["needle"].values()) <= {"PASS", "FAIL"} and rec.probes["needle"]
    assert rec.probes["arithmetic"] and rec.probes["coherence"]
    assert rec.placement.get("expert_tier") == "resident"
    assert rec.machine.get("python") and rec.server.get("url", "").startswith("http://127.0.0.1")


def test_diff_plan_vs_measured_run(server, record) -> None:
    from moetplan.cli import app

    _, out = record
    r = CliRunner().invoke(app, ["diff", server["plan"], str(out), "--json"])
    assert r.exit_code == 0, r.output
    rows = {x["field"]: x for x in json.loads(r.stdout)}
    assert rows["decode_tok_s"]["b"] > 0 and rows["decode_tok_s"]["a"] > 0
    assert rows["decode_tok_s"]["change"].endswith("%")


def test_calibrate_on_the_measured_run(record, tmp_path) -> None:
    from moetplan.cli import app

    _, out = record
    target = tmp_path / "calibration.yaml"
    r = CliRunner().invoke(app, ["calibrate", str(out), "--out", str(target), "--json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["written_to"] == str(target) and target.exists()
    rows = [x for x in doc["rows"] if x["metric"] == "decode_tok_s"]
    assert rows and abs(rows[0]["error_after"]) <= abs(rows[0]["error_before"]) + 1e-9

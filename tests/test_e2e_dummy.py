"""End to end (marker `vllm`): `moetplan run --model M --dummy-weights` serves an hwdb model with no checkpoint on
disk, on vLLM's CPU backend; the locality router's measured hit rate after a warm-up is within 5 points of the
plan's prediction; `moetplan bench` measures it and `moetplan diff` lines it up with the plan.

Two sizes of the same checks:
- default run: `tiny-qwen3-dummy`, a Qwen3-MoE-shaped hwdb entry at toy size (tests/fixtures/hwdb_models, added to
  a copy of hwdb/ through MOETPLAN_HWDB), experts in the host tier behind a cache of 29% of the rows (from a
  quarter of the rows up the prediction is ~1 point from the steady state; docs/ARCHITECTURE.md), 200 decode steps
  measured after 60 of warm-up; about a minute on 2 CPU cores, most of it vLLM's start.
- slow tier (marker `slow`): the whole Qwen3-30B-A3B, 48 layers x 128 experts, the largest honest configuration for
  a 2-core, 24 GiB CI machine: experts in the host tier (8.1 GiB of 2-bit rows in RAM) behind a 2 GiB expert cache,
  context 1024, one sequence. A decode step takes seconds there (the torch reference dequantizes every routed
  expert it reads), so the hit rate is taken over 30 decode steps after 30 of warm-up; docs/ARCHITECTURE.md ("Try
  before you download") has the bound. About 2.5 minutes on 2 CPU cores with the CPU expert kernels (20-25 on the torch reference).
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm")

from served import free_port, start_run  # noqa: E402

from moetplan.measure.window import window_kpis  # noqa: E402
from moetplan.contract import Plan, RunRecord, load_json  # noqa: E402

FIXTURE_MODELS = Path(__file__).resolve().parent / "fixtures" / "hwdb_models"
HWDB = Path(__file__).resolve().parents[1] / "hwdb"


@dataclass(frozen=True)
class Case:
    model: str
    moe_layers: int
    cache_gib: float
    context: int
    warm_tokens: int
    measured_tokens: int
    start_timeout_s: int


TINY = Case("tiny-qwen3-dummy", 4, 0.002, 512, 60, 200, 400)
FULL = Case("qwen3-30b-a3b", 48, 2, 1024, 30, 30, 1200)


@pytest.fixture(scope="module", params=[TINY, pytest.param(FULL, marks=pytest.mark.slow)], ids=lambda c: c.model)
def served(request, tmp_path_factory):
    case: Case = request.param
    env = dict(os.environ)  # the plan sizes vLLM's KV cache (conftest: this module's cache dir, offline)
    if (FIXTURE_MODELS / f"{case.model}.yaml").exists():
        hwdb = tmp_path_factory.mktemp("hwdb") / "hwdb"
        shutil.copytree(HWDB, hwdb)
        shutil.copy(FIXTURE_MODELS / f"{case.model}.yaml", hwdb / "models")
        env["MOETPLAN_HWDB"] = str(hwdb)
    run_dir = tmp_path_factory.mktemp("run")
    port = free_port()
    proc, ready, events = start_run(
        ["--model", case.model, "--dummy-weights", "--set", "expert_tier=host", "--set",
         f"gpu_expert_cache_gib={case.cache_gib}", "--set", "max_num_seqs=1", "--set", f"context={case.context}",
         "--port", str(port), "--run-dir", str(run_dir), "--timeout", str(case.start_timeout_s)], env,
        deadline_s=case.start_timeout_s + 100)
    if ready is None:
        pytest.fail(f"server did not come up: {events[-3:]}")
    yield {"case": case, "proc": proc, "ready": ready, "events": events, "port": port, "run_dir": run_dir,
           "env": env}
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)


def _complete(port: int, model: str, max_tokens: int) -> dict:
    import httpx

    r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=1800, json={
        "model": model, "prompt": "hello world, the model", "max_tokens": max_tokens, "ignore_eos": True})
    r.raise_for_status()
    return r.json()


def _record(path: Path, min_steps: int) -> RunRecord:
    time.sleep(3.0)  # the flusher's next write follows the last step
    deadline = time.monotonic() + 60
    rec = None
    while time.monotonic() < deadline:  # the worker flushes its record about once a second
        if path.exists():
            rec = load_json(RunRecord, path)
            if (rec.runtime.get("decode") or {}).get("steps", 0) >= min_steps:
                return rec
        time.sleep(1.0)
    raise AssertionError(f"run record {path} did not reach {min_steps} decode steps: {rec and rec.runtime}")


@pytest.fixture(scope="module")
def windows(served):
    path = Path(served["ready"]["run_record"])
    case: Case = served["case"]
    # A request's first token comes from its prefill, and the store closes a decode step when the next begins.
    first = _complete(served["port"], case.model, case.warm_tokens)
    before = _record(path, case.warm_tokens - 2)
    _complete(served["port"], case.model, case.measured_tokens)
    after = _record(path, case.warm_tokens + case.measured_tokens - 3)
    return first, before, after


def test_dummy_weights_serve_the_whole_model_with_no_checkpoint(served, windows):
    first, _, after = windows
    case: Case = served["case"]
    assert first["usage"]["completion_tokens"] == case.warm_tokens and first["choices"][0]["text"]
    plan = load_json(Plan, served["ready"]["plan"])
    folder = Path(plan.launch.model_path)
    assert (folder / "config.json").is_file() and not list(folder.glob("*.safetensors"))
    rt = after.runtime
    assert (rt["weights"], rt["router"], rt["expert_tier"]) == ("dummy", "locality", "host")
    assert rt["expert_sources"] == ["dummy"] and rt["moe_layers"] == plan.model.moe_layers == case.moe_layers
    # the rows are in the tier the plan placed them, at the plan's row size and cache size
    assert rt["expert_row_bytes"] == plan.placement.expert_row_bytes
    assert rt["gpu_expert_cache_slots"] == plan.placement.gpu_expert_cache_slots
    assert rt["backing"] == "PinnedHostStore"


def test_locality_hit_rate_is_within_5_points_of_the_plan(served, windows):
    _, before, after = windows
    plan = load_json(Plan, served["ready"]["plan"])
    w = window_kpis(before.runtime, after.runtime)
    assert w["steps"] >= served["case"].measured_tokens - 1
    assert abs(w["token_hit_rate"] - plan.prediction.token_hit_rate) <= 0.05, (w, plan.prediction.token_hit_rate)


def test_moetplan_bench_measures_the_dummy_plan(served, windows, tmp_path):
    # 32 tokens: the bench trusts a decode rate only when decoding takes at least twice the TTFT (a 33-token
    # prefill reads nearly every expert of every layer: ~50 s here)
    out = tmp_path / "run.json"
    r = subprocess.run([sys.executable, "-m", "moetplan.cli", "bench", "--url", f"http://127.0.0.1:{served['port']}",
                        "--plan", served["ready"]["plan"], "--runs", "1", "--max-tokens", "32", "--concurrency", "1",
                        "--prompt-lens", "32", "--no-probes", "--timeout", "600", "--out", str(out)],
                       env=served["env"], capture_output=True, text=True, timeout=1800)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    rec = load_json(RunRecord, out)
    assert rec.measured["decode_tok_s"] > 0 and rec.model_id == served["case"].model
    assert rec.runtime["weights"] == "dummy" and 0 < rec.measured["token_hit_rate"] <= 1
    diff = subprocess.run([sys.executable, "-m", "moetplan.cli", "diff", served["ready"]["plan"], str(out), "--json"],
                          env=served["env"], capture_output=True, text=True, timeout=300)
    assert diff.returncode == 0, diff.stderr[-2000:]
    rows = {row["field"]: row for row in json.loads(diff.stdout)}
    hit = rows["token_hit_rate"]  # `moetplan diff plan.json run.json` lines the bench's window up with the plan
    assert (hit["a"], hit["b"]) == (plan_hit_rate(served), rec.measured["token_hit_rate"])


def plan_hit_rate(served) -> float:
    return load_json(Plan, served["ready"]["plan"]).prediction.token_hit_rate

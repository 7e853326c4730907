"""Server supervision with stand-in servers: readiness, progress from log lines, diagnoses, and stopping the whole
process tree (checked by PID) — including servers that ignore SIGTERM and children that outlive their parent."""
from __future__ import annotations

import socket
import sys
import textwrap

import psutil
import pytest

from moetplan.launch.supervisor import Server, ServerDiedError, ServerTimeoutError, diagnose, progress_event

FAKE = textwrap.dedent('''
    import http.server, os, signal, subprocess, sys, threading, time
    port, mode = int(sys.argv[1]), sys.argv[2]
    if mode == "ignore_term":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    child_cmd = [sys.executable, "-c", "import signal,time\\n"
                 + ("signal.signal(signal.SIGTERM, signal.SIG_IGN)\\n" if mode == "ignore_term" else "")
                 + "time.sleep(600)"]
    child = subprocess.Popen(child_cmd)  # an engine-core stand-in
    print("INFO Initializing a V1 LLM engine (v0.32.0) with config: ...", flush=True)
    print("INFO Starting to load model /tmp/x...", flush=True)
    if mode == "oom":
        print("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB", flush=True)
        child.kill()
        sys.exit(1)
    print("INFO Loading weights took 0.25 seconds", flush=True)
    print("INFO moetplan: model.layers.0.mlp.experts experts=16 source=bfloat16 format=2bit tier=resident (0.01s)",
          flush=True)
    print("INFO init engine (profile, create kv cache, warmup model) took 1.50 s", flush=True)
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            if self.path == "/health":
                self.send_response(200); self.end_headers()
            elif self.path == "/v1/models":
                body = b'{"data": [{"id": "fake-model"}]}'
                self.send_response(200); self.send_header("content-length", str(len(body))); self.end_headers()
                self.wfile.write(body)
            else:
                self.send_response(404); self.end_headers()
        def log_message(self, *a):
            pass
    if mode != "never_ready":
        srv = http.server.HTTPServer(("127.0.0.1", port), H)
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        print("INFO Application startup complete.", flush=True)
    while True:
        time.sleep(0.1)
''')


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _server(tmp_path, mode: str) -> Server:
    script = tmp_path / "fake_server.py"
    script.write_text(FAKE)
    port = _port()
    return Server([sys.executable, str(script), str(port), mode], {}, tmp_path / f"{mode}.log", port=port)


def _gone(pids) -> bool:
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                return False
        except psutil.NoSuchProcess:
            continue
    return True


def test_ready_progress_models_and_clean_stop(tmp_path):
    srv = _server(tmp_path, "normal")
    events: list[str] = []
    srv.start()
    try:
        waited = srv.wait_ready(timeout=60, on_progress=events.append, poll_s=0.05)
        assert waited >= 0
        assert srv.healthy() and srv.served_models() == ["fake-model"]
        pids = srv.tree_pids()
        assert len(pids) >= 2  # server + its child
        assert "weights: loading" in events and "weights: loaded in 0.25s" in events
        assert any(e.startswith("experts: model.layers.0.mlp.experts") for e in events)
        assert "warm-up: done in 1.50s" in events and "server: up" in events
    finally:
        rep = srv.stop(timeout=10)
    assert rep.leftover == [] and not rep.killed
    assert set(pids) <= set(rep.pids_seen)
    assert _gone(rep.pids_seen)


def test_server_dying_while_loading_gives_tail_and_diagnosis(tmp_path):
    srv = _server(tmp_path, "oom")
    srv.start()
    with pytest.raises(ServerDiedError) as ei:
        srv.wait_ready(timeout=60, poll_s=0.05)
    assert "out of memory" in str(ei.value) and ei.value.returncode == 1
    assert any("CUDA out of memory" in ln for ln in ei.value.tail)
    rep = srv.stop(timeout=5)
    assert rep.leftover == [] and _gone(rep.pids_seen)


def test_sigterm_ignoring_tree_is_killed_and_verified(tmp_path):
    srv = _server(tmp_path, "ignore_term")
    srv.start()
    try:
        srv.wait_ready(timeout=60, poll_s=0.05)
        pids = srv.tree_pids()
    finally:
        rep = srv.stop(timeout=1.0)
    assert rep.killed and rep.leftover == []
    assert set(pids) <= set(rep.pids_seen) and _gone(rep.pids_seen)


def test_timeout_names_the_log_and_the_fix(tmp_path):
    srv = _server(tmp_path, "never_ready")
    srv.start()
    try:
        with pytest.raises(ServerTimeoutError, match="--timeout"):
            srv.wait_ready(timeout=1.5, poll_s=0.05)
    finally:
        rep = srv.stop(timeout=5)
    assert rep.leftover == []


@pytest.mark.parametrize("line,expect", [
    ("(Worker pid=1) INFO 11-30 [default_loader.py:501] Loading weights took 0.01 seconds",
     "weights: loaded in 0.01s"),
    ("INFO moetplan: pack /p/x.pack valid, reading rows instead of quantizing", "packs: /p/x.pack valid, reading rows "
     "instead of quantizing"),
    ("(EngineCore pid=2) INFO [kv_cache_utils.py:2327] CPU KV cache size: 524,288 tokens, Maximum ...",
     "kv cache: 524,288 tokens"),
    ("INFO:     Application startup complete.", "server: up"),
    ("some unrelated line", None),
])
def test_progress_events(line, expect):
    assert progress_event(line) == expect


@pytest.mark.parametrize("lines,needle", [
    (["RuntimeError: CUDA error: no kernel image is available for execution on the device"], "missing kernel"),
    (["moetplan.runtime.store.backing.PinnedMemoryError: pinned allocation failed (RLIMIT_MEMLOCK 64 KiB)"], "memlock"),
    (["OSError: [Errno 98] error while attempting to bind on address ('127.0.0.1', 8000): address already in use"],
     "--port"),
    (["ValueError: No available memory for the cache blocks. Try increasing `gpu_memory_utilization`"],
     "out of memory"),
    (["moetplan.contract.errors.ConfigError: The moetplan quantization method needs a plan: MOETPLAN_PLAN is not set"],
     "MOETPLAN_PLAN"),
])
def test_diagnoses(lines, needle):
    assert needle in (diagnose(lines) or "")


def test_no_diagnosis_for_unknown_failures():
    assert diagnose(["Traceback (most recent call last):", "KeyError: 'foo'"]) is None


def _fake_spec(tmp_path):
    """A one-layer local model for plans whose server is a stand-in script."""
    from moetplan.contract.model import Attention, ModelSpec

    return ModelSpec(id="local:fake", name="fake", local_path=str(tmp_path), num_layers=1, moe_layers=1,
                     hidden_size=64, moe_intermediate_size=32, n_routed_experts=4, top_k=2, vocab_size=64,
                     max_position_embeddings=128, attention=Attention(kind="gqa", num_heads=1),
                     kv_bytes_per_token={"bf16": 1.0}, non_routed_params_b=1e-6)


def test_run_command_flow_with_a_stand_in_server(tmp_path, monkeypatch):
    """`moetplan run plan.json --json --logs` end to end without vLLM: progress, ready, the server dying on its
    own (non-zero exit, last lines), and the stop report."""
    import json

    from typer.testing import CliRunner

    from moetplan.cli import app
    from moetplan.launch import run as run_mod
    from moetplan.launch.command import build_launch as real_build
    from moetplan.contract import save_json

    script = tmp_path / "fake_server.py"
    script.write_text(FAKE.replace("while True:\n    time.sleep(0.1)", "time.sleep(1.5)\nsys.exit(3)"))
    port = _port()

    def fake_build(plan, **kw):
        la = real_build(plan, **kw)
        la.argv = [sys.executable, str(script), str(port), "normal"]
        return la

    monkeypatch.setattr(run_mod, "build_launch", fake_build)
    spec = _fake_spec(tmp_path)
    plan_path = tmp_path / "plan.json"
    from moetplan.plan.cpu_backend import plan_for_cpu

    save_json(plan_for_cpu(spec, context=128), plan_path)
    res = CliRunner().invoke(app, ["run", str(plan_path), "--json", "--logs", "--port", str(port), "--restart", "no"])
    events = [json.loads(ln) for ln in res.stdout.splitlines() if ln.startswith("{")]
    kinds = [e["event"] for e in events]
    assert kinds[:2] == ["plan", "starting"] and "ready" in kinds and kinds[-1] == "stopped", kinds
    assert events[0]["summary"].startswith("plan: ") and "predicted" in events[0]["summary"]
    ready = next(e for e in events if e["event"] == "ready")
    assert ready["model"] == "fake-model" and ready["endpoint"] == f"http://127.0.0.1:{port}/v1"
    assert ready["run_record"].endswith("plan.run.json")
    assert "server: up" in [e.get("message") for e in events]
    exited = next(e for e in events if e["event"] == "exited")
    assert exited["crashed"] and exited["returncode"] == 3 and "error code 3" in exited["message"]
    assert "code 3" in exited["message"] and any("Application startup complete" in ln for ln in exited["tail"])
    assert events[-1]["leftover"] == []
    assert res.exit_code == 1
    assert (tmp_path / "plan.server.log").exists()


def test_describe_exit_tells_a_crash_from_a_clean_exit():
    from moetplan.launch.supervisor import describe_exit

    # vLLM's API server exits 0 after its engine core died of an illegal instruction: that is a crash.
    tail = ["(EngineCore pid=7) Fatal Python error: Illegal instruction", "(APIServer pid=6) INFO shutting down"]
    what, crashed = describe_exit(0, tail)
    assert crashed and "Fatal Python error: Illegal instruction" in what and "exit code 0" in what
    what, crashed = describe_exit(-9, [])
    assert crashed and "SIGKILL" in what and "OOM" in what
    what, crashed = describe_exit(-11, [])
    assert crashed and "SIGSEGV" in what
    what, crashed = describe_exit(2, ["usage: vllm serve ..."])
    assert crashed and "error code 2" in what
    what, crashed = describe_exit(0, ["INFO Application shutdown complete."])
    assert not crashed and "cleanly" in what


def test_a_silent_load_reports_that_it_is_still_loading(tmp_path):
    """No new log line for a while: wait_ready says so, with the elapsed time and the last stage."""
    script = tmp_path / "slow.py"
    script.write_text("import time\nprint('INFO Initializing a V1 LLM engine', flush=True)\ntime.sleep(30)\n")
    srv = Server([sys.executable, str(script)], {}, tmp_path / "slow.log", port=_port())
    heard: list[str] = []
    srv.start()
    try:
        with pytest.raises(ServerTimeoutError):
            srv.wait_ready(timeout=2.5, on_progress=heard.append, poll_s=0.1, heartbeat_s=1.0)
    finally:
        srv.stop(timeout=5)
    assert "engine: starting" in heard
    beats = [h for h in heard if h.startswith("still loading")]
    assert beats and "last: engine: starting" in beats[0]



# A vLLM stand-in whose engine process (titled as vLLM titles it) is SIGKILLed while serving on the first start;
# the API server logs an engine-dead traceback, then leak noise, and exits 0 as vLLM's does. The second start
# serves, then exits with code 3 (the restart budget of 1 is spent: run gives up).
FLAKY = textwrap.dedent('''
    import http.server, os, signal, subprocess, sys, threading, time
    port, marker = int(sys.argv[1]), sys.argv[2]
    first = not os.path.exists(marker)
    open(marker, "a").close()
    child = subprocess.Popen([sys.executable, "-c",
                              "import setproctitle, time; setproctitle.setproctitle('VLLM::EngineCore'); "
                              "time.sleep(600)"])
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404); self.end_headers()
        def log_message(self, *a):
            pass
    srv = http.server.HTTPServer(("127.0.0.1", port), H)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    print("INFO Application startup complete.", flush=True)
    print("(APIServer pid=1) ERROR [hermes_tool_parser.py:117] Error in extracting tool call.", flush=True)
    time.sleep(3.0)
    if first:
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
        srv.shutdown()
        print("(APIServer pid=1) ERROR [async_llm.py:906] AsyncLLM output_handler failed.", flush=True)
        print("(APIServer pid=1) ERROR [async_llm.py:906] Traceback (most recent call last):", flush=True)
        print("(APIServer pid=1) ERROR [async_llm.py:906]   File \\"core_client.py\\", line 1235, in get", flush=True)
        print("(APIServer pid=1) ERROR [async_llm.py:906] vllm.v1.engine.exceptions.EngineDeadError: EngineCore "
              "encountered an issue.", flush=True)
        print("nanobind: leaked 514 functions!", flush=True)
        time.sleep(8.0)  # vLLM's API server lingers; the supervisor must not wait for it
        sys.exit(0)
    child.kill()
    sys.exit(3)
''')


def test_a_killed_engine_is_restarted_and_the_restarts_are_recorded(tmp_path, monkeypatch):
    import json

    from typer.testing import CliRunner

    from moetplan.cli import app
    from moetplan.contract import load_json, run_record_path, RunRecord, save_json
    from moetplan.launch import run as run_mod
    from moetplan.launch.command import build_launch as real_build
    from moetplan.plan.cpu_backend import plan_for_cpu

    pytest.importorskip("setproctitle")
    script = tmp_path / "flaky_server.py"
    script.write_text(FLAKY)
    port = _port()

    def fake_build(plan, **kw):
        la = real_build(plan, **kw)
        la.argv = [sys.executable, str(script), str(port), str(tmp_path / "started-once")]
        return la

    monkeypatch.setattr(run_mod, "build_launch", fake_build)
    monkeypatch.setattr(run_mod, "DEAD_CHILD_GRACE_S", 1.0)
    spec = _fake_spec(tmp_path)
    plan_path = tmp_path / "plan.json"
    save_json(plan_for_cpu(spec, context=128), plan_path)
    res = CliRunner().invoke(app, ["run", str(plan_path), "--json", "--port", str(port), "--max-restarts", "1"])
    events = [json.loads(ln) for ln in res.stdout.splitlines() if ln.startswith("{")]
    events = [e for e in events if e["event"] != "progress"]
    kinds = [e["event"] for e in events]
    assert kinds == ["plan", "starting", "ready", "died", "restarting", "starting", "ready", "died", "exited",
                     "stopped"], kinds
    died = events[3]
    assert died["process"].startswith("EngineCore (pid ") and died["restart_in_s"] == 2.0
    # the root cause is the engine-dead traceback, not the earlier request error nor the leak noise
    assert any("EngineDeadError" in ln for ln in died["cause"]) and "Traceback" in died["cause"][0]
    assert not any("nanobind" in ln or "hermes" in ln for ln in died["cause"])
    assert events[7]["restart_in_s"] is None and "API server" in events[7]["process"]
    assert "not restarted (1 restart(s) within 600 s already)" in events[8]["message"]
    assert res.exit_code == 1 and events[-1]["leftover"] == []
    rec = load_json(RunRecord, run_record_path(plan_path))
    restarts = rec.server["restarts"]
    assert [r["restarted"] for r in restarts] == [True, False]
    assert restarts[0]["process"] == died["process"] and "exited with code 3" in restarts[1]["how"]


def test_restart_policy_backs_off_and_bounds_restarts_in_a_window():
    from moetplan.launch.supervisor import RestartPolicy

    p = RestartPolicy(max_restarts=3, window_s=100.0, backoff_s=2.0, backoff_max_s=5.0)
    assert [p.delay([], 0.0), p.delay([0.0], 1.0), p.delay([0.0, 1.0], 2.0)] == [2.0, 4.0, 5.0]
    assert p.delay([0.0, 1.0, 2.0], 3.0) is None  # three in the window: give up
    assert p.delay([0.0, 1.0, 2.0], 150.0) == 2.0  # the window moved on
    assert RestartPolicy(enabled=False).delay([], 0.0) is None


def test_root_cause_skips_shutdown_noise():
    from moetplan.launch.supervisor import root_cause

    lines = ["INFO serving", "nanobind: leaked 3 instances!",
             "(EngineCore pid=9) ERROR x Traceback (most recent call last):",
             '  File "a.py", line 1, in f', "torch.OutOfMemoryError: CUDA out of memory", "INFO Shutting down"]
    assert root_cause(lines) == lines[2:5]
    assert root_cause(["INFO ok", " - leaked type x", "ERROR CUDA error: an illegal memory access"]) == \
        ["ERROR CUDA error: an illegal memory access"]
    assert root_cause(["INFO nothing to see"]) == []

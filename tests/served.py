"""Starting `moetplan run` as a user would, for the end-to-end tests (shared by the vLLM-marked test files)."""
from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_run(args: list[str], env: dict[str, str], deadline_s: float = 480) -> tuple[subprocess.Popen, Any, list]:
    """`python -m moetplan.cli run ... --json`; read its event lines until `ready` (or a failure).

    Returns (process, ready event or None, events). On None the caller fails the test; the process is killed here.
    """
    proc = subprocess.Popen([sys.executable, "-m", "moetplan.cli", "run", "--json", *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    events: list[dict] = []
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        line = proc.stdout.readline()
        if not line:
            break
        if line.startswith("{"):
            ev = json.loads(line)
            events.append(ev)
            if ev["event"] == "ready":
                return proc, ev, events
            if ev["event"] in ("failed", "error", "exited"):
                break
    proc.kill()
    return proc, None, events


# Offline vLLM engines, one after another in a subprocess (engines are spawned, so the script needs the __main__
# guard). A job is [model, quantization or None, plan path or None, seconds to wait before shutdown (the worker's
# run-record flusher writes about once a second)]. Everything the worker does comes from the plan.
OFFLINE_SCRIPT = '''
import gc, json, os, sys, time


def generate(model, quantization, plan, settle_s=0.0):
    from vllm import LLM, SamplingParams
    if plan:
        os.environ["MOETPLAN_PLAN"] = plan
    # vLLM's AMX MLA kernel (chosen wherever CPUID reports AMX) takes bf16 only; fp32 MLA names the reference
    # CPU_MLA backend, as moetplan's launch does (launch/command.py, cpu_mla_backend).
    from moetplan.vllm_compat import cpu_mla_backend
    with open(os.path.join(model, "config.json")) as f:
        mla = "kv_lora_rank" in json.load(f)
    extra = {"attention_backend": cpu_mla_backend()} if mla else {}
    llm = LLM(model=model, dtype="float32", enforce_eager=True, max_model_len=512, seed=0,
              quantization=quantization, gpu_memory_utilization=0.5, **extra)
    out = llm.generate([sys.argv[2]], SamplingParams(temperature=0, max_tokens=int(sys.argv[3]), ignore_eos=True))
    ids = list(out[0].outputs[0].token_ids)
    time.sleep(settle_s)
    try:  # stop this engine's processes before the next one starts (2 CPU cores)
        llm.llm_engine.engine_core.shutdown()
    except Exception:
        pass
    del llm
    gc.collect()
    return ids


if __name__ == "__main__":
    jobs = json.loads(sys.argv[1])
    res = {name: generate(*args) for name, args in jobs.items()}
    print("RESULT " + json.dumps(res), flush=True)
'''


def run_offline(script_dir: Path, jobs: dict[str, list], env: dict[str, str], prompt: str,
                max_tokens: int) -> dict[str, list[int]]:
    """Greedy token ids per job name (OFFLINE_SCRIPT); fails with the subprocess's output tail."""
    script = script_dir / "offline_runs.py"
    script.write_text(OFFLINE_SCRIPT)
    res = subprocess.run([sys.executable, str(script), json.dumps(jobs), prompt, str(max_tokens)], env=env,
                         capture_output=True, text=True, timeout=900)
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith("RESULT ")]
    assert res.returncode == 0 and lines, (res.stdout[-3000:] + res.stderr[-3000:])
    return json.loads(lines[-1][len("RESULT "):])


def plan_file(tmp: Path, ckpt: Path, fmt: str, tag: str = "", gate: dict | None = None, promoter: str | None = None,
              **placement: Any) -> str:
    """A CPU plan for a generated checkpoint with these placement fields set (and the FP4 promoter, a runtime
    knob), saved as a file; returns its path."""
    from moetplan.plan.cpu_backend import plan_for_cpu
    from moetplan.models import resolve_model
    from moetplan.contract import Gate, RuntimeKnobs, save_json

    plan = plan_for_cpu(resolve_model(str(ckpt)), context=512, expert_format=fmt)
    for k, v in placement.items():
        setattr(plan.placement, k, v)
    if gate is not None:
        plan.placement.gate = Gate(**gate)
    if promoter is not None:
        plan.runtime_knobs = RuntimeKnobs(promoter=promoter)
    path = tmp / f"{ckpt.name}.{fmt}{tag}.json"
    save_json(plan, path)
    return str(path)

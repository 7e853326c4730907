"""Serve the tiny models through `moetplan run` and measure what a user sees: time to healthy, time to first token,
decode tokens/s (client side, greedy, streamed), the plugin's own step timing from the run record, and how long
the stop takes and whether any process is left. CPU backend where there is no GPU.

    .venv/bin/python bench/serve_tiny.py                      # tiny-moe 2-bit and unquantized, tiny-moe-mla 2-bit
    .venv/bin/python bench/serve_tiny.py --models tiny-moe --experts 2bit --tokens 128

Writes bench/results/serve_tiny.json (with machine info). Numbers on a 2-core VM are about the path, not speed.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from moetplan.contract import RunRecord, atomic_write_text, load_json  # noqa: E402

PROMPT = "hello world, the model serves tokens for every expert in the cache"


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stream(port: int, model: str, tokens: int) -> dict:
    import httpx

    t0 = time.perf_counter()
    first = None
    chunks, usage = 0, None
    with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", timeout=600, json={
        "model": model, "prompt": PROMPT, "max_tokens": tokens, "temperature": 0, "ignore_eos": True,
        "stream": True, "stream_options": {"include_usage": True}}) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            doc = json.loads(line[6:])
            if doc.get("usage"):
                usage = doc["usage"]
            if doc.get("choices"):  # one chunk per token (a byte-level token may carry no printable text)
                chunks += 1
                if first is None:
                    first = time.perf_counter()
    end = time.perf_counter()
    n = usage["completion_tokens"] if usage else chunks
    return {"tokens": n, "ttft_ms": round(1e3 * ((first or end) - t0), 1), "wall_s": end - t0}


def _decode_rate(port: int, model: str, tokens: int) -> dict:
    """Streamed chunks arrive bunched, so the decode rate is the slope between a short and a long request."""
    short, long_ = _stream(port, model, 8), _stream(port, model, tokens)
    rate = (long_["tokens"] - short["tokens"]) / (long_["wall_s"] - short["wall_s"])
    return {"tokens": long_["tokens"], "ttft_ms": short["ttft_ms"], "decode_tok_s": round(rate, 2)}


def one(model: str, experts: str, tokens: int, run_dir: Path) -> dict:
    port = _port()
    cmd = [sys.executable, "-m", "moetplan.cli", "run", "--model", model, "--experts", experts, "--port", str(port),
           "--json", "--run-dir", str(run_dir), "--timeout", "600"]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    ready = None
    for line in proc.stdout:
        if line.startswith("{"):
            ev = json.loads(line)
            if ev["event"] == "ready":
                ready = ev
                break
            if ev["event"] in ("failed", "error"):
                proc.wait()
                return {"model": model, "experts": experts, "error": ev.get("error")}
    healthy_s = time.perf_counter() - t0
    res = {"model": model, "experts": experts, "time_to_healthy_s": round(healthy_s, 2),
           "server_startup_s": ready["startup_s"]}
    _stream(port, model, 4)  # warm
    res["client"] = _decode_rate(port, model, tokens)
    time.sleep(2.5)  # the worker flushes its run record about once a second
    rec = load_json(RunRecord, ready["run_record"])
    res["runtime"] = {k: rec.runtime.get(k) for k in ("moe_calls", "steps", "tokens", "moe_ms_per_step", "load_s",
                                                       "token_hit_rate", "expert_sources")}
    res["runtime_measured"] = rec.measured
    t1 = time.perf_counter()
    proc.send_signal(signal.SIGTERM)
    rest, _ = proc.communicate(timeout=180)
    res["stop_s"] = round(time.perf_counter() - t1, 2)
    stopped = [json.loads(ln) for ln in rest.splitlines() if ln.startswith("{") and '"stopped"' in ln]
    res["processes"] = len(stopped[-1]["pids"]) if stopped else None
    res["leftover"] = stopped[-1]["leftover"] if stopped else None
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", nargs="*", default=None)
    ap.add_argument("--experts", default=None, help="2bit or unquantized (default: a fixed set of runs)")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "serve_tiny.json"))
    a = ap.parse_args()
    runs = [(m, a.experts or "2bit") for m in a.models] if a.models else \
        [("tiny-moe", "2bit"), ("tiny-moe", "unquantized"), ("tiny-moe-mla", "2bit")]
    import psutil

    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for m, e in runs:
            r = one(m, e, a.tokens, Path(tmp) / f"{m}-{e}")
            print(json.dumps(r), flush=True)
            results.append(r)
    doc = {
        "bench": "serve_tiny",
        "created_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": {"hostname": platform.node(), "platform": platform.platform(), "cpu_count": os.cpu_count(),
                    "ram_gib": round(psutil.virtual_memory().total / 2**30, 1), "python": platform.python_version()},
        "tokens": a.tokens,
        "results": results,
    }
    atomic_write_text(a.out, json.dumps(doc, indent=2) + "\n")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()

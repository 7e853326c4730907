"""Starting `moetplan run` as a user would, for the end-to-end tests (shared by the vLLM-marked test files)."""
from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
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

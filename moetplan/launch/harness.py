"""`moetplan run` as a child process, for scripts and tests that serve a plan and measure it.

`moetplan run --json` prints one JSON event per line (plan, starting, progress, ready, failed / exited, stopping,
stopped). `RunProcess` starts it in its own session, follows those events from a reader thread (so several runs
can start side by side), waits for `ready` with a deadline, and stops it the way a user does: SIGTERM, which makes
`moetplan run`'s supervisor stop the whole server tree and report what was left. A run that outlives its stop
deadline is killed with every process it was seen to own, so a caller's next server never meets a leftover.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

import psutil

from moetplan.contract.errors import MoetplanError

FAILED_EVENTS = ("failed", "error", "exited")


class RunFailed(MoetplanError):
    """The run ended or timed out before it was ready; `events` holds what it said."""

    def __init__(self, message: str, events: list[dict[str, Any]]):
        super().__init__(message)
        self.events = events


def run_argv(args: list[str], python: str = sys.executable) -> list[str]:
    """The command line of `moetplan run --json <args>` through this Python (no console script needed)."""
    return [python, "-m", "moetplan.cli", "run", "--json", *args]


class RunProcess:
    def __init__(self, args: list[str], env: dict[str, str] | None = None, log_path: str | Path | None = None,
                 python: str = sys.executable, on_event: Callable[[dict[str, Any]], None] | None = None):
        self.argv = run_argv(args, python)
        self.env = dict(os.environ if env is None else env)
        self.log_path = Path(log_path) if log_path is not None else None
        self.on_event = on_event
        self.events: list[dict[str, Any]] = []
        self.proc: subprocess.Popen[str] | None = None
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._reader: threading.Thread | None = None
        self._seen_pids: set[int] = set()

    # ------------------------------------------------------------------ start / follow

    def start(self) -> "RunProcess":
        self.proc = subprocess.Popen(self.argv, env=self.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, bufsize=1, start_new_session=True)
        self._reader = threading.Thread(target=self._read, name="moetplan-run-events", daemon=True)
        self._reader.start()
        return self

    def _read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        log = open(self.log_path, "a", encoding="utf-8") if self.log_path else None
        try:
            for line in self.proc.stdout:
                if log is not None:
                    log.write(line)
                    log.flush()
                ev = parse_event(line)
                if ev is None:
                    continue
                with self._changed:
                    self.events.append(ev)
                    self._seen_pids.update(int(p) for p in ev.get("pids") or [] if isinstance(p, int))
                    if isinstance(ev.get("pid"), int):
                        self._seen_pids.add(ev["pid"])
                    self._changed.notify_all()
                if self.on_event is not None:
                    self.on_event(ev)
        finally:
            if log is not None:
                log.close()
            with self._changed:
                self._changed.notify_all()

    def event(self, name: str) -> dict[str, Any] | None:
        with self._lock:
            return next((e for e in reversed(self.events) if e.get("event") == name), None)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def wait_ready(self, timeout: float) -> dict[str, Any]:
        """The `ready` event; RunFailed when the run fails, exits or is not ready within `timeout` seconds."""
        end = time.monotonic() + timeout
        with self._changed:
            while True:
                ready = next((e for e in self.events if e.get("event") == "ready"), None)
                if ready is not None:
                    return ready
                bad = next((e for e in self.events if e.get("event") in FAILED_EVENTS), None)
                if bad is not None:
                    raise RunFailed(f"moetplan run {bad['event']}: {describe_failure(bad)}", list(self.events))
                if self._reader is not None and not self._reader.is_alive():  # stdout closed: the run ended
                    code = self.proc.poll() if self.proc else None
                    raise RunFailed(f"moetplan run exited (code {code}) before the server was ready",
                                    list(self.events))
                left = end - time.monotonic()
                if left <= 0:
                    raise RunFailed(f"server not ready within {timeout:.0f} s (last: {self.last_progress()})",
                                    list(self.events))
                self._changed.wait(min(left, 1.0))

    def last_progress(self) -> str:
        with self._lock:
            ev = next((e for e in reversed(self.events) if e.get("event") == "progress"), None)
        return str(ev.get("message")) if ev else "no progress reported"

    @property
    def url(self) -> str | None:
        ready = self.event("ready")
        endpoint = str(ready["endpoint"]) if ready else None
        return endpoint.removesuffix("/v1") if endpoint else None

    # ------------------------------------------------------------------ stop

    def stop(self, timeout: float = 120.0) -> dict[str, Any]:
        """SIGTERM and wait for `moetplan run` to stop its server; returns its `stopped` event (or what this
        method found: leftover pids it had to kill)."""
        if self.proc is None:
            return {"event": "stopped", "leftover": [], "killed": False}
        if self.proc.poll() is None:
            try:
                self.proc.send_signal(signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                _kill_group(self.proc.pid)
                self.proc.wait(timeout=10)
        if self._reader is not None:
            self._reader.join(timeout=10)
        stopped = dict(self.event("stopped") or {"event": "stopped", "returncode": self.proc.returncode})
        left = [p for p in sorted(self._seen_pids) if _running(p)]
        if left:
            for pid in left:
                _kill(pid)
            stopped["leftover_killed"] = left
        stopped.setdefault("leftover", [])
        return stopped


def parse_event(line: str) -> dict[str, Any] | None:
    line = line.strip()
    if not line.startswith("{"):
        return None
    try:
        ev = json.loads(line)
    except ValueError:
        return None
    return ev if isinstance(ev, dict) and "event" in ev else None


def describe_failure(ev: dict[str, Any]) -> str:
    msg = ev.get("error") or ev.get("message") or ""
    tail = [str(t) for t in (ev.get("tail") or [])][-3:]
    return f"{msg}" + (f" | log: {' / '.join(tail)}" if tail else "")


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _kill(pid: int) -> None:
    try:
        psutil.Process(pid).kill()
    except psutil.Error:
        pass


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


__all__ = ["FAILED_EVENTS", "RunFailed", "RunProcess", "describe_failure", "parse_event", "run_argv"]

"""Start, watch and stop a vLLM server process tree: health, load progress from its log, no orphans.

The server runs in its own session (process group), its output goes to a log file that this module follows.
Stopping sends SIGTERM to the group (vLLM's API server then ends its engine and workers), waits, SIGKILLs what
is left, and checks every PID it ever saw in the tree with psutil, so a caller can assert that nothing remains.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import psutil

from moetplan.contract.errors import MoetplanError


class ServerDiedError(MoetplanError):
    """The server exited before it became healthy; message holds the diagnosis, `tail` the last log lines."""

    def __init__(self, message: str, tail: list[str], returncode: int | None):
        super().__init__(message)
        self.tail = tail
        self.returncode = returncode


class ServerTimeoutError(MoetplanError):
    def __init__(self, message: str, tail: list[str]):
        super().__init__(message)
        self.tail = tail


# --------------------------------------------------------------------------- log lines -> progress / diagnosis

_PROGRESS: list[tuple[re.Pattern[str], str]] = [
    (re.compile(r"non-default args"), "vLLM: reading the model config"),
    (re.compile(r"Using max model len (\d+)"), "vLLM: context {0} tokens"),
    (re.compile(r"Initializing a V1 LLM engine|Initializing an? .*engine"), "engine: starting"),
    (re.compile(r"OpenMP thread binding"), "engine: binding CPU threads"),
    (re.compile(r"world_size=\d+ rank=(\d+)"), "worker {0}: starting"),
    (re.compile(r"Starting to load model"), "weights: loading"),
    (re.compile(r"Loading weights took ([\d.]+) ?s"), "weights: loaded in {0}s"),
    (re.compile(r"moetplan: pack (.*)"), "packs: {0}"),
    (re.compile(r"moetplan: (\S+) experts=(\d+) source=(\S+) format=(\S+) tier=(\S+)"),
     "experts: {0} ({1} experts, {2} -> {3}, {4})"),
    (re.compile(r"Model loading took ([\d.]+) ?GiB"), "weights: {0} GiB in memory"),
    (re.compile(r"KV cache size: ([\d,]+) tokens"), "kv cache: {0} tokens"),
    (re.compile(r"init engine \(profile, create kv cache, warmup model\) took ([\d.]+)"), "warm-up: done in {0}s"),
    (re.compile(r"Capturing CUDA graph"), "warm-up: capturing CUDA graphs"),
    (re.compile(r"Starting vLLM (API )?server"), "server: starting HTTP"),
    (re.compile(r"Application startup complete"), "server: up"),
]

_DIAGNOSES: list[tuple[re.Pattern[str], str]] = [
    # a pack row that failed its checksum: the runtime's own line names the pack, the layers, the rows and the fix
    (re.compile(r"(?:moetplan: |PackCorruptError: )(Pack \S+: \d+ row\(s\) fail their xxh3 checksum.*)"), "{0}"),
    # memlock first: its errors mention memory too (PinnedMemoryError)
    (re.compile(r"memlock|RLIMIT_MEMLOCK|cudaHostRegister|PinnedMemoryError|mlock", re.I),
     "pinned memory refused (memlock limit): raise it (`ulimit -l unlimited`, or LimitMEMLOCK in the service) "
     "or plan a smaller host arena"),
    (re.compile(r"CUDA out of memory|OutOfMemoryError|torch\.OutOfMemoryError|No available memory for the cache"
                r"|insufficient memory|Cannot allocate memory|\bMemoryError|oom-kill|\bKilled\b", re.I),
     "out of memory: lower context / max_num_seqs / gpu_memory_utilization, or re-plan with a smaller expert "
     "cache (`moetplan plan --set ...`)"),
    (re.compile(r"no kernel image is available|not compiled for|undefined symbol|"
                r"operator \S+ does not exist|Could not run '[^']+' with arguments|NotImplementedError.*kernel",
                re.I),
     "missing kernel for this device or build: install the vLLM build for this machine "
     "(`pip install moetplan[cpu]` or `moetplan[cuda]`)"),
    (re.compile(r"Address already in use|error while attempting to bind", re.I),
     "port in use: pick another with --port"),
    (re.compile(r"PackageNotFoundError.*vllm|No module named 'vllm'", re.I),
     "vLLM is not installed in this Python: `pip install moetplan[cpu]` or `moetplan[cuda]`"),
    (re.compile(r"MOETPLAN_PLAN", re.I), "the runtime could not read the plan: check the MOETPLAN_PLAN path"),
    (re.compile(r"StalePackError|Pack .* is stale|unfinished", re.I),
     "expert packs are stale or unfinished: rebuild them with `moetplan quantize`"),
    (re.compile(r"Repository Not Found|HF_HUB_OFFLINE|LocalEntryNotFoundError|OfflineModeIsEnabled", re.I),
     "checkpoint not found locally (offline): download it first or point the plan at a local folder"),
]


# The runtime's own error line in a worker ("ERROR ... [file.py:N] moetplan: <message>"), logged before vLLM's
# traceback: it names the problem and the fix, so it is the diagnosis wherever it appears in the log.
_RUNTIME_ERROR = re.compile(r"\bERROR\b.*?\] moetplan: (.+)")

# A process that dies of these leaves one of these lines, whatever exit code its parent then reports.
_CRASH = re.compile(r"Fatal Python error: (\w[\w ]*)|EngineCore.*(?:died|failed)|Engine core .*(?:died|failed)|"
                    r"Segmentation fault|core dumped|RuntimeError: Engine|EngineDeadError", re.I)


def describe_exit(returncode: int | None, tail: list[str]) -> tuple[str, bool]:
    """(what happened, whether it was a crash) for a server that ended on its own.

    A negative code is a signal; vLLM's API server can also exit 0 after its engine process crashed, so the log
    decides too."""
    crash_line = next((ln for ln in reversed(tail) if _CRASH.search(ln)), None)
    if returncode is not None and returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        hint = " (the kernel's OOM killer sends SIGKILL: check `dmesg`)" if -returncode == signal.SIGKILL else ""
        return f"vLLM was killed by {name}{hint}", True
    if crash_line is not None:
        m = _CRASH.search(crash_line)
        what = f"Fatal Python error: {m.group(1)}" if m and m.group(1) else crash_line.strip()[-160:]
        return f"vLLM crashed (exit code {returncode}): {what}", True
    if returncode:
        return f"vLLM exited with error code {returncode}", True
    return f"vLLM exited cleanly (code {returncode}) without being asked to stop", False


def progress_event(line: str) -> str | None:
    """A short load-progress message for a vLLM log line, or None."""
    for pat, fmt in _PROGRESS:
        m = pat.search(line)
        if m:
            return fmt.format(*m.groups())
    return None


def diagnose(lines: list[str]) -> str | None:
    """One-line diagnosis of a failed start from its last log lines, where one is known."""
    text = "\n".join(lines)
    for pat, msg in _DIAGNOSES:
        m = pat.search(text)
        if m:
            return msg.format(*m.groups())
    return None


# --------------------------------------------------------------------------- root cause of a death

# Lines a dying vLLM prints on its way down that explain nothing: leak reports of its extension modules, the
# shutdown of its other processes, multiprocessing's resource tracker.
_NOISE = re.compile(r"nanobind|leaked \d+ (?:instances|types|functions)|leaked semaphore|resource_tracker|"
                    r"Shutting down|shutdown|Waiting for|Finished server process|Stopping|"
                    r"Application shutdown|Terminated|SIGTERM|KeyboardInterrupt", re.I)
_ERROR_LINE = re.compile(r"\bERROR\b|\bCRITICAL\b|Fatal Python error|Segmentation fault|core dumped|"
                         r"CUDA error|out of memory|OutOfMemory|\bKilled\b|died", re.I)
_TRACEBACK = re.compile(r"Traceback \(most recent call last\)")
# The exception line that closes a traceback ("torch.OutOfMemoryError: ...", "...EngineDeadError: ..."), after
# whatever prefix the logger put before it.
_EXC_LINE = re.compile(r"(?:^|[\s\]])[A-Za-z_][\w.]*(?:Error|Exception|Interrupt|Exit)\b(?::|\s*$)")


def root_cause(lines: list[str], limit: int = 8) -> list[str]:
    """The lines that say why vLLM died: the first traceback (its head and its exception line) or, without one,
    the first ERROR-like line with what follows it, leaving out shutdown noise (leak reports, the other processes
    stopping)."""
    for i, ln in enumerate(lines):
        if _TRACEBACK.search(ln):
            end = next((j for j in range(i + 1, len(lines))
                        if _EXC_LINE.search(lines[j]) and 'File "' not in lines[j]), None)
            if end is not None:
                body = lines[i:end + 1]
                return body[:2] + (["  ..."] if len(body) > limit else []) + body[max(2, len(body) - limit + 3):]
    for i, ln in enumerate(lines):
        if _ERROR_LINE.search(ln) and not _NOISE.search(ln):
            return [x for x in lines[i:i + limit] if not _NOISE.search(x)][:limit]
    return []


@dataclass
class Death:
    """A server tree that stopped serving: which process went first and how, and the lines that say why."""

    process: str  # "EngineCore (pid 123)", "API server (pid 100)"
    how: str  # "killed by SIGKILL", "exit code 1", "gone (exit status not visible: not our child)"
    cause: list[str]
    at: float  # time.time()

    def summary(self) -> str:
        return f"{self.process} {self.how}"


@dataclass
class RestartPolicy:
    """On-failure restarts with exponential backoff, at most `max_restarts` within `window_s` seconds."""

    enabled: bool = True
    max_restarts: int = 5
    window_s: float = 600.0
    backoff_s: float = 2.0
    backoff_max_s: float = 60.0

    def delay(self, restart_times: list[float], now: float) -> float | None:
        """Seconds to wait before the next restart, or None to give up (disabled, or the window is full)."""
        if not self.enabled:
            return None
        recent = [t for t in restart_times if now - t < self.window_s]
        if len(recent) >= self.max_restarts:
            return None
        return min(self.backoff_max_s, self.backoff_s * 2 ** len(recent))


_TITLE = re.compile(r"VLLM::(\w+)")
_LOGGED_EXIT = re.compile(r"(EngineCore\w*|Worker\w*)'?\s*:\s*(-?\d+)|"
                          r"(?:proc|process) (\S+) died with exit code (-?\d+)")


def _how(code: int | None) -> str:
    if code is None:
        return "gone (exit status not visible to moetplan)"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}"


# --------------------------------------------------------------------------- the process


class LogFollower:
    """Reads the lines appended to a log file since the last call (keeps a tail for diagnoses)."""

    def __init__(self, path: Path, keep: int = 200):
        self.path = path
        self._pos = 0
        self._partial = ""
        self.tail: deque[str] = deque(maxlen=keep)
        self.count = 0  # lines read so far

    def skip_to_end(self) -> None:
        try:
            self._pos = self.path.stat().st_size
        except FileNotFoundError:
            self._pos = 0

    def new_lines(self) -> list[str]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self._pos)
                data = f.read()
                self._pos = f.tell()
        except FileNotFoundError:
            return []
        if not data:
            return []
        text = self._partial + data.decode("utf-8", "replace").replace("\r", "\n")
        lines = text.split("\n")
        self._partial = lines.pop()
        lines = [ln for ln in lines if ln.strip()]
        self.tail.extend(lines)
        self.count += len(lines)
        return lines


@dataclass
class StopReport:
    returncode: int | None
    pids_seen: list[int]
    leftover: list[int]
    killed: bool


class Server:
    """One vLLM server process tree."""

    def __init__(self, argv: list[str], env: dict[str, str], log_path: str | os.PathLike[str],
                 host: str = "127.0.0.1", port: int = 8000, cwd: str | None = None):
        self.argv, self.env, self.host, self.port, self.cwd = argv, env, host, int(port), cwd
        self.log_path = Path(log_path)
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = LogFollower(self.log_path)
        # psutil handles remember each process's start time, so a recycled PID is never mistaken for ours.
        self._seen: dict[int, psutil.Process] = {}
        self._last_stage, self._last_stage_t = "starting", time.monotonic()
        self.runtime_error: str | None = None  # the first moetplan error line a worker logged
        self._titles: dict[int, str] = {}  # pid -> vLLM's process title (VLLM::EngineCore ...) or its command
        self.first_gone: tuple[int, str, float] | None = None  # (pid, title, when) of the first child seen gone
        self._healthy_mark = 0  # log lines read when /health last answered 200

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host
        return f"http://{host}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        logf = open(self.log_path, "ab")
        try:
            self.proc = subprocess.Popen(
                self.argv, env={**os.environ, **self.env}, cwd=self.cwd, stdin=subprocess.DEVNULL,
                stdout=logf, stderr=subprocess.STDOUT, start_new_session=True,
            )
        finally:
            logf.close()  # the child holds its own descriptor
        self._remember({self.proc.pid})

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def tree_pids(self) -> set[int]:
        """PIDs of the server, its descendants and its process group now (and remembers them)."""
        if self.proc is None:
            return set()
        pids: set[int] = set()
        try:
            root = psutil.Process(self.proc.pid)
            pids.add(root.pid)
            pids.update(c.pid for c in root.children(recursive=True))
        except psutil.NoSuchProcess:
            pass
        pgid = self.proc.pid  # start_new_session: the server leads its own group
        for p in psutil.process_iter(["pid"]):
            try:
                if os.getpgid(p.pid) == pgid:
                    pids.add(p.pid)
            except (ProcessLookupError, PermissionError, psutil.Error):
                continue
        self._remember(pids)
        return pids

    def _remember(self, pids: set[int]) -> None:
        for pid in pids:
            if pid not in self._seen:
                try:
                    self._seen[pid] = psutil.Process(pid)
                except psutil.NoSuchProcess:
                    continue
            if pid not in self._titles or not _TITLE.search(self._titles[pid]):
                try:  # vLLM retitles its processes after they start (setproctitle)
                    self._titles[pid] = " ".join(self._seen[pid].cmdline())[:120]
                except psutil.Error:
                    pass

    def process_name(self, pid: int) -> str:
        if self.proc is not None and pid == self.proc.pid:
            return f"API server (pid {pid})"
        m = _TITLE.search(self._titles.get(pid, ""))
        return f"{m.group(1) if m else 'vLLM process'} (pid {pid})"

    def watch(self) -> tuple[int, str, float] | None:
        """Check the tree once while serving: remembers new processes and the first one of them that is gone
        (vLLM's API server may outlive its engine for a while, serving errors)."""
        self.tree_pids()
        if self.first_gone is None:
            for pid, p in self._seen.items():
                if self.proc is not None and pid == self.proc.pid:
                    continue
                # vLLM's engine and workers only (their titles say so): helpers may come and go
                if not _TITLE.search(self._titles.get(pid, "")):
                    continue
                if not _alive([p]):
                    self.first_gone = (pid, self.process_name(pid), time.time())
                    break
        return self.first_gone

    def mark_healthy(self) -> None:
        """The server answered /health: errors logged before now did not stop it (a failed request's traceback)."""
        self.follow()
        self._healthy_mark = self.log.count

    def death(self) -> Death:
        """What stopped the tree (call after it stopped serving): the first process gone, how, and why (from the
        lines logged since it last answered /health)."""
        self.follow()
        tail = list(self.log.tail)
        since = self.log.count - self._healthy_mark
        if 0 < since < len(tail):
            tail = tail[-since:]
        root_code = self.proc.returncode if self.proc is not None else None
        if self.first_gone is not None:
            pid, name, at = self.first_gone
            code = None
            for m in _LOGGED_EXIT.finditer("\n".join(tail)):
                code = int(m.group(2) or m.group(4))
            how = _how(code)
        else:
            name, at, how = self.process_name(self.pid or 0), time.time(), _how(root_code)
        return Death(process=name, how=how, cause=root_cause(tail), at=at)

    def healthy(self, timeout: float = 2.0) -> bool:
        import httpx

        try:
            return httpx.get(self.url + "/health", timeout=timeout).status_code == 200
        except httpx.HTTPError:
            return False

    def served_models(self, timeout: float = 5.0) -> list[str]:
        import httpx

        try:
            data = httpx.get(self.url + "/v1/models", timeout=timeout).json()
            return [m["id"] for m in data.get("data", [])]
        except (httpx.HTTPError, ValueError, KeyError, TypeError):
            return []

    def wait_ready(self, timeout: float = 600.0, on_line: Callable[[str], None] | None = None,
                   on_progress: Callable[[str], None] | None = None, poll_s: float = 0.5,
                   heartbeat_s: float = 15.0) -> float:
        """Follow the log until /health answers 200; returns seconds waited. Raises ServerDiedError/TimeoutError.

        With no new stage for `heartbeat_s`, on_progress hears "still loading" with the elapsed time and the last
        stage, so a long import or load is never silent."""
        t0 = time.monotonic()
        next_health = t0
        self._last_stage, self._last_stage_t = "starting", t0
        while True:
            self._pump(on_line, on_progress)
            if self.proc is None or self.proc.poll() is not None:
                self._pump(on_line, on_progress)
                tail = list(self.log.tail)[-40:]
                rc = self.proc.returncode if self.proc else None
                what, _ = describe_exit(rc, tail)
                diag = self.runtime_error or diagnose(tail)
                msg = f"{what} while loading"
                raise ServerDiedError(f"{msg}: {diag}" if diag else f"{msg} (log: {self.log_path})", tail, rc)
            now = time.monotonic()
            if now >= next_health:
                self.tree_pids()
                if self.healthy(timeout=1.0):
                    self._pump(on_line, on_progress)
                    return now - t0
                next_health = now + 1.0
            if on_progress and now - self._last_stage_t >= heartbeat_s:
                on_progress(f"still loading ({now - t0:.0f} s; last: {self._last_stage})")
                self._last_stage_t = now
            if now - t0 > timeout:
                raise ServerTimeoutError(
                    f"the server did not become healthy within {timeout:.0f}s (log: {self.log_path}); "
                    "raise --timeout for big checkpoints", list(self.log.tail)[-40:])
            time.sleep(poll_s)

    def _pump(self, on_line: Callable[[str], None] | None, on_progress: Callable[[str], None] | None) -> None:
        for ln in self.log.new_lines():
            if self.runtime_error is None and (m := _RUNTIME_ERROR.search(ln)):
                self.runtime_error = m.group(1).strip()
            if on_line:
                on_line(ln)
            if on_progress:
                ev = progress_event(ln)
                if ev:
                    self._last_stage, self._last_stage_t = ev, time.monotonic()
                    on_progress(ev)

    def follow(self, on_line: Callable[[str], None] | None = None) -> list[str]:
        """New log lines since the last call (for --logs streaming)."""
        lines = self.log.new_lines()
        if on_line:
            for ln in lines:
                on_line(ln)
        return lines

    def stop(self, timeout: float = 30.0) -> StopReport:
        """SIGTERM the group, wait, SIGKILL stragglers; then verify by PID that none of the tree remains."""
        if self.proc is None:
            return StopReport(None, [], [], False)
        self.tree_pids()
        procs = list(self._seen.values())
        killed = False
        if self.proc.poll() is None:
            _signal_group(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pass
        # Children may outlive the API server by a moment while they flush; give them the rest of the budget.
        deadline = time.monotonic() + max(2.0, timeout / 3)
        while _alive(procs) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = _alive(procs)
        if left or self.proc.poll() is None:
            killed = True
            _signal_group(self.proc.pid, signal.SIGKILL)
            for p in left:
                try:
                    p.kill()  # psutil checks the start time first: never a recycled PID
                except psutil.Error:
                    pass
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
            end = time.monotonic() + 5
            while _alive(procs) and time.monotonic() < end:
                time.sleep(0.1)
        return StopReport(self.proc.returncode, sorted(p.pid for p in procs),
                          sorted(p.pid for p in _alive(procs)), killed)


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _alive(procs: list[psutil.Process]) -> list[psutil.Process]:
    """Processes still running (zombies, dead but not yet reaped by their parent, do not count)."""
    out = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.NoSuchProcess:
            continue
    return out

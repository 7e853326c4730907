"""Serve a Plan through vLLM and supervise the server until Ctrl-C / SIGTERM (`moetplan run` after planning).

Supervision: when vLLM stops serving on its own (a process of its tree killed, OOM, a CUDA error), `run` says which
process died and how, with the lines that say why, and starts it again under the same plan on the same port
(`RestartPolicy`: exponential backoff, at most N restarts in a window; `--restart no` exits instead). The first
start is not retried: a plan that cannot load would only fail again. Restarts and their causes are written beside
the plan (`<plan>.restarts.json`) as they happen and into the run record's `server.restarts` when `run` exits.
"""
from __future__ import annotations

import json
import signal
import sys
import time
from pathlib import Path
from typing import Any, Callable

from moetplan.contract import RunRecord, run_record_path
from moetplan.contract.io import atomic_write_text
from moetplan.launch.command import build_launch, is_cpu_plan, served_name

# A tree whose engine or worker is gone is given this long to exit by itself (vLLM's API server notices and
# shuts down) before moetplan stops it.
DEAD_CHILD_GRACE_S = 5.0
# /health failing this many checks in a row (one every HEALTH_EVERY_S) while every process is up: a hung server.
HEALTH_FAILURES = 6
HEALTH_EVERY_S = 5.0


class _Stop(Exception):
    pass


def _on_sigterm(signum: int, frame: Any) -> None:
    raise _Stop()


def restarts_path(plan_path: Path) -> Path:
    return plan_path.with_name(plan_path.stem + ".restarts.json")


def _record_restarts(plan_path: Path, restarts: list[dict[str, Any]]) -> None:
    """Restarts into the run record (the worker rewrites that file while it runs, so this runs at exit) and the
    sidecar beside the plan."""
    if not restarts:
        return
    atomic_write_text(restarts_path(plan_path), json.dumps(restarts, indent=2) + "\n")
    rec_path = run_record_path(plan_path)
    try:
        rec = RunRecord.model_validate_json(Path(rec_path).read_text()) if Path(rec_path).is_file() else \
            RunRecord(plan_path=str(plan_path))
    except ValueError:
        rec = RunRecord(plan_path=str(plan_path))
    rec.server["restarts"] = restarts
    atomic_write_text(rec_path, rec.model_dump_json(indent=2) + "\n")


def _serve_until_down(server: Any, on_line: Callable[[str], None] | None) -> str:
    """Block while the server serves; return why it stopped serving ("exited", "child died", "unhealthy")."""
    last_health, fails = time.monotonic(), 0
    server.mark_healthy()
    while server.alive():
        if on_line:
            server.follow(on_line)
        gone = server.watch()
        if gone is not None and time.time() - gone[2] > DEAD_CHILD_GRACE_S:
            return "child died"
        now = time.monotonic()
        if now - last_health >= HEALTH_EVERY_S:
            last_health = now
            if server.healthy(timeout=3.0):
                fails = 0
                server.mark_healthy()
            else:
                fails += 1
            if fails >= HEALTH_FAILURES:
                return "unhealthy"
        time.sleep(0.5)
    return "exited"


def serve(plan: Any, plan_path: Path, *, host: str, port: int, show_logs: bool, as_json: bool, timeout: float,
          extra_args: list[str], console: Any, err: Any, restart: Any = None) -> int:
    from moetplan.launch.supervisor import (RestartPolicy, Server, ServerDiedError, ServerTimeoutError,
                                            describe_exit, diagnose)

    policy = restart if restart is not None else RestartPolicy(enabled=False)
    if not is_cpu_plan(plan):
        try:  # the installed vLLM's own list of attention splitting ops (build_launch uses it when loaded)
            import vllm.config.compilation  # noqa: F401
        except Exception:
            pass
    launch = build_launch(plan, plan_path=str(plan_path), host=host, port=port, python=sys.executable,
                          extra_args=extra_args)
    log_path = plan_path.with_name(plan_path.stem + ".server.log")
    log_path.unlink(missing_ok=True)
    restarts_path(plan_path).unlink(missing_ok=True)
    record_path = run_record_path(plan_path)
    emit = (lambda d: print(json.dumps(d), flush=True)) if as_json else None
    # SIGINT too: a shell starts background jobs with SIGINT ignored, and Ctrl-C must still stop the tree.
    stop_signals = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
    prev = {sig: signal.signal(sig, _on_sigterm) for sig in stop_signals}
    rc = 0
    interrupted = False
    restarts: list[dict[str, Any]] = []
    restart_times: list[float] = []
    server = Server(launch.argv, launch.env, log_path, host=host, port=port)
    on_line = (lambda ln: err.print(ln, markup=False, highlight=False)) if show_logs else None
    try:
        while True:
            server.start()
            if emit:
                emit({"event": "starting", "pid": server.pid, "log": str(log_path), "plan": str(plan_path),
                      "argv": launch.argv, "restarts": len(restart_times)})
            elif not restart_times:
                console.print(f"[bold]moetplan run[/] {launch.served_model_name} — log: {log_path}")
            try:
                waited = _wait_ready(server, timeout, on_line, emit, console)
            except (ServerDiedError, ServerTimeoutError):
                if not restart_times:
                    raise  # the first start: the plan cannot load, a restart would fail the same way
                waited = None
            if waited is not None:
                models = server.served_models() or [launch.served_model_name or served_name(plan)]
                info = {"event": "ready", "endpoint": server.url + "/v1", "model": models[0], "pid": server.pid,
                        "pids": sorted(server.tree_pids()), "startup_s": round(waited, 2), "plan": str(plan_path),
                        "run_record": str(record_path), "log": str(log_path), "restarts": len(restart_times)}
                if emit:
                    emit(info)
                else:
                    again = f" (restart {len(restart_times)})" if restart_times else ""
                    console.print(f"[bold green]ready[/]{again} in {waited:.1f}s  endpoint [bold]{info['endpoint']}"
                                  f"[/]  model [bold]{info['model']}[/]")
                    if not restart_times:
                        console.print(f"  run record: {record_path}   (Ctrl-C stops the server)")
                why = _serve_until_down(server, on_line)
            else:
                why = "failed to load again"
            death = server.death()
            code = server.proc.returncode if server.proc else None
            msg, _ = describe_exit(code, list(server.log.tail))
            diag = diagnose(death.cause or list(server.log.tail)[-20:])
            what = f"{death.summary()} ({why}; {msg})" + (f"; {diag}" if diag else "")
            server.stop()  # what is left of the tree: restarting needs the port and the memory back
            delay = policy.delay(restart_times, time.monotonic())
            entry = {"at": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(death.at)), "process": death.process,
                     "how": death.how, "why": why, "cause": death.cause, "diagnosis": diag,
                     "restarted": delay is not None}
            restarts.append(entry)
            if emit:
                emit({"event": "died", "message": what, "process": death.process, "how": death.how,
                      "cause": death.cause, "returncode": code,
                      "restart_in_s": delay, "tail": list(server.log.tail)[-20:]})
            else:
                err.print(f"[bold red]vLLM stopped serving:[/] {what}", highlight=False)
                if death.cause:
                    err.print("  root cause:", highlight=False)
                    for ln in death.cause:
                        err.print("    " + ln, markup=False, highlight=False)
            if delay is None:
                rc = 1
                why_not = ("--restart no" if not policy.enabled else
                           f"{policy.max_restarts} restart(s) within {policy.window_s:.0f} s already")
                if emit:
                    emit({"event": "exited", "message": f"{what}; not restarted ({why_not})", "crashed": True,
                          "returncode": code, "tail": list(server.log.tail)[-20:]})
                else:
                    err.print(f"[bold red]error:[/] not restarted ({why_not}); log: {log_path}", highlight=False)
                break
            _record_restarts(plan_path, restarts)
            if not emit:
                console.print(f"restarting in {delay:.0f} s under the same plan on port {port} "
                              f"(restart {len(restart_times) + 1}; --restart no to exit instead)")
            else:
                emit({"event": "restarting", "in_s": delay, "restart": len(restart_times) + 1})
            time.sleep(delay)
            restart_times.append(time.monotonic())
            server = Server(launch.argv, launch.env, log_path, host=host, port=port)
            server.log.skip_to_end()  # the new tree's lines only (its diagnoses must not read the old ones)
    except (KeyboardInterrupt, _Stop):
        rc = 0
        interrupted = True
    except (ServerDiedError, ServerTimeoutError) as e:
        rc = 1
        if emit:
            emit({"event": "failed", "error": str(e), "tail": e.tail})
        else:
            err.print("[bold red]last log lines:[/]")
            for ln in e.tail[-25:]:
                err.print("  " + ln, markup=False, highlight=False)
            err.print(f"[bold red]error:[/] {e}")
    finally:
        for sig in stop_signals:  # a second Ctrl-C / SIGTERM must not interrupt the cleanup
            signal.signal(sig, signal.SIG_IGN)
        if server.alive():
            n = len(server.tree_pids())
            what_ = "stop asked" if interrupted else "stopping"
            if emit:
                emit({"event": "stopping", "message": f"{what_}: SIGTERM to the server's {n} process(es)"})
            else:
                console.print(f"{what_}: sending SIGTERM to the server's {n} process(es), waiting for them to exit "
                              "(up to 30 s, then SIGKILL)")
        report = server.stop()
        _record_restarts(plan_path, restarts)
        for sig, handler in prev.items():
            signal.signal(sig, handler)
        stopped = {"event": "stopped", "returncode": report.returncode, "pids": report.pids_seen,
                   "leftover": report.leftover, "killed": report.killed, "restarts": len(restart_times)}
        if emit:
            emit(stopped)
        elif report.pids_seen:
            state = "no process left" if not report.leftover else f"LEFT RUNNING: {report.leftover}"
            console.print(f"stopped ({len(report.pids_seen)} processes, {state})")
        if report.leftover:
            rc = 1
    return rc


def _wait_ready(server: Any, timeout: float, on_line: Any, emit: Any, console: Any) -> float:
    if emit:
        on_progress = lambda ev: emit({"event": "progress", "message": ev})  # noqa: E731
        return server.wait_ready(timeout=timeout, on_line=on_line, on_progress=on_progress)
    with console.status("starting vLLM") as status:
        def on_progress(ev: str) -> None:
            status.update(ev)
            console.print(f"  [dim]{ev}[/]")

        return server.wait_ready(timeout=timeout, on_line=on_line, on_progress=on_progress)

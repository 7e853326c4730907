"""Serve a Plan through vLLM and supervise the server until Ctrl-C / SIGTERM (`moetplan run` after planning)."""
from __future__ import annotations

import json
import signal
import sys
import time
from pathlib import Path
from typing import Any

from moetplan.contract import run_record_path
from moetplan.launch.command import build_launch, is_cpu_plan, served_name


class _Stop(Exception):
    pass


def _on_sigterm(signum: int, frame: Any) -> None:
    raise _Stop()


def serve(plan: Any, plan_path: Path, *, host: str, port: int, show_logs: bool, as_json: bool, timeout: float,
          extra_args: list[str], console: Any, err: Any) -> int:
    if not is_cpu_plan(plan):
        try:  # the installed vLLM's own list of attention splitting ops (build_launch uses it when loaded)
            import vllm.config.compilation  # noqa: F401
        except Exception:
            pass
    launch = build_launch(plan, plan_path=str(plan_path), host=host, port=port, python=sys.executable,
                          extra_args=extra_args)
    from moetplan.launch.supervisor import Server, ServerDiedError, ServerTimeoutError, describe_exit, diagnose

    log_path = plan_path.with_name(plan_path.stem + ".server.log")
    log_path.unlink(missing_ok=True)
    record_path = run_record_path(plan_path)
    server = Server(launch.argv, launch.env, log_path, host=host, port=port)
    emit = (lambda d: print(json.dumps(d), flush=True)) if as_json else None
    # SIGINT too: a shell starts background jobs with SIGINT ignored, and Ctrl-C must still stop the tree.
    stop_signals = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
    prev = {sig: signal.signal(sig, _on_sigterm) for sig in stop_signals}
    rc = 0
    interrupted = False
    try:
        server.start()
        if emit:
            emit({"event": "starting", "pid": server.pid, "log": str(log_path), "plan": str(plan_path),
                  "argv": launch.argv})
        else:
            console.print(f"[bold]moetplan run[/] {launch.served_model_name} — log: {log_path}")
        on_line = (lambda ln: err.print(ln, markup=False, highlight=False)) if show_logs else None
        if emit:
            on_progress = lambda ev: emit({"event": "progress", "message": ev})  # noqa: E731
            waited = server.wait_ready(timeout=timeout, on_line=on_line, on_progress=on_progress)
        else:
            with console.status("starting vLLM") as status:
                def on_progress(ev: str) -> None:
                    status.update(ev)
                    console.print(f"  [dim]{ev}[/]")

                waited = server.wait_ready(timeout=timeout, on_line=on_line, on_progress=on_progress)
        models = server.served_models() or [launch.served_model_name or served_name(plan)]
        info = {"event": "ready", "endpoint": server.url + "/v1", "model": models[0], "pid": server.pid,
                "pids": sorted(server.tree_pids()), "startup_s": round(waited, 2), "plan": str(plan_path),
                "run_record": str(record_path), "log": str(log_path)}
        if emit:
            emit(info)
        else:
            console.print(f"[bold green]ready[/] in {waited:.1f}s  endpoint [bold]{info['endpoint']}[/]  "
                          f"model [bold]{info['model']}[/]")
            console.print(f"  run record: {record_path}   (Ctrl-C stops the server)")
        while server.alive():
            if show_logs:
                server.follow(on_line)
            time.sleep(0.5)
        server.follow()  # the last lines the server wrote before it went
        rc = 1
        tail = list(server.log.tail)[-20:]
        code = server.proc.returncode if server.proc else None
        msg, crashed = describe_exit(code, list(server.log.tail))
        diag = diagnose(tail) if crashed else None
        if diag:
            msg = f"{msg}; {diag}"
        if emit:
            emit({"event": "exited", "message": msg, "crashed": crashed, "returncode": code, "tail": tail})
        else:
            err.print(f"[bold red]error:[/] {msg}; last log lines ({log_path}):")
            for ln in tail:
                err.print("  " + ln, markup=False, highlight=False)
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
            what = "stop asked" if interrupted else "stopping"
            if emit:
                emit({"event": "stopping", "message": f"{what}: SIGTERM to the server's {n} process(es)"})
            else:
                console.print(f"{what}: sending SIGTERM to the server's {n} process(es), waiting for them to exit "
                              "(up to 30 s, then SIGKILL)")
        report = server.stop()
        for sig, handler in prev.items():
            signal.signal(sig, handler)
        stopped = {"event": "stopped", "returncode": report.returncode, "pids": report.pids_seen,
                   "leftover": report.leftover, "killed": report.killed}
        if emit:
            emit(stopped)
        elif report.pids_seen:
            state = "no process left" if not report.leftover else f"LEFT RUNNING: {report.leftover}"
            console.print(f"stopped ({len(report.pids_seen)} processes, {state})")
        if report.leftover:
            rc = 1
    return rc

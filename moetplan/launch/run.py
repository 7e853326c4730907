"""`moetplan run`: serve a model under a plan through vLLM and supervise it until Ctrl-C / SIGTERM.

Input is a plan.json, or `--model NAME` which plans first: the tiny embedded models (`tiny-moe`,
`tiny-moe-mla`) are generated once, cached, and planned for this machine (vLLM's CPU backend when there is no
GPU); any other name or checkpoint goes through the solver with the usual hardware sources (--box/--gpus/--hw
or a probe of this machine).
"""
from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any, List, Optional

import typer

from moetplan.contract.errors import MoetplanError, UsageError
from moetplan.launch.command import DEFAULT_HOST, DEFAULT_PORT, build_launch, is_cpu_plan, shell_line
from moetplan import contract as _schema
from moetplan.contract import load_json, save_json

EXPERT_FORMAT_CHOICES = ("2bit", "unquantized")

from moetplan.plan.cpu_backend import host_info, plan_for_cpu  # noqa: E402,F401  (the CPU-backend planner)


# --------------------------------------------------------------------------- plans for local CPU serving


def _moetplan_version() -> str:
    try:
        from importlib.metadata import version

        return version("moetplan")
    except Exception:
        return ""


def runs_root() -> Path:
    import platformdirs

    return Path(os.environ.get("MOETPLAN_CACHE_DIR") or platformdirs.user_cache_dir("moetplan")) / "runs"


def set_expert_format(plan: Any, expert_format: str) -> None:
    if expert_format not in EXPERT_FORMAT_CHOICES:
        raise UsageError(f"--experts {expert_format}: choose one of {', '.join(EXPERT_FORMAT_CHOICES)}")
    plan.placement.expert_format = expert_format


def resolve_plan(plan_path: str | None, model: str | None, *, box: str | None = None, gpus: str | None = None,
                 hw: str | None = None, context: str | None = None, set_: list[str] | None = None,
                 experts: str | None = None, run_dir: str | None = None) -> tuple[Any, Path, bool]:
    """-> (plan, path the runtime will read it from, whether that file was written by this run)."""
    if bool(plan_path) == bool(model):
        raise UsageError("give either a plan.json or --model NAME (e.g. `moetplan run --model tiny-moe`)")
    if plan_path:
        plan = load_json(_schema.Plan, plan_path)
        path = Path(plan_path).resolve()
        if experts and experts != plan.placement.expert_format:
            set_expert_format(plan, experts)
            path = path.with_name(f"{path.stem}.{experts}.json")
            save_json(plan, path)
            return plan, path, True
        return plan, path, False

    from moetplan.launch import tiny

    ctx = None
    if context:
        from moetplan.contract import parse_tokens as _parse_tokens

        try:
            ctx = _parse_tokens(context)
        except ValueError:
            raise UsageError(f"--context {context}: not a token count (e.g. 4096 or 32k)") from None
    if tiny.is_tiny(model):  # type: ignore[arg-type]
        ckpt = tiny.ensure_tiny_checkpoint(model)  # type: ignore[arg-type]
        from moetplan.models import resolve_model

        spec = resolve_model(str(ckpt))
        spec.id, spec.name = model, model  # type: ignore[assignment]
        if box or gpus or hw:
            plan = _solve(spec, box, gpus, hw, ctx, set_)
        else:
            plan = _solve_here(spec, ctx, set_, experts or "2bit")
        plan.launch.model_path = str(ckpt)
        plan.launch.served_model_name = model
    else:
        from moetplan.models import resolve_model

        spec = resolve_model(model)  # type: ignore[arg-type]
        plan = _solve(spec, box, gpus, hw, ctx, set_)
    if experts:
        set_expert_format(plan, experts)
    plan.moetplan_version = plan.moetplan_version or _moetplan_version()
    name = plan.launch.served_model_name or spec.id.replace(":", "-").replace("/", "-")
    folder = Path(run_dir) if run_dir else runs_root() / name
    path = (folder / "plan.json").resolve()
    save_json(plan, path)
    return plan, path, True


def _solve(spec: Any, box: str | None, gpus: str | None, hw: str | None, ctx: int | None,
           set_: list[str] | None) -> Any:
    from moetplan.plan.hardware import resolve_hardware
    from moetplan.plan.solver import parse_set, solve

    profile, notes = resolve_hardware(hw, box, gpus, probe_progress=False)
    plan = solve(spec, profile, _schema.Goals(context=ctx, pinned=parse_set(set_ or [])), with_launch=False)
    plan.warnings = notes + plan.warnings
    return plan


def local_gpu_count() -> int:
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            return int(pynvml.nvmlDeviceGetCount())
        finally:
            pynvml.nvmlShutdown()
    except Exception:
        return 0


def _solve_here(spec: Any, ctx: int | None, set_: list[str] | None, experts: str) -> Any:
    """Plan for this machine: its GPUs through the solver, or the CPU backend when it has none."""
    if local_gpu_count() == 0:
        pins = {}
        for item in set_ or []:
            k, _, v = item.partition("=")
            pins[k.strip()] = v.strip()
        unknown = set(pins) - {"context", "max_num_seqs"}
        if unknown:
            raise UsageError(f"--set {', '.join(sorted(unknown))}: a CPU-backend plan takes only context and "
                             "max_num_seqs")
        from moetplan.contract import parse_tokens as _parse_tokens

        try:
            context = _parse_tokens(pins["context"]) if "context" in pins else ctx
            seqs = int(pins.get("max_num_seqs", 4))
        except ValueError:
            raise UsageError(f"--set {' '.join(set_ or [])}: not a number") from None
        return plan_for_cpu(spec, context=context, expert_format=experts, max_num_seqs=seqs)
    return _solve(spec, None, None, None, ctx, set_)


# --------------------------------------------------------------------------- run


class _Stop(Exception):
    pass


def _on_sigterm(signum: int, frame: Any) -> None:
    raise _Stop()


def serve(plan: Any, plan_path: Path, *, host: str, port: int, show_logs: bool, as_json: bool, timeout: float,
          extra_args: list[str], console: Any, err: Any) -> int:
    if not is_cpu_plan(plan):
        have, want = local_gpu_count(), plan.placement.tp * plan.placement.pp
        if have < want:
            where = plan.hardware.box_id or plan.hardware.description or "another machine"
            raise UsageError(
                f"this plan is for {want} GPU(s) ({where}); this machine has {have}. Use --dry-run to print its "
                "command, run it on that machine, or plan for this one (`moetplan run --model NAME` without --box)"
            )
        try:  # the installed vLLM's own list of attention splitting ops (build_launch uses it when loaded)
            import vllm.config.compilation  # noqa: F401
        except Exception:
            pass
    launch = build_launch(plan, plan_path=str(plan_path), host=host, port=port, python=sys.executable,
                          extra_args=extra_args)
    from moetplan.launch.supervisor import Server, ServerDiedError, ServerTimeoutError
    from moetplan.runtime.records import run_record_path

    log_path = plan_path.with_name(plan_path.stem + ".server.log")
    log_path.unlink(missing_ok=True)
    record_path = run_record_path(plan_path)
    server = Server(launch.argv, launch.env, log_path, host=host, port=port)
    emit = (lambda d: print(json.dumps(d), flush=True)) if as_json else None
    # SIGINT too: a shell starts background jobs with SIGINT ignored, and Ctrl-C must still stop the tree.
    stop_signals = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
    prev = {sig: signal.signal(sig, _on_sigterm) for sig in stop_signals}
    rc = 0
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
        models = server.served_models() or [launch.served_model_name]
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
        rc = 1
        tail = list(server.log.tail)[-20:]
        msg = f"the server exited on its own with code {server.proc.returncode if server.proc else '?'}"
        if emit:
            emit({"event": "exited", "message": msg, "tail": tail})
        else:
            err.print(f"[bold red]error:[/] {msg}; last log lines:")
            for ln in tail:
                err.print("  " + ln, markup=False, highlight=False)
    except (KeyboardInterrupt, _Stop):
        rc = 0
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


def run_command(
    plan_file: Optional[str] = typer.Argument(None, metavar="[PLAN.JSON]", help="plan to serve"),
    model: Optional[str] = typer.Option(None, "--model", "-m", help="plan first: tiny-moe, tiny-moe-mla, tiny-moe-fp8, an hwdb "
                                        "model id or a checkpoint folder"),
    box: Optional[str] = typer.Option(None, "--box", help="with --model: plan for a reference box"),
    gpus: Optional[str] = typer.Option(None, "--gpus", help="with --model: inline GPUs, e.g. 2xrtx-5090"),
    hw: Optional[str] = typer.Option(None, "--hw", help="with --model: HardwareProfile JSON"),
    context: Optional[str] = typer.Option(None, "--context", help="with --model: wanted context"),
    set_: List[str] = typer.Option([], "--set", help="with --model: pin a knob name=value"),
    experts: Optional[str] = typer.Option(None, "--experts", help="routed experts: 2bit (default) or "
                                          "unquantized (checkpoint precision; for correctness checks)"),
    host: str = typer.Option(DEFAULT_HOST, "--host"),
    port: int = typer.Option(DEFAULT_PORT, "--port"),
    dry_run: bool = typer.Option(False, "--dry-run", help="print the vLLM command and environment, start nothing"),
    logs: bool = typer.Option(False, "--logs", help="stream the server log to stderr"),
    timeout: float = typer.Option(900.0, "--timeout", help="seconds to wait for the server to become healthy"),
    run_dir: Optional[str] = typer.Option(None, "--run-dir", help="with --model: where plan.json, the log and "
                                          "the run record go (default: the user cache dir)"),
    as_json: bool = typer.Option(False, "--json", help="JSON lines (events) instead of text"),
    vllm_args: List[str] = typer.Argument(None, hidden=True),
) -> None:
    """Serve a model under a plan through vLLM (extra vLLM flags after `--`)."""
    from rich.console import Console

    console, err = Console(), Console(stderr=True)
    extra = list(vllm_args or [])
    try:
        if plan_file and (plan_file.startswith("-") or (model and not plan_file.endswith(".json"))):
            # After `--` click hands every word to the positionals: the first belongs to the vLLM flags.
            extra, plan_file = [plan_file, *extra], None
        plan, plan_path, written = resolve_plan(plan_file, model, box=box, gpus=gpus, hw=hw, context=context,
                                                set_=set_, experts=experts, run_dir=run_dir)
        if dry_run:
            launch = build_launch(plan, plan_path=str(plan_path), host=host, port=port, extra_args=extra)
            if as_json:
                print(json.dumps({"argv": launch.argv, "env": launch.env, "model_path": launch.model_path,
                                  "served_model_name": launch.served_model_name, "plan": str(plan_path),
                                  "backend": "cpu" if is_cpu_plan(plan) else "cuda"}, indent=2))
            else:
                _render_dry_run(launch, plan, plan_path, console)
            return
        rc = serve(plan, plan_path, host=host, port=port, show_logs=logs, as_json=as_json, timeout=timeout,
                   extra_args=extra, console=console, err=err)
    except MoetplanError as e:
        if as_json:
            print(json.dumps({"event": "error", "error": str(e), "exit_code": e.exit_code}))
        else:
            err.print(f"[bold red]error:[/] {e}")
        raise typer.Exit(e.exit_code)
    if rc:
        raise typer.Exit(rc)


def _render_dry_run(launch: Any, plan: Any, plan_path: Path, console: Any) -> None:
    from rich.table import Table

    t = Table(title=f"vLLM launch for {launch.served_model_name} ({'CPU' if is_cpu_plan(plan) else 'CUDA'})",
              show_header=True, header_style="bold")
    t.add_column("environment")
    t.add_column("value", overflow="fold")
    for k, v in sorted(launch.env.items()):
        t.add_row(k, v)
    console.print(t)
    console.print("[bold]command[/]")
    console.print(shell_line(launch), markup=False, highlight=False, soft_wrap=True)
    console.print(f"[dim]plan: {plan_path}[/]")

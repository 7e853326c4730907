"""`moetplan run`: plan if needed, launch vLLM under the plan, supervise it until Ctrl-C / SIGTERM."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, List, Optional

import typer

from moetplan import __version__
from moetplan import contract as _schema
from moetplan.contract import InfeasibleError, MoetplanError, UsageError, load_json, runs_root, save_json
from moetplan.cli.common import SERVING_HELP, STRICT_HELP
from moetplan.contract.vocab import EXPERT_FORMATS, check_choice
from moetplan.hw.gpus import local_gpu_count
from moetplan.launch.command import DEFAULT_HOST, DEFAULT_PORT, build_launch, is_cpu_plan, shell_line
from moetplan.launch.run import serve
from moetplan.plan.cpu_backend import CPU_UNSERVED_ATTENTION, cpu_backend_serves, plan_for_cpu

# What a CPU-backend plan can be pinned to (plan/cpu_backend.py: experts resident, or a RAM cache over a host store).
CPU_PINS = ("context", "max_num_seqs", "expert_tier", "gpu_expert_cache_gib", "moe_graphs", "tp")


def set_expert_format(plan: Any, expert_format: str) -> None:
    check_choice("--experts", expert_format, EXPERT_FORMATS)
    plan.placement.expert_format = expert_format


def resolve_plan(plan_path: str | None, model: str | None, *, box: str | None = None, gpus: str | None = None,
                 hw: str | None = None, context: str | None = None, set_: list[str] | None = None,
                 experts: str | None = None, run_dir: str | None = None, dummy_weights: bool = False,
                 router: str | None = None, serving: dict[str, str | None] | None = None,
                 pack_dir: str | None = None) -> tuple[Any, Path, bool]:
    """-> (plan, path the runtime will read it from, whether that file was written by this run).

    `serving`: the user's tool-call / reasoning parser, tokenizer mode and chat template (None: hwdb's)."""
    from moetplan.launch.dummy import apply_dummy_weights, check_dummy_source, check_router, set_router
    from moetplan.launch.serving import serving_for

    serving = {k: v for k, v in (serving or {}).items() if v is not None}

    if bool(plan_path) == bool(model):
        raise UsageError("give either a plan.json or --model NAME (e.g. `moetplan run --model tiny-moe`)")
    check_router(router)
    if dummy_weights:
        check_dummy_source(model, plan_path)
        if experts and experts != "2bit":
            raise UsageError("--dummy-weights writes random 2-bit expert rows; drop --experts unquantized")
    if plan_path:
        plan = load_json(_schema.Plan, plan_path)
        path = Path(plan_path).resolve()
        changed = []
        if experts and experts != plan.placement.expert_format:
            set_expert_format(plan, experts)
            changed.append(experts)
        if dummy_weights and plan.runtime_knobs.weights != "dummy":
            apply_dummy_weights(plan, router)
            changed.append("dummy")
        elif router and router != plan.runtime_knobs.router:
            set_router(plan, router)
            changed.append(router)
        if serving:
            plan.serving = serving_for(plan, serving)
            changed.append("serving")
        if pack_dir and pack_dir != plan.placement.pack_dir:
            plan.placement.pack_dir = str(Path(pack_dir).expanduser().resolve())
            changed.append("packs")
        if plan.runtime_knobs.weights == "dummy":
            apply_dummy_weights(plan, plan.runtime_knobs.router)  # its config folder, rewritten if missing
        if changed:
            path = path.with_name(f"{path.stem}.{'.'.join(changed)}.json")
            save_json(plan, path)
            return plan, path, True
        return plan, path, False

    plan = plan_model(model, box=box, gpus=gpus, hw=hw, context=context, set_=set_,  # type: ignore[arg-type]
                      experts=experts, dummy_weights=dummy_weights, router=router, serving=serving,
                      pack_dir=pack_dir)
    plan.moetplan_version = plan.moetplan_version or __version__
    name = plan.launch.served_model_name or plan.model.id.replace(":", "-").replace("/", "-")
    folder = Path(run_dir) if run_dir else runs_root() / name
    path = (folder / "plan.json").resolve()
    save_json(plan, path)
    return plan, path, True


def plan_model(model: str, *, box: str | None = None, gpus: str | None = None, hw: str | None = None,
               context: str | None = None, set_: list[str] | None = None, experts: str | None = None,
               dummy_weights: bool = False, router: str | None = None,
               serving: dict[str, str | None] | None = None, pack_dir: str | None = None) -> Any:
    """The plan for `--model` (what `run --model` serves and `plan --model` writes): this machine's GPUs, or the
    CPU backend on a machine without one for a model it serves here (a tiny model, a checkpoint folder, an hwdb
    model with --dummy-weights); a GPU box only when --box, --gpus or --hw says which."""
    from moetplan.launch.dummy import apply_dummy_weights, set_router
    from moetplan.launch.serving import serving_for
    from moetplan.models import tiny

    ctx = None
    if context:
        from moetplan.contract import parse_tokens as _parse_tokens

        try:
            ctx = _parse_tokens(context)
        except ValueError:
            raise UsageError(f"--context {context}: not a token count (e.g. 4096 or 32k)") from None
    if tiny.is_tiny(model) or tiny.is_trained(model):  # type: ignore[arg-type]
        ckpt = (tiny.ensure_tiny_checkpoint(model) if tiny.is_tiny(model)  # type: ignore[arg-type]
                else trained_checkpoint())
        from moetplan.models import resolve_model

        spec = resolve_model(str(ckpt))
        spec.id, spec.name = model, model  # type: ignore[assignment]
        if box or gpus or hw:
            plan = _solve(spec, box, gpus, hw, ctx, set_, pack_dir)
        else:
            plan = _solve_here(spec, ctx, set_, experts or "2bit", pack_dir)
        plan.launch.model_path = str(ckpt)
        plan.launch.served_model_name = model
    else:
        from moetplan.models import resolve_model

        spec = resolve_model(model)  # type: ignore[arg-type]
        cpu_ok = cpu_backend_serves(spec) or (dummy_weights and spec.attention.kind not in CPU_UNSERVED_ATTENTION)
        if cpu_ok and not (box or gpus or hw):
            try:  # the CPU backend where there is no GPU
                plan = _solve_here(spec, ctx, set_, experts or "2bit", pack_dir)
            except InfeasibleError as e:
                if not dummy_weights or local_gpu_count() > 0:
                    raise
                # Too big for this machine's RAM: a GPU box's plan, which --dry-run shows and run refuses.
                plan = _first_box_that_fits(spec, ctx, set_, pack_dir)
                plan.warnings.insert(0, f"not served on this machine's CPU backend: {e}")
        elif dummy_weights and not (box or gpus or hw) and local_gpu_count() == 0:
            plan = _first_box_that_fits(spec, ctx, set_, pack_dir)  # no GPU here, no CPU kernels for it
        else:
            plan = _solve(spec, box, gpus, hw, ctx, set_, pack_dir)
    if experts:
        set_expert_format(plan, experts)
    if dummy_weights:
        apply_dummy_weights(plan, router)
    elif router:
        set_router(plan, router)
    plan.serving = serving_for(plan, {k: v for k, v in (serving or {}).items() if v is not None})
    plan.moetplan_version = plan.moetplan_version or __version__
    return plan


def _solve(spec: Any, box: str | None, gpus: str | None, hw: str | None, ctx: int | None,
           set_: list[str] | None, pack_dir: str | None = None) -> Any:
    from moetplan.hw.resolve import resolve_hardware
    from moetplan.plan.solver import parse_set, solve

    profile, notes = resolve_hardware(hw, box, gpus, pack_dir=pack_dir, probe_progress=False)
    plan = solve(spec, profile, _schema.Goals(context=ctx, pinned=parse_set(set_ or []), pack_dir=pack_dir))
    plan.warnings = notes + plan.warnings
    return plan


def trained_checkpoint() -> Path:
    """The trained tiny MoE's served checkpoint: trained once on first use (a progress bar on stderr), then
    read from the cache."""
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from moetplan.models import tiny
    from moetplan.runtime.offline import quality as Q

    spec = Q.TinyMoeSpec()
    with Progress(TextColumn("training tiny-moe-py on Python's standard library"), BarColumn(),
                  TextColumn("{task.completed}/{task.total} steps {task.fields[loss]}"), TimeElapsedColumn(),
                  transient=True, console=Console(stderr=True)) as bar:
        task = bar.add_task("train", total=spec.train_steps, loss="")

        def log(line: str) -> None:  # "step N: loss X", every 50 steps
            step, _, loss = line.removeprefix("step ").partition(": ")
            if step.isdigit():
                bar.update(task, completed=int(step) + 1, loss=loss)

        model, tok, info = Q.load_or_train(spec, log=log)
    return tiny.export_trained(model, tok, info)


def _first_box_that_fits(spec: Any, ctx: int | None, set_: list[str] | None, pack_dir: str | None) -> Any:
    """The default box's plan, or the first reference box (smallest total VRAM first) whose plan fits: with no GPU
    here, `--dummy-weights --dry-run` still shows a launch for a model no single card holds."""
    from moetplan import hwdb

    default = hwdb.guards()["planner"]["default_box"]
    boxes = sorted(hwdb.box_ids(), key=lambda b: sum(g.vram_gib for g in hwdb.box_profile(b).gpus))
    first_error = None
    for box in [default] + [b for b in boxes if b != default]:
        try:
            plan = _solve(spec, box, None, None, ctx, set_, pack_dir)
        except InfeasibleError as e:
            first_error = first_error or e
            continue
        if box != default:
            plan.warnings.insert(0, f"the default box '{default}' does not hold {spec.id}; planned for '{box}' "
                                    "(--box for another)")
        return plan
    raise first_error  # type: ignore[misc]


def _solve_here(spec: Any, ctx: int | None, set_: list[str] | None, experts: str,
                pack_dir: str | None = None) -> Any:
    """Plan for this machine: its GPUs through the solver, or the CPU backend when it has none (what `run --model`
    and `plan --model` without --box/--gpus/--hw both do)."""
    if local_gpu_count() == 0:
        from moetplan.plan.solver import parse_set

        pins = parse_set(set_ or [])
        from moetplan.hw.host import query_host  # the probe's cores and DRAM rate price the CPU step

        unknown = set(pins) - set(CPU_PINS)
        if unknown:
            raise UsageError(f"--set {', '.join(sorted(unknown))}: a CPU-backend plan takes only "
                             f"{', '.join(CPU_PINS)}")
        return plan_for_cpu(spec, context=pins.get("context", ctx), expert_format=experts,
                            max_num_seqs=pins.get("max_num_seqs", 4), expert_tier=pins.get("expert_tier", "resident"),
                            gpu_expert_cache_gib=pins.get("gpu_expert_cache_gib"),
                            pack_dir=str(Path(pack_dir).expanduser().resolve()) if pack_dir else None,
                            tp=pins.get("tp", 1), moe_graphs=pins.get("moe_graphs", "replay"),
                            host=query_host(measure=True, try_cuda=False).info)
    return _solve(spec, None, None, None, ctx, set_, pack_dir)


def serving_overrides(tool_call_parser: str | None = None, reasoning_parser: str | None = None,
                      tokenizer_mode: str | None = None, chat_template: str | None = None,
                      tool_strict_level: str | None = None) -> dict[str, str | None]:
    if chat_template and chat_template.lower() not in ("none", "off") and not Path(chat_template).is_file() \
            and "{" not in chat_template:
        raise UsageError(f"--chat-template {chat_template}: no such file; give a Jinja template file")
    return {"tool_call_parser": tool_call_parser, "reasoning_parser": reasoning_parser,
            "tokenizer_mode": tokenizer_mode, "chat_template": chat_template, "tool_strict_level": tool_strict_level}


def restart_policy(restart: str, max_restarts: int, window_s: float) -> Any:
    from moetplan.launch.supervisor import RestartPolicy

    if restart not in ("on-failure", "no"):
        raise UsageError(f"--restart {restart}: choose on-failure or no")
    if max_restarts < 0 or window_s <= 0:
        raise UsageError("--max-restarts must be >= 0 and --restart-window > 0 seconds")
    return RestartPolicy(enabled=restart == "on-failure", max_restarts=max_restarts, window_s=window_s)


def check_gpus_here(plan: Any) -> None:
    """A GPU plan needs its GPUs on this machine; say so before vLLM fails in its own words."""
    if is_cpu_plan(plan):
        return
    have, want = local_gpu_count(), plan.placement.tp * plan.placement.pp
    if have < want:
        where = plan.hardware.box_id or plan.hardware.description or "another machine"
        raise UsageError(
            f"this plan is for {want} GPU(s) ({where}); this machine has {have}. Use --dry-run to print its "
            "command, run it on that machine, or plan for this one (`moetplan run --model NAME` without --box)"
        )


def run_command(
    plan_file: Optional[str] = typer.Argument(None, metavar="[PLAN.JSON]", help="plan to serve"),
    model: Optional[str] = typer.Option(None, "--model", "-m", help="plan first: tiny-moe-py (trained on Python "
                                        "source on first use), tiny-moe, tiny-moe-mla, tiny-moe-fp8 (random), an "
                                        "hwdb model id or a checkpoint folder"),
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
    dummy_weights: bool = typer.Option(False, "--dummy-weights", help="with --model (an hwdb model): serve the "
                                       "plan with random weights, no checkpoint on disk (config.json and a "
                                       "tokenizer written from hwdb; experts as random 2-bit rows in their tier)"),
    router: Optional[str] = typer.Option(None, "--router", help="who picks the experts: model (its own router) "
                                         "or locality (popularity follows the model's published coverage curve; "
                                         "the default with --dummy-weights)"),
    tool_call_parser: Optional[str] = typer.Option(None, "--tool-call-parser", help=SERVING_HELP),
    reasoning_parser: Optional[str] = typer.Option(None, "--reasoning-parser", help=SERVING_HELP),
    tokenizer_mode: Optional[str] = typer.Option(None, "--tokenizer-mode", help=SERVING_HELP),
    chat_template: Optional[str] = typer.Option(None, "--chat-template", help="a Jinja chat template file for "
                                                "vLLM (default: the checkpoint's own)"),
    tool_strict_level: Optional[str] = typer.Option(None, "--tool-strict-level", help=STRICT_HELP),
    pack_dir: Optional[str] = typer.Option(None, "--pack-dir", help="serve the experts from the packs in DIR "
                                           "(`moetplan quantize`; written there on first load when missing)"),
    restart: str = typer.Option("on-failure", "--restart", help="when vLLM dies while serving: on-failure "
                                "(restart it under the same plan and port, with backoff) or no (exit)"),
    max_restarts: int = typer.Option(5, "--max-restarts", help="with --restart on-failure: give up after this "
                                     "many restarts within --restart-window seconds"),
    restart_window: float = typer.Option(600.0, "--restart-window", help="seconds over which --max-restarts "
                                         "counts"),
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
                                                set_=set_, experts=experts, run_dir=run_dir,
                                                dummy_weights=dummy_weights, router=router,
                                                serving=serving_overrides(tool_call_parser, reasoning_parser,
                                                                          tokenizer_mode, chat_template,
                                                                          tool_strict_level),
                                                pack_dir=pack_dir)
        policy = restart_policy(restart, max_restarts, restart_window)
        if dry_run:
            launch = build_launch(plan, plan_path=str(plan_path), host=host, port=port, extra_args=extra)
            if as_json:
                print(json.dumps({"argv": launch.argv, "env": launch.env, "model_path": launch.model_path,
                                  "serving": plan.serving.model_dump() if plan.serving else None,
                                  "served_model_name": launch.served_model_name, "plan": str(plan_path),
                                  "backend": "cpu" if is_cpu_plan(plan) else "cuda"}, indent=2))
            else:
                _render_dry_run(launch, plan, plan_path, console)
            return
        check_gpus_here(plan)
        from moetplan.report.plan_view import plan_line

        line = plan_line(plan)
        if as_json:
            print(json.dumps({"event": "plan", "summary": line, "plan": str(plan_path),
                              "placement": plan.placement.model_dump(mode="json"),
                              "predicted_decode_tok_s": plan.prediction.decode_tok_s}), flush=True)
        else:
            console.print(line, highlight=False)
        rc = serve(plan, plan_path, host=host, port=port, show_logs=logs, as_json=as_json, timeout=timeout,
                   extra_args=extra, console=console, err=err, restart=policy)
    except MoetplanError as e:
        if as_json:
            print(json.dumps({"event": "error", "error": str(e), "exit_code": e.exit_code}))
        else:
            err.print(f"[bold red]error:[/] {e}")
        raise typer.Exit(e.exit_code) from None
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
    from moetplan.launch.serving import serving_line

    console.print(serving_line(plan.serving), markup=False, highlight=False)
    for note in (plan.serving.notes if plan.serving else []):
        console.print(f"  note: {note}", markup=False, highlight=False)
    console.print(f"[dim]plan: {plan_path}[/]")

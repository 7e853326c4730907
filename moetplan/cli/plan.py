"""`moetplan plan`, `diff`, `schema` and the hwdb lists (`models`, `gpus`, `boxes`)."""
from __future__ import annotations

import json as _json
from pathlib import Path as _Path
from typing import List, Optional

import typer

from moetplan.cli.common import SERVING_HELP, STRICT_HELP, fail
from moetplan.cli.common import out as console
from moetplan.contract import OBJECTIVES, MoetplanError


def plan_cmd(
    model: str = typer.Option(..., "--model", "-m", help="hwdb id/alias (glm-5.2, ds4-flash, ...) or a local "
                              "config.json / checkpoint folder"),
    hw: Optional[str] = typer.Option(None, "--hw", help="HardwareProfile JSON from `moetplan probe`"),
    box: Optional[str] = typer.Option(None, "--box", help="reference box id (`moetplan boxes`)"),
    gpus: Optional[str] = typer.Option(None, "--gpus", help="inline GPUs, e.g. 2xrtx-5090"),
    host_ram_gib: Optional[float] = typer.Option(None, "--host-ram-gib"),
    nvme_gbps: Optional[float] = typer.Option(None, "--nvme-gbps", help="pack dir read GB/s"),
    pack_dir_free_gib: Optional[float] = typer.Option(None, "--pack-dir-free-gib"),
    pack_dir: Optional[str] = typer.Option(None, "--pack-dir"),
    context: Optional[str] = typer.Option(None, "--context", help="wanted context, e.g. 32768 or 128k"),
    concurrency: int = typer.Option(1, "--concurrency"),
    objective: str = typer.Option("balanced", "--objective", help=" | ".join(OBJECTIVES)),
    set_: List[str] = typer.Option([], "--set", help="pin a knob: name=value (repeatable)"),
    explain: bool = typer.Option(False, "--explain", help="per-term step time and what would move the bottleneck"),
    plot: Optional[str] = typer.Option(None, "--plot", help="write the context vs decode Pareto plot (PNG)"),
    out: Optional[str] = typer.Option(None, "--out", "-o", help="write plan.json"),
    as_json: bool = typer.Option(False, "--json", help="print the plan as JSON"),
    tool_call_parser: Optional[str] = typer.Option(None, "--tool-call-parser", help=SERVING_HELP),
    reasoning_parser: Optional[str] = typer.Option(None, "--reasoning-parser", help=SERVING_HELP),
    tokenizer_mode: Optional[str] = typer.Option(None, "--tokenizer-mode", help=SERVING_HELP),
    chat_template: Optional[str] = typer.Option(None, "--chat-template", help="a Jinja chat template file"),
    tool_strict_level: Optional[str] = typer.Option(None, "--tool-strict-level", help=STRICT_HELP),
) -> None:
    """Solve the placement, predict tok/s and name the bottleneck."""
    from moetplan.contract import Goals, InfeasibleError
    from moetplan.hw.resolve import resolve_hardware
    from moetplan.launch.command import build_launch
    from moetplan.models.by_name import spec_for_name
    from moetplan.plan.request import check_args, with_notes
    from moetplan.plan.solver import parse_set, solve

    try:
        from moetplan.cli.run import plan_model, serving_overrides
        from moetplan.launch.serving import serving_for

        ctx = check_args(objective, concurrency, context)
        serving = serving_overrides(tool_call_parser, reasoning_parser, tokenizer_mode, chat_template,
                                    tool_strict_level)
        if not (hw or box or gpus) and _cpu_backend_here(model):
            # No GPU here and a checkpoint the CPU backend serves: the plan `moetplan run --model` makes.
            plan = plan_model(model, context=context, set_=set_, serving=serving, pack_dir=pack_dir)
            build_launch(plan)  # a plan vLLM cannot serve fails here
            _show(plan, out, as_json, explain, plot)
            return
        spec = spec_for_name(model)
        goals = Goals(context=ctx, concurrency=concurrency, objective=objective, pinned=parse_set(set_),
                      pack_dir=pack_dir)  # type: ignore[arg-type]
        profile, notes = resolve_hardware(hw, box, gpus, host_ram_gib, nvme_gbps, pack_dir_free_gib, pack_dir,
                                          probe_progress=not as_json)
        try:
            plan = solve(spec, profile, goals)
        except InfeasibleError as e:
            raise with_notes(e, notes) from None
        plan.warnings = notes + plan.warnings
        plan.serving = serving_for(plan, {k: v for k, v in serving.items() if v is not None})
        build_launch(plan)  # a plan vLLM cannot serve fails here, not at `moetplan run`
    except MoetplanError as e:
        fail(e, as_json)
        return
    except Exception as e:  # noqa: BLE001 - a bug must still reach the user as one line and exit code 1
        fail(MoetplanError(f"plan failed: {type(e).__name__}: {e} (please report it with the command line)"), as_json)
        return
    _show(plan, out, as_json, explain, plot)


def _cpu_backend_here(model: str) -> bool:
    """No NVIDIA GPU on this machine and `model` is a checkpoint its CPU backend serves (a tiny model, a folder)."""
    from moetplan.hw.gpus import local_gpu_count
    from moetplan.models import tiny
    from moetplan.models.by_name import spec_for_name
    from moetplan.plan.cpu_backend import cpu_backend_serves

    if local_gpu_count() > 0:
        return False
    if tiny.is_tiny(model) or tiny.is_trained(model):
        return True
    try:
        return cpu_backend_serves(spec_for_name(model))
    except MoetplanError:
        return False  # the planner's own path names the problem


def _show(plan, out: Optional[str], as_json: bool, explain: bool, plot: Optional[str]) -> None:  # noqa: ANN001
    from moetplan.contract import save_json
    from moetplan.launch.serving import serving_line

    if out:
        save_json(plan, out)
    if as_json:
        print(plan.model_dump_json(indent=2))
    else:
        from moetplan.report.plan_view import render_plan

        whatifs = None
        if explain:
            from moetplan.plan.whatifs import whatifs as _whatifs

            whatifs = _whatifs(plan.model, plan.hardware, plan.placement)
        render_plan(plan, console, explain=explain, whatifs=whatifs)
        console.print(serving_line(plan.serving), markup=False, highlight=False)
        for note in (plan.serving.notes if plan.serving else []):
            console.print(f"  note: {note}", markup=False, highlight=False)
        if out:
            console.print(f"wrote {out}")
    if plot:
        from moetplan.report.plot import pareto_plot

        pareto_plot(plan, plot)
        if not as_json:
            console.print(f"wrote {plot}")


def diff_cmd(
    a: str = typer.Argument(..., help="plan.json"),
    b: str = typer.Argument(..., help="plan.json or run.json"),
    markdown: bool = typer.Option(False, "--markdown", help="print a markdown table"),
    all_rows: bool = typer.Option(False, "--all", help="also rows that did not change"),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """What changed between two plans and what it costs; or a plan vs a measured run."""
    from moetplan.contract.errors import UsageError
    from moetplan.contract import Plan, RunRecord, load_any
    from moetplan.report.compare import check_same_model
    from moetplan.report.diff import diff_markdown, diff_plan_run, diff_plans, diff_table

    try:
        da, db = load_any(a), load_any(b)
        if isinstance(da, RunRecord) and isinstance(db, Plan):
            da, db, a, b = db, da, b, a
        if not isinstance(da, Plan):
            raise UsageError(f"{a}: diff needs a plan.json first (got a {type(da).__name__})")
        if isinstance(db, Plan):
            rows, title = diff_plans(da, db), "plan vs plan"
        elif isinstance(db, RunRecord):
            check_same_model(da, db, a, b)
            rows, title = diff_plan_run(da, db), "plan vs measured run"
        else:
            raise UsageError(f"{b}: diff needs a plan.json or run.json (got a hardware profile)")
    except MoetplanError as e:
        fail(e, as_json)
        return
    labels = (_Path(a).name, _Path(b).name)
    if as_json:
        print(_json.dumps([r.__dict__ for r in rows], indent=2, default=str))
    elif markdown:
        print(diff_markdown(rows, labels, all_rows), end="")
    else:
        console.print(diff_table(rows, title, labels, all_rows))


def schema_cmd(which: str = typer.Argument("plan", help="plan | hw | run")) -> None:
    """Print the JSON Schema of plan.json, hw.json or run.json."""
    from moetplan.contract import HardwareProfile, Plan, RunRecord

    cls = {"plan": Plan, "hw": HardwareProfile, "hardware": HardwareProfile, "run": RunRecord}.get(which)
    if cls is None:
        fail(__import__("moetplan.contract.errors", fromlist=["UsageError"]).UsageError(
            f"schema '{which}': choose plan, hw or run"))
        return
    print(_json.dumps(cls.model_json_schema(), indent=2))


def models_cmd(as_json: bool = typer.Option(False, "--json")) -> None:
    """List the models in hwdb."""
    from rich.table import Table

    from moetplan import hwdb

    from moetplan.models import tiny
    from moetplan.models.by_name import spec_for_tiny

    specs = [hwdb.model_spec(i) for i in hwdb.model_ids()]
    tinies = [spec_for_tiny(n).model_copy(update={"aliases": [tiny.get_tiny(n).description]})
              for n in tiny.tiny_names()]
    tiny_ids = {s.id for s in tinies}
    if as_json:
        print(_json.dumps([{"id": s.id, "name": s.name, "aliases": s.aliases, "params_total_b": s.params_total_b,
                            "routed_2bit_gib": round(s.routed_gib("2bit"), 2),
                            "dense_gib": round(s.dense_bytes() / 2**30, 2), "tiny": s.id in tiny_ids}
                           for s in specs + tinies], indent=2))
        return
    specs += tinies
    t = Table(title="Models (hwdb/models; tiny-* are embedded test models for `moetplan run`)", header_style="bold")
    for c in ("id", "name", "layers/MoE", "experts (top-k)", "2-bit experts GiB", "dense GiB", "aliases"):
        t.add_column(c, overflow="fold")
    for s in specs:
        t.add_row(s.id, s.name, f"{s.num_layers}/{s.moe_layers}", f"{s.n_routed_experts} ({s.top_k})",
                  f"{s.routed_gib('2bit'):.1f}", f"{s.dense_bytes() / 2**30:.1f}", ", ".join(s.aliases))
    console.print(t)


def gpus_cmd(as_json: bool = typer.Option(False, "--json"),
             model: Optional[str] = typer.Option(None, "--model", "-m", help="show which GPU families run it")) -> None:
    """List the GPUs in hwdb; with --model, which GPU families current vLLM runs that model on."""
    from rich.table import Table

    from moetplan import hwdb

    if model:
        try:
            _support_table(model, as_json)
        except MoetplanError as e:
            fail(e, as_json)
        return
    infos = [hwdb.gpu_info(i) for i in hwdb.gpu_ids()]
    if as_json:
        print(_json.dumps([g.model_dump(exclude_none=True) for g in infos], indent=2))
        return
    t = Table(title="GPUs (hwdb/gpus.yaml)", header_style="bold")
    for c in ("id", "name", "VRAM GiB", "GB/s", "cc", "fp8", "fp4", "PCIe"):
        t.add_column(c)
    for g in infos:
        t.add_row(g.hwdb_id or "", g.name, f"{g.vram_gib:.0f}", f"{g.mem_bw_gbps:.0f}", g.compute_capability,
                  "yes" if g.fp8 else "", "yes" if g.fp4 else "", f"{g.pcie_gen or '?'} x{g.pcie_width or '?'}")
    console.print(t)


def boxes_cmd(as_json: bool = typer.Option(False, "--json")) -> None:
    """List the reference boxes in hwdb."""
    from rich.table import Table

    from moetplan import hwdb
    from moetplan.report.plan_view import hardware_line

    profs = [hwdb.box_profile(i) for i in hwdb.box_ids()]
    if as_json:
        print(_json.dumps([p.model_dump(exclude_none=True) for p in profs], indent=2))
        return
    t = Table(title="Reference boxes (hwdb/boxes)", header_style="bold")
    t.add_column("id")
    t.add_column("machine", overflow="fold")
    for p in profs:
        t.add_row(p.box_id or "", hardware_line(p))
    console.print(t)


def _support_table(model: str, as_json: bool) -> None:
    from rich.table import Table

    from moetplan.models.by_name import spec_for_name
    from moetplan.plan import support

    spec = spec_for_name(model)
    rows, needs = support.support_rows(spec), support.requirement(spec)[1]["what"]
    if as_json:
        print(_json.dumps({"model": spec.id, "architecture": spec.vllm_arch, "needs": needs, "families": rows},
                          indent=2))
        return
    t = Table(title=f"{spec.name} ({spec.vllm_arch or spec.attention.kind}) needs {needs}: GPU families in current "
              "vLLM", header_style="bold")
    for c in ("family", "GPUs", "runs", "attention backends", "KV", "why / note"):
        t.add_column(c, overflow="fold")
    for r in rows:
        t.add_row(r["family"], r["gpus"], "yes" if r["runs"] else "[red]no[/]", ", ".join(r["backends"]) or "-",
                  ", ".join(r["kv_dtypes"]) if r["runs"] else "-", r["note"])
    console.print(t)

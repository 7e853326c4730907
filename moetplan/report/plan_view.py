"""Rich rendering of a Plan for people: placement, memory ledger as bars, prediction, reasons, alternatives."""
from __future__ import annotations

from rich.console import Console, Group
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from moetplan.contract.errors import InfeasibleError
from moetplan.contract import GPURankMemory, HardwareProfile, Plan, Prediction

# One colour per ledger item so bars read at a glance.
_COLOURS = {
    "dense": "blue", "mtp": "cyan", "drafter": "cyan", "experts_2bit": "green", "expert_cache": "green",
    "fp4_reserve": "magenta", "kv_cache": "yellow", "cuda_graphs_workspace": "red", "activations": "bright_red",
}


def _bar(g: GPURankMemory, width: int = 48) -> Text:
    t = Text()
    scale = width / max(g.total_gib, 1e-9)
    used_cells = 0
    for it in g.items:
        n = max(0, round(it.gib * scale))
        if n:
            t.append("█" * n, style=_COLOURS.get(it.name, "white"))
            used_cells += n
    budget_cells = round(g.budget_gib * scale)
    if budget_cells > used_cells:
        t.append("·" * (budget_cells - used_cells), style="dim")
    if width > max(used_cells, budget_cells):
        t.append("░" * (width - max(used_cells, budget_cells)), style="dim")
    return t


def hardware_line(hw: HardwareProfile) -> str:
    if not hw.gpus:
        return "no NVIDIA GPU"
    names: dict[str, int] = {}
    for g in hw.gpus:
        names[g.name] = names.get(g.name, 0) + 1
    gpus = ", ".join(f"{n}x {k}" for k, n in names.items())
    disk = f", pack dir {hw.storage.free_gib:.0f} GiB free" if hw.storage.free_gib is not None else ""
    return f"{gpus}; {hw.host.ram_gib:.0f} GiB RAM{disk} ({hw.source})"


def plan_line(plan: Plan) -> str:
    """One line: what will be served where, and what the plan predicts (`moetplan run` prints it first)."""
    p, pred = plan.placement, plan.prediction
    name = plan.launch.served_model_name or plan.model.id
    if not plan.hardware.gpus:
        where = "this machine (vLLM CPU backend)"
        tier = (f"experts {p.expert_format} in a RAM host store, cache {p.gpu_expert_cache_gib:.1f} GiB "
                f"(predicted hit rate {pred.token_hit_rate:.0%})" if p.expert_tier == "host" and pred.token_hit_rate
                is not None else f"experts {p.expert_format} resident in RAM")
    else:
        where = hardware_line(plan.hardware)
        ranks = (f"TP{p.tp}" + (f"xPP{p.pp}" if p.pp > 1 else "")) if p.tp * p.pp > 1 else "1 GPU"
        tier = f"{ranks}, experts {p.expert_format} {p.expert_tier}"
        if p.expert_tier != "resident":
            tier += f", GPU cache {p.gpu_expert_cache_gib:.1f} GiB/rank"
        if p.fp4_reserve_gib:
            tier += f", FP4 reserve {p.fp4_reserve_gib:.1f} GiB"
        if p.mtp:
            tier += f", MTP {p.mtp}"
    ctx = f"context {p.context:,} ({p.kv_dtype} KV)"
    guess = f"predicted {pred.decode_tok_s:,.1f} tok/s decode" + (f", bound by {pred.bottleneck}" if pred.bottleneck
                                                                   else "")
    knobs = plan.runtime_knobs
    dummy = f"; dummy weights, {knobs.router} router" if knobs.weights == "dummy" else ""
    return f"plan: {name} on {where}: {tier}, {ctx}; {guess}{dummy}"


def placement_table(plan: Plan) -> Table:
    p = plan.placement
    t = Table(title="Placement", show_header=True, header_style="bold")
    t.add_column("knob")
    t.add_column("value", justify="right")
    t.add_column("why", overflow="fold")
    why = {r.knob: r.text for r in plan.reasons}
    rows = [
        ("tp", f"{p.tp}" + (f" (pp {p.pp})" if p.pp > 1 else "")),
        ("expert_tier", p.expert_tier),
        ("gpu_expert_cache_gib", f"{p.gpu_expert_cache_gib:.1f} ({p.gpu_expert_cache_slots} slots)"
         if p.expert_tier != "resident" else "—"),
        ("fp4_reserve_gib", f"{p.fp4_reserve_gib:.1f}"),
        ("host_arena_gib", f"{p.host_arena_gib:.0f}" if p.expert_tier == "nvme" else "—"),
        ("kv_dtype", p.kv_dtype),
        ("context", f"{p.context:,}"),
        ("mtp", f"{p.mtp} ({p.mtp_acceptance:.2f} tok/step)" if p.mtp else "0"),
        ("max_num_seqs", f"{p.max_num_seqs}"),
        ("max_num_batched_tokens", f"{p.max_num_batched_tokens}"),
        ("gpu_memory_utilization", f"{p.gpu_memory_utilization:.2f}"),
    ]
    for k, v in rows:
        t.add_row(k, v, why.get(k, ""))
    return t


def memory_table(plan: Plan) -> Table:
    m = plan.memory
    t = Table(title="Memory ledger (GiB)", header_style="bold")
    t.add_column("where")
    t.add_column("used / budget / total", justify="right")
    t.add_column("bar (█ used, · budget left, ░ reserved)")
    t.add_column("items", overflow="fold")
    for g in m.gpus:
        items = ", ".join(f"{i.name} {i.gib:.1f}" for i in g.items if i.gib > 0.005)
        t.add_row(f"GPU{g.rank} {g.gpu}", f"{g.used_gib:.1f} / {g.budget_gib:.1f} / {g.total_gib:.0f}", _bar(g), items)
    host = ", ".join(f"{i.name} {i.gib:.1f}" for i in m.host_items)
    t.add_row("host RAM", f"{m.host_gib:.1f} / — / {m.host_total_gib:.0f}", "", host)
    disk = ", ".join(f"{i.name} {i.gib:.0f}" for i in m.disk_items)
    free = f"{m.disk_free_gib:.0f} free" if m.disk_free_gib is not None else "free unknown"
    t.add_row("disk (packs)", f"{m.disk_gib:.0f} / {free}", "", disk)
    return t


def prediction_panel(pred: Prediction) -> Panel:
    lines = [
        f"[bold]decode[/] {pred.decode_tok_s:.1f} tok/s (one stream)   "
        f"[bold]aggregate[/] {pred.aggregate_tok_s:.1f} tok/s   [bold]prefill[/] {pred.prefill_tok_s:,.0f} tok/s",
        f"[bold]bottleneck[/]: {pred.bottleneck}",
    ]
    if pred.zero_miss_step_share is not None:
        lines.append(f"token hit rate {pred.token_hit_rate:.1%}, steps with zero misses "
                     f"{pred.zero_miss_step_share:.0%}, misses/step {pred.misses_per_step:.1f}"
                     + (f", replayed steps {pred.replay_rate:.0%}" if pred.replay_rate is not None else ""))
    if pred.cpu_miss_share is not None:
        lines.append(f"misses served: {pred.cpu_miss_share:.0%} computed on the CPU, "
                     f"{1 - pred.cpu_miss_share:.0%} fetched over the link")
    return Panel("\n".join(lines), title="Prediction", expand=False)


def terms_table(pred: Prediction) -> Table:
    t = Table(title=f"Decode step: {pred.step_ms:.2f} ms for {pred.tokens_per_step:.2f} tokens", header_style="bold")
    t.add_column("term")
    t.add_column("ms", justify="right")
    t.add_column("share", justify="right")
    t.add_column("note", overflow="fold")
    for term in sorted(pred.terms, key=lambda x: -x.ms):
        t.add_row(term.name, f"{term.ms:.3f}", f"{term.share:.0%}", term.note or "")
    return t


def alternatives_table(plan: Plan) -> Table:
    t = Table(title="Alternatives considered", header_style="bold")
    t.add_column("placement")
    t.add_column("context", justify="right")
    t.add_column("decode tok/s", justify="right")
    t.add_column("pareto")
    t.add_column("bottleneck", overflow="fold")
    for a in plan.alternatives:
        t.add_row(a.label, f"{a.context:,}", f"{a.decode_tok_s:.1f}", "yes" if a.pareto else "", a.bottleneck)
    return t


def render_plan(plan: Plan, console: Console, explain: bool = False, whatifs: list[str] | None = None) -> None:
    console.print(Panel(f"[bold]{plan.model.name}[/] ({plan.model.id}) on {hardware_line(plan.hardware)}",
                        title="moetplan plan", expand=False))
    console.print(placement_table(plan))
    console.print(memory_table(plan))
    console.print(prediction_panel(plan.prediction))
    if explain:
        console.print(terms_table(plan.prediction))
        if whatifs:
            console.print(Panel("\n".join(f"• {w}" for w in whatifs), title="What would move the bottleneck",
                                expand=False))
    if plan.alternatives:
        console.print(alternatives_table(plan))
    for w in plan.warnings:
        console.print(f"[yellow]warning:[/] {w}")


def render_infeasible(e: InfeasibleError, console: Console) -> None:
    body = [f"[bold red]{e}[/]"]
    if e.shortfalls:
        body.append("\n[bold]What is short:[/]")
        body += [f"  • {s}" for s in e.shortfalls]
    if e.suggestions:
        body.append("\n[bold]What would fit:[/]")
        body += [f"  • {s}" for s in e.suggestions]
    console.print(Panel(Group(*[Text.from_markup(b) for b in body]), title="does not fit", expand=False))

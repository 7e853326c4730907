"""`moetplan diff`: what changed between two plans and what it costs; or a plan against a measured run."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rich.table import Table

from moetplan.contract import Plan, RunRecord
from moetplan.report.plan_view import hardware_line

PLACEMENT_FIELDS = ("tp", "pp", "expert_tier", "gpu_expert_cache_gib", "gpu_expert_cache_slots", "fp4_reserve_gib",
                    "host_arena_gib", "kv_dtype", "kv_cache_gib", "context", "mtp", "mtp_acceptance", "max_num_seqs",
                    "concurrency", "max_num_batched_tokens", "gpu_memory_utilization", "moe_graphs")
PREDICTION_FIELDS = ("decode_tok_s", "aggregate_tok_s", "prefill_tok_s", "ttft_ms", "bottleneck", "token_hit_rate",
                     "zero_miss_step_share", "misses_per_step", "replay_rate")


@dataclass
class DiffRow:
    section: str
    field: str
    a: Any
    b: Any
    change: str  # human text: "+12.0%", "resident -> host", "" when equal

    @property
    def changed(self) -> bool:
        return self.a != self.b


def _fmt(v: Any) -> str:
    if v is None:
        return "—"
    if isinstance(v, float):
        return f"{v:,.2f}" if abs(v) < 1000 else f"{v:,.0f}"
    if isinstance(v, int) and not isinstance(v, bool):
        return f"{v:,}"
    return str(v)


def _change(a: Any, b: Any) -> str:
    if a == b:
        return ""
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
        d = b - a
        rel = f" ({d / a:+.0%})" if a else ""
        return f"{d:+,.2f}{rel}" if isinstance(d, float) else f"{d:+,}{rel}"
    return f"{_fmt(a)} -> {_fmt(b)}"


def diff_plans(a: Plan, b: Plan) -> list[DiffRow]:
    rows: list[DiffRow] = []

    def add(section: str, field: str, va: Any, vb: Any) -> None:
        rows.append(DiffRow(section, field, va, vb, _change(va, vb)))

    add("model", "id", a.model.id, b.model.id)
    add("hardware", "machine", hardware_line(a.hardware), hardware_line(b.hardware))
    add("goals", "objective", a.goals.objective, b.goals.objective)
    for f in PLACEMENT_FIELDS:
        add("placement", f, getattr(a.placement, f), getattr(b.placement, f))
    ga, gb = a.memory.gpus, b.memory.gpus
    add("memory", "gpus", len(ga), len(gb))
    add("memory", "gpu0_used_gib", round(ga[0].used_gib, 2) if ga else None, round(gb[0].used_gib, 2) if gb else None)
    add("memory", "gpu0_total_gib", ga[0].total_gib if ga else None, gb[0].total_gib if gb else None)
    items_a = {i.name: i.gib for i in (ga[0].items if ga else [])}
    items_b = {i.name: i.gib for i in (gb[0].items if gb else [])}
    for name in sorted(set(items_a) | set(items_b)):
        add("memory", f"gpu0.{name}_gib", round(items_a.get(name, 0.0), 2), round(items_b.get(name, 0.0), 2))
    add("memory", "host_gib", round(a.memory.host_gib, 1), round(b.memory.host_gib, 1))
    add("memory", "disk_gib", round(a.memory.disk_gib, 1), round(b.memory.disk_gib, 1))
    for f in PREDICTION_FIELDS:
        va, vb = getattr(a.prediction, f), getattr(b.prediction, f)
        add("prediction", f, round(va, 3) if isinstance(va, float) else va,
            round(vb, 3) if isinstance(vb, float) else vb)
    return rows


def diff_plan_run(plan: Plan, run: RunRecord) -> list[DiffRow]:
    """Predicted vs measured per metric, with the error (measured relative to predicted)."""
    from moetplan.report.compare import compare

    rows = []
    for r in compare(plan, run):
        err = r.get("error_pct")
        rows.append(DiffRow("predicted vs measured", r["metric"], r.get("predicted"), r.get("measured"),
                            "" if err is None else f"{err:+.1f}%"))
    return rows


def diff_table(rows: list[DiffRow], title: str, labels: tuple[str, str], all_rows: bool = False) -> Table:
    t = Table(title=title, header_style="bold")
    for c in ("section", "field", labels[0], labels[1], "change"):
        t.add_column(c, justify="right" if c in labels else "left", overflow="fold")
    for r in rows:
        if all_rows or r.changed or r.section == "predicted vs measured":
            t.add_row(r.section, r.field, _fmt(r.a), _fmt(r.b), r.change)
    return t


def diff_markdown(rows: list[DiffRow], labels: tuple[str, str], all_rows: bool = False) -> str:
    out = [f"| section | field | {labels[0]} | {labels[1]} | change |", "|---|---|---:|---:|---|"]
    for r in rows:
        if all_rows or r.changed or r.section == "predicted vs measured":
            out.append(f"| {r.section} | {r.field} | {_fmt(r.a)} | {_fmt(r.b)} | {r.change} |")
    return "\n".join(out) + "\n"

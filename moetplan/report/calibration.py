"""`moetplan calibrate`'s human output: predicted vs measured before and after, and what was (not) written."""
from __future__ import annotations

from typing import Any


def render_calibration(result: dict[str, Any], n_runs: int, dry_run: bool, console: Any = None) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"Cost-model calibration ({result['family']}, {n_runs} run record(s))")
    for col in ("run", "metric", "measured", "predicted before", "error", "predicted after", "error"):
        left = col in ("run", "metric")
        table.add_column(col, justify="left" if left else "right", overflow="fold" if left else "ellipsis")
    for r in result["rows"]:
        table.add_row(r["row"], r["metric"], f"{r['measured']:.1f}", f"{r['predicted_before']:.1f}",
                      f"{r['error_before']:+.1%}", f"{r['predicted_after']:.1f}", f"{r['error_after']:+.1%}")
    con = console or Console()
    con.print(table)
    mb, ma = result["before"]["median_abs_error"], result["after"]["median_abs_error"]
    con.print(f"median |error|: {mb:.1%} -> {ma:.1%}")
    mc = result["miss_correlation"]
    for z in mc["zero_miss_step_share"]:
        con.print(f"{z['row']}: zero-miss step share measured {z['measured']:.0%}, predicted "
                  f"{z['predicted_before']:.0%} -> {z['predicted_after']:.0%} (miss correlation "
                  f"{mc['before']:.3g} -> {mc['after']:.3g})")
    gate = result["gate_recompute_share"]
    if gate["measured"]:
        shares = ", ".join(f"{g['share']:.0%} at tau {g['tau']:g}" for g in gate["measured"])
        con.print(f"FP4 gate recomputed {shares} of decode steps: recompute share at tau 1 "
                  f"{gate['before']:.0%} -> {gate['after']:.0%} (median)")
    if dry_run:
        con.print("not written (--dry-run)")
    elif result["kept_previous"]:
        con.print(f"[bold yellow]not written:[/] the refit fits these records worse ({mb:.1%} -> {ma:.1%} median "
                  "|error|) than the factors it started from, which stay in place; --force writes it anyway")
    else:
        con.print(f"written to {result['written_to']}")

"""`moetplan calibrate`: refit the cost model's factors from measured run records."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from moetplan.cli.common import fail
from moetplan.contract import MoetplanError
from moetplan.cost_model.refit import calibrate_runs


def calibrate_command(
    runs: list[Path] = typer.Argument(..., help="Run records (run.json) from `moetplan bench` or the runtime"),
    box: Optional[str] = typer.Option(None, "--box", help="hwdb box id, when the runs name no plan"),
    hw_path: Optional[Path] = typer.Option(None, "--hw", help="Hardware profile (hw.json), when the runs name no plan"),
    model: Optional[str] = typer.Option(None, "--model", help="Model name or config.json, when the runs name none"),
    out: Optional[Path] = typer.Option(None, "--out", help="Where to write the factors (default: user config dir)"),
    dry_run: bool = typer.Option(False, "--dry-run", help="Fit and report, write nothing"),
    as_json: bool = typer.Option(False, "--json", help="Machine-readable output"),
) -> None:
    """Refit the cost model's efficiency factors for this machine from measured runs; report error before/after."""
    try:
        result = calibrate_runs(runs, box=box, hw_path=hw_path, model=model, out=out, dry_run=dry_run)
    except MoetplanError as e:
        fail(e, as_json)
        return
    target = result.pop("_target")
    if as_json:
        typer.echo(json.dumps(result, indent=2))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"Cost-model calibration ({result['family']}, {len(runs)} run record(s))")
    for col in ("run", "metric", "measured", "predicted before", "error", "predicted after", "error"):
        left = col in ("run", "metric")
        table.add_column(col, justify="left" if left else "right", overflow="fold" if left else "ellipsis")
    for r in result["rows"]:
        table.add_row(r["row"], r["metric"], f"{r['measured']:.1f}", f"{r['predicted_before']:.1f}",
                      f"{r['error_before']:+.1%}", f"{r['predicted_after']:.1f}", f"{r['error_after']:+.1%}")
    con = Console()
    con.print(table)
    mb, ma = result["before"]["median_abs_error"], result["after"]["median_abs_error"]
    con.print(f"median |error|: {mb:.1%} -> {ma:.1%}")
    mc = result["miss_correlation"]
    for z in mc["zero_miss_step_share"]:
        con.print(f"{z['row']}: zero-miss step share measured {z['measured']:.0%}, predicted "
                  f"{z['predicted_before']:.0%} -> {z['predicted_after']:.0%} "
                  f"(miss correlation {mc['before']:.3g} -> {mc['after']:.3g})")
    gate = result["gate_fire_share"]
    if gate["measured"]:
        shares = ", ".join(f"{g['share']:.0%}" for g in gate["measured"])
        con.print(f"FP4 gate fired on {shares} of decode steps: "
                  f"fire share {gate['before']:.0%} -> {gate['after']:.0%} (median)")
    con.print("not written (--dry-run)" if dry_run else f"written to {target}")

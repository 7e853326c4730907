"""`moetplan calibrate`: refit the cost model's factors from measured run records."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from moetplan.cli.common import fail
from moetplan.contract import MoetplanError


def calibrate_command(
    runs: list[Path] = typer.Argument(..., help="Run records (run.json) from `moetplan bench` or the runtime"),
    box: Optional[str] = typer.Option(None, "--box", help="hwdb box id, when the runs name no plan"),
    hw_path: Optional[Path] = typer.Option(None, "--hw", help="Hardware profile (hw.json), when the runs name no plan"),
    model: Optional[str] = typer.Option(None, "--model", help="Model name, tiny model or config.json, when the runs "
                                        "name none"),
    out: Optional[Path] = typer.Option(None, "--out", help="Where to write the factors (default: user config dir)"),
    dry_run: bool = typer.Option(False, "--dry-run", help="Fit and report, write nothing"),
    as_json: bool = typer.Option(False, "--json", help="Machine-readable output"),
    force: bool = typer.Option(False, "--force", help="Write the refit even when it fits the records worse"),
) -> None:
    """Refit the cost model's efficiency factors for this machine from measured runs; report error before/after."""
    from moetplan.cost_model.refit import calibrate_runs

    try:
        result = calibrate_runs(runs, box=box, hw_path=hw_path, model=model, out=out, dry_run=dry_run, force=force)
    except MoetplanError as e:
        fail(e, as_json)
        return
    if as_json:
        typer.echo(json.dumps(result, indent=2))
        return
    from moetplan.report.calibration import render_calibration

    render_calibration(result, len(runs), dry_run)

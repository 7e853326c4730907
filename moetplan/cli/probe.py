"""`moetplan probe`: parse, call run_probe, render or write JSON. Heavy imports stay inside."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer


def probe_command(
    quick: bool = typer.Option(
        False, "--quick", help="Test file <= 1 GiB, few repetitions, under 20 s (default: full, 8 GiB file, 1-3 min)"
    ),
    pack_dir: Optional[Path] = typer.Option(
        None, "--pack-dir", help="Directory the pack files will live in (default: user cache dir/moetplan/packs)"
    ),
    out: Path = typer.Option(Path("hw.json"), "--out", help="Where the HardwareProfile JSON goes (for plan --hw)"),
    as_json: bool = typer.Option(False, "--json", help="Print the HardwareProfile JSON on stdout, no table"),
) -> None:
    """Measure what this machine can move: GPUs, host memory and memlock, pack-dir disk reads, copy rates."""
    from moetplan.hw.profile_probe import run_probe
    from moetplan.hw.render import render_profile
    from moetplan.contract import save_json

    try:
        result = run_probe(str(pack_dir) if pack_dir else None, quick=quick, progress=True)
    except KeyboardInterrupt:
        typer.echo("probe interrupted; its temporary test file was removed", err=True)
        raise typer.Exit(130) from None
    try:
        save_json(result.profile, out)
    except OSError as e:
        typer.echo(f"error: cannot write {out}: {e.strerror or e}; pass --out PATH", err=True)
        raise typer.Exit(1) from None
    if as_json:
        typer.echo(result.profile.model_dump_json(indent=2))
        return
    render_profile(result.profile, result.details, elapsed_s=result.elapsed_s)
    typer.echo(f"wrote {out} (use it with `moetplan plan --hw {out}`)")

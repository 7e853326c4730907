"""`moetplan quantize`: the typer command, its progress bar and its report table."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import typer

from moetplan.contract.vocab import ZERO_MODES
from moetplan.runtime.format.quantize_ckpt import quantize_checkpoint


def _render(result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    con = Console()
    t = Table(title=f"moetplan quantize: {result['model_key']} ({result['source_format']} -> {result['fmt']}, "
                    f"tp={result['tp']})")
    t.add_column("matrix")
    for c in ("tensors", "rel RMS mean", "rel RMS max", "bias mean (scale units)", "|bias| max", "zero-balanced"):
        t.add_column(c, justify="right")
    for mat, r in result["errors"].items():
        t.add_row(mat, str(r["tensors"]), f"{r['rel_rms_mean']:.4f}", f"{r['rel_rms_max']:.4f}",
                  f"{r['bias_scale_units_mean']:+.5f}", f"{r['bias_scale_units_max_abs']:.5f}",
                  str(r["balanced_zero_tensors"]))
    con.print(t)
    rate = result["input_gib_per_s"]
    con.print(f"layers quantized {result['layers_quantized']}, already done {result['layers_skipped']}, "
              f"rows written {result['rows_written']}, input {result['input_gib']:.3f} GiB"
              + (f" at {_rate(rate * 2**30)}" if rate else ""))
    for p, why in result["rebuilt"].items():
        con.print(f"[yellow]rebuilt stale pack[/] {p}: {why}")
    for p, rows in result["bad_rows"].items():
        con.print(f"[yellow]checksum failed, re-quantized[/] {p}: rows {rows[:16]}{' ...' if len(rows) > 16 else ''}")
    for p in result["packs"]:
        con.print(f"pack: {p}")


def _rate(bytes_per_s: float) -> str:
    return f"{bytes_per_s / 2**30:.2f} GiB/s" if bytes_per_s >= 2**28 else f"{bytes_per_s / 2**20:.1f} MiB/s"


def quantize_command(
    model: Path = typer.Option(..., "--model", help="Local safetensors checkpoint folder"),
    pack_dir: Path = typer.Option(..., "--pack-dir", help="Where the pack files go (NVMe)"),
    tp: int = typer.Option(1, "--tp", help="Tensor-parallel ranks: one pack per rank"),
    fp4: bool = typer.Option(False, "--fp4", help="Write the FP4 (e2m1) reserve format instead of 2-bit"),
    zero_mode: str = typer.Option("auto", "--zero-mode", help=f"{' | '.join(ZERO_MODES)} (zero-sign balancing)"),
    model_key: str = typer.Option(None, "--model-key", help="Pack file name prefix (default: the folder name)"),
    verify: bool = typer.Option(True, "--verify/--no-verify", help="Re-check finished rows' checksums on resume"),
    report: bool = typer.Option(True, "--report/--no-report", help="Compute the per-tensor error report"),
    workers: int = typer.Option(0, "--workers", help="Experts quantized in parallel (0 = one per CPU core)"),
    json_out: bool = typer.Option(False, "--json", help="Print the summary as JSON"),
    layer_delay: float = typer.Option(0.0, "--layer-delay", hidden=True),
) -> None:
    """Quantize a checkpoint's routed experts into pack files (resumable; rerun after Ctrl-C)."""
    import json

    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, \
        TimeRemainingColumn

    err = Console(stderr=True)
    state: dict[str, Any] = {"bytes": 0, "t0": time.perf_counter(), "done": 0}
    progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn("layers"),
                        TextColumn("{task.fields[rate]}"), TimeElapsedColumn(), TimeRemainingColumn(),
                        console=err, disable=json_out or not err.is_terminal)
    task = None

    def on_start(info: dict[str, Any]) -> None:
        nonlocal task
        done = info["layers"] - info["todo_layers"]
        state["done"] = done
        if info["resumed"] and not json_out:
            err.print(f"resuming: {done} of {info['layers']} layers already in the pack")
        task = progress.add_task("quantize", total=info["layers"], completed=done, rate="")

    def on_layer(ev: dict[str, Any]) -> None:
        state["bytes"] += ev["input_bytes"]
        state["done"] += 1
        rate = _rate(state["bytes"] / max(time.perf_counter() - state["t0"], 1e-9))
        progress.update(task, advance=1, rate=rate)
        if not progress.console.is_terminal and not json_out:
            err.print(f"layer {ev['layer']} done ({state['done']} layers in pack, {rate})")

    try:
        with progress:
            result = quantize_checkpoint(model, pack_dir, tp=tp, fmt="fp4" if fp4 else "2bit", zero_mode=zero_mode,
                                         model_key=model_key, verify=verify, report=report, on_layer=on_layer,
                                         on_start=on_start, layer_delay_s=layer_delay, workers=workers or None)
    except KeyboardInterrupt:
        err.print(f"[yellow]interrupted[/]: {state['done']} layer(s) are in the pack; rerun the same command to resume")
        raise typer.Exit(130) from None
    if json_out:
        typer.echo(json.dumps(result, indent=2))
    else:
        _render(result)

"""`moetplan replay`: replay a routing trace through the expert store at several cache sizes."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

import typer

from moetplan.cli.common import fail
from moetplan.contract import UsageError, atomic_write_text


def _table(doc: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    t = doc["trace"]
    title = (f"replay: {t['layers']} MoE layers x {t['experts']} experts, top-{t['top_k']}, {t['tokens']} tok/step, "
             f"{t['steps']} steps" + (f", skew {t['skew']:.2f}" if "skew" in t else ""))
    tab = Table(title=title)
    for col in ("slots", "cache share", "token hit rate", "zero-miss steps", "misses/step", "static coverage"):
        tab.add_column(col, justify="right")
    for r in doc["curve"]:
        tab.add_row(str(r["slots"]), f"{100 * r['slot_share']:.1f}%", f"{100 * r['token_hit_rate']:.2f}%",
                    f"{100 * r['zero_miss_step_share']:.1f}%", f"{r['misses_per_step']:.2f}",
                    f"{100 * r['static_coverage']:.1f}%")
    Console().print(tab)


def replay_command(
    trace: Optional[Path] = typer.Option(None, "--trace", help="Recorded trace (.npz from Trace.save, or .npy ids "
                                         "[steps, layers, tokens, top_k]); default: a synthetic one"),
    model: Optional[str] = typer.Option(None, "--model", help="hwdb model: its shape, and skew fitted to its coverage"),
    layers: int = typer.Option(8, "--layers", help="MoE layers (synthetic, without --model)"),
    experts: int = typer.Option(64, "--experts", help="Routed experts per layer (synthetic, without --model)"),
    top_k: int = typer.Option(6, "--top-k", help="Experts per token (synthetic, without --model)"),
    tokens: int = typer.Option(1, "--tokens", help="Tokens per decode step: concurrency x (1 + MTP depth)"),
    steps: int = typer.Option(300, "--steps", help="Decode steps to replay"),
    skew: Optional[float] = typer.Option(None, "--skew", help="Zipf skew (default: fitted to --model, else 1.0)"),
    temporal: float = typer.Option(0.9, "--temporal", help="Step-to-step correlation of a token stream's routing"),
    layer_corr: float = typer.Option(0.5, "--layer-corr", help="Correlation of routing across consecutive layers"),
    seed: int = typer.Option(0, "--seed"),
    shares: str = typer.Option("0.05,0.1,0.2,0.3,0.5", "--shares", help="Cache sizes as shares of all experts"),
    warmup: int = typer.Option(50, "--warmup", help="Steps before counting (the cache fills)"),
    out: Optional[Path] = typer.Option(None, "--out", help="Also write the JSON here"),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table"),
) -> None:
    """Replay a routing trace through the expert store: token hit rate and zero-miss steps vs cache size."""
    from moetplan.runtime.offline.trace import run_replay  # numpy: loaded when replaying, not for every command

    try:
        share_list = [float(x) for x in shares.split(",") if x.strip()]
    except ValueError:
        raise UsageError(f"--shares must be comma-separated numbers like 0.1,0.2, got '{shares}'") from None
    if not share_list or not all(0 < x <= 1 for x in share_list):
        raise UsageError(f"--shares must be in (0, 1], got '{shares}'")
    spec = None
    if model:
        from moetplan import hwdb

        try:
            spec = hwdb.model_spec(model)
        except UsageError as e:
            fail(e, as_json)
    doc = run_replay(trace_path=str(trace) if trace else None, model=spec, layers=layers, experts=experts,
                     top_k=top_k, tokens=tokens, steps=steps, skew=skew, temporal=temporal, layer_corr=layer_corr,
                     seed=seed, shares=share_list, warmup=warmup)
    if out is not None:
        atomic_write_text(out, json.dumps(doc, indent=2) + "\n")
    if as_json:
        typer.echo(json.dumps(doc, indent=2))
        return
    _table(doc)
    if out is not None:
        typer.echo(f"wrote {out}")

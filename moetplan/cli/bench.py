"""`moetplan bench`: the typer command (the measuring lives in moetplan.measure)."""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import typer

from moetplan.contract import MoetplanError


def bench_command(
    url: str = typer.Option(..., "--url", help="Base URL of an OpenAI-compatible server, e.g. http://127.0.0.1:8000"),
    plan: Optional[Path] = typer.Option(None, "--plan",
                                        help="plan.json whose placement and concurrency this run measures"),
    model: Optional[str] = typer.Option(None, "--model",
                                        help="Model id to request (default: the plan's, else the first in /v1/models)"),
    prompt_lens: Optional[str] = typer.Option(None, "--prompt-lens", help="Prompt lengths (tokens) for prefill "
                                              "tok/s (default 512,2048, fitted to the server's max_model_len)"),
    concurrency: str = typer.Option("1,4,8", "--concurrency", help="Concurrent streams for the batch curve"),
    runs: int = typer.Option(3, "--runs", help="Timed runs per point (median reported)"),
    max_tokens: int = typer.Option(128, "--max-tokens", help="Tokens generated per decode / batch request"),
    needle_lens: Optional[str] = typer.Option(None, "--needle-lens",
                                    help="Context lengths for needle retrieval ('' = none)"),
    timeout: float = typer.Option(60.0, "--timeout", help="Seconds without data before a request counts as stalled"),
    out: Optional[Path] = typer.Option(None, "--out", help="Write the run record here (atomically, after every phase)"),
    json_out: bool = typer.Option(False, "--json", help="Print the run record as JSON instead of tables"),
    no_probes: bool = typer.Option(False, "--no-probes", help="Skip the quality probes"),
    chat: bool = typer.Option(False, "--chat", help="Use /v1/chat/completions instead of /v1/completions"),
    resume: bool = typer.Option(False, "--resume",
                                help="Keep what --out already holds; measure only what is missing or failed"),
) -> None:
    """Measure a served model: decode, prefill, TTFT, batch curve, and quality probes -> run record."""
    # Imported here: the CLI loads every command module at start, and `moetplan plan` must not pay for httpx.
    from moetplan.measure.phases import parse_int_list, run_bench
    from moetplan.measure.render import render_run
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress as Bar, TextColumn, TimeElapsedColumn

    kwargs = dict(
        model=model, plan=plan, prompt_lens=None if prompt_lens is None else parse_int_list("--prompt-lens", prompt_lens),
        concurrency=parse_int_list("--concurrency", concurrency), runs=runs, max_tokens=max_tokens,
        needle_lens=None if needle_lens is None else parse_int_list("--needle-lens", needle_lens), timeout=timeout, out=out,
        probes=not no_probes, chat=chat, resume=resume,
    )
    err = Console(stderr=True)
    with Bar(TextColumn("{task.description:<22}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
             console=err, transient=True) as bar:
        task = bar.add_task("connecting", total=None)

        def progress(what: str, steps: int, total: int) -> None:
            bar.update(task, description=what, advance=steps, total=total)

        rec = run_bench(url, progress=progress, **kwargs)  # type: ignore[arg-type]
    if json_out:
        sys.stdout.write(rec.model_dump_json(indent=2) + "\n")
    else:
        console = Console()
        render_run(rec, console)
        if out is not None:
            console.print(f"run record: {out}")
    if rec.errors:
        raise typer.Exit(code=MoetplanError.exit_code)

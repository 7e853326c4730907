"""The moetplan command line: one client of the library. Each command parses, calls a library function of its
area and renders; no typer below this package."""
from __future__ import annotations

import functools
import sys
from typing import Any, Callable

import typer

from moetplan.cli.bench import bench_command
from moetplan.cli.calibrate import calibrate_command
from moetplan.cli.common import fail
from moetplan.cli.build_kernels import build_kernels_command
from moetplan.cli.plan import boxes_cmd, diff_cmd, gpus_cmd, models_cmd, plan_cmd, schema_cmd
from moetplan.cli.probe import probe_command
from moetplan.cli.quantize import quantize_command
from moetplan.cli.replay import replay_command
from moetplan.cli.run import run_command
from moetplan.contract import MoetplanError

app = typer.Typer(
    name="moetplan",
    help="Plan, launch and measure frontier MoE models on the GPUs you have.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

def _answers_errors(fn: Callable[..., Any]) -> Callable[..., Any]:
    """A MoetplanError anywhere below a command becomes its message and exit code, never a traceback."""

    @functools.wraps(fn)
    def command(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except MoetplanError as e:
            fail(e, bool(kwargs.get("as_json") or kwargs.get("json_out")))

    return command


for _name, _fn in (
    ("probe", probe_command), ("plan", plan_cmd), ("run", run_command), ("bench", bench_command),
    ("diff", diff_cmd), ("quantize", quantize_command), ("calibrate", calibrate_command),
    ("replay", replay_command), ("build-kernels", build_kernels_command), ("models", models_cmd),
    ("gpus", gpus_cmd), ("boxes", boxes_cmd), ("schema", schema_cmd),
):
    app.command(_name)(_answers_errors(_fn))


def main() -> None:
    try:
        app()
    except MoetplanError as e:  # pragma: no cover - commands catch their own; this is the last net
        from rich.console import Console

        Console(stderr=True).print(f"[bold red]error:[/] {e}")
        sys.exit(e.exit_code)


__all__ = ["app", "main"]

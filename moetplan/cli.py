"""The moetplan command line: thin — parse, call, render. Commands live in their area's module."""
from __future__ import annotations

import sys

import typer

from moetplan.errors import MoetplanError

app = typer.Typer(
    name="moetplan",
    help="Plan, launch and measure frontier MoE models on the GPUs you have.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

# --- command registrations (one line per command; implementations live in their area) ---
# (filled in per area)
# --- end registrations ---


def main() -> None:
    try:
        app()
    except MoetplanError as e:  # pragma: no cover - exercised through CliRunner in tests
        from rich.console import Console

        Console(stderr=True).print(f"[bold red]error:[/] {e}")
        sys.exit(e.exit_code)


if __name__ == "__main__":
    main()

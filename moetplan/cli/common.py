"""What every command shares: the consoles and the one way a MoetplanError becomes a message and an exit code."""
from __future__ import annotations

import json

import typer
from rich.console import Console
from rich.markup import escape

from moetplan.contract import InfeasibleError, MoetplanError

out = Console()
err = Console(stderr=True)


def fail(e: MoetplanError, as_json: bool = False) -> None:
    """Print the error (JSON with --json; the infeasible answer's shortfalls and suggestions) and exit with its
    code; never a traceback."""
    if as_json:
        doc = {"error": str(e), "exit_code": e.exit_code}
        if isinstance(e, InfeasibleError):
            doc.update(shortfalls=e.shortfalls, suggestions=e.suggestions)
        print(json.dumps(doc, indent=2))
    elif isinstance(e, InfeasibleError):
        from moetplan.report.plan_view import render_infeasible

        render_infeasible(e, err)
    else:
        err.print(f"[bold red]error:[/] {escape(str(e))}", soft_wrap=True, highlight=False)
    raise typer.Exit(e.exit_code)


# The chat-format options `plan` and `run` share.
SERVING_HELP = ("a vLLM registry name, or none to switch it off (default: hwdb/serving.yaml for the model, checked "
                "against the installed vLLM)")
STRICT_HELP = ("how far tool calls are held to their declared shape (vLLM 0.31+): auto (only tools marked strict), "
               "function (known names, JSON arguments) or parameter (each tool's argument schema; the default)")

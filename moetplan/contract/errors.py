"""Errors with a message that names the problem and the fix; the CLI maps them to exit codes."""
from __future__ import annotations

# Exit codes: distinguish usage errors from infeasible plans (scripts branch on these).
EXIT_OK = 0
EXIT_FAILURE = 1  # runtime failure (server died, I/O error)
EXIT_USAGE = 2  # bad input: unknown model/GPU, malformed config or JSON, bad --set
EXIT_INFEASIBLE = 3  # the hardware cannot hold the model under the goals


class MoetplanError(Exception):
    exit_code = EXIT_FAILURE


class UsageError(MoetplanError):
    """Bad input from the user; the message says what and how to fix it."""

    exit_code = EXIT_USAGE


class UnknownNameError(UsageError):
    def __init__(self, kind: str, name: str, known: list[str]):
        import difflib

        close = difflib.get_close_matches(name.lower(), [k.lower() for k in known], n=3, cutoff=0.5)
        hint = f" Did you mean: {', '.join(close)}?" if close else ""
        plural = {"box": "boxes"}.get(kind, f"{kind}s")
        super().__init__(f"Unknown {kind} '{name}'.{hint} (`moetplan {plural}` lists them)")
        self.kind, self.name, self.suggestions = kind, name, close


class ConfigError(UsageError):
    """A config.json / checkpoint / yaml is malformed; message names the file and the field."""


class InfeasibleError(MoetplanError):
    """The hardware cannot hold the model; `shortfalls` say what is short, `suggestions` what would fit."""

    exit_code = EXIT_INFEASIBLE

    def __init__(self, message: str, shortfalls: list[str] | None = None, suggestions: list[str] | None = None):
        super().__init__(message)
        self.shortfalls = shortfalls or []
        self.suggestions = suggestions or []


def validation_summary(e: "Exception") -> str:
    """A pydantic ValidationError as one line naming the first bad field: "field 'a.b': msg (N error(s) in all)"."""
    errs = e.errors()  # type: ignore[attr-defined]
    first = errs[0]
    loc = ".".join(str(x) for x in first["loc"])
    return f"field '{loc}': {first['msg']} ({len(errs)} error(s) in all)"

"""What `moetplan plan` checks of its flags before any search, and how what the hardware resolution assumed
reaches an infeasible answer."""
from __future__ import annotations

from moetplan.contract import parse_tokens
from moetplan.contract.errors import InfeasibleError, UsageError
from moetplan.contract.vocab import OBJECTIVES


def check_args(objective: str, concurrency: int, context: str | None) -> int | None:
    """Usage errors for the goal flags; returns the wanted context in tokens (None: as much as fits)."""
    if objective not in OBJECTIVES:
        raise UsageError(f"--objective {objective}: must be {', '.join(OBJECTIVES[:-1])} or {OBJECTIVES[-1]}")
    if concurrency < 1:
        raise UsageError(f"--concurrency {concurrency}: must be at least 1 (streams decoded at once)")
    try:
        ctx = parse_tokens(context) if context else None
    except ValueError:
        raise UsageError(f"--context {context}: not a token count (e.g. 32768 or 128k)") from None
    if ctx is not None and ctx < 1:
        raise UsageError(f"--context {context}: must be at least 1 token")
    return ctx


def with_notes(e: InfeasibleError, notes: list[str]) -> InfeasibleError:
    """The infeasible answer, led by what the hardware resolution assumed (e.g. a default box for a machine with
    no GPU), so the answer is not read as being about this machine."""
    if not notes:
        return e
    return InfeasibleError(f"{'; '.join(notes)}. {e}", list(e.shortfalls), list(e.suggestions))

"""A progress bar for long host-side loads (pinned stores, preloads): rich on a terminal, silent elsewhere."""
from __future__ import annotations

import contextlib
import sys
from typing import Callable, Iterator


@contextlib.contextmanager
def progress_bar(total: int, label: str, *, enabled: bool | None = None) -> Iterator[Callable[[int], None]]:
    """A rich progress bar when on a terminal (or enabled=True); silent otherwise (enabled=False / non-tty)."""
    show = sys.stderr.isatty() if enabled is None else enabled
    if not show or total <= 0:
        yield lambda n: None
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                  transient=True) as bar:
        task = bar.add_task(label, total=total)
        yield lambda n: bar.advance(task, n)


__all__ = ["progress_bar"]

"""Spinners and progress bars for long CLI operations, on stderr and only for a person at a terminal.

Output meant for machines (stdout, `--json`, logs, pipes in tests) never sees them: when stderr is not a
terminal, or the caller asks for quiet, every helper here is a no-op.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Protocol

from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn


def interactive(quiet: bool = False) -> bool:
    """True when stderr is a terminal and nothing asked for machine-readable output."""
    return not quiet and sys.stderr.isatty()


@contextmanager
def spinner(message: str, *, quiet: bool = False) -> Iterator[None]:
    """A spinner with `message` while the block runs (model load, server start)."""
    if not interactive(quiet):
        yield
        return
    with Console(stderr=True).status(message):
        yield


class Advance(Protocol):
    def __call__(self, amount: int) -> None: ...


@contextmanager
def byte_progress(description: str, total: int, *, quiet: bool = False) -> Iterator[Advance]:
    """A transfer bar of `total` bytes; the block calls the yielded function with each chunk's size."""
    if not interactive(quiet):
        yield lambda amount: None
        return
    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
    )
    with Progress(*columns, console=Console(stderr=True), transient=True) as progress:
        task = progress.add_task(description, total=total)
        yield lambda amount: progress.advance(task, amount)

"""The console the client commands print tables on: the terminal's width on a terminal; piped, wide enough that
no column is cut (rich assumes 80 columns when stdout is not a terminal, and would truncate)."""

from __future__ import annotations

import sys

from rich.console import Console

PIPED_WIDTH = 10_000


def table_console() -> Console:
    if sys.stdout.isatty():
        return Console()
    return Console(width=PIPED_WIDTH, soft_wrap=True)

"""What every `opentinker registry ...` command shares: the console its tables print to, and the client
whose failed calls end the command with one line."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from opentinker.cli.console import table_console
from opentinker.cli.failure import reported
from opentinker.client import RegistryClient

console = table_console()  # piped: wide enough that no column is cut


@contextmanager
def connect(address: str, token: str | None, ca_cert: Path | None) -> Iterator[RegistryClient]:
    """The registry's client for the block; a failed call in it prints `error: CODE: message [REASON]` and
    exits 1 (no traceback)."""
    # No deadline, as before: an admin call (gc, a long watch) takes as long as it takes.
    with RegistryClient(address, token, timeout=None, ca_cert=ca_cert) as client, reported(ca_cert):
        yield client

"""How the client commands report a failed call: one line, `CODE: message [REASON]`, plus a hint when the
likely cause is on this side (plaintext to a server that speaks TLS)."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import NoReturn

import grpc
import typer

from opentinker.client import OpenTinkerError

TLS_HINT = "(if the server speaks TLS, pass --ca-cert)"


def describe(error: OpenTinkerError, ca_cert: Path | None) -> str:
    # Plaintext to a TLS port reads as UNAVAILABLE "Socket closed": say what is probably missing.
    if error.code == grpc.StatusCode.UNAVAILABLE and ca_cert is None:
        return f"{error} {TLS_HINT}"
    return str(error)


def fail(message: str) -> NoReturn:
    """`error: MESSAGE` on stderr, exit 1."""
    print(f"error: {message}", file=sys.stderr)
    raise typer.Exit(1)


@contextlib.contextmanager
def reported(ca_cert: Path | None) -> Iterator[None]:
    """A failed call in the block prints `error: CODE: message [REASON]` and exits 1 (no traceback)."""
    try:
        yield
    except OpenTinkerError as exc:
        fail(describe(exc, ca_cert))

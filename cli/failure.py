"""How the client commands report a failed call: one line, `CODE: message [REASON]`, plus a hint when the
likely cause is on this side (plaintext to a server that speaks TLS)."""

from __future__ import annotations

from pathlib import Path

import grpc

from opentinker.client import OpenTinkerError

TLS_HINT = "(if the server speaks TLS, pass --ca-cert)"


def describe(error: OpenTinkerError, ca_cert: Path | None) -> str:
    # Plaintext to a TLS port reads as UNAVAILABLE "Socket closed": say what is probably missing.
    if error.code == grpc.StatusCode.UNAVAILABLE and ca_cert is None:
        return f"{error} {TLS_HINT}"
    return str(error)

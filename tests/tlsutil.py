"""A TLS certificate, a tokens file and a bearer-token channel for tests of servers behind TLS and tokens."""

from __future__ import annotations

import collections
import json
import shutil
import subprocess
from pathlib import Path

import grpc
import pytest


def make_certificate(directory: Path) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 and localhost (openssl CLI), valid one day: (cert, key)."""
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl CLI to make a test certificate")
    cert, key = directory / "cert.pem", directory / "key.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-keyout",
            str(key),
            "-out",
            str(cert),
            "-days",
            "1",
            "-subj",
            "/CN=localhost",
            "-addext",
            "subjectAltName=IP:127.0.0.1,DNS:localhost",
        ],
        check=True,
        capture_output=True,
    )
    return cert, key


def write_tokens(path: Path, tokens: dict[str, tuple[str, str]]) -> Path:
    """A --tokens-file: token -> (tenant, role)."""
    entries = [{"token": token, "tenant": tenant, "role": role} for token, (tenant, role) in tokens.items()]
    path.write_text(json.dumps({"tokens": entries}))
    return path


class _Details(
    collections.namedtuple(
        "_Details", ("method", "timeout", "metadata", "credentials", "wait_for_ready", "compression")
    ),
    grpc.ClientCallDetails,
):
    pass


class Bearer(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    """Adds one token to every call of a channel."""

    def __init__(self, token: str) -> None:
        self.header = ("authorization", f"Bearer {token}")

    def _with_token(self, details: grpc.ClientCallDetails) -> _Details:
        metadata = [*(details.metadata or ()), self.header]
        return _Details(
            details.method, details.timeout, metadata, details.credentials, details.wait_for_ready, details.compression
        )

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._with_token(details), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._with_token(details), request)

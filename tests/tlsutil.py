"""A TLS certificate and a tokens file for tests of servers behind TLS and bearer tokens."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

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

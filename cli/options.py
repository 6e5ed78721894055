"""Options every client command shares (admin, sample, status): where to connect and how to authenticate."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

REGISTRY_PORT = 7070
DEFAULT_REGISTRY = f"127.0.0.1:{REGISTRY_PORT}"

RegistryAddr = Annotated[
    str, typer.Option("--registry", envvar="OPENTINKER_REGISTRY", help="Registry address host:port.")
]
Token = Annotated[
    str | None,
    typer.Option("--token", envvar="OPENTINKER_TOKEN", help="Access token, sent as the authorization bearer."),
]
CaCert = Annotated[
    Path | None,
    typer.Option(
        "--ca-cert",
        envvar="OPENTINKER_CA_CERT",
        exists=True,
        dir_okay=False,
        help="PEM root certificate(s) verifying the server's TLS certificate; when set, TLS instead of plaintext.",
    ),
]
AsJson = Annotated[bool, typer.Option("--json", help="Machine-readable JSON output.")]

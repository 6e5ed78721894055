"""Typer options every `... serve` command shares, so all servers take the same flags."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from opentinker.rpc.process.config import load_config_file
from opentinker.rpc.serving.server import ServerOptions

Host = Annotated[str, typer.Option(help="Address to bind; non-loopback needs tokens or --insecure-public.")]
Port = Annotated[int, typer.Option(help="gRPC port; 0 picks a free port (printed on start).")]
MetricsPort = Annotated[int, typer.Option(help="Prometheus metrics port; 0 picks a free one, -1 disables.")]
TokensFile = Annotated[
    Path | None, typer.Option(help="JSON file mapping bearer tokens to tenants and roles.", exists=True)
]
InsecurePublic = Annotated[bool, typer.Option(help="Allow binding a public address without authentication.")]
TlsCert = Annotated[Path | None, typer.Option(help="PEM certificate chain for TLS.", exists=True)]
TlsKey = Annotated[Path | None, typer.Option(help="PEM private key for TLS.", exists=True)]
RegistryCa = Annotated[
    Path | None,
    typer.Option(
        envvar="OPENTINKER_REGISTRY_CA",
        exists=True,
        help="PEM root certificate(s) verifying the registry's TLS certificate; when set, TLS to the registry.",
    ),
]
ServedModelName = Annotated[
    str | None,
    typer.Option(
        help="Public name of a --model given as a directory, which clients send as base_model and load the "
        "tokenizer by (default: the hub id its config.json names, else the path as given). A hub id --model "
        "is its own name."
    ),
]
ReadyFile = Annotated[Path | None, typer.Option(help="Write {address, metrics_address} JSON here once serving.")]
LogLevel = Annotated[str, typer.Option(help="Logging level.")]
MaxMessageMb = Annotated[
    int, typer.Option(min=1, max=2047, help="Largest gRPC message this server sends or receives, in MiB.")
]
Config = Annotated[
    Path | None,
    typer.Option(
        "--config",
        is_eager=True,
        callback=load_config_file,
        dir_okay=False,
        help="TOML file with flag values (shared keys, then this server's [section]); flags and env vars win.",
    ),
]
Store = Annotated[
    str,
    typer.Option(
        help="Where artifacts live: a folder (plain path or file:///path) or a bucket, s3://bucket/prefix, "
        "az://container/prefix or gs://bucket/prefix (credentials from the standard environment only)."
    ),
]
CacheDir = Annotated[
    Path | None,
    typer.Option(help="With a bucket --store: the local folder of verified copies of what was pulled or pushed."),
]
CacheMaxMb = Annotated[
    int,
    typer.Option(min=0, help="With a bucket --store: MiB the cache may hold; least recently used out (0: no bound)."),
]
PrintConfig = Annotated[
    bool, typer.Option(help="Print the resolved flags and where each came from as JSON, then exit.")
]


def server_options(
    host: str,
    port: int,
    metrics_port: int,
    tokens_file: Path | None,
    insecure_public: bool,
    tls_cert: Path | None,
    tls_key: Path | None,
    ready_file: Path | None,
    max_message_mb: int = 64,
    max_calls_per_tenant: int = 0,
) -> ServerOptions:
    return ServerOptions(
        host=host,
        port=port,
        metrics_port=None if metrics_port < 0 else metrics_port,
        tokens_file=tokens_file,
        insecure_public=insecure_public,
        tls_cert=tls_cert,
        tls_key=tls_key,
        ready_file=ready_file,
        max_message_bytes=max_message_mb << 20,
        max_calls_per_tenant=max_calls_per_tenant,
    )

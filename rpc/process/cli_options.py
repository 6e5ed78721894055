"""Typer options every `... serve` command shares, so all servers take the same flags."""

from __future__ import annotations

import functools
import inspect
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import typer

from opentinker.rpc.process.config import load_config_file
from opentinker.rpc.process.model_server_setup import ModelServerSetup
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
_SIZE_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 1 << 10, "m": 10**6, "mb": 10**6, "mib": 1 << 20}
_SIZE_UNITS |= {"g": 10**9, "gb": 10**9, "gib": 1 << 30, "t": 10**12, "tb": 10**12, "tib": 1 << 40}


def parse_size(text: str | int) -> int:
    """Bytes from ``20GiB``, ``512MB``, ``1.5G`` or a plain number of bytes (units: k, M, G, T in powers of
    1000, KiB, MiB, GiB, TiB in powers of 1024, case-insensitive)."""
    if isinstance(text, int):
        return text
    cleaned = text.strip().replace("_", "").replace(" ", "")
    number = cleaned.rstrip("bBiIkKmMgGtT")
    unit = _SIZE_UNITS.get(cleaned[len(number) :].lower())
    try:
        value = float(number) * unit if unit is not None and number else -1.0
    except ValueError:
        value = -1.0
    if not 0 <= value < 2**63:  # also refuses NaN and infinity
        raise typer.BadParameter(f"{text!r} is not a size: bytes, or a number with a unit such as 512MiB or 20GiB")
    return int(value)


CacheMaxBytes = Annotated[
    int,
    typer.Option(
        parser=parse_size,
        metavar="SIZE",
        help="With a bucket --store: what the cache may hold (bytes, or 512MiB, 20GiB ...); least recently used "
        "out (0: no bound).",
    ),
]
Model = Annotated[str, typer.Option(help="Base model: a local HF directory (or a cached HF id).")]
Registry = Annotated[str, typer.Option(envvar="OPENTINKER_REGISTRY", help="Registry address host:port.")]
Device = Annotated[str, typer.Option(help="auto (CUDA when present), cpu or cuda.")]
Revision = Annotated[
    str | None, typer.Option(help="Of a hub id --model: the cached commit, branch or tag (as `hf download`).")
]
DtypeFlag = Annotated[str, typer.Option(help="auto (bfloat16 on CUDA, float32 on the CPU), float32 or bfloat16.")]
Zone = Annotated[str, typer.Option(help="Free-text zone registered with the fleet (at most 64 bytes).")]
HeartbeatS = Annotated[float, typer.Option(min=0.05, max=20.0, help="Seconds between the fleet lease's renewals.")]
LeaseBeats = Annotated[
    int, typer.Option(min=1, max=60, help="Missed beats after which the registry drops this replica.")
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


@dataclass(frozen=True, slots=True)
class Serving:
    """The flags every server takes (how it listens and logs), parsed once by `serve_flags`."""

    server: ServerOptions
    log_level: str

    def refuse_unsafe_exposure(self, label: str) -> None:
        """Exits with one line when the server would listen publicly without authentication: before the model
        (or the data) is touched, not after."""
        from opentinker.rpc.serving.server import exit_if_unsafe

        exit_if_unsafe(label, self.server)

    def check_ports(self) -> None:
        """A busy port is found now, before the model loads or the data is locked."""
        from opentinker.rpc.process.startup import check_ports

        metrics_port = -1 if self.server.metrics_port is None else self.server.metrics_port
        check_ports(self.server.host, self.server.port, metrics_port)


# name, type with its typer.Option, default: the flags of `serve_flags`, after each server's own.
_SHARED: tuple[tuple[str, Any, Any], ...] = (
    ("host", Host, "127.0.0.1"),
    ("port", Port, None),  # the server's own port
    ("metrics_port", MetricsPort, 0),
    ("tokens_file", TokensFile, None),
    ("insecure_public", InsecurePublic, False),
    ("tls_cert", TlsCert, None),
    ("tls_key", TlsKey, None),
    ("ready_file", ReadyFile, None),
    ("log_level", LogLevel, "INFO"),
    ("max_message_mb", MaxMessageMb, 64),
    ("config_file", Config, None),
    ("print_config", PrintConfig, False),
)


def serve_flags(default_port: int) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """Adds the shared flags to a `serve` command, declared here once: the command's function takes its own
    flags and `serving: Serving` (typer reads the signature this returns; the function gets the parsed record)."""

    def parse(values: dict[str, Any]) -> Serving:
        options = server_options(
            values["host"],
            values["port"],
            values["metrics_port"],
            values["tokens_file"],
            values["insecure_public"],
            values["tls_cert"],
            values["tls_key"],
            values["ready_file"],
            values["max_message_mb"],
        )
        return Serving(options, values["log_level"])

    flags = tuple((name, kind, default_port if name == "port" else default) for name, kind, default in _SHARED)
    return functools.partial(_with_flags, flags=flags, record="serving", parse=parse)


def model_server_flags(role: str) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """Adds the flags the trainer and the sampler share (the base model, the registry, the store) to `serve`:
    the command's function takes `setup: ModelServerSetup` instead of them."""
    token = Annotated[
        str | None,
        typer.Option(envvar="OPENTINKER_REGISTRY_TOKEN", help=f"Token the {role} uses with the registry."),
    ]
    advertise = Annotated[
        str,
        typer.Option(
            help=f"host:port clients use to reach this {role}, registered with the fleet; default the bound "
            "address (a wildcard host becomes this machine's name)."
        ),
    ]
    flags: tuple[tuple[str, Any, Any], ...] = (
        ("model", Model, inspect.Parameter.empty),
        ("registry", Registry, inspect.Parameter.empty),
        ("store", Store, inspect.Parameter.empty),
        ("registry_token", token, None),
        ("device", Device, "auto"),
        ("revision", Revision, None),
        ("served_model_name", ServedModelName, None),
        ("dtype", DtypeFlag, "auto"),
        ("registry_ca", RegistryCa, None),
        ("cache_dir", CacheDir, None),
        ("cache_max_bytes", CacheMaxBytes, 0),
        ("advertise", advertise, ""),
        ("zone", Zone, ""),
        ("heartbeat_s", HeartbeatS, 1.0),
        ("lease_beats", LeaseBeats, 3),
    )

    def parse(values: dict[str, Any]) -> ModelServerSetup:
        if values["dtype"] not in ("auto", "float32", "bfloat16"):
            raise typer.BadParameter("dtype must be auto, float32 or bfloat16", param_hint="--dtype")
        _check_fleet_flags(values["advertise"], values["zone"], values["heartbeat_s"], values["lease_beats"])
        return ModelServerSetup(**values)

    return functools.partial(_with_flags, flags=flags, record="setup", parse=parse)


def _check_fleet_flags(advertise: str, zone: str, heartbeat_s: float, lease_beats: int) -> None:
    if advertise and not re.fullmatch(r"(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.-]+):\d{1,5}", advertise):
        raise typer.BadParameter(f"{advertise!r} is not host:port", param_hint="--advertise")
    if len(zone.encode()) > 64:
        raise typer.BadParameter("at most 64 bytes", param_hint="--zone")
    if heartbeat_s * lease_beats > 60:
        raise typer.BadParameter(
            "the lease (--heartbeat-s x --lease-beats) is at most 60 s", param_hint="--lease-beats"
        )


def _with_flags(
    command: Callable[..., None],
    flags: tuple[tuple[str, Any, Any], ...],
    record: str,
    parse: Callable[[dict[str, Any]], Any],
) -> Callable[..., None]:
    """`command` with `flags` (name, type with its typer.Option, default) in place of its parameter `record`:
    typer reads the signature returned; the command gets the record `parse` makes of the flags' values."""
    own = inspect.signature(command, eval_str=True)
    kept = [p for p in own.parameters.values() if p.name != record]
    keyword = inspect.Parameter.KEYWORD_ONLY
    added = [inspect.Parameter(name, keyword, annotation=kind, default=default) for name, kind, default in flags]

    @functools.wraps(command)
    def with_flags(**values: Any) -> None:
        mine = {name: values.pop(name) for name, _kind, _default in flags}
        command(**values, **{record: parse(mine)})

    parameters = [*kept, *added]
    with_flags.__signature__ = own.replace(parameters=parameters)  # type: ignore[attr-defined]
    with_flags.__annotations__ = {p.name: p.annotation for p in parameters} | {"return": None}
    return with_flags

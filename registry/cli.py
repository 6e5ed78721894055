"""`opentinker registry serve`: run the registry server (its wiring: `registry/build.py`). The admin commands
that talk to a running registry live with the other client tools in `opentinker.cli`."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Annotated

import typer

from opentinker.rpc.process import cli_options as opt
from opentinker.rpc.process.config import serve_command
from opentinker.weights.artifact_bucket import store_environment

DEFAULT_PORT = 7070
registry_app = typer.Typer(no_args_is_help=True)


@registry_app.command("serve", cls=serve_command("registry", lambda params: store_environment(params.get("store"))))
@opt.serve_flags(DEFAULT_PORT)
def serve(
    redis_url: Annotated[
        str | None, typer.Option(help="Redis URL; default: a private embedded Redis under --data-dir.")
    ] = None,
    data_dir: Annotated[
        Path | None,
        typer.Option(
            help="Embedded Redis data and default artifact store, locked while this registry runs (default: "
            "$XDG_DATA_HOME/opentinker/registry, else ~/.local/share/opentinker/registry; `up`: WORKDIR/registry)."
        ),
    ] = None,
    store: Annotated[
        str | None,
        typer.Option(
            help="Where artifacts live: a folder (default DATA_DIR/artifacts) or a bucket, s3://bucket/prefix, "
            "az://container/prefix or gs://bucket/prefix; with a bucket the registry keeps metadata only "
            "(credentials from the standard environment only)."
        ),
    ] = None,
    events_maxlen: Annotated[int, typer.Option(help="Approximate number of events the stream keeps.")] = 100_000,
    max_watches_per_tenant: Annotated[
        int, typer.Option(min=1, help="Open WatchEvents streams per user tenant (admins are not counted).")
    ] = 16,
    max_description_bytes: Annotated[int, typer.Option(min=0, help="Longest adapter description (bytes).")] = 4096,
    max_labels: Annotated[int, typer.Option(min=0, help="Most labels on one adapter.")] = 32,
    max_label_bytes: Annotated[int, typer.Option(min=1, help="Longest label key or value (bytes).")] = 256,
    max_artifact_files: Annotated[int, typer.Option(min=1, help="Most files in one uploaded artifact.")] = 64,
    tenant_storage_quota_mb: Annotated[
        int, typer.Option(min=0, help="Bytes of uploaded artifacts one user tenant may store, in MiB (0: no quota).")
    ] = 20480,
    upload_grace_s: Annotated[
        float,
        typer.Option(
            "--upload-grace-s",
            "--gc-grace",
            min=0,
            help="Seconds after which unpublished artifacts are collected: uploads (swept while serving) and, with "
            "a bucket store, objects pushed and never published (by `opentinker registry gc`); 0: never.",
        ),
    ] = 3600.0,
    max_calls_per_tenant: Annotated[
        int,
        typer.Option(
            min=0, help="Calls one user tenant may have in flight at once (admins are not counted; 0: no limit)."
        ),
    ] = 64,
    *,
    serving: opt.Serving,
) -> None:
    """Run the registry gRPC server (embedded Redis unless --redis-url)."""
    from opentinker.registry.build import build_registry
    from opentinker.registry.data_dir import default_data_dir
    from opentinker.registry.limits import RegistryLimits
    from opentinker.rpc.serving.server import ServerHooks, configure_logging, serve_forever

    configure_logging(serving.log_level)
    limits = RegistryLimits(
        max_watches_per_tenant=max_watches_per_tenant,
        max_description_bytes=max_description_bytes,
        max_labels=max_labels,
        max_label_bytes=max_label_bytes,
        max_artifact_files=max_artifact_files,
        tenant_storage_quota_bytes=tenant_storage_quota_mb << 20,
        upload_grace_s=upload_grace_s,
    )
    options = dataclasses.replace(serving.server, max_calls_per_tenant=max_calls_per_tenant)
    serving.check_ports()  # before the lock and Redis: a clash must not touch the data
    server = build_registry(redis_url, data_dir or default_data_dir(), store, events_maxlen, limits)
    try:
        serve_forever("registry", [server.binding], options, ServerHooks(on_stop=server.on_stop))
    finally:
        server.stop_redis()

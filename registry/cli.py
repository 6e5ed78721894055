"""`opentinker registry ...`: run the registry server, and administer a running one over gRPC."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any, NoReturn, TypeVar

import grpc
import typer
from google.protobuf.json_format import MessageToDict
from google.protobuf.message import Message
from rich.console import Console
from rich.table import Table

from opentinker.rpc import cli_options as opt
from opentinker.rpc.config import serve_command
from opentinker.rpc.errors import describe
from opentinker.v1 import registry_pb2, registry_pb2_grpc

DEFAULT_PORT = 7070
registry_app = typer.Typer(no_args_is_help=True)
alias_app = typer.Typer(no_args_is_help=True, help="Move or remove aliases.")
registry_app.add_typer(alias_app, name="alias")

RegistryAddr = Annotated[
    str, typer.Option("--registry", envvar="OPENTINKER_REGISTRY", help="Registry address host:port.")
]
Token = Annotated[str | None, typer.Option("--token", envvar="OPENTINKER_TOKEN", help="Bearer token.")]
AsJson = Annotated[bool, typer.Option("--json", help="Machine-readable JSON output.")]
DEFAULT_ADDR = f"127.0.0.1:{DEFAULT_PORT}"
T = TypeVar("T")


@registry_app.command("serve", cls=serve_command("registry"))
def serve(
    redis_url: Annotated[
        str | None, typer.Option(help="Redis URL; default: a private embedded Redis under --data-dir.")
    ] = None,
    data_dir: Annotated[Path, typer.Option(help="Embedded Redis data and default artifact store.")] = Path(
        "registry-data"
    ),
    store: Annotated[Path | None, typer.Option(help="Artifact store root (default DATA_DIR/artifacts).")] = None,
    events_maxlen: Annotated[int, typer.Option(help="Approximate number of events the stream keeps.")] = 100_000,
    host: opt.Host = "127.0.0.1",
    port: opt.Port = DEFAULT_PORT,
    metrics_port: opt.MetricsPort = 0,
    tokens_file: opt.TokensFile = None,
    insecure_public: opt.InsecurePublic = False,
    tls_cert: opt.TlsCert = None,
    tls_key: opt.TlsKey = None,
    ready_file: opt.ReadyFile = None,
    log_level: opt.LogLevel = "INFO",
    max_message_mb: opt.MaxMessageMb = 64,
    config_file: opt.Config = None,
    print_config: opt.PrintConfig = False,
) -> None:
    """Run the registry gRPC server (embedded Redis unless --redis-url)."""
    from opentinker.registry.embedded_redis import EmbeddedRedis
    from opentinker.registry.service import RegistryServicer
    from opentinker.registry.store import RegistryStore
    from opentinker.rpc.server import ServiceBinding, configure_logging, serve_forever
    from opentinker.weights.artifact_store import ArtifactStore

    configure_logging(log_level)
    embedded = None
    if redis_url is None:
        embedded = EmbeddedRedis(data_dir / "redis").start()
        redis_url = embedded.url
    artifacts = ArtifactStore(store or data_dir / "artifacts")
    artifacts.cleanup_temp()
    registry_store = RegistryStore.from_url(redis_url, events_maxlen=events_maxlen)
    servicer = RegistryServicer(registry_store, artifacts)

    async def on_stop() -> None:
        await registry_store.close()
        if embedded is not None:
            embedded.stop()

    binding = ServiceBinding(
        registry_pb2.DESCRIPTOR.services_by_name["RegistryService"].full_name,
        lambda server: registry_pb2_grpc.add_RegistryServiceServicer_to_server(servicer, server),
    )
    options = opt.server_options(host, port, metrics_port, tokens_file, insecure_public, tls_cert, tls_key, ready_file,
                                 max_message_mb)  # fmt: skip
    try:
        serve_forever("registry", [binding], options, on_stop=on_stop)
    finally:
        if embedded is not None:
            embedded.stop()


# Admin commands


@contextmanager
def _stub(address: str, token: str | None) -> Iterator[tuple[registry_pb2_grpc.RegistryServiceStub, Any]]:
    metadata = [("authorization", f"Bearer {token}")] if token else None
    with grpc.insecure_channel(address) as channel:
        yield registry_pb2_grpc.RegistryServiceStub(channel), metadata


def _call(fn: Callable[[], T]) -> T:
    """Run one RPC; a failure prints `error: CODE: message [REASON]` and exits 1 (no traceback)."""
    try:
        return fn()
    except grpc.RpcError as exc:
        print(f"error: {describe(exc)}", file=sys.stderr)
        raise typer.Exit(1) from None


def _dump(message: Message) -> dict[str, Any]:
    return MessageToDict(message, preserving_proto_field_name=True)


def _print_json(value: object) -> None:
    print(json.dumps(value, indent=2, sort_keys=True))


def _when(message: Any) -> str:
    return str(message.ToDatetime().strftime("%Y-%m-%d %H:%M:%S")) if message.seconds else ""


console = Console()


@registry_app.command("create")
def create(
    name: str,
    rank: Annotated[int, typer.Option(help="LoRA rank.")] = 32,
    alpha: Annotated[float, typer.Option(help="LoRA alpha (default: rank).")] = 0.0,
    target: Annotated[list[str] | None, typer.Option(help="Target modules (attn, mlp, all-linear, names).")] = None,
    description: Annotated[str, typer.Option(help="Free text.")] = "",
    registry: RegistryAddr = DEFAULT_ADDR,
    token: Token = None,
    as_json: AsJson = False,
) -> None:
    """Register an adapter name."""
    from opentinker.v1 import common_pb2

    lora = common_pb2.LoraConfig(rank=rank, alpha=alpha, target_modules=target or [])
    request = registry_pb2.CreateAdapterRequest(name=name, lora_config=lora, description=description)
    with _stub(registry, token) as (stub, md):
        response = _call(lambda: stub.CreateAdapter(request, metadata=md))
    if as_json:
        _print_json(_dump(response))
    else:
        console.print(f"created {response.adapter.name} (event {response.event_id})")


@registry_app.command("adapters")
def adapters(
    prefix: Annotated[str, typer.Option(help="Only names with this prefix.")] = "",
    registry: RegistryAddr = DEFAULT_ADDR,
    token: Token = None,
    as_json: AsJson = False,
) -> None:
    """List adapters with their aliases."""
    found: list[registry_pb2.Adapter] = []
    page = ""
    with _stub(registry, token) as (stub, md):
        while True:
            request = registry_pb2.ListAdaptersRequest(prefix=prefix, page_token=page, page_size=500)

            def list_page(r: registry_pb2.ListAdaptersRequest = request) -> registry_pb2.ListAdaptersResponse:
                response: registry_pb2.ListAdaptersResponse = stub.ListAdapters(r, metadata=md)
                return response

            response = _call(list_page)
            found.extend(response.adapters)
            page = response.next_page_token
            if not page:
                break
    if as_json:
        _print_json([_dump(a) for a in found])
        return
    table = Table("adapter", "versions", "newest", "aliases", "rank", "created")
    for a in found:
        aliases = ", ".join(f"{k}->{v}" for k, v in sorted(a.aliases.items()))
        table.add_row(a.name, str(a.version_count), str(a.latest_version), aliases, str(a.lora_config.rank),
                      _when(a.create_time))  # fmt: skip
    console.print(table)


@registry_app.command("versions")
def versions(
    name: str,
    limit: Annotated[int, typer.Option(help="Newest N versions.")] = 20,
    registry: RegistryAddr = DEFAULT_ADDR,
    token: Token = None,
    as_json: AsJson = False,
) -> None:
    """Versions of an adapter, newest first."""
    request = registry_pb2.ListVersionsRequest(adapter=name, page_size=limit)
    with _stub(registry, token) as (stub, md):
        response = _call(lambda: stub.ListVersions(request, metadata=md))
    if as_json:
        _print_json([_dump(v) for v in response.versions])
        return
    table = Table("version", "aliases", "step", "tokens", "artifact", "published", "by")
    for v in response.versions:
        artifact = "(collected)" if v.artifact_deleted else v.artifact_sha256[:12]
        table.add_row(
            str(v.version), ", ".join(v.aliases), str(v.lineage.trainer_step), str(v.lineage.tokens_trained),
            artifact, _when(v.publish_time), v.published_by,
        )  # fmt: skip
    console.print(table)


@registry_app.command("show")
def show(reference: str, registry: RegistryAddr = DEFAULT_ADDR, token: Token = None, as_json: AsJson = False) -> None:
    """Resolve a reference (name, name@alias, name@N) to its exact version."""
    with _stub(registry, token) as (stub, md):
        response = _call(lambda: stub.Resolve(registry_pb2.ResolveRequest(reference=reference), metadata=md))
    v = response.version
    if as_json:
        _print_json(_dump(v))
        return
    console.print(f"{reference} -> {v.adapter}@{v.version}")
    console.print(f"  aliases    {', '.join(v.aliases) or '-'}")
    console.print(
        f"  artifact   {v.artifact_uri}{' (collected)' if v.artifact_deleted else ''} ({v.artifact_size_bytes} B)"
    )
    console.print(
        f"  lora       rank {v.lora_config.rank} alpha {v.lora_config.alpha:g} {list(v.lora_config.target_modules)}"
    )
    console.print(f"  parent     {v.lineage.parent_version or '-'}  step {v.lineage.trainer_step}")
    console.print(f"  published  {_when(v.publish_time)} by {v.published_by}")


@alias_app.command("set")
def alias_set(
    name: str,
    alias: str,
    version: int,
    expect: Annotated[int | None, typer.Option(help="Only if the alias points to this version now.")] = None,
    registry: RegistryAddr = DEFAULT_ADDR,
    token: Token = None,
    as_json: AsJson = False,
) -> None:
    """Point ALIAS of NAME at VERSION."""
    request = registry_pb2.SetAliasRequest(adapter=name, alias=alias, version=version, expected_version=expect)
    with _stub(registry, token) as (stub, md):
        response = _call(lambda: stub.SetAlias(request, metadata=md))
    if as_json:
        _print_json(_dump(response))
    else:
        console.print(f"{name}@{alias}: {response.previous_version or '-'} -> {response.version}")


@alias_app.command("rm")
def alias_rm(
    name: str,
    alias: str,
    expect: Annotated[int | None, typer.Option(help="Only if the alias points to this version now.")] = None,
    registry: RegistryAddr = DEFAULT_ADDR,
    token: Token = None,
    as_json: AsJson = False,
) -> None:
    """Remove ALIAS of NAME."""
    request = registry_pb2.DeleteAliasRequest(adapter=name, alias=alias, expected_version=expect)
    with _stub(registry, token) as (stub, md):
        response = _call(lambda: stub.DeleteAlias(request, metadata=md))
    if as_json:
        _print_json(_dump(response))
    else:
        console.print(f"removed {name}@{alias} (was {response.previous_version})")


@registry_app.command("rollback")
def rollback(
    name: str,
    alias: Annotated[str, typer.Option(help="Alias to move back.")] = "latest",
    to: Annotated[int | None, typer.Option(help="Target version (default: the previous one).")] = None,
    registry: RegistryAddr = DEFAULT_ADDR,
    token: Token = None,
    as_json: AsJson = False,
) -> None:
    """Move an alias back to an older version."""
    request = registry_pb2.RollbackRequest(adapter=name, alias=alias, to_version=to)
    with _stub(registry, token) as (stub, md):
        response = _call(lambda: stub.Rollback(request, metadata=md))
    if as_json:
        _print_json(_dump(response))
    else:
        console.print(f"{name}@{response.alias}: {response.from_version} -> {response.to_version}")


@registry_app.command("lineage")
def lineage(
    reference: str,
    depth: Annotated[int, typer.Option(help="At most N versions (0: all).")] = 0,
    registry: RegistryAddr = DEFAULT_ADDR,
    token: Token = None,
    as_json: AsJson = False,
) -> None:
    """The chain of versions back to the first, with their batches."""
    request = registry_pb2.GetLineageRequest(reference=reference, max_depth=depth)
    with _stub(registry, token) as (stub, md):
        response = _call(lambda: stub.GetLineage(request, metadata=md))
    if as_json:
        _print_json([_dump(v) for v in response.chain])
        return
    table = Table("version", "parent", "step", "tokens", "batches", "trace ids", "metrics")
    for v in response.chain:
        traces = sorted({t for b in v.lineage.batches for t in b.trace_ids})
        metrics = ", ".join(f"{k}={val:.4g}" for k, val in sorted(v.lineage.metrics.items()))
        table.add_row(
            f"{v.adapter}@{v.version}", str(v.lineage.parent_version or "-"), str(v.lineage.trainer_step),
            str(v.lineage.tokens_trained), str(len(v.lineage.batches)), ", ".join(traces[:4]), metrics,
        )  # fmt: skip
    console.print(table)


@registry_app.command("watch")
def watch(
    from_id: Annotated[str, typer.Option("--from", help="Resume after this event id ('0': from the oldest).")] = "",
    adapter: Annotated[list[str] | None, typer.Option(help="Only these adapters ('tenant/*' patterns).")] = None,
    count: Annotated[int, typer.Option(help="Stop after N messages (0: never).")] = 0,
    registry: RegistryAddr = DEFAULT_ADDR,
    token: Token = None,
    as_json: AsJson = False,
) -> None:
    """Stream registry events (one per line)."""
    request = registry_pb2.WatchEventsRequest(after_event_id=from_id, adapters=adapter or [])
    seen = 0
    with _stub(registry, token) as (stub, md):
        stream = stub.WatchEvents(request, metadata=md)

        def consume() -> None:
            nonlocal seen
            for message in stream:
                if as_json:
                    print(json.dumps(_dump(message), sort_keys=True), flush=True)
                elif message.HasField("reconcile"):
                    r = message.reconcile
                    print(f"{r.event_id} RECONCILE ({r.reason}) {len(r.adapters)} adapters", flush=True)
                    for a in r.adapters:
                        print(f"    {a.adapter} {dict(sorted(a.aliases.items()))}", flush=True)
                else:
                    e = message.event
                    kind = registry_pb2.EventType.Name(e.type).removeprefix("EVENT_TYPE_")
                    detail = f"{e.alias} {e.previous_version or '-'} -> {e.version}" if e.alias else f"v{e.version}"
                    print(f"{e.event_id} {kind} {e.adapter} {detail} by {e.actor}", flush=True)
                seen += 1
                if count and seen >= count:
                    stream.cancel()
                    return

        _call(consume)


@registry_app.command("gc")
def gc(
    keep: Annotated[int, typer.Option(help="Keep the newest K versions of each adapter (plus aliased ones).")] = 5,
    adapter: Annotated[str, typer.Option(help="Only this adapter.")] = "",
    dry_run: Annotated[bool, typer.Option(help="Only report.")] = False,
    registry: RegistryAddr = DEFAULT_ADDR,
    token: Token = None,
    as_json: AsJson = False,
) -> None:
    """Delete artifacts outside the retention policy (admin)."""
    request = registry_pb2.GarbageCollectRequest(keep_last=keep, adapter=adapter, dry_run=dry_run)
    with _stub(registry, token) as (stub, md):
        response = _call(lambda: stub.GarbageCollect(request, metadata=md))
    if as_json:
        _print_json(_dump(response))
        return
    verb = "would collect" if dry_run else "collected"
    for c in response.collected:
        console.print(f"{verb} {c.adapter}@{c.version} ({c.size_bytes} B)")
    console.print(f"{len(response.collected)} versions, {response.bytes_freed} bytes freed")


@registry_app.command("delete")
def delete(name: str, registry: RegistryAddr = DEFAULT_ADDR, token: Token = None) -> None:
    """Delete an adapter and its aliases (admin); versions remain until gc."""
    with _stub(registry, token) as (stub, md):
        response = _call(lambda: stub.DeleteAdapter(registry_pb2.DeleteAdapterRequest(name=name), metadata=md))
    console.print(f"deleted {name} (event {response.event_id})")


# Peft interop


def _fail(message: str) -> NoReturn:
    print(f"error: {message}", file=sys.stderr)
    raise typer.Exit(1)


@registry_app.command("import")
def import_adapter(
    directory: Annotated[
        Path, typer.Argument(help="A peft LoRA folder (adapter_config.json, adapter_model.safetensors).")
    ],
    name: Annotated[str, typer.Argument(help="Adapter to publish it to (created if missing).")],
    base_model: Annotated[
        Path | None, typer.Option(help="Local base model folder to check shapes against and record (its digest).")
    ] = None,
    alias: Annotated[list[str] | None, typer.Option(help="Also point these aliases at the new version.")] = None,
    registry: RegistryAddr = DEFAULT_ADDR,
    token: Token = None,
    as_json: AsJson = False,
) -> None:
    """Publish a peft LoRA adapter trained elsewhere as a new version (validated first; lineage says where from)."""
    from opentinker.registry.peft_io import PeftFolderError, inspect_peft_folder
    from opentinker.rpc.progress import spinner

    try:
        with spinner(f"checking {directory}", quiet=as_json):
            adapter = inspect_peft_folder(directory, base_model)
    except PeftFolderError as exc:
        _fail(str(exc))
    with _stub(registry, token) as (stub, md):
        version = _call(lambda: _publish_import(stub, md, adapter, name, alias or [], quiet=as_json))
    if as_json:
        _print_json(_dump(version))
        return
    console.print(f"imported {directory} as {version.adapter}@{version.version} (rank {adapter.rank}, "
                  f"{len(adapter.modules)} modules: {', '.join(adapter.target_modules)})")  # fmt: skip
    for note in adapter.notes:
        console.print(f"  note: {note}")


def _publish_import(
    stub: registry_pb2_grpc.RegistryServiceStub, md: Any, adapter: Any, name: str, aliases: list[str], *, quiet: bool
) -> registry_pb2.Version:
    import tempfile
    import uuid

    from google.protobuf.timestamp_pb2 import Timestamp

    from opentinker.rpc.progress import byte_progress
    from opentinker.rpc.registry_link import upload_messages
    from opentinker.weights.artifact_store import ArtifactStore
    from opentinker.weights.peft import PEFT_FILES

    source = str(adapter.directory.resolve())
    try:
        existing = stub.GetAdapter(registry_pb2.GetAdapterRequest(name=name), metadata=md).adapter
    except grpc.RpcError as exc:
        if not isinstance(exc, grpc.Call) or exc.code() != grpc.StatusCode.NOT_FOUND:
            raise
        existing = None
    if existing is not None:
        theirs, ours = existing.base_model_digest, adapter.base_model_digest
        if theirs and ours and theirs != ours:
            _fail(f"{name} belongs to base model {theirs[:12]}..., but {source} was checked against "
                  f"{adapter.base_model_checked} ({ours[:12]}...)")  # fmt: skip
        base_digest = ours or theirs
    else:
        base_digest = adapter.base_model_digest
        stub.CreateAdapter(registry_pb2.CreateAdapterRequest(
            name=name, lora_config=adapter.lora_config(), base_model_digest=base_digest,
            labels={"origin": "peft-import"}, description=f"imported from {source}"[:1000],
        ), metadata=md)  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="opentinker-import-") as tmp:
        store = ArtifactStore(Path(tmp))
        ref = store.commit_files({f: (adapter.directory / f).read_bytes() for f in PEFT_FILES})
        with byte_progress(f"uploading {name}", ref.size_bytes, quiet=quiet) as advance:

            def counted() -> Iterator[registry_pb2.UploadArtifactRequest]:
                for message in upload_messages(store, ref.uri):
                    advance(len(message.chunk))
                    yield message

            uploaded = stub.UploadArtifact(counted(), metadata=md)
    now = Timestamp()
    now.GetCurrentTime()
    # Imported weights were not trained from any earlier version: no parent, one record naming the source.
    record = registry_pb2.BatchRecord(digest=adapter.weights_sha256, trace_ids=[f"import:{source}"],
                                      loss_fn="peft-import", time=now)  # fmt: skip
    lineage = registry_pb2.Lineage(base_model_digest=base_digest, batches=[record])
    request = registry_pb2.PublishVersionRequest(
        adapter=name, artifact_uri=uploaded.artifact_uri, artifact_sha256=uploaded.artifact_sha256,
        artifact_size_bytes=uploaded.artifact_size_bytes, lora_config=adapter.lora_config(), lineage=lineage,
        aliases=aliases, request_id=f"import-{uuid.uuid4().hex}",
    )  # fmt: skip
    version: registry_pb2.Version = stub.PublishVersion(request, metadata=md).version
    return version


@registry_app.command("export")
def export_adapter(
    reference: Annotated[str, typer.Argument(help="name, name@alias or name@N.")],
    directory: Annotated[Path, typer.Argument(help="New or empty folder to write the peft adapter into.")],
    base_model_name: Annotated[
        str | None,
        typer.Option("--base-model-name", help="Write this as base_model_name_or_path in adapter_config.json."),
    ] = None,
    registry: RegistryAddr = DEFAULT_ADDR,
    token: Token = None,
    as_json: AsJson = False,
) -> None:
    """Write a version as a plain peft folder (PeftModel.from_pretrained loads it)."""
    import asyncio
    import tempfile

    from opentinker.registry.peft_io import PeftFolderError, write_peft_folder
    from opentinker.rpc.errors import ServiceError
    from opentinker.rpc.progress import spinner
    from opentinker.rpc.registry_link import fetch_artifact
    from opentinker.weights.artifact_store import ArtifactStore

    if directory.exists() and (not directory.is_dir() or any(directory.iterdir())):
        _fail(f"{directory}: exists and is not an empty directory")
    with _stub(registry, token) as (stub, md):
        version = _call(lambda: stub.Resolve(registry_pb2.ResolveRequest(reference=reference), metadata=md).version)
    if version.artifact_deleted:
        _fail(f"{version.adapter}@{version.version} was garbage-collected; its weights are gone")

    async def download(store: ArtifactStore) -> None:
        async with grpc.aio.insecure_channel(registry) as channel:
            await fetch_artifact(registry_pb2_grpc.RegistryServiceStub(channel), store, version.artifact_uri, md)

    with tempfile.TemporaryDirectory(prefix="opentinker-export-") as tmp:
        store = ArtifactStore(Path(tmp))
        try:
            with spinner(f"downloading {version.adapter}@{version.version}", quiet=as_json):
                asyncio.run(download(store))
            written = write_peft_folder(store.path(version.artifact_uri), directory,
                                        base_model_name_or_path=base_model_name)  # fmt: skip
        except ServiceError as exc:
            _fail(f"{exc.code.name}: {exc.message} [{exc.reason}]")
        except PeftFolderError as exc:
            _fail(str(exc))
    if as_json:
        _print_json({"adapter": version.adapter, "version": str(version.version), "directory": str(directory),
                     "files": [p.name for p in written], "artifact_sha256": version.artifact_sha256})  # fmt: skip
    else:
        console.print(
            f"wrote {version.adapter}@{version.version} to {directory} ({', '.join(p.name for p in written)})"
        )

"""Python SDK for the OpenTinker registry: typed, synchronous wrappers around RegistryService.

    from opentinker.client import RegistryClient

    with RegistryClient("127.0.0.1:7070", token="s3cret") as registry:
        registry.create_adapter("team-a/agent", rank=16)
        artifact = registry.upload_artifact(Path("checkpoints/step-100"))
        version = registry.publish_version("team-a/agent", artifact, aliases=("canary",))
        registry.resolve("team-a/agent@canary").number  # == version.number

Every method maps to one RPC (two for the paged listings, which follow every page) and returns frozen
dataclasses; no protobuf message leaves this module. Every failure is an `OpenTinkerError` carrying the
gRPC status code and the ErrorInfo reason the server attached.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import stat
import tempfile
from collections.abc import Callable, Generator, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path, PurePosixPath
from types import TracebackType
from typing import BinaryIO, Final, TypeVar

import grpc
from google.protobuf.message import Message
from google.protobuf.timestamp_pb2 import Timestamp

from opentinker.client.connection import open_channel, translated
from opentinker.client.errors import OpenTinkerError, from_rpc_error
from opentinker.client.types import LoraConfig, lora_config_to_proto
from opentinker.v1 import common_pb2, registry_pb2, registry_pb2_grpc

__all__ = [
    "Adapter",
    "AliasMove",
    "ArtifactInfo",
    "BatchRecord",
    "Event",
    "GarbageCollection",
    "Lineage",
    "Reconcile",
    "RegistryClient",
    "Version",
]

CHUNK_SIZE: Final = 1 << 20
"""Upload message size: the contract's limit per chunk, well under gRPC's 4 MiB default message cap."""

_PAGE_SIZE: Final = 100
# Pages of versions carry their lineage (every batch record), so large pages could exceed the receive cap;
# the server default keeps each page small while still needing few round trips.
_MAX_RECEIVE_BYTES: Final = 64 << 20
_URI_PREFIX: Final = "sha256:"
_EVENT_PREFIX: Final = "EVENT_TYPE_"
_MANIFEST_FORMAT: Final = 1
_ALL_LINEAR: Final = "all-linear"

_M = TypeVar("_M", bound=Message)


# Data types


@dataclass(frozen=True, slots=True)
class BatchRecord:
    """One training batch that went into a version (what ForwardBackward saw)."""

    digest: str
    trace_ids: tuple[str, ...] = ()
    step: int = 0
    num_datums: int = 0
    num_tokens: int = 0
    loss_fn: str = ""
    # None when the trainer did not record a time.
    time: datetime | None = None


@dataclass(frozen=True, slots=True)
class Lineage:
    """Where a version came from: its parent, cumulative training totals and the batches since the parent."""

    parent_version: int = 0
    trainer_step: int = 0
    tokens_trained: int = 0
    datums_trained: int = 0
    batches: tuple[BatchRecord, ...] = ()
    metrics: dict[str, float] = field(default_factory=dict)
    base_model_digest: str = ""


@dataclass(frozen=True, slots=True)
class Adapter:
    """A registered adapter name with its LoRA shape and current aliases."""

    name: str
    tenant: str
    rank: int
    alpha: float
    target_modules: tuple[str, ...]
    aliases: dict[str, int]
    latest_version: int
    version_count: int
    created_at: datetime
    created_by: str
    labels: dict[str, str]
    description: str
    base_model_digest: str = ""
    dropout: float = 0.0
    # The ADAPTER_CREATED event's id when create_adapter returned this record (watch_events can resume there).
    event_id: str = field(default="", compare=False)


@dataclass(frozen=True, slots=True)
class Version:
    """One published, immutable version of an adapter."""

    adapter: str
    number: int
    sha256: str
    artifact_uri: str
    size_bytes: int
    created_at: datetime
    aliases: tuple[str, ...]
    published_by: str
    artifact_deleted: bool
    lineage: Lineage
    rank: int
    alpha: float
    # The version's own LoRA shape ("" / empty: all linear modules), which an imported version may set.
    target_modules: tuple[str, ...] = ()
    dropout: float = 0.0

    @property
    def reference(self) -> str:
        """The exact reference of this version, "name@N"."""
        return f"{self.adapter}@{self.number}"


@dataclass(frozen=True, slots=True)
class AliasMove:
    """The outcome of set_alias or rollback. previous_version 0: the alias did not exist."""

    adapter: str
    alias: str
    previous_version: int
    version: int
    event_id: str


@dataclass(frozen=True, slots=True)
class Event:
    """One registry change, carrying absolute state (replaying or repeating one is harmless).

    ``type`` is the EventType name without its prefix: "ADAPTER_CREATED", "ADAPTER_DELETED",
    "VERSION_PUBLISHED", "ALIAS_SET", "ALIAS_DELETED" or "ARTIFACT_DELETED".
    """

    event_id: str
    type: str
    adapter: str
    version: int
    alias: str
    previous_version: int
    aliases: dict[str, int]
    time: datetime
    actor: str
    cause: str
    artifact_sha256: str


@dataclass(frozen=True, slots=True)
class Reconcile:
    """A full alias snapshot (adapter -> alias -> version), sent first when asked for or when the
    requested resume point was trimmed. Apply it, then keep reading: events resume after ``event_id``."""

    event_id: str
    aliases: dict[str, dict[str, int]]
    reason: str


@dataclass(frozen=True, slots=True)
class GarbageCollection:
    """What garbage collection removed (or would remove, on a dry run): (adapter, version) pairs."""

    collected: tuple[tuple[str, int], ...]
    bytes_freed: int
    # The artifact of each collected version, in the same order.
    artifacts: tuple[ArtifactInfo, ...] = ()


@dataclass(frozen=True, slots=True)
class ArtifactInfo:
    """A committed artifact. size_bytes counts the payload files plus its manifest.json."""

    uri: str
    sha256: str
    size_bytes: int


# Proto -> dataclass conversion


def _time(stamp: Timestamp) -> datetime:
    return stamp.ToDatetime(tzinfo=UTC)


def _batch(proto: registry_pb2.BatchRecord) -> BatchRecord:
    return BatchRecord(
        digest=proto.digest,
        trace_ids=tuple(proto.trace_ids),
        step=proto.step,
        num_datums=proto.num_datums,
        num_tokens=proto.num_tokens,
        loss_fn=proto.loss_fn,
        time=_time(proto.time) if proto.HasField("time") else None,
    )


def _lineage(proto: registry_pb2.Lineage) -> Lineage:
    return Lineage(
        parent_version=proto.parent_version,
        trainer_step=proto.trainer_step,
        tokens_trained=proto.tokens_trained,
        datums_trained=proto.datums_trained,
        batches=tuple(_batch(b) for b in proto.batches),
        metrics=dict(proto.metrics),
        base_model_digest=proto.base_model_digest,
    )


def _adapter(proto: registry_pb2.Adapter) -> Adapter:
    lora = proto.lora_config
    return Adapter(
        name=proto.name,
        tenant=proto.tenant,
        rank=lora.rank,
        alpha=lora.alpha,
        target_modules=tuple(lora.target_modules),
        aliases=dict(proto.aliases),
        latest_version=proto.latest_version,
        version_count=proto.version_count,
        created_at=_time(proto.create_time),
        created_by=proto.created_by,
        labels=dict(proto.labels),
        description=proto.description,
        base_model_digest=proto.base_model_digest,
        dropout=lora.dropout,
    )


def _version(proto: registry_pb2.Version) -> Version:
    return Version(
        adapter=proto.adapter,
        number=proto.version,
        sha256=proto.artifact_sha256,
        artifact_uri=proto.artifact_uri,
        size_bytes=proto.artifact_size_bytes,
        created_at=_time(proto.publish_time),
        aliases=tuple(proto.aliases),
        published_by=proto.published_by,
        artifact_deleted=proto.artifact_deleted,
        lineage=_lineage(proto.lineage),
        rank=proto.lora_config.rank,
        alpha=proto.lora_config.alpha,
        target_modules=tuple(proto.lora_config.target_modules),
        dropout=proto.lora_config.dropout,
    )


def _event_type(value: int) -> str:
    try:
        name = registry_pb2.EventType.Name(value)
    except ValueError:
        # proto3 enums are open: a newer server may send a type this SDK does not know yet.
        return f"UNKNOWN_{value}"
    return name.removeprefix(_EVENT_PREFIX)


def _event(proto: registry_pb2.Event) -> Event:
    return Event(
        event_id=proto.event_id,
        type=_event_type(proto.type),
        adapter=proto.adapter,
        version=proto.version,
        alias=proto.alias,
        previous_version=proto.previous_version,
        aliases=dict(proto.aliases),
        time=_time(proto.time),
        actor=proto.actor,
        cause=proto.cause,
        artifact_sha256=proto.artifact_sha256,
    )


def _reconcile(proto: registry_pb2.Reconcile) -> Reconcile:
    return Reconcile(
        event_id=proto.event_id,
        aliases={entry.adapter: dict(entry.aliases) for entry in proto.adapters},
        reason=proto.reason,
    )


# Dataclass -> proto conversion


def _batch_proto(batch: BatchRecord) -> registry_pb2.BatchRecord:
    return registry_pb2.BatchRecord(
        digest=batch.digest,
        trace_ids=list(batch.trace_ids),
        step=batch.step,
        num_datums=batch.num_datums,
        num_tokens=batch.num_tokens,
        loss_fn=batch.loss_fn,
        time=batch.time,  # None leaves the field unset
    )


def _lineage_proto(lineage: Lineage) -> registry_pb2.Lineage:
    return registry_pb2.Lineage(
        parent_version=lineage.parent_version,
        trainer_step=lineage.trainer_step,
        tokens_trained=lineage.tokens_trained,
        datums_trained=lineage.datums_trained,
        batches=[_batch_proto(b) for b in lineage.batches],
        metrics=lineage.metrics,
        base_model_digest=lineage.base_model_digest,
    )


def _strings(values: Iterable[str], what: str) -> list[str]:
    # A bare string is iterable too; ("stable") instead of ("stable",) would otherwise become 6 aliases.
    if isinstance(values, str):
        raise TypeError(f"{what} must be a sequence of strings, not a single string")
    return list(values)


# Artifact helpers


@dataclass(frozen=True, slots=True)
class _LocalFile:
    rel: str
    path: Path
    size: int
    sha256: str


def _hash_file(path: Path) -> tuple[str, int]:
    hasher = hashlib.sha256()
    size = 0
    with path.open("rb") as handle:
        while block := handle.read(CHUNK_SIZE):
            hasher.update(block)
            size += len(block)
    return hasher.hexdigest(), size


def _source_error(message: str, **metadata: str) -> OpenTinkerError:
    return OpenTinkerError(grpc.StatusCode.INVALID_ARGUMENT, message, "INVALID_ARTIFACT_SOURCE", metadata)


def _scan_directory(directory: Path) -> list[_LocalFile]:
    """Every regular file under ``directory``, sorted by relative POSIX path, with its size and sha256.

    Symlinks and special files are refused rather than skipped or followed: following could upload data
    from outside the directory, skipping would silently publish an incomplete adapter (the registry's own
    commit_dir makes the same choice).
    """
    if not directory.is_dir():
        raise _source_error(f"{directory} is not a directory", source=str(directory))
    found: list[tuple[str, Path]] = []

    def fail(error: OSError) -> None:
        raise error  # os.walk skips unreadable directories silently otherwise

    for dirpath, dirnames, filenames in os.walk(directory, onerror=fail):
        base = Path(dirpath)
        rel_dir = base.relative_to(directory).as_posix()
        prefix = "" if rel_dir == "." else rel_dir + "/"
        for name in (*dirnames, *filenames):
            full = base / name
            mode = full.lstat().st_mode
            if stat.S_ISDIR(mode):
                continue  # os.walk descends into it (symlinked directories are not S_ISDIR under lstat)
            if not stat.S_ISREG(mode):
                raise _source_error(
                    f"{full} is a symlink or special file; only regular files can be uploaded",
                    path=prefix + name,
                )
            found.append((prefix + name, full))
    found.sort()
    files = []
    for rel, full in found:
        sha, size = _hash_file(full)
        files.append(_LocalFile(rel, full, size, sha))
    return files


def _upload_requests(files: list[_LocalFile]) -> Iterator[registry_pb2.UploadArtifactRequest]:
    """The manifest, then the files' bytes back to back in manifest order, in chunks of CHUNK_SIZE.

    Chunks may span file boundaries (the server splits by the declared sizes): many small files then
    cost few messages. Exactly the declared number of bytes is read from each file, so a file that grew
    after hashing cannot shift the next file's bytes; the server re-hashes everything it receives.
    """
    headers = [registry_pb2.ArtifactFileHeader(path=f.rel, size_bytes=f.size, sha256=f.sha256) for f in files]
    yield registry_pb2.UploadArtifactRequest(manifest=registry_pb2.ArtifactManifest(files=headers))
    buffer = bytearray()
    for entry in files:
        remaining = entry.size
        with entry.path.open("rb") as handle:
            while remaining:
                block = handle.read(min(CHUNK_SIZE, remaining))
                if not block:
                    raise OpenTinkerError(
                        grpc.StatusCode.DATA_LOSS,
                        f"{entry.path} shrank while uploading",
                        "DIGEST_MISMATCH",
                        {"path": entry.rel},
                    )
                remaining -= len(block)
                buffer += block
                while len(buffer) >= CHUNK_SIZE:
                    yield registry_pb2.UploadArtifactRequest(chunk=bytes(buffer[:CHUNK_SIZE]))
                    del buffer[:CHUNK_SIZE]
    if buffer:
        yield registry_pb2.UploadArtifactRequest(chunk=bytes(buffer))


def _manifest_bytes(headers: Iterable[registry_pb2.ArtifactFileHeader]) -> bytes:
    """The registry's canonical manifest.json (see opentinker.registry.artifacts): its sha256 is the
    artifact digest, so recomputing it proves the streamed manifest is the one the URI names."""
    entries = sorted(
        ({"path": h.path, "sha256": h.sha256, "size": h.size_bytes} for h in headers),
        key=lambda entry: str(entry["path"]),
    )
    document = {"files": entries, "format": _MANIFEST_FORMAT}
    return (json.dumps(document, sort_keys=True, separators=(",", ":"), ensure_ascii=True) + "\n").encode()


def _data_loss(message: str, **metadata: str) -> OpenTinkerError:
    return OpenTinkerError(grpc.StatusCode.DATA_LOSS, message, "DIGEST_MISMATCH", metadata)


def _safe_target(directory: Path, rel: str) -> Path:
    """``directory / rel`` for a relative POSIX path that cannot escape ``directory``."""
    parts = rel.split("/")
    if not rel or rel.startswith("/") or "\\" in rel or "\0" in rel or any(p in ("", ".", "..") for p in parts):
        raise _data_loss(f"artifact manifest names an unsafe path {rel!r}", path=rel)
    return directory.joinpath(*PurePosixPath(rel).parts)


class _DownloadSink:
    """Writes the streamed bytes into files in manifest order, verifying each file's size and sha256.

    Each file is written to a temporary name next to its target and renamed into place only once its
    digest checks out, so a mismatch never leaves a wrong file under the real name.
    """

    def __init__(self, directory: Path, headers: list[registry_pb2.ArtifactFileHeader]) -> None:
        self._directory = directory
        self._headers = headers
        self._targets = [_safe_target(directory, h.path) for h in headers]
        self._index = -1
        self._handle: BinaryIO | None = None
        self._temp: Path | None = None
        self._hasher = hashlib.sha256()
        self._remaining = 0

    def feed(self, data: bytes) -> None:
        view = memoryview(data)
        while view.nbytes:
            if self._handle is None:
                self._open_next_nonempty()
            handle = self._handle
            assert handle is not None
            take = min(self._remaining, view.nbytes)
            handle.write(view[:take])
            self._hasher.update(view[:take])
            self._remaining -= take
            view = view[take:]
            if self._remaining == 0:
                self._finish_current()

    def close(self) -> None:
        """Completes trailing empty files; every declared byte must have arrived."""
        if self._handle is not None:
            path = self._headers[self._index].path
            raise _data_loss(f"download ended inside {path!r}", path=path)
        for index in range(self._index + 1, len(self._headers)):
            header = self._headers[index]
            if header.size_bytes:
                raise _data_loss(f"download ended before {header.path!r}", path=header.path)
            self._index = index
            self._open(index)
            self._finish_current()

    def abort(self) -> None:
        if self._handle is not None:
            self._handle.close()
            self._handle = None
        if self._temp is not None:
            self._temp.unlink(missing_ok=True)
            self._temp = None

    def _open_next_nonempty(self) -> None:
        # Zero-length files carry no bytes in the stream: complete them as we pass them.
        while True:
            self._index += 1
            if self._index >= len(self._headers):
                raise _data_loss("the server sent more bytes than its manifest declares")
            self._open(self._index)
            if self._remaining:
                return
            self._finish_current()

    def _open(self, index: int) -> None:
        target = self._targets[index]
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, temp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".partial", dir=target.parent)
        self._handle = os.fdopen(fd, "wb")
        self._temp = Path(temp)
        self._hasher = hashlib.sha256()
        self._remaining = self._headers[index].size_bytes

    def _finish_current(self) -> None:
        header = self._headers[self._index]
        assert self._handle is not None and self._temp is not None
        self._handle.close()
        self._handle = None
        actual = self._hasher.hexdigest()
        if actual != header.sha256:
            raise _data_loss(
                f"{header.path!r} hashes to {actual}, the manifest says {header.sha256}",
                path=header.path,
                expected_sha256=header.sha256,
                actual_sha256=actual,
            )
        os.replace(self._temp, self._targets[self._index])
        self._temp = None


# The client


class RegistryClient:
    """Synchronous client of one registry server over one gRPC channel. Thread-safe (gRPC channels are).

    ``token`` is sent as ``authorization: Bearer <token>`` on every call. ``timeout`` (seconds, None for
    none) bounds each unary call; the streaming calls (watch_events, upload_artifact, download_artifact)
    run without a deadline because their length depends on the data, not on the server's health.
    Use as a context manager, or call close().
    """

    def __init__(
        self, addr: str, token: str | None = None, *, timeout: float | None = 30.0, ca_cert: Path | None = None
    ) -> None:
        self.address = addr
        self.timeout = timeout
        self._metadata: tuple[tuple[str, str], ...] = (("authorization", f"Bearer {token}"),) if token else ()
        # ca_cert: PEM root certificates; TLS verified against them instead of plaintext.
        self._channel = open_channel(addr, ca_cert, [("grpc.max_receive_message_length", _MAX_RECEIVE_BYTES)])
        self._stub = registry_pb2_grpc.RegistryServiceStub(self._channel)

    def close(self) -> None:
        """Closes the channel; in-flight calls and open watch_events streams are cancelled."""
        self._channel.close()

    def __enter__(self) -> RegistryClient:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def _unary(self, method: Callable[..., object], request: Message, response_type: type[_M]) -> _M:
        with translated():
            response = method(request, timeout=self.timeout, metadata=self._metadata)
        # The generated stubs are untyped; checking the type here keeps the rest of the module typed.
        if not isinstance(response, response_type):
            raise TypeError(f"expected {response_type.__name__}, got {type(response).__name__}")
        return response

    # Adapters

    def create_adapter(
        self,
        name: str,
        *,
        rank: int = 32,
        alpha: float | None = None,
        dropout: float = 0.0,
        target_modules: Iterable[str] = ("all-linear",),
        base_model_digest: str = "",
        labels: Mapping[str, str] | None = None,
        description: str = "",
    ) -> Adapter:
        """Registers an adapter name (ALREADY_EXISTS if taken). alpha None means alpha = rank."""
        targets = _strings(target_modules, "target_modules")
        if targets == [_ALL_LINEAR]:
            # The contract spells "all-linear" as an empty list, and the server's module-name check
            # rejects the literal (a "-" is not valid in a module name): send the empty form.
            targets = []
        request = registry_pb2.CreateAdapterRequest(
            name=name,
            lora_config=common_pb2.LoraConfig(
                rank=rank,
                alpha=alpha or 0.0,  # 0 asks the server for its default (alpha = rank)
                dropout=dropout,
                target_modules=targets,
            ),
            base_model_digest=base_model_digest,
            labels=dict(labels or {}),
            description=description,
        )
        response = self._unary(self._stub.CreateAdapter, request, registry_pb2.CreateAdapterResponse)
        return dataclasses.replace(_adapter(response.adapter), event_id=response.event_id)

    def get_adapter(self, name: str) -> Adapter:
        request = registry_pb2.GetAdapterRequest(name=name)
        return _adapter(self._unary(self._stub.GetAdapter, request, registry_pb2.GetAdapterResponse).adapter)

    def list_adapters(self, prefix: str = "") -> list[Adapter]:
        """Every visible adapter whose name starts with ``prefix``, ordered by name (all pages)."""
        adapters: list[Adapter] = []
        token = ""
        while True:
            request = registry_pb2.ListAdaptersRequest(prefix=prefix, page_size=_PAGE_SIZE, page_token=token)
            response = self._unary(self._stub.ListAdapters, request, registry_pb2.ListAdaptersResponse)
            adapters.extend(_adapter(a) for a in response.adapters)
            token = response.next_page_token
            if not token:
                return adapters

    def delete_adapter(self, name: str) -> str:
        """Deletes the adapter and its aliases (admin only; versions stay until garbage collection).
        Returns the event id."""
        request = registry_pb2.DeleteAdapterRequest(name=name)
        return self._unary(self._stub.DeleteAdapter, request, registry_pb2.DeleteAdapterResponse).event_id

    # Versions

    def publish_version(
        self,
        adapter: str,
        artifact_uri: str | ArtifactInfo,
        sha256: str = "",
        *,
        size_bytes: int = 0,
        lineage: Lineage | None = None,
        aliases: Iterable[str] = (),
        skip_latest: bool = False,
        request_id: str = "",
        expected_latest_version: int | None = None,
        lora: LoraConfig | None = None,
    ) -> Version:
        """Publishes an uploaded artifact as the adapter's next version and moves "latest" (unless
        skip_latest) plus ``aliases`` to it. ``artifact_uri`` may be the ArtifactInfo upload_artifact
        returned. A retry with the same ``request_id`` returns the first result and creates nothing.
        ``lora``: the version's LoRA shape when it differs from the adapter's (None: the adapter's)."""
        if isinstance(artifact_uri, ArtifactInfo):
            sha256 = sha256 or artifact_uri.sha256
            size_bytes = size_bytes or artifact_uri.size_bytes
            artifact_uri = artifact_uri.uri
        request = registry_pb2.PublishVersionRequest(
            adapter=adapter,
            artifact_uri=artifact_uri,
            artifact_sha256=sha256,
            artifact_size_bytes=size_bytes,
            lineage=_lineage_proto(lineage) if lineage is not None else None,
            aliases=_strings(aliases, "aliases"),
            skip_latest=skip_latest,
            request_id=request_id,
            expected_latest_version=expected_latest_version,  # None leaves it unset: no compare-and-set
            lora_config=lora_config_to_proto(lora) if lora is not None else None,
        )
        response = self._unary(self._stub.PublishVersion, request, registry_pb2.PublishVersionResponse)
        return _version(response.version)

    def get_version(self, adapter: str, number: int) -> Version:
        request = registry_pb2.GetVersionRequest(adapter=adapter, version=number)
        return _version(self._unary(self._stub.GetVersion, request, registry_pb2.GetVersionResponse).version)

    def list_versions(self, adapter: str, limit: int | None = None) -> list[Version]:
        """Every version of the adapter (the newest ``limit`` of them, if given), newest first."""
        if limit is not None and limit < 1:
            raise ValueError(f"limit must be at least 1, got {limit}")
        versions: list[Version] = []
        token = ""
        while True:
            size = _PAGE_SIZE if limit is None else min(_PAGE_SIZE, limit - len(versions))
            request = registry_pb2.ListVersionsRequest(adapter=adapter, page_size=size, page_token=token)
            response = self._unary(self._stub.ListVersions, request, registry_pb2.ListVersionsResponse)
            versions.extend(_version(v) for v in response.versions)
            token = response.next_page_token
            if not token or (limit is not None and len(versions) >= limit):
                return versions

    def resolve(self, ref: str) -> Version:
        """The exact version a reference names: "name" (= name@latest), "name@alias" or "name@N"."""
        request = registry_pb2.ResolveRequest(reference=ref)
        return _version(self._unary(self._stub.Resolve, request, registry_pb2.ResolveResponse).version)

    # Aliases

    def set_alias(self, adapter: str, alias: str, version: int, expected_version: int | None = None) -> AliasMove:
        """Points ``alias`` at ``version``. With ``expected_version`` it is a compare-and-set: the alias must
        point there now (0: must not exist), else FAILED_PRECONDITION / VERSION_CONFLICT."""
        request = registry_pb2.SetAliasRequest(
            adapter=adapter, alias=alias, version=version, expected_version=expected_version
        )
        response = self._unary(self._stub.SetAlias, request, registry_pb2.SetAliasResponse)
        return AliasMove(adapter, alias, response.previous_version, response.version, response.event_id)

    def delete_alias(self, adapter: str, alias: str, expected_version: int | None = None) -> int:
        """Removes an alias ("latest" cannot be removed); returns the version it pointed to."""
        return self.delete_alias_move(adapter, alias, expected_version).previous_version

    def delete_alias_move(self, adapter: str, alias: str, expected_version: int | None = None) -> AliasMove:
        """delete_alias, returning the move (version 0: the alias is gone) with its event id."""
        request = registry_pb2.DeleteAliasRequest(adapter=adapter, alias=alias, expected_version=expected_version)
        response = self._unary(self._stub.DeleteAlias, request, registry_pb2.DeleteAliasResponse)
        return AliasMove(adapter, alias, response.previous_version, 0, response.event_id)

    def rollback(
        self,
        adapter: str,
        alias: str = "latest",
        to_version: int | None = None,
        *,
        expected_version: int | None = None,
    ) -> AliasMove:
        """Moves ``alias`` back: to ``to_version``, or (None) to where it pointed before its last move."""
        request = registry_pb2.RollbackRequest(
            adapter=adapter, alias=alias, to_version=to_version, expected_version=expected_version
        )
        response = self._unary(self._stub.Rollback, request, registry_pb2.RollbackResponse)
        return AliasMove(adapter, response.alias, response.from_version, response.to_version, response.event_id)

    def get_lineage(self, ref: str, max_depth: int = 0) -> list[Version]:
        """The referenced version, then its parent, back to the first version (max_depth 0: all of them)."""
        request = registry_pb2.GetLineageRequest(reference=ref, max_depth=max_depth)
        response = self._unary(self._stub.GetLineage, request, registry_pb2.GetLineageResponse)
        return [_version(v) for v in response.chain]

    # Events

    def watch_events(
        self, after_id: str | None = None, adapters: Iterable[str] = (), send_snapshot: bool = False
    ) -> Generator[Event | Reconcile, None, None]:
        """Streams registry changes as they happen, forever (until closed or the server goes away).

        ``after_id``: resume after this event id; None: only events from now on; "0": from the oldest
        retained event. ``adapters``: only these names ("tenant/*" matches a tenant); empty: all visible.
        ``send_snapshot``: start with a Reconcile holding every alias map. A Reconcile also comes first,
        unasked, when ``after_id`` was trimmed from the log: replace local state with it, never assume
        no gap.

        This is a generator: the RPC starts at the first ``next()`` (errors surface there), and closing
        the generator (``gen.close()``, leaving a ``with contextlib.closing(gen)`` block, or garbage
        collection) cancels the server stream. Closing the client ends it too: the next ``next()``
        raises OpenTinkerError with code CANCELLED.
        """
        request = registry_pb2.WatchEventsRequest(
            after_event_id=after_id or "",
            adapters=_strings(adapters, "adapters"),
            send_snapshot=send_snapshot,
        )
        with translated():
            # No deadline: a watch is meant to stay open.
            call = self._stub.WatchEvents(request, metadata=self._metadata)
        try:
            with translated():
                for message in call:
                    kind = message.WhichOneof("message")
                    if kind == "event":
                        yield _event(message.event)
                    elif kind == "reconcile":
                        yield _reconcile(message.reconcile)
                    # Anything else is a message kind newer than this SDK: skip it.
        finally:
            # Runs on close() too (GeneratorExit at the yield): stop the server stream instead of leaking it.
            call.cancel()

    # Garbage collection and artifacts

    def garbage_collect(self, keep_last: int = 5, adapter: str = "", dry_run: bool = False) -> GarbageCollection:
        """Deletes artifacts of versions beyond the newest ``keep_last`` of each adapter (aliased versions are
        always kept). Admin only. With dry_run, reports what would go and deletes nothing."""
        request = registry_pb2.GarbageCollectRequest(keep_last=keep_last, adapter=adapter, dry_run=dry_run)
        response = self._unary(self._stub.GarbageCollect, request, registry_pb2.GarbageCollectResponse)
        return GarbageCollection(
            collected=tuple((c.adapter, c.version) for c in response.collected),
            bytes_freed=response.bytes_freed,
            artifacts=tuple(
                ArtifactInfo(_URI_PREFIX + c.artifact_sha256, c.artifact_sha256, c.size_bytes)
                for c in response.collected
            ),
        )

    def upload_artifact(self, directory: Path) -> ArtifactInfo:
        """Uploads every regular file under ``directory`` (recursively; paths relative, "/"-separated) as
        one content-addressed artifact. Equal content gives an equal sha256, so uploading twice is cheap
        to publish and stores nothing new. Symlinks and special files are refused (INVALID_ARGUMENT)."""
        files = _scan_directory(Path(directory))
        # gRPC runs the request iterator on its own thread and turns an exception there into a bare
        # UNKNOWN status ("Exception iterating requests!"); keep the exception so the caller sees the
        # real cause (a file that vanished or shrank, a permission error).
        failure: list[BaseException] = []

        def requests() -> Iterator[registry_pb2.UploadArtifactRequest]:
            try:
                yield from _upload_requests(files)
            except Exception as exc:
                failure.append(exc)
                raise

        try:
            response = self._stub.UploadArtifact(requests(), metadata=self._metadata)
        except grpc.RpcError as err:
            if failure:
                raise failure[0] from err
            raise from_rpc_error(err) from err
        if not isinstance(response, registry_pb2.UploadArtifactResponse):
            raise TypeError(f"expected UploadArtifactResponse, got {type(response).__name__}")
        return ArtifactInfo(response.artifact_uri, response.artifact_sha256, response.artifact_size_bytes)

    def download_artifact(self, artifact_uri: str, directory: Path) -> ArtifactInfo:
        """Writes the artifact's files under ``directory`` (created if needed; same-named files are
        replaced). The streamed manifest is checked against the URI's digest and every file against the
        manifest's size and sha256; any mismatch raises OpenTinkerError(DATA_LOSS, "DIGEST_MISMATCH")
        and leaves no file with wrong content under its real name."""
        directory = Path(directory)
        request = registry_pb2.DownloadArtifactRequest(artifact_uri=artifact_uri)
        with translated():
            call = self._stub.DownloadArtifact(request, metadata=self._metadata)
        sink: _DownloadSink | None = None
        try:
            with translated():
                messages = iter(call)
                first = next(messages, None)
                if first is None or first.WhichOneof("message") != "manifest":
                    raise _data_loss(f"download of {artifact_uri} did not start with a manifest")
                headers = list(first.manifest.files)
                manifest = _manifest_bytes(headers)
                digest = hashlib.sha256(manifest).hexdigest()
                requested = artifact_uri.removeprefix(_URI_PREFIX).lower()
                if digest != requested:
                    raise _data_loss(
                        f"the streamed manifest hashes to {digest}, not the requested {requested}",
                        expected_sha256=requested,
                        actual_sha256=digest,
                    )
                directory.mkdir(parents=True, exist_ok=True)
                sink = _DownloadSink(directory, headers)
                for message in messages:
                    if message.WhichOneof("message") != "chunk":
                        raise _data_loss(f"download of {artifact_uri} sent a second manifest")
                    sink.feed(message.chunk)
                sink.close()
            size = sum(h.size_bytes for h in headers) + len(manifest)
            return ArtifactInfo(_URI_PREFIX + digest, digest, size)
        except BaseException:
            if sink is not None:
                sink.abort()
            raise
        finally:
            # Stops the server stream when we bail out early; a no-op once the stream has ended.
            call.cancel()

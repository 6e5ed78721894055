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
from collections.abc import Generator, Iterable, Mapping
from pathlib import Path
from types import TracebackType
from typing import Final

from opentinker.client import registry_transfer
from opentinker.client.connection import Connection, translated
from opentinker.client.fleet_types import Replica, ReplicaChange, ReplicaRole
from opentinker.client.fleet_wire import change_from_proto, replica_from_proto, role_to_proto
from opentinker.client.registry_types import (
    Adapter,
    AliasMove,
    ArtifactInfo,
    BatchRecord,
    Event,
    GarbageCollection,
    Lineage,
    Reconcile,
    ServingAliasMove,
    Version,
)
from opentinker.client.registry_wire import (
    adapter_from_proto,
    event_from_proto,
    lineage_to_proto,
    reconcile_from_proto,
    version_from_proto,
)
from opentinker.client.training_types import LoraConfig
from opentinker.client.wire import lora_config_to_proto
from opentinker.v1 import common_pb2, registry_pb2, registry_pb2_grpc
from opentinker.weights.artifact_manifest import URI_PREFIX

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
    "Replica",
    "ReplicaChange",
    "ServingAliasMove",
    "Version",
]

CHUNK_SIZE: Final = registry_transfer.CHUNK_SIZE
# Versions carry their lineage (every batch record): pages this small stay well under the 64 MiB receive cap
# (rpc/serving/channel.py) while still needing few round trips.
_PAGE_SIZE: Final = 100
_ALL_LINEAR: Final = "all-linear"


def _strings(values: Iterable[str], what: str) -> list[str]:
    # A bare string is iterable too; ("stable") instead of ("stable",) would otherwise become 6 aliases.
    if isinstance(values, str):
        raise TypeError(f"{what} must be a sequence of strings, not a single string")
    return list(values)


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
        # ca_cert: PEM root certificates; TLS verified against them instead of plaintext.
        self._connection = Connection(
            addr, registry_pb2_grpc.RegistryServiceStub, token, timeout=timeout, ca_cert=ca_cert
        )
        self._stub = self._connection.stub

    @property
    def timeout(self) -> float | None:
        return self._connection.timeout

    @timeout.setter
    def timeout(self, value: float | None) -> None:
        self._connection.timeout = value

    def close(self) -> None:
        """Closes the channel; in-flight calls and open watch_events streams are cancelled."""
        self._connection.close()

    def __enter__(self) -> RegistryClient:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

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
        response = self._connection.unary("CreateAdapter", request, registry_pb2.CreateAdapterResponse)
        return dataclasses.replace(adapter_from_proto(response.adapter), event_id=response.event_id)

    def get_adapter(self, name: str) -> Adapter:
        request = registry_pb2.GetAdapterRequest(name=name)
        return adapter_from_proto(
            self._connection.unary("GetAdapter", request, registry_pb2.GetAdapterResponse).adapter
        )

    def list_adapters(self, prefix: str = "") -> list[Adapter]:
        """Every visible adapter whose name starts with ``prefix``, ordered by name (all pages)."""
        adapters: list[Adapter] = []
        token = ""
        while True:
            request = registry_pb2.ListAdaptersRequest(prefix=prefix, page_size=_PAGE_SIZE, page_token=token)
            response = self._connection.unary("ListAdapters", request, registry_pb2.ListAdaptersResponse)
            adapters.extend(adapter_from_proto(a) for a in response.adapters)
            token = response.next_page_token
            if not token:
                return adapters

    def delete_adapter(self, name: str) -> str:
        """Deletes the adapter and its aliases (its own tenant or an admin; versions stay until garbage collection).
        Returns the event id."""
        request = registry_pb2.DeleteAdapterRequest(name=name)
        return self._connection.unary("DeleteAdapter", request, registry_pb2.DeleteAdapterResponse).event_id

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
            lineage=lineage_to_proto(lineage) if lineage is not None else None,
            aliases=_strings(aliases, "aliases"),
            skip_latest=skip_latest,
            request_id=request_id,
            expected_latest_version=expected_latest_version,  # None leaves it unset: no compare-and-set
            lora_config=lora_config_to_proto(lora) if lora is not None else None,
        )
        response = self._connection.unary("PublishVersion", request, registry_pb2.PublishVersionResponse)
        return version_from_proto(response.version)

    def get_version(self, adapter: str, number: int) -> Version:
        request = registry_pb2.GetVersionRequest(adapter=adapter, version=number)
        return version_from_proto(
            self._connection.unary("GetVersion", request, registry_pb2.GetVersionResponse).version
        )

    def list_versions(self, adapter: str, limit: int | None = None) -> list[Version]:
        """Every version of the adapter (the newest ``limit`` of them, if given), newest first."""
        if limit is not None and limit < 1:
            raise ValueError(f"limit must be at least 1, got {limit}")
        versions: list[Version] = []
        token = ""
        while True:
            size = _PAGE_SIZE if limit is None else min(_PAGE_SIZE, limit - len(versions))
            request = registry_pb2.ListVersionsRequest(adapter=adapter, page_size=size, page_token=token)
            response = self._connection.unary("ListVersions", request, registry_pb2.ListVersionsResponse)
            versions.extend(version_from_proto(v) for v in response.versions)
            token = response.next_page_token
            if not token or (limit is not None and len(versions) >= limit):
                return versions

    def resolve(self, ref: str) -> Version:
        """The exact version a reference names: "name" (= name@<its serving alias>, latest unless set),
        "name@alias" or "name@N"."""
        request = registry_pb2.ResolveRequest(reference=ref)
        return version_from_proto(self._connection.unary("Resolve", request, registry_pb2.ResolveResponse).version)

    # Aliases

    def set_alias(self, adapter: str, alias: str, version: int, expected_version: int | None = None) -> AliasMove:
        """Points ``alias`` at ``version``. With ``expected_version`` it is a compare-and-set: the alias must
        point there now (0: must not exist), else FAILED_PRECONDITION / VERSION_CONFLICT."""
        request = registry_pb2.SetAliasRequest(
            adapter=adapter, alias=alias, version=version, expected_version=expected_version
        )
        response = self._connection.unary("SetAlias", request, registry_pb2.SetAliasResponse)
        return AliasMove(adapter, alias, response.previous_version, response.version, response.event_id)

    def delete_alias(self, adapter: str, alias: str, expected_version: int | None = None) -> int:
        """Removes an alias ("latest" cannot be removed); returns the version it pointed to."""
        return self.delete_alias_move(adapter, alias, expected_version).previous_version

    def delete_alias_move(self, adapter: str, alias: str, expected_version: int | None = None) -> AliasMove:
        """delete_alias, returning the move (version 0: the alias is gone) with its event id."""
        request = registry_pb2.DeleteAliasRequest(adapter=adapter, alias=alias, expected_version=expected_version)
        response = self._connection.unary("DeleteAlias", request, registry_pb2.DeleteAliasResponse)
        return AliasMove(adapter, alias, response.previous_version, 0, response.event_id)

    def set_serving_alias(self, adapter: str, alias: str) -> ServingAliasMove:
        """Makes bare ``adapter`` (no "@") resolve to ``alias`` for every client and sampler ("latest" restores
        the default): serve ``stable`` and a rollback of stable sticks while training keeps moving latest."""
        request = registry_pb2.SetServingAliasRequest(adapter=adapter, alias=alias)
        response = self._connection.unary("SetServingAlias", request, registry_pb2.SetServingAliasResponse)
        return ServingAliasMove(adapter, response.previous_alias, response.alias, response.version, response.event_id)

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
        response = self._connection.unary("Rollback", request, registry_pb2.RollbackResponse)
        return AliasMove(adapter, response.alias, response.from_version, response.to_version, response.event_id)

    def get_lineage(self, ref: str, max_depth: int = 0) -> list[Version]:
        """The referenced version, then its parent, back to the first version (max_depth 0: all of them)."""
        request = registry_pb2.GetLineageRequest(reference=ref, max_depth=max_depth)
        response = self._connection.unary("GetLineage", request, registry_pb2.GetLineageResponse)
        return [version_from_proto(v) for v in response.chain]

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
            call = self._stub.WatchEvents(request, metadata=self._connection.metadata)
        try:
            with translated():
                for message in call:
                    kind = message.WhichOneof("message")
                    if kind == "event":
                        yield event_from_proto(message.event)
                    elif kind == "reconcile":
                        yield reconcile_from_proto(message.reconcile)
                    # Anything else is a message kind newer than this SDK: skip it.
        finally:
            # Runs on close() too (GeneratorExit at the yield): stop the server stream instead of leaking it.
            call.cancel()

    # The fleet

    def list_replicas(self, role: ReplicaRole | None = None) -> list[Replica]:
        """The live replicas (samplers and trainers that registered and keep beating), by id; ``role``: only
        those. A user token sees only its own tenant's adapters among each replica's resident versions."""
        request = registry_pb2.ListReplicasRequest(role=role_to_proto(role))
        with translated():
            response = self._stub.ListReplicas(request, timeout=self.timeout, metadata=self._connection.metadata)
        return [replica_from_proto(r) for r in response.replicas]

    def watch_replicas(
        self, role: ReplicaRole | None = None, include_load: bool = False
    ) -> Generator[ReplicaChange, None, None]:
        """The fleet as it changes: first a snapshot of every live replica, then each join, leave and state
        change (and, with ``include_load``, each new load report). A generator like watch_events: the RPC
        starts at the first ``next()``, and closing the generator cancels it."""
        request = registry_pb2.WatchReplicasRequest(role=role_to_proto(role), include_load=include_load)
        with translated():
            call = self._stub.WatchReplicas(request, metadata=self._connection.metadata)
        try:
            with translated():
                for message in call:
                    yield change_from_proto(message)
        finally:
            call.cancel()

    # Garbage collection and artifacts

    def garbage_collect(
        self, keep_last: int = 5, adapter: str = "", dry_run: bool = False, grace_s: float | None = None
    ) -> GarbageCollection:
        """Deletes artifacts of versions beyond the newest ``keep_last`` of each adapter (aliased versions are
        always kept). Admin only. With dry_run, reports what would go and deletes nothing. grace_s: how old an
        unpublished artifact must be to go (None: the registry's --gc-grace)."""
        request = registry_pb2.GarbageCollectRequest(
            keep_last=keep_last, adapter=adapter, dry_run=dry_run, grace_s=grace_s
        )
        response = self._connection.unary("GarbageCollect", request, registry_pb2.GarbageCollectResponse)
        return GarbageCollection(
            collected=tuple((c.adapter, c.version) for c in response.collected),
            bytes_freed=response.bytes_freed,
            artifacts=tuple(
                ArtifactInfo(URI_PREFIX + c.artifact_sha256, c.artifact_sha256, c.size_bytes)
                for c in response.collected
            ),
        )

    def upload_artifact(self, directory: Path) -> ArtifactInfo:
        """Uploads every regular file under ``directory`` (recursively; paths relative, "/"-separated) as
        one content-addressed artifact. Equal content gives an equal sha256, so uploading twice is cheap
        to publish and stores nothing new. Symlinks and special files are refused (INVALID_ARGUMENT)."""
        self._connection.check_open()
        return registry_transfer.upload_artifact(self._stub, directory, self._connection.metadata)

    def download_artifact(self, artifact_uri: str, directory: Path) -> ArtifactInfo:
        """Writes the artifact's files under ``directory`` (created if needed; same-named files are
        replaced). The streamed manifest is checked against the URI's digest and every file against the
        manifest's size and sha256; any mismatch raises OpenTinkerError(DATA_LOSS, "DIGEST_MISMATCH")
        and leaves no file with wrong content under its real name."""
        self._connection.check_open()
        return registry_transfer.download_artifact(self._stub, artifact_uri, directory, self._connection.metadata)

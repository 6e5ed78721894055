"""RegistryService against a real registry: serving alias, lineage, artifacts, deletion, Watch, GC."""

from __future__ import annotations

import threading

import grpc
import pytest
from registryrpcutil import Stub, assert_status, rpc_error
from registryutil import artifact_files, create_adapter, publish, unique_name, upload

from opentinker.v1 import registry_pb2


def test_serving_alias_is_what_a_bare_name_resolves_to(registry: Stub) -> None:
    name = unique_name()
    created = registry.CreateAdapter(registry_pb2.CreateAdapterRequest(name=name))
    publish(registry, name, aliases=("stable",))
    publish(registry, name)

    def bare() -> int:
        return int(registry.Resolve(registry_pb2.ResolveRequest(reference=name)).version.version)

    assert bare() == 2
    # Refused: an alias the adapter lacks, a bad alias, an unknown adapter; each changes nothing.
    for request, code, reason in (
        (
            registry_pb2.SetServingAliasRequest(adapter=name, alias="canary"),
            grpc.StatusCode.NOT_FOUND,
            "ALIAS_NOT_FOUND",
        ),
        (
            registry_pb2.SetServingAliasRequest(adapter=name, alias="7"),
            grpc.StatusCode.INVALID_ARGUMENT,
            "INVALID_ALIAS",
        ),
        (
            registry_pb2.SetServingAliasRequest(adapter=unique_name(), alias="stable"),
            grpc.StatusCode.NOT_FOUND,
            "ADAPTER_NOT_FOUND",
        ),
    ):
        assert_status(rpc_error(registry.SetServingAlias, request), code, reason)
    assert bare() == 2 and registry.GetAdapter(registry_pb2.GetAdapterRequest(name=name)).adapter.serving_alias == ""
    moved = registry.SetServingAlias(registry_pb2.SetServingAliasRequest(adapter=name, alias="stable"))
    assert (moved.previous_alias, moved.alias, moved.version) == ("latest", "stable", 1)
    assert registry.GetAdapter(registry_pb2.GetAdapterRequest(name=name)).adapter.serving_alias == "stable"
    publish(registry, name)  # training moves latest, not what bare names get
    assert bare() == 1
    assert registry.Resolve(registry_pb2.ResolveRequest(reference=f"{name}@latest")).version.version == 3
    registry.SetAlias(registry_pb2.SetAliasRequest(adapter=name, alias="stable", version=3))
    assert bare() == 3
    registry.Rollback(registry_pb2.RollbackRequest(adapter=name, alias="stable"))
    assert bare() == 1
    # The serving alias cannot be deleted while it serves.
    busy = registry_pb2.DeleteAliasRequest(adapter=name, alias="stable")
    error = rpc_error(registry.DeleteAlias, busy)
    assert_status(error, grpc.StatusCode.FAILED_PRECONDITION, "ALIAS_SERVING")
    assert "serve" in str(error.details()) and bare() == 1
    # Every event carries the serving alias; a snapshot too.
    stream = registry.WatchEvents(registry_pb2.WatchEventsRequest(after_event_id=created.event_id, adapters=[name]))
    events = [next(stream).event for _ in range(6)]
    stream.cancel()
    assert [(registry_pb2.EventType.Name(e.type).removeprefix("EVENT_TYPE_"), e.serving_alias) for e in events] == [
        ("VERSION_PUBLISHED", ""),
        ("VERSION_PUBLISHED", ""),
        ("SERVING_ALIAS_SET", "stable"),
        ("VERSION_PUBLISHED", "stable"),
        ("ALIAS_SET", "stable"),
        ("ALIAS_SET", "stable"),
    ]
    assert (events[2].alias, events[2].version, events[2].actor) == ("stable", 1, "local")
    watch = registry.WatchEvents(registry_pb2.WatchEventsRequest(adapters=[name], send_snapshot=True))
    snapshot = next(watch).reconcile
    watch.cancel()
    assert [(a.adapter, a.serving_alias) for a in snapshot.adapters] == [(name, "stable")]
    back = registry.SetServingAlias(registry_pb2.SetServingAliasRequest(adapter=name, alias="latest"))
    assert (back.previous_alias, back.alias, back.version) == ("stable", "latest", 3) and bare() == 3
    registry.DeleteAlias(busy)  # no longer serving: deletable
    # A deleted and re-created adapter starts over on latest.
    registry.SetAlias(registry_pb2.SetAliasRequest(adapter=name, alias="stable", version=2))
    registry.SetServingAlias(registry_pb2.SetServingAliasRequest(adapter=name, alias="stable"))
    registry.DeleteAdapter(registry_pb2.DeleteAdapterRequest(name=name))
    registry.CreateAdapter(registry_pb2.CreateAdapterRequest(name=name))
    assert registry.GetAdapter(registry_pb2.GetAdapterRequest(name=name)).adapter.serving_alias == ""


def test_lineage_chain_with_batches(registry: Stub) -> None:
    name = unique_name()
    create_adapter(registry, name)
    parent = 0
    for step in range(3):
        batch = registry_pb2.BatchRecord(digest=f"d{step}", trace_ids=[f"trace-{step}"], step=step + 1, num_tokens=10)
        lineage = registry_pb2.Lineage(
            parent_version=parent,
            trainer_step=step + 1,
            tokens_trained=10 * (step + 1),
            batches=[batch],
            metrics={"loss:mean": 1.0 / (step + 1)},
        )
        uri = upload(registry, artifact_files(step))
        response = registry.PublishVersion(
            registry_pb2.PublishVersionRequest(adapter=name, artifact_uri=uri, lineage=lineage)
        )
        parent = response.version.version
    chain = registry.GetLineage(registry_pb2.GetLineageRequest(reference=name)).chain
    assert [v.version for v in chain] == [3, 2, 1]
    assert [v.lineage.batches[0].trace_ids[0] for v in chain] == ["trace-2", "trace-1", "trace-0"]
    assert chain[0].lineage.metrics["loss:mean"] == pytest.approx(1 / 3)
    assert chain[0].published_by == "local" and chain[0].artifact_size_bytes > 0
    short = registry.GetLineage(registry_pb2.GetLineageRequest(reference=f"{name}@3", max_depth=2)).chain
    assert [v.version for v in short] == [3, 2]
    orphan = registry_pb2.PublishVersionRequest(
        adapter=name, artifact_uri=uri, lineage=registry_pb2.Lineage(parent_version=42)
    )
    assert_status(rpc_error(registry.PublishVersion, orphan), grpc.StatusCode.NOT_FOUND, "VERSION_NOT_FOUND")


def test_upload_download_round_trip_and_digest_mismatch(registry: Stub) -> None:
    files = artifact_files(99, size=3_000_000)  # several chunks, larger than one 1 MiB download chunk
    uri = upload(registry, files)
    messages = list(registry.DownloadArtifact(registry_pb2.DownloadArtifactRequest(artifact_uri=uri)))
    headers = messages[0].manifest.files
    data = b"".join(m.chunk for m in messages[1:])
    assert [h.path for h in headers] == sorted(files)
    assert data == b"".join(files[h.path] for h in headers)

    from registryutil import upload_requests

    def corrupted() -> object:
        for i, message in enumerate(upload_requests(artifact_files(100))):
            if i == 2:
                message.chunk = bytes([message.chunk[0] ^ 1]) + message.chunk[1:]
            yield message

    error = rpc_error(registry.UploadArtifact, corrupted())
    assert_status(error, grpc.StatusCode.DATA_LOSS, "DIGEST_MISMATCH")
    unknown = registry_pb2.DownloadArtifactRequest(artifact_uri="sha256:" + "cd" * 32)
    assert_status(
        rpc_error(lambda: list(registry.DownloadArtifact(unknown))),
        grpc.StatusCode.NOT_FOUND,
        "ARTIFACT_NOT_FOUND",
    )
    bad = registry_pb2.DownloadArtifactRequest(artifact_uri="md5:abc")
    assert_status(
        rpc_error(lambda: list(registry.DownloadArtifact(bad))),
        grpc.StatusCode.INVALID_ARGUMENT,
        "INVALID_ARTIFACT_URI",
    )


def test_delete_adapter_keeps_versions_for_lineage(registry: Stub) -> None:
    name = unique_name()
    create_adapter(registry, name)
    publish(registry, name)
    registry.DeleteAdapter(registry_pb2.DeleteAdapterRequest(name=name))
    error = rpc_error(registry.GetAdapter, registry_pb2.GetAdapterRequest(name=name))
    assert_status(error, grpc.StatusCode.NOT_FOUND, "ADAPTER_NOT_FOUND")
    # Re-creating the name continues its numbering: version numbers are never reused.
    create_adapter(registry, name)
    assert publish(registry, name).version.version == 2


def test_watch_resumes_from_event_id_with_absolute_state(registry: Stub) -> None:
    name = unique_name()
    created = registry.CreateAdapter(registry_pb2.CreateAdapterRequest(name=name))
    first = publish(registry, name)
    publish(registry, name, aliases=("stable",))
    registry.Rollback(registry_pb2.RollbackRequest(adapter=name))
    stream = registry.WatchEvents(registry_pb2.WatchEventsRequest(after_event_id=created.event_id, adapters=[name]))
    events = [next(stream).event for _ in range(3)]
    stream.cancel()
    assert [registry_pb2.EventType.Name(e.type) for e in events] == [
        "EVENT_TYPE_VERSION_PUBLISHED",
        "EVENT_TYPE_VERSION_PUBLISHED",
        "EVENT_TYPE_ALIAS_SET",
    ]
    assert events[0].event_id == first.event_id
    assert dict(events[0].aliases) == {"latest": 1}
    assert dict(events[1].aliases) == {"latest": 2, "stable": 2}
    assert (events[2].alias, events[2].previous_version, events[2].version, events[2].cause) == (
        "latest",
        2,
        1,
        "rollback",
    )
    assert dict(events[2].aliases) == {"latest": 1, "stable": 2}
    assert events[1].artifact_sha256 and events[0].actor == "local"


def test_watch_live_events_and_snapshot(registry: Stub) -> None:
    name = unique_name()
    create_adapter(registry, name)
    publish(registry, name)
    stream = registry.WatchEvents(registry_pb2.WatchEventsRequest(adapters=[name], send_snapshot=True))
    snapshot = next(stream).reconcile
    assert snapshot.reason == "requested"
    assert [(a.adapter, dict(a.aliases)) for a in snapshot.adapters] == [(name, {"latest": 1})]
    received: list[registry_pb2.Event] = []

    def read_one() -> None:
        received.append(next(stream).event)

    reader = threading.Thread(target=read_one)
    reader.start()
    publish(registry, name)
    reader.join(10)
    stream.cancel()
    assert received and received[0].version == 2 and dict(received[0].aliases) == {"latest": 2}


def test_watch_rejects_bad_ids_and_patterns(registry: Stub) -> None:
    for request in (
        registry_pb2.WatchEventsRequest(after_event_id="yesterday"),
        registry_pb2.WatchEventsRequest(adapters=["Bad Pattern"]),
    ):
        error = rpc_error(lambda r=request: next(registry.WatchEvents(r)))
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_garbage_collect_keeps_last_and_aliased(registry: Stub, registry_server: object) -> None:
    name = unique_name()
    create_adapter(registry, name)
    for i in range(6):
        publish(registry, name, seed=1000 + i, aliases=("stable",) if i == 0 else ())
    dry = registry.GarbageCollect(registry_pb2.GarbageCollectRequest(adapter=name, keep_last=2, dry_run=True))
    assert sorted(c.version for c in dry.collected) == [2, 3, 4]
    assert not registry.GetVersion(registry_pb2.GetVersionRequest(adapter=name, version=2)).version.artifact_deleted
    done = registry.GarbageCollect(registry_pb2.GarbageCollectRequest(adapter=name, keep_last=2))
    assert sorted(c.version for c in done.collected) == [2, 3, 4] and done.bytes_freed > 0
    v2 = registry.GetVersion(registry_pb2.GetVersionRequest(adapter=name, version=2)).version
    assert v2.artifact_deleted and v2.lineage.trainer_step == 1  # record and lineage stay
    gone = registry_pb2.DownloadArtifactRequest(artifact_uri=v2.artifact_uri)
    assert_status(
        rpc_error(lambda: list(registry.DownloadArtifact(gone))),
        grpc.StatusCode.NOT_FOUND,
        "ARTIFACT_NOT_FOUND",
    )
    kept = registry.GetVersion(registry_pb2.GetVersionRequest(adapter=name, version=1)).version
    assert not kept.artifact_deleted and list(kept.aliases) == ["stable"]
    back = registry_pb2.SetAliasRequest(adapter=name, alias="stable", version=3)
    assert_status(rpc_error(registry.SetAlias, back), grpc.StatusCode.FAILED_PRECONDITION, "ARTIFACT_DELETED")
    again = registry.GarbageCollect(registry_pb2.GarbageCollectRequest(adapter=name, keep_last=2))
    assert not again.collected


def test_shared_artifact_survives_until_last_user_collected(registry: Stub) -> None:
    a, b = unique_name(), unique_name()
    for name in (a, b):
        create_adapter(registry, name)
        publish(registry, name, seed=4242)
        publish(registry, name)
    registry.GarbageCollect(registry_pb2.GarbageCollectRequest(adapter=a, keep_last=1))
    shared = registry.GetVersion(registry_pb2.GetVersionRequest(adapter=b, version=1)).version
    assert (
        len(list(registry.DownloadArtifact(registry_pb2.DownloadArtifactRequest(artifact_uri=shared.artifact_uri)))) > 1
    )


def test_garbage_collect_refuses_a_grace_that_is_no_duration_and_keeps_uploads_at_grace_zero(registry: Stub) -> None:
    # NaN and infinity once reached int() in the sweep: INTERNAL to the client (found by the RPC fuzzer).
    for grace_s in (float("nan"), float("inf"), -1.0, 1e12):
        request = registry_pb2.GarbageCollectRequest(keep_last=2**32 - 1, grace_s=grace_s)
        assert_status(rpc_error(registry.GarbageCollect, request), grpc.StatusCode.INVALID_ARGUMENT, "INVALID_GRACE")
    uri = upload(registry, artifact_files(4343))  # never published
    # keep_last this high collects no version of the adapters other tests share this registry with.
    registry.GarbageCollect(registry_pb2.GarbageCollectRequest(keep_last=2**32 - 1, grace_s=0))
    kept = list(registry.DownloadArtifact(registry_pb2.DownloadArtifactRequest(artifact_uri=uri)))
    assert len(kept) > 1  # grace 0: no unpublished artifact is deleted, as the proto says

"""Registry guarantees that need their own processes: trimmed event logs, Redis restarts, tenancy,
corrupted artifacts, and nothing changed by rejected calls."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from registryrpcutil import assert_status, rpc_error
from registryutil import create_adapter, publish, unique_name
from serverproc import ServerProcess, start_registry

from opentinker.registry.embedded_redis import EmbeddedRedis
from opentinker.v1 import registry_pb2, registry_pb2_grpc

Stub = registry_pb2_grpc.RegistryServiceStub


def last_event_id(stub: Stub) -> str:
    stream = stub.WatchEvents(registry_pb2.WatchEventsRequest(send_snapshot=True))
    event_id: str = next(stream).reconcile.event_id
    stream.cancel()
    return event_id


def test_rejected_alias_move_consumes_nothing(registry: Stub) -> None:
    name = unique_name()
    create_adapter(registry, name)
    publish(registry, name)
    publish(registry, name)
    before = last_event_id(registry)
    stale = registry_pb2.SetAliasRequest(adapter=name, alias="latest", version=1, expected_version=1)
    assert_status(rpc_error(registry.SetAlias, stale), grpc.StatusCode.FAILED_PRECONDITION, "VERSION_CONFLICT")
    stale_publish = lambda: publish(registry, name, expected_latest_version=1)  # noqa: E731
    assert_status(rpc_error(stale_publish), grpc.StatusCode.FAILED_PRECONDITION, "VERSION_CONFLICT")
    assert last_event_id(registry) == before
    adapter = registry.GetAdapter(registry_pb2.GetAdapterRequest(name=name)).adapter
    assert adapter.version_count == 2 and dict(adapter.aliases) == {"latest": 2}
    assert publish(registry, name).version.version == 3


def test_disconnected_watcher_resumes_and_gets_all_five_in_order(registry: Stub) -> None:
    name = unique_name()
    create_adapter(registry, name)
    publish(registry, name)
    stream = registry.WatchEvents(
        registry_pb2.WatchEventsRequest(after_event_id="", adapters=[name], send_snapshot=True)
    )
    cursor = next(stream).reconcile.event_id
    got: list[registry_pb2.Event] = []
    reader = threading.Thread(target=lambda: got.append(next(stream).event))
    reader.start()
    publish(registry, name)
    reader.join(10)
    stream.cancel()  # the watcher goes away
    cursor = got[0].event_id
    for _ in range(5):
        publish(registry, name)
    resumed = registry.WatchEvents(registry_pb2.WatchEventsRequest(after_event_id=cursor, adapters=[name]))
    events = [next(resumed).event for _ in range(5)]
    resumed.cancel()
    assert [e.version for e in events] == [3, 4, 5, 6, 7]
    assert [e.event_id for e in events] == sorted(e.event_id for e in events)


def test_rollback_emits_event_and_lineage_keeps_chain(registry: Stub) -> None:
    name = unique_name()
    create_adapter(registry, name)
    parent = 0
    for _ in range(3):
        parent = publish(registry, name, parent=parent).version.version
    rolled = registry.Rollback(registry_pb2.RollbackRequest(adapter=name))
    stream = registry.WatchEvents(registry_pb2.WatchEventsRequest(after_event_id="0", adapters=[name]))
    events = [next(stream).event for _ in range(5)]  # created, 3 publishes, rollback
    stream.cancel()
    assert events[-1].event_id == rolled.event_id and events[-1].cause == "rollback"
    assert dict(events[-1].aliases) == {"latest": 2}
    chain = registry.GetLineage(registry_pb2.GetLineageRequest(reference=f"{name}@3")).chain
    assert [v.version for v in chain] == [3, 2, 1]


def test_empty_and_malformed_fields_get_precise_codes_and_server_stays_up(
    registry: Stub, registry_channel: grpc.Channel
) -> None:
    calls = [
        (registry.CreateAdapter, registry_pb2.CreateAdapterRequest(), "INVALID_ADAPTER_NAME"),
        (registry.GetAdapter, registry_pb2.GetAdapterRequest(), "INVALID_ADAPTER_NAME"),
        (registry.PublishVersion, registry_pb2.PublishVersionRequest(adapter="x"), "INVALID_ARTIFACT_URI"),
        (registry.GetVersion, registry_pb2.GetVersionRequest(adapter="x"), "INVALID_VERSION"),
        (registry.Resolve, registry_pb2.ResolveRequest(), "INVALID_ADAPTER_NAME"),
        (registry.SetAlias, registry_pb2.SetAliasRequest(adapter="x"), "INVALID_ALIAS"),
        (registry.SetAlias, registry_pb2.SetAliasRequest(adapter="x", alias="7", version=1), "INVALID_ALIAS"),
        (registry.GetLineage, registry_pb2.GetLineageRequest(reference="x@"), "INVALID_REFERENCE"),
        (registry.ListAdapters, registry_pb2.ListAdaptersRequest(page_size=5000), "INVALID_PAGE_SIZE"),
        (
            registry.CreateAdapter,
            registry_pb2.CreateAdapterRequest(
                name=unique_name(), lora_config={"rank": 4, "target_modules": ["q proj"]}
            ),
            "INVALID_LORA_CONFIG",
        ),
    ]
    for method, request, reason in calls:
        assert_status(rpc_error(method, request), grpc.StatusCode.INVALID_ARGUMENT, reason)
    health = health_pb2_grpc.HealthStub(registry_channel).Check(health_pb2.HealthCheckRequest())
    assert health.status == health_pb2.HealthCheckResponse.SERVING


def test_corrupted_artifact_is_data_loss(registry: Stub, registry_server: ServerProcess) -> None:
    name = unique_name()
    create_adapter(registry, name)
    version = publish(registry, name).version
    store = Path(registry_server.ready_file).parent / "artifacts" / "sha256" / version.artifact_sha256
    weights = store / "adapter_model.safetensors"
    data = bytearray(weights.read_bytes())
    data[100] ^= 0x10  # one flipped bit
    weights.write_bytes(bytes(data))
    request = registry_pb2.DownloadArtifactRequest(artifact_uri=version.artifact_uri)
    assert_status(
        rpc_error(lambda: list(registry.DownloadArtifact(request))),
        grpc.StatusCode.DATA_LOSS,
        "DIGEST_MISMATCH",
    )
    republish = registry_pb2.PublishVersionRequest(adapter=name, artifact_uri=version.artifact_uri)
    assert_status(rpc_error(registry.PublishVersion, republish), grpc.StatusCode.DATA_LOSS, "DIGEST_MISMATCH")
    weights.write_bytes(bytes(data[:500]))  # truncated
    assert_status(
        rpc_error(lambda: list(registry.DownloadArtifact(request))),
        grpc.StatusCode.DATA_LOSS,
        "DIGEST_MISMATCH",
    )
    assert registry.GetAdapter(registry_pb2.GetAdapterRequest(name=name)).adapter.version_count == 1


@pytest.fixture(scope="module")
def small_log_registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """Its own embedded Redis (the default when no --redis-url) and an event log of ~10 entries."""
    server = start_registry(tmp_path_factory.mktemp("small-log"), "--events-maxlen", "10")
    yield server
    assert server.terminate() == 0


def test_trimmed_event_id_gets_reconcile_with_full_alias_map(small_log_registry: ServerProcess) -> None:
    with grpc.insecure_channel(small_log_registry.address) as channel:
        stub = registry_pb2_grpc.RegistryServiceStub(channel)
        name = unique_name()
        first_id = stub.CreateAdapter(registry_pb2.CreateAdapterRequest(name=name)).event_id
        publish(stub, name)
        publish(stub, name, aliases=("stable",))
        for _ in range(300):  # enough alias moves to trim whole stream nodes (MAXLEN ~)
            stub.SetAlias(registry_pb2.SetAliasRequest(adapter=name, alias="canary", version=1))
        stream = stub.WatchEvents(registry_pb2.WatchEventsRequest(after_event_id=first_id))
        message = next(stream)
        assert message.HasField("reconcile")
        reconcile = message.reconcile
        assert reconcile.reason == "trimmed"
        aliases = {a.adapter: dict(a.aliases) for a in reconcile.adapters}
        assert aliases[name] == {"latest": 2, "stable": 2, "canary": 1}
        publisher = threading.Timer(0.3, lambda: publish(stub, name))
        publisher.start()
        after = next(stream).event  # live events continue after the reconcile
        publisher.join()
        stream.cancel()
        assert after.version == 3 and after.event_id > reconcile.event_id


def test_redis_restart_publish_unavailable_then_recovers(tmp_path: Path) -> None:
    redis_dir = tmp_path / "redis"
    redis_server = EmbeddedRedis(redis_dir).start()
    port = redis_server.port
    server = start_registry(tmp_path / "registry", "--redis-url", redis_server.url)
    try:
        with grpc.insecure_channel(server.address) as channel:
            stub = registry_pb2_grpc.RegistryServiceStub(channel)
            name = unique_name()
            create_adapter(stub, name)
            publish(stub, name)
            watch = stub.WatchEvents(registry_pb2.WatchEventsRequest(adapters=[name], send_snapshot=True))
            cursor = next(watch).reconcile.event_id
            redis_server.stop()
            error = rpc_error(lambda: publish(stub, name))
            assert_status(error, grpc.StatusCode.UNAVAILABLE, "STORE_UNAVAILABLE")
            # The open watch ends with UNAVAILABLE too; the watcher resumes from its cursor later.
            with pytest.raises(grpc.RpcError) as ended:
                next(watch)
            assert ended.value.code() == grpc.StatusCode.UNAVAILABLE
            redis_server = EmbeddedRedis(redis_dir, port=port).start()
            second = publish(stub, name).version
            assert second.version == 2  # nothing half-written by the failed publish
            resumed = stub.WatchEvents(registry_pb2.WatchEventsRequest(after_event_id=cursor, adapters=[name]))
            event = next(resumed).event
            resumed.cancel()
            assert event.version == 2 and event.type == registry_pb2.EVENT_TYPE_VERSION_PUBLISHED
    finally:
        server.terminate()
        redis_server.stop()


@pytest.fixture(scope="module")
def secured_registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    workdir = tmp_path_factory.mktemp("secured-registry")
    tokens = workdir / "tokens.json"
    tokens.write_text(
        json.dumps(
            {
                "tokens": [
                    {"token": "tok-a", "tenant": "team-a"},
                    {"token": "tok-b", "tenant": "team-b"},
                    {"token": "tok-admin", "tenant": "ops", "role": "admin"},
                ]
            }
        )
    )
    server = start_registry(workdir, "--tokens-file", str(tokens))
    yield server
    assert server.terminate() == 0


def test_tenant_isolation_and_admin_only_operations(secured_registry: ServerProcess) -> None:
    def md(token: str) -> list[tuple[str, str]]:
        return [("authorization", f"Bearer {token}")]

    a, b, admin = md("tok-a"), md("tok-b"), md("tok-admin")
    with grpc.insecure_channel(secured_registry.address) as channel:
        stub = registry_pb2_grpc.RegistryServiceStub(channel)
        assert_status(
            rpc_error(lambda: create_adapter(stub, "team-a/x")),
            grpc.StatusCode.UNAUTHENTICATED,
            "UNAUTHENTICATED",
        )
        mine = "team-a/" + unique_name()
        create_adapter(stub, mine, metadata=a)
        version = publish(stub, mine, metadata=a).version
        assert version.published_by == "team-a:user"
        theirs = "team-b/" + unique_name()
        create_adapter(stub, theirs, metadata=b)
        publish(stub, theirs, metadata=b)
        # Each tenant sees only its own adapters.
        listed_a = [x.name for x in stub.ListAdapters(registry_pb2.ListAdaptersRequest(), metadata=a).adapters]
        assert mine in listed_a and theirs not in listed_a
        listed_all = [x.name for x in stub.ListAdapters(registry_pb2.ListAdaptersRequest(), metadata=admin).adapters]
        assert {mine, theirs} <= set(listed_all)
        for call in (
            lambda: stub.GetAdapter(registry_pb2.GetAdapterRequest(name=theirs), metadata=a),
            lambda: stub.Resolve(registry_pb2.ResolveRequest(reference=theirs), metadata=a),
            lambda: stub.Rollback(registry_pb2.RollbackRequest(adapter=theirs), metadata=a),
            lambda: create_adapter(stub, "team-b/" + unique_name(), metadata=a),
            lambda: create_adapter(stub, unique_name(), metadata=a),
            lambda: stub.DeleteAdapter(registry_pb2.DeleteAdapterRequest(name=theirs), metadata=a),
            lambda: stub.GarbageCollect(registry_pb2.GarbageCollectRequest(), metadata=a),
        ):
            assert rpc_error(call).code() == grpc.StatusCode.PERMISSION_DENIED
        # Watchers only see their tenant's events.
        watch = stub.WatchEvents(registry_pb2.WatchEventsRequest(after_event_id="0", send_snapshot=True), metadata=a)
        snapshot = next(watch).reconcile
        assert {x.adapter for x in snapshot.adapters} == {mine}
        watch.cancel()
        # Artifacts are readable only through a version the caller can see.
        download = registry_pb2.DownloadArtifactRequest(artifact_uri=version.artifact_uri)
        assert len(list(stub.DownloadArtifact(download, metadata=a))) > 1
        assert rpc_error(lambda: list(stub.DownloadArtifact(download, metadata=b))).code() == (
            grpc.StatusCode.PERMISSION_DENIED
        )
        # The admin may do what tenants may not.
        stub.GarbageCollect(registry_pb2.GarbageCollectRequest(keep_last=5), metadata=admin)
        stub.DeleteAdapter(registry_pb2.DeleteAdapterRequest(name=theirs), metadata=admin)

"""Noisy neighbours at the registry: team-a abuses a shared resource while team-b runs its normal workload at
the same time, on one registry process (tokens on, its own Redis so the test can read INFO clients). team-b
gets 0 errors; team-a gets the precise status; the registry's memory after the abuse stays within a stated
bound of before. (Issue "Noisy neighbours", cases 2, 8, 9 and 11, and the registry's per-tenant bound on calls in
flight.)"""

from __future__ import annotations

import json
import re
import secrets
import threading
import time
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
import redis
from registryabuse import Registry, admin_cli, status_of, team_b, wait_until
from registryutil import artifact_files, create_adapter, publish, unique_name, upload, upload_requests
from serverproc import registry_store, start_registry
from tlsutil import write_tokens

from opentinker.registry.embedded_redis import EmbeddedRedis
from opentinker.v1 import registry_pb2, registry_pb2_grpc
from opentinker.weights.artifact_store import ArtifactStore

MAX_WATCHES = 16
MAX_CALLS = 24  # calls in flight per user tenant (above MAX_WATCHES: watch streams count as calls)
MAX_FILES = 64
QUOTA_MB = 2
GRACE_S = 4
MiB = 1 << 20


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Registry]:
    workdir = tmp_path_factory.mktemp("noisy-registry")
    tokens = {who: f"tok-{who}-{secrets.token_hex(8)}" for who in ("team-a", "team-b", "ops")}
    roles = {who: "admin" if who == "ops" else "user" for who in tokens}
    tokens_file = write_tokens(workdir / "tokens.json", {t: (who, roles[who]) for who, t in tokens.items()})
    redis_server = EmbeddedRedis(workdir / "redis", appendonly=False).start()
    server = start_registry(
        workdir / "registry",
        "--redis-url",
        redis_server.url,
        "--tokens-file",
        str(tokens_file),
        "--max-watches-per-tenant",
        str(MAX_WATCHES),
        "--max-artifact-files",
        str(MAX_FILES),
        "--tenant-storage-quota-mb",
        str(QUOTA_MB),
        "--upload-grace-s",
        str(GRACE_S),
        "--max-calls-per-tenant",
        str(MAX_CALLS),
    )
    channel = grpc.insecure_channel(server.address)
    try:
        yield Registry(server, redis_server.url, channel, tokens)
    finally:
        channel.close()
        code = server.terminate()
        redis_server.stop()
    assert code == 0


def test_case2_watch_flood_is_capped_and_shares_one_redis_reader(registry: Registry, figure: Any) -> None:
    stub, md_a = registry.stub(), registry.md("team-a")
    own = f"team-a/{unique_name('flood')}"
    create_adapter(stub, own, metadata=md_a)
    clients_before, memory_before = registry.redis_clients(), registry.memory()
    flood_channel = grpc.insecure_channel(registry.server.address)  # team-a's 100 streams on their own channel
    flood = registry_pb2_grpc.RegistryServiceStub(flood_channel)
    workload, thread = team_b(registry)
    thread.start()
    accepted: list[Any] = []
    refused: list[tuple[str, str]] = []
    for _ in range(100):
        call = flood.WatchEvents(registry_pb2.WatchEventsRequest(send_snapshot=True), metadata=md_a)
        try:
            assert next(call).HasField("reconcile")
            accepted.append(call)
        except grpc.RpcError as error:
            refused.append(status_of(error))
    clients_during = registry.redis_clients()
    thread.join(120)
    # The accepted watches see team-a's events and never team-b's (tenant filter on the shared feed).
    publish(stub, own, seed=7, metadata=md_a)
    first = [next(call).event for call in accepted[:4]]
    for call in accepted:
        call.cancel()
    flood_channel.close()
    assert workload.errors == []
    assert workload.versions == list(range(1, 9)) and workload.watched == workload.versions
    assert len(accepted) == MAX_WATCHES and refused == [("RESOURCE_EXHAUSTED", "TOO_MANY_WATCHES")] * (
        100 - MAX_WATCHES
    )
    assert [(e.adapter, e.version) for e in first] == [(own, 1)] * 4
    # One shared stream reader, not a connection per watch. team-b's calls and the flood's snapshot reads run
    # concurrently on the server's handler threads, so the command pool may grow by a few connections (seen: 4);
    # a connection per watch would add at least MAX_WATCHES.
    assert clients_during < clients_before + MAX_WATCHES // 2, (clients_before, clients_during)

    # The slots come back once the streams are gone: team-a can watch again.
    def can_watch() -> bool:
        call = stub.WatchEvents(registry_pb2.WatchEventsRequest(send_snapshot=True), metadata=md_a)
        try:
            next(call)
            return True
        except grpc.RpcError:
            return False
        finally:
            call.cancel()

    assert wait_until(can_watch)
    memory_after = registry.memory()
    assert memory_after - memory_before < 64 * MiB
    figure(
        "case 2 watch flood: accepted, refused, redis clients before/during, registry MiB before/after",
        f"{len(accepted)}, {len(refused)}, {clients_before}/{clients_during}, "
        f"{memory_before / MiB:.0f}/{memory_after / MiB:.0f}",
    )


def test_case8_a_digest_is_not_a_bearer_key(registry: Registry, figure: Any) -> None:
    stub, md_a, md_b = registry.stub(), registry.md("team-a"), registry.md("team-b")
    mine, theirs = f"team-a/{unique_name('thief')}", f"team-b/{unique_name('owner')}"
    create_adapter(stub, mine, metadata=md_a)
    create_adapter(stub, theirs, metadata=md_b)
    published = publish(stub, theirs, seed=101, metadata=md_b).version.artifact_uri
    unpublished = upload(stub, artifact_files(seed=102), metadata=md_b)
    missing = "sha256:" + "0" * 64
    workload, thread = team_b(registry)
    thread.start()

    def steal(uri: str) -> tuple[str, str, str]:
        request = registry_pb2.PublishVersionRequest(adapter=mine, artifact_uri=uri)
        try:
            stub.PublishVersion(request, metadata=md_a)
        except grpc.RpcError as error:
            # Each call's own request id aside, the answers must be identical.
            message = re.sub(r" \(request [^)]*\)$", "", error.details() or "")
            return (*status_of(error), message.replace(uri, "<uri>"))
        return ("OK", "", "")

    def download(uri: str) -> tuple[str, str]:
        try:
            list(stub.DownloadArtifact(registry_pb2.DownloadArtifactRequest(artifact_uri=uri), metadata=md_a))
        except grpc.RpcError as error:
            return status_of(error)
        return ("OK", "")

    answers = {uri: steal(uri) for uri in (published, unpublished, missing)}
    downloads = {uri: download(uri) for uri in (published, unpublished, missing)}
    thread.join(120)
    assert workload.errors == [] and workload.versions == list(range(1, 9))
    # The same answer as for a digest that does not exist: team-a learns nothing about team-b's bytes.
    assert set(answers.values()) == {("NOT_FOUND", "ARTIFACT_NOT_FOUND", "artifact <uri> not found")}, answers
    assert set(downloads.values()) == {("PERMISSION_DENIED", "PERMISSION_DENIED")}, downloads
    assert stub.GetAdapter(registry_pb2.GetAdapterRequest(name=mine), metadata=md_a).adapter.version_count == 0
    # Bytes team-a uploaded itself it may publish (and then download).
    own = publish(stub, mine, seed=103, metadata=md_a).version
    assert own.version == 1 and download(own.artifact_uri) == ("OK", "")
    figure(
        "case 8 team-b's published / unpublished / a missing digest: team-a's publish, download",
        " / ".join(f"{answers[u][:2]}, {downloads[u]}" for u in (published, unpublished, missing)),
    )


def test_case11_bounded_metadata_own_deletes_and_a_paged_admin_listing(registry: Registry, figure: Any) -> None:
    stub, md_a, md_b = registry.stub(), registry.md("team-a"), registry.md("team-b")
    memory_before = registry.memory()
    workload, thread = team_b(registry)
    thread.start()

    def create(name: str, description: str, labels: dict[str, str]) -> tuple[str, str]:
        request = registry_pb2.CreateAdapterRequest(name=name, description=description, labels=labels)
        try:
            stub.CreateAdapter(request, metadata=md_a)
        except grpc.RpcError as error:
            return status_of(error)
        return ("OK", "")

    refused = [
        create(f"team-a/{unique_name('big')}", "x" * MiB, {}),
        create(f"team-a/{unique_name('big')}", "", {f"k{i}": "v" for i in range(10_000)}),
        create(f"team-a/{unique_name('big')}", "", {"k": "v" * MiB}),
    ]
    # As many adapters as team-a likes, each with the largest description and labels allowed.
    prefix = f"team-a/{unique_name('many')}-"
    labels = {f"{i:02d}".ljust(256, "k"): "v" * 256 for i in range(32)}
    names = [f"{prefix}{i:04d}" for i in range(300)]
    created = [create(name, "d" * 4096, labels) for name in names]
    listing = admin_cli(registry, "adapters", "--prefix", prefix, "--json")
    thread.join(120)
    assert workload.errors == [] and workload.versions == list(range(1, 9))
    assert refused == [
        ("INVALID_ARGUMENT", "DESCRIPTION_TOO_LONG"),
        ("INVALID_ARGUMENT", "TOO_MANY_LABELS"),
        ("INVALID_ARGUMENT", "LABEL_TOO_LONG"),
    ]
    assert set(created) == {("OK", "")}
    assert listing.returncode == 0, listing.stderr
    assert [a["name"] for a in json.loads(listing.stdout)] == names  # every page, in order
    # team-a deletes its own adapters; another tenant's it may not.
    for name in names:
        stub.DeleteAdapter(registry_pb2.DeleteAdapterRequest(name=name), metadata=md_a)
    theirs = f"team-b/{unique_name('keep')}"
    create_adapter(stub, theirs, metadata=md_b)
    with pytest.raises(grpc.RpcError) as caught:
        stub.DeleteAdapter(registry_pb2.DeleteAdapterRequest(name=theirs), metadata=md_a)
    assert status_of(caught.value) == ("PERMISSION_DENIED", "PERMISSION_DENIED")
    left = stub.ListAdapters(registry_pb2.ListAdaptersRequest(prefix=prefix), metadata=md_a).adapters
    assert list(left) == []
    memory_after = registry.memory()
    assert memory_after - memory_before < 64 * MiB
    figure(
        "case 11 metadata: refused, created + listed by the admin CLI, registry MiB before/after",
        f"{refused}, {len(created)} + {len(json.loads(listing.stdout))}, "
        f"{memory_before / MiB:.0f}/{memory_after / MiB:.0f}",
    )


def test_case9_many_files_quota_and_unpublished_uploads(registry: Registry, figure: Any) -> None:
    stub, md_a = registry.stub(), registry.md("team-a")
    store = ArtifactStore(registry_store(registry.server))
    memory_before = registry.memory()
    workload, thread = team_b(registry, rounds=12)

    def try_upload(files: dict[str, bytes]) -> tuple[str, str]:
        try:
            return ("OK", upload(stub, files, metadata=md_a))
        except grpc.RpcError as error:
            return status_of(error)

    # The quota refusal is checked while the 1.5 MiB upload is still in flight: it counts from its manifest on,
    # so the outcome cannot depend on whether the grace period has already collected anything. (It used to be
    # checked after that upload, which passed only if the sweep had not yet collected it.)
    gate = threading.Event()
    big: list[tuple[str, str]] = []

    def stalled_upload() -> None:
        requests = upload_requests({"w": b"a" * (3 * MiB // 2)}, chunk=64 << 10)

        def held() -> Iterator[registry_pb2.UploadArtifactRequest]:
            yield next(requests)  # the manifest
            gate.wait(120)
            yield from requests

        try:
            big.append(("OK", stub.UploadArtifact(held(), metadata=md_a).artifact_uri))
        except grpc.RpcError as error:
            big.append(status_of(error))

    reserved = redis.Redis.from_url(registry.redis_url)
    uploader = threading.Thread(target=stalled_upload)
    thread.start()
    try:
        # While team-b works: one artifact of 50,000 empty files (the issue's), then four of 5,000.
        flood = [try_upload({f"f{i:05d}": b"" for i in range(n)}) for n in (50_000, 5_000, 5_000, 5_000, 5_000)]
        at_limit = try_upload({f"f{i:02d}": bytes([i]) for i in range(MAX_FILES)})
        uploader.start()
        assert wait_until(lambda: reserved.hlen("ot:tenant:team-a:reserved") == 1, timeout=60)
        over_quota = try_upload({"w": b"b" * MiB})
    finally:
        gate.set()
        uploader.join(120)
        reserved.close()
    thread.join(120)
    assert workload.errors == [] and workload.versions == list(range(1, 13))
    assert flood == [("INVALID_ARGUMENT", "TOO_MANY_FILES")] * 5
    assert at_limit[0] == "OK" and big[0][0] == "OK"
    assert over_quota == ("RESOURCE_EXHAUSTED", "STORAGE_QUOTA_EXCEEDED")
    # Nobody publishes team-a's uploads: after the grace period they are collected. The quota is released in
    # the same step that decides to delete the bytes, before they go, so once they are gone it is free again.
    assert wait_until(lambda: not store.exists(big[0][1]) and not store.exists(at_limit[1]), timeout=60)
    again = try_upload({"w": b"b" * MiB})
    assert again[0] == "OK"
    memory_after = registry.memory()
    assert memory_after - memory_before < 64 * MiB
    figure(
        "case 9 uploads: 50,000 + 4 x 5,000-file artifacts refused, 64 files / 1.5 MiB ok, quota refusal, "
        "collected after the grace period, registry MiB before/after",
        f"{len(flood)} x {flood[0]}, {at_limit[0]} / {big[0][0]}, {over_quota}, yes, "
        f"{memory_before / MiB:.0f}/{memory_after / MiB:.0f}",
    )


def test_calls_in_flight_are_bounded_per_tenant(registry: Registry, figure: Any) -> None:
    """team-a opens 40 uploads it never sends a byte of (each holds a handler, a stream and its buffers): the
    first MAX_CALLS run, the rest are refused before their handler starts; team-b's workload meanwhile gets 0
    errors; an admin is not counted; team-a's calls work again once its streams are gone."""
    stub, md_a = registry.stub(), registry.md("team-a")
    memory_before = registry.memory()
    release = threading.Event()

    def stalled() -> Iterator[registry_pb2.UploadArtifactRequest]:
        release.wait(120)
        return
        yield  # a generator that sends nothing until released

    flood_channel = grpc.insecure_channel(registry.server.address)
    flood = registry_pb2_grpc.RegistryServiceStub(flood_channel)
    calls = [flood.UploadArtifact.future(stalled(), metadata=md_a) for _ in range(40)]
    try:
        assert wait_until(lambda: sum(call.done() for call in calls) >= 40 - MAX_CALLS)
        time.sleep(0.5)  # nothing else completes: the accepted ones are waiting for their first message
        refused = [status_of(call.exception()) for call in calls if call.done()]
        assert refused == [("RESOURCE_EXHAUSTED", "TOO_MANY_REQUESTS")] * (40 - MAX_CALLS)
        with pytest.raises(grpc.RpcError) as more:
            stub.ListAdapters(registry_pb2.ListAdaptersRequest(prefix="team-a/"), metadata=md_a)
        assert status_of(more.value) == ("RESOURCE_EXHAUSTED", "TOO_MANY_REQUESTS")
        assert "--max-calls-per-tenant" in (more.value.details() or "")
        stub.ListAdapters(registry_pb2.ListAdaptersRequest(prefix="team-a/"), metadata=registry.md("ops"))  # admin
        workload, thread = team_b(registry)
        thread.start()
        thread.join(120)
        assert workload.errors == [] and len(workload.versions) == 8
    finally:
        for call in calls:
            call.cancel()
        release.set()
        flood_channel.close()

    def can_call() -> bool:
        try:
            stub.ListAdapters(registry_pb2.ListAdaptersRequest(prefix="team-a/"), metadata=md_a)
            return True
        except grpc.RpcError:
            return False

    assert wait_until(can_call)
    memory_after = registry.memory()
    assert memory_after - memory_before < 64 * MiB
    figure(
        "calls in flight: accepted, refused, registry MiB before/after",
        f"{MAX_CALLS}, {40 - MAX_CALLS}, {memory_before / MiB:.0f}/{memory_after / MiB:.0f}",
    )

"""GC, the upload sweep and DeleteVersion against concurrent uploads and publishes of the same bytes (issue 33,
item 1). Deciding that an artifact's bytes go, releasing them from every tenant's quota and refusing a publish of
them is one atomic step; checking a quota and reserving it is one step too. Eight threads publish, delete
versions and collect garbage against one registry for 30 s; afterwards every version the registry still shows
downloads and verifies, and every tenant's quota counter equals a recount from the stored bytes."""

from __future__ import annotations

import contextlib
import hashlib
import random
import secrets
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest
import redis
from registryutil import artifact_files, create_adapter, upload_requests
from serverproc import ServerProcess, registry_store, start_registry
from tlsutil import write_tokens

from opentinker.registry.embedded_redis import EmbeddedRedis
from opentinker.rpc.serving.errors import ServiceError, error_info
from opentinker.v1 import registry_pb2, registry_pb2_grpc
from opentinker.weights.artifact_manifest import ArtifactFile, manifest_bytes
from opentinker.weights.artifact_store import ArtifactStore

Stub = registry_pb2_grpc.RegistryServiceStub
TENANTS = ("team-a", "team-b")
QUOTA = 1 << 20  # --tenant-storage-quota-mb 1
GRACE_S = 1.0
RUN_S = 30.0
# Five fit in a tenant's quota, so two uploads in flight often find it nearly full.
ARTIFACT_BYTES = 200 << 10
# Few distinct artifacts, shared by both tenants: every one is published, collected and uploaded again all the
# time, so collections and publishes of the same bytes overlap.
SEEDS = range(12)
# What a worker may legitimately be told; anything else fails the test.
EXPECTED = {
    ("upload", "RESOURCE_EXHAUSTED", "STORAGE_QUOTA_EXCEEDED"),  # the tenant's quota is full
    ("publish", "NOT_FOUND", "ARTIFACT_NOT_FOUND"),  # the upload was collected before the publish took it
    ("delete", "FAILED_PRECONDITION", "VERSION_ALIASED"),  # a publish moved 'latest' onto it meanwhile
}


@dataclass
class Registry:
    server: ServerProcess
    redis_url: str
    channel: grpc.Channel
    tokens: dict[str, str]

    def stub(self) -> Stub:
        return registry_pb2_grpc.RegistryServiceStub(self.channel)

    def md(self, who: str) -> list[tuple[str, str]]:
        return [("authorization", f"Bearer {self.tokens[who]}")]


@pytest.fixture
def registry(tmp_path: Path) -> Iterator[Registry]:
    tokens = {who: f"tok-{who}-{secrets.token_hex(8)}" for who in (*TENANTS, "ops")}
    roles = {who: "admin" if who == "ops" else "user" for who in tokens}
    tokens_file = write_tokens(tmp_path / "tokens.json", {t: (who, roles[who]) for who, t in tokens.items()})
    redis_server = EmbeddedRedis(tmp_path / "redis", appendonly=False).start()
    server = start_registry(
        tmp_path / "registry",
        "--redis-url",
        redis_server.url,
        "--tokens-file",
        str(tokens_file),
        "--tenant-storage-quota-mb",
        str(QUOTA >> 20),
        "--upload-grace-s",
        str(GRACE_S),
    )
    channel = grpc.insecure_channel(server.address)
    try:
        yield Registry(server, redis_server.url, channel, tokens)
    finally:
        channel.close()
        code = server.terminate()
        redis_server.stop()
    assert code == 0, server.log()


@dataclass
class Tally:
    done: Counter[str] = field(default_factory=Counter)
    refused: Counter[tuple[str, str, str]] = field(default_factory=Counter)
    unexpected: list[str] = field(default_factory=list)
    lost: list[str] = field(default_factory=list)  # visible versions whose bytes were gone
    max_stored: dict[str, int] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def call(self, what: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        try:
            result = fn(*args, **kwargs)
        except grpc.RpcError as error:
            info = error_info(error)
            key = (what, error.code().name, info.reason if info else "")
            with self.lock:
                if key in EXPECTED:
                    self.refused[key] += 1
                else:
                    self.unexpected.append(f"{key}: {error.details()}")
            return None
        except AssertionError as error:  # a download that does not verify
            with self.lock:
                self.unexpected.append(f"{what}: {error}")
            return None
        with self.lock:
            self.done[what] += 1
        return result

    def sample(self, tenant: str, stored: int) -> None:
        with self.lock:
            self.max_stored[tenant] = max(self.max_stored.get(tenant, 0), stored)

    def check(self, stub: Stub, md: list[tuple[str, str]], reference: str) -> None:
        resolved = self.call("resolve", stub.Resolve, registry_pb2.ResolveRequest(reference=reference), metadata=md)
        if resolved is None:
            return
        if self.call("download", downloads_and_verifies, stub, resolved.version.artifact_uri, md):
            with self.lock:
                self.done["verified"] += 1
            return
        adapter, number = reference.rsplit("@", 1)
        again = stub.GetVersion(registry_pb2.GetVersionRequest(adapter=adapter, version=int(number)), metadata=md)
        if not again.version.artifact_deleted:
            with self.lock:
                self.lost.append(reference)


def stored_bytes(client: redis.Redis, tenant: str) -> int:
    return sum(int(size) for size in client.hvals(f"ot:tenant:{tenant}:uploads"))


def downloads_and_verifies(stub: Stub, uri: str, md: list[tuple[str, str]]) -> bool:
    """Every file against its sha256 and the manifest against the digest; False if the registry answers that
    the bytes are gone (NOT_FOUND; PERMISSION_DENIED once no version uses them; DATA_LOSS when they went
    while streaming)."""
    request = registry_pb2.DownloadArtifactRequest(artifact_uri=uri)
    try:
        messages = list(stub.DownloadArtifact(request, metadata=md))
    except grpc.RpcError as error:
        if error.code() in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.DATA_LOSS):
            return False
        raise
    data = b"".join(m.chunk for m in messages[1:])
    files, offset = [], 0
    for header in messages[0].manifest.files:
        body = data[offset : offset + header.size_bytes]
        offset += header.size_bytes
        assert hashlib.sha256(body).hexdigest() == header.sha256, (uri, header.path)
        files.append(ArtifactFile(header.path, header.sha256, header.size_bytes))
    assert offset == len(data) and f"sha256:{hashlib.sha256(manifest_bytes(files)).hexdigest()}" == uri
    return True


def publisher(registry: Registry, tenant: str, adapter: str, tally: Tally, stop: threading.Event) -> None:
    """Uploads and publishes; samples the tenant's stored bytes after each upload, and resolves and downloads
    each version it published: bytes that are gone are only acceptable if the version was collected since."""
    stub, md, rng = registry.stub(), registry.md(tenant), random.Random()
    client = redis.Redis.from_url(registry.redis_url)
    try:
        while not stop.is_set():
            files = artifact_files(rng.choice(SEEDS), size=ARTIFACT_BYTES)
            uploaded = tally.call("upload", stub.UploadArtifact, upload_requests(files, chunk=32 << 10), metadata=md)
            if uploaded is None:
                continue
            tally.sample(tenant, stored_bytes(client, tenant))
            # Mostly without moving 'latest', so the deleters may collect the new version right away.
            request = registry_pb2.PublishVersionRequest(
                adapter=adapter, artifact_uri=uploaded.artifact_uri, skip_latest=rng.random() < 0.8
            )
            published = tally.call("publish", stub.PublishVersion, request, metadata=md)
            if published is not None:
                tally.check(stub, md, f"{adapter}@{published.version.version}")
    finally:
        client.close()


def deleter(registry: Registry, tenant: str, adapter: str, tally: Tally, stop: threading.Event) -> None:
    stub, md, rng = registry.stub(), registry.md(tenant), random.Random()
    while not stop.is_set():
        listing = tally.call(
            "list", stub.ListVersions, registry_pb2.ListVersionsRequest(adapter=adapter, page_size=8), metadata=md
        )
        live = [v.version for v in listing.versions if not v.artifact_deleted and not v.aliases] if listing else []
        if live:
            request = registry_pb2.DeleteVersionRequest(adapter=adapter, version=rng.choice(live))
            tally.call("delete", stub.DeleteVersion, request, metadata=md)


def collector(registry: Registry, tally: Tally, stop: threading.Event) -> None:
    """GC as the admin (every adapter, then the sweep of unpublished uploads), sampling each tenant's stored
    bytes between runs: they must never pass the quota."""
    stub, md = registry.stub(), registry.md("ops")
    client = redis.Redis.from_url(registry.redis_url)
    try:
        while not stop.is_set():
            tally.call("gc", stub.GarbageCollect, registry_pb2.GarbageCollectRequest(keep_last=1), metadata=md)
            for tenant in TENANTS:
                tally.sample(tenant, stored_bytes(client, tenant))
    finally:
        client.close()


def snapshot(client: redis.Redis) -> dict[str, Any]:
    """The accounting as the registry holds it, read in one transaction."""
    digest_keys = sorted(k.decode() for k in client.scan_iter(match="ot:artifact:*", count=1000))
    with client.pipeline(transaction=True) as pipe:
        for tenant in TENANTS:
            pipe.hgetall(f"ot:tenant:{tenant}:uploads")
            pipe.hgetall(f"ot:tenant:{tenant}:reserved")
        pipe.zrange("ot:artifacts:deleting", 0, -1)
        pipe.zrange("ot:uploads", 0, -1)
        for key in digest_keys:
            if key.endswith((":uploaders", ":refs")):
                pipe.smembers(key)
            else:
                pipe.zrange(key, 0, -1)
        values = pipe.execute()
    tenants = {
        tenant: {"uploads": {k.decode(): int(v) for k, v in values[2 * i].items()}, "reserved": values[2 * i + 1]}
        for i, tenant in enumerate(TENANTS)
    }
    rest = values[2 * len(TENANTS) :]
    return {
        "tenants": tenants,
        "deleting": {d.decode() for d in rest[0]},
        "waiting": {d.decode() for d in rest[1]},
        "keys": {key: sorted(v.decode() for v in value) for key, value in zip(digest_keys, rest[2:], strict=True)},
    }


def recount(registry: Registry) -> tuple[dict[str, Any], dict[str, int]]:
    """A snapshot and, for every artifact on disk, its verified size. Repeated until the snapshot is the same
    before and after the disk is read (the background sweep may be collecting): only then do both describe one
    state."""
    store = ArtifactStore(registry_store(registry.server))
    client = redis.Redis.from_url(registry.redis_url)
    try:
        for _ in range(200):
            before = snapshot(client)
            on_disk = {}
            for entry in (store.root / "sha256").iterdir():
                with contextlib.suppress(ServiceError):  # deleted while we read it: the snapshots differ
                    on_disk[entry.name] = store.ref(f"sha256:{entry.name}").size_bytes
            if snapshot(client) == before:
                return before, on_disk
    finally:
        client.close()
    raise AssertionError("the registry's accounting kept changing with no client calling it")


def test_gc_deletes_and_publishes_race_for_30_s_without_losing_bytes_or_quota(
    registry: Registry, record_property: Callable[[str, object], None]
) -> None:
    stub = registry.stub()
    adapters = {tenant: f"{tenant}/race" for tenant in TENANTS}
    for tenant, name in adapters.items():
        create_adapter(stub, name, metadata=registry.md(tenant))
    tally, stop = Tally(), threading.Event()
    workers = [
        *(threading.Thread(target=publisher, args=(registry, t, adapters[t], tally, stop)) for t in TENANTS * 2),
        *(threading.Thread(target=deleter, args=(registry, t, adapters[t], tally, stop)) for t in TENANTS),
        *(threading.Thread(target=collector, args=(registry, tally, stop)) for _ in range(2)),
    ]
    assert len(workers) == 8
    for worker in workers:
        worker.start()
    time.sleep(RUN_S)
    stop.set()
    for worker in workers:
        worker.join(60)
    assert not any(worker.is_alive() for worker in workers)
    assert tally.unexpected == []
    assert tally.lost == []
    assert min(tally.done[what] for what in ("upload", "publish", "delete", "gc")) > 0, tally.done

    # Every version the registry still shows (not collected) resolves, downloads and verifies.
    verified = 0
    for tenant, name in adapters.items():
        md, token = registry.md(tenant), ""
        while True:
            page = stub.ListVersions(registry_pb2.ListVersionsRequest(adapter=name, page_token=token), metadata=md)
            for version in page.versions:
                if version.artifact_deleted:
                    continue
                resolved = stub.Resolve(registry_pb2.ResolveRequest(reference=f"{name}@{version.version}"), metadata=md)
                assert resolved.version.artifact_sha256 == version.artifact_sha256
                assert downloads_and_verifies(stub, resolved.version.artifact_uri, md)
                verified += 1
            token = page.next_page_token
            if not token:
                break
        latest = stub.Resolve(registry_pb2.ResolveRequest(reference=f"{name}@latest"), metadata=md).version
        assert downloads_and_verifies(stub, latest.artifact_uri, md)
    assert verified > 0

    # Every tenant's quota counter equals a recount from the bytes on disk and who uploaded them; nothing is
    # reserved or leased once no call is in flight; no stored artifact is forgotten (a version references it, the
    # sweep will look at it, or its deletion is under way).
    state, on_disk = recount(registry)
    keys = state["keys"]
    for tenant in TENANTS:
        counted = state["tenants"][tenant]["uploads"]
        recounted = {d: size for d, size in on_disk.items() if tenant in keys.get(f"ot:artifact:{d}:uploaders", [])}
        assert counted == recounted, tenant
        assert state["tenants"][tenant]["reserved"] == {}
        assert tally.max_stored[tenant] <= QUOTA, (tenant, tally.max_stored[tenant])
    assert [key for key in keys if key.endswith(":leases")] == []
    forgotten = [
        d for d in on_disk if not keys.get(f"ot:artifact:{d}:refs") and d not in state["waiting"] | state["deleting"]
    ]
    assert forgotten == []

    summary = (
        f"{RUN_S:.0f} s, 8 threads: {tally.done['upload']} uploads, {tally.done['publish']} publishes, "
        f"{tally.done['delete']} version deletes, {tally.done['gc']} GC runs; refused {dict(tally.refused)}; "
        f"{tally.done['verified']} new versions resolved, downloaded and verified during the run (the others "
        f"collected first), {verified} after it; {len(TENANTS)} quota counters = recount over "
        f"{len(on_disk)} stored artifacts; most stored {max(tally.max_stored.values()) >> 10} KiB of a "
        f"{QUOTA >> 10} KiB quota"
    )
    record_property("registry_races", summary)
    print(summary)

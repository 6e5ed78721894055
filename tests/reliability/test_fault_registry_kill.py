"""The registry process SIGKILLed during a burst of publishes from 8 clients, and restarted on the same address
(Redis and the artifact store outlive it). Clients retry with their request ids. Afterwards every acknowledged
publish exists exactly once, version numbers are contiguous and never shared, and the uploads the killed
process was receiving left nothing in the store's tmp/."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from faultutil import SOAK
from publishburst import Publisher, publish_burst
from registryutil import create_adapter, unique_name
from serverproc import ServerProcess, registry_store, start_registry

from opentinker.registry.embedded_redis import EmbeddedRedis
from opentinker.v1 import registry_pb2, registry_pb2_grpc
from opentinker.weights.artifact_store import ArtifactStore

CLIENTS = 8
PUBLISHES = 25 if SOAK else 6  # per client
KILLS = 10 if SOAK else 2


@dataclass
class Outcome:
    name: str
    publishers: list[Publisher]
    kills: list[int]  # exit codes of the killed registry processes
    versions: list[registry_pb2.Version]
    store: Path


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(scope="module")
def outcome(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Outcome]:
    workdir = tmp_path_factory.mktemp("registry-kill")
    redis_server = EmbeddedRedis(workdir / "redis").start()
    port = str(free_port())  # the same address after each restart: clients' channels simply reconnect
    args = ("--redis-url", redis_server.url, "--port", port)
    server: ServerProcess = start_registry(workdir / "registry", *args)
    channel = grpc.insecure_channel(server.address)
    try:
        stub = registry_pb2_grpc.RegistryServiceStub(channel)
        name = unique_name("gkill")
        create_adapter(stub, name)
        publishers = [Publisher(i + 1) for i in range(CLIENTS)]
        threads = [
            threading.Thread(target=publish_burst, args=(stub, tiny_model, name, p, PUBLISHES)) for p in publishers
        ]
        for thread in threads:
            thread.start()
        kills: list[int] = []
        for round_ in range(KILLS):
            target = (round_ + 1) * CLIENTS * PUBLISHES // (KILLS + 1)
            while sum(len(p.acked) for p in publishers) < target and any(t.is_alive() for t in threads):
                time.sleep(0.005)
            server.process.kill()  # SIGKILL mid-burst: uploads and publishes in flight are cut
            kills.append(server.process.wait())
            server.kill()  # closes its log
            time.sleep(0.2)  # clients run into the closed port meanwhile
            server = start_registry(workdir / "registry", *args)
        for thread in threads:
            thread.join(120)
        listed = stub.ListVersions(registry_pb2.ListVersionsRequest(adapter=name, page_size=1000)).versions
        yield Outcome(name, publishers, kills, list(listed), registry_store(server))
    finally:
        channel.close()
        server.terminate()
        redis_server.stop()


def test_clients_saw_only_unavailable_and_every_publish_was_acknowledged(outcome: Outcome) -> None:
    assert outcome.kills == [-9] * KILLS
    failures = [f for p in outcome.publishers for f in p.failures]
    assert failures, "no client ran into a dead registry"
    assert {code for code, _reason in failures} == {grpc.StatusCode.UNAVAILABLE}, failures
    assert all(len(p.acked) == PUBLISHES for p in outcome.publishers), [len(p.acked) for p in outcome.publishers]


def test_every_acknowledged_publish_exists_exactly_once(
    outcome: Outcome, figure: Callable[[str, object], None]
) -> None:
    acked = {rid: v for p in outcome.publishers for rid, v in p.acked.items()}
    uris = {rid: uri for p in outcome.publishers for rid, uri in p.uris.items()}
    numbers = [v.version for v in outcome.versions]
    assert sorted(numbers) == list(range(1, CLIENTS * PUBLISHES + 1))  # contiguous, none duplicated
    # Each publish carries its own artifact: a publish applied twice would show its artifact twice.
    by_uri = {v.artifact_uri: v.version for v in outcome.versions}
    assert len(by_uri) == len(outcome.versions)
    for request_id, version in acked.items():
        assert by_uri[uris[request_id]] == version.version, request_id
    store = ArtifactStore(outcome.store)
    for version in outcome.versions:
        store.ref(version.artifact_uri)  # complete and verified
    failures = sum(len(p.failures) for p in outcome.publishers)
    figure(
        "registry SIGKILLs during 8-client publish bursts: kills, publishes, UNAVAILABLE answers",
        f"{len(outcome.kills)}, {len(acked)}, {failures}",
    )


def test_cut_uploads_left_nothing_in_tmp(outcome: Outcome) -> None:
    leftovers = [p.name for p in (outcome.store / "tmp").iterdir()]
    assert leftovers == [], leftovers

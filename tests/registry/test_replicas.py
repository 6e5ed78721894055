"""The registry's fleet against a real registry process: register, beat, lease expiry, draining, the watch
stream, bad records refused with nothing listed, and a user tenant's view (no beats; only its own resident
versions)."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import redis
from registryrpcutil import Stub, assert_status, rpc_error
from serverproc import ServerProcess, start_registry
from tlsutil import Bearer, write_tokens

from opentinker.registry.embedded_redis import EmbeddedRedis
from opentinker.v1 import registry_pb2, registry_pb2_grpc


def _replica(**fields: object) -> registry_pb2.Replica:
    record: dict[str, object] = {
        "replica_id": f"test-{uuid.uuid4().hex[:12]}",
        "role": registry_pb2.REPLICA_ROLE_SAMPLER,
        "address": "127.0.0.1:7101",
        "base_fingerprint": "sha256-" + "ab" * 8,
        "max_slots": 8,
        "lease_seconds": 30.0,
    }
    record.update(fields)
    return registry_pb2.Replica(**record)  # type: ignore[arg-type]


def _listed(registry: Stub, replica_id: str) -> Any:
    for replica in registry.ListReplicas(registry_pb2.ListReplicasRequest()).replicas:
        if replica.replica_id == replica_id:
            return replica
    return None


def test_register_beat_and_list(registry: Stub) -> None:
    sent = _replica(zone="eu-1", resident=["b@2", "a@1"])
    got = registry.RegisterReplica(registry_pb2.RegisterReplicaRequest(replica=sent)).replica
    assert got.register_time.seconds > 0 and list(got.resident) == ["a@1", "b@2"]  # sorted
    assert got.state == registry_pb2.REPLICA_STATE_SERVING  # unspecified means serving
    load = registry_pb2.ReplicaLoad(slots_used=3, slots_total=8, waiting_sequences=5, tokens_per_second=12.5)
    beat = registry_pb2.HeartbeatRequest(
        replica_id=sent.replica_id, state=registry_pb2.REPLICA_STATE_DRAINING, load=load, resident=["c@7"]
    )
    registry.Heartbeat(beat)
    listed = _listed(registry, sent.replica_id)
    assert listed is not None
    assert (listed.address, listed.zone, listed.max_slots) == ("127.0.0.1:7101", "eu-1", 8)
    assert listed.state == registry_pb2.REPLICA_STATE_DRAINING and listed.load == load
    assert list(listed.resident) == ["c@7"] and listed.register_time == got.register_time
    trainers = registry.ListReplicas(registry_pb2.ListReplicasRequest(role=registry_pb2.REPLICA_ROLE_TRAINER))
    assert sent.replica_id not in {r.replica_id for r in trainers.replicas}


def test_a_lease_ends_without_beats_and_the_next_beat_says_register_again(registry: Stub) -> None:
    sent = _replica(lease_seconds=0.3)
    registry.RegisterReplica(registry_pb2.RegisterReplicaRequest(replica=sent))
    assert _listed(registry, sent.replica_id) is not None
    time.sleep(0.5)
    assert _listed(registry, sent.replica_id) is None
    error = rpc_error(registry.Heartbeat, registry_pb2.HeartbeatRequest(replica_id=sent.replica_id))
    assert_status(error, grpc.StatusCode.NOT_FOUND, "REPLICA_NOT_FOUND")
    registry.RegisterReplica(registry_pb2.RegisterReplicaRequest(replica=sent))  # what a replica then does
    assert _listed(registry, sent.replica_id) is not None


def test_beats_keep_a_short_lease_alive(registry: Stub) -> None:
    sent = _replica(lease_seconds=0.4)
    registry.RegisterReplica(registry_pb2.RegisterReplicaRequest(replica=sent))
    for _ in range(8):  # 1.2 s in all, three leases
        time.sleep(0.15)
        registry.Heartbeat(registry_pb2.HeartbeatRequest(replica_id=sent.replica_id))
    assert _listed(registry, sent.replica_id) is not None


@pytest.mark.parametrize(
    "fields",
    [
        {"replica_id": ""},
        {"replica_id": "has space"},
        {"replica_id": "x" * 65},
        {"role": registry_pb2.REPLICA_ROLE_UNSPECIFIED},
        {"role": 9},
        {"address": "no-port"},
        {"address": "host:0"},
        {"address": "host:70000"},
        {"address": "a b:80"},
        {"base_fingerprint": ""},
        {"base_fingerprint": "bad fingerprint"},
        {"zone": "z" * 65},
        {"lease_seconds": 0.01},
        {"lease_seconds": 61.0},
        {"lease_seconds": float("nan")},
        {"state": 7},
        {"resident": ["BAD NAME"]},
        {"resident": ["a@"]},
        {"resident": ["a@0"]},
        {"resident": ["BAD NAME@1"]},
        {"resident": [f"a@{i}" for i in range(1, 4099)]},
    ],
)
def test_bad_records_are_refused_and_nothing_is_listed(registry: Stub, fields: dict[str, object]) -> None:
    sent = _replica(**fields)
    error = rpc_error(registry.RegisterReplica, registry_pb2.RegisterReplicaRequest(replica=sent))
    assert_status(error, grpc.StatusCode.INVALID_ARGUMENT, "INVALID_REPLICA")
    if sent.replica_id:
        assert _listed(registry, sent.replica_id) is None


def test_bad_beats_and_role_filters_are_refused(registry: Stub) -> None:
    sent = _replica()
    registry.RegisterReplica(registry_pb2.RegisterReplicaRequest(replica=sent))
    bad = registry_pb2.HeartbeatRequest(replica_id=sent.replica_id, resident=["a@x"])
    assert_status(rpc_error(registry.Heartbeat, bad), grpc.StatusCode.INVALID_ARGUMENT, "INVALID_REPLICA")
    listed = _listed(registry, sent.replica_id)
    assert listed is not None and list(listed.resident) == []  # the refused beat changed nothing
    error = rpc_error(registry.ListReplicas, registry_pb2.ListReplicasRequest(role=5))  # type: ignore[arg-type]
    assert_status(error, grpc.StatusCode.INVALID_ARGUMENT, "INVALID_REPLICA_ROLE")


def test_watch_sends_the_fleet_then_joins_state_changes_and_leaves(registry: Stub) -> None:
    watch = registry.WatchReplicas(registry_pb2.WatchReplicasRequest(), timeout=30)
    try:
        first = next(watch)
        assert first.snapshot
        sent = _replica(lease_seconds=1.0)
        registry.RegisterReplica(registry_pb2.RegisterReplicaRequest(replica=sent))

        def next_about(check: Callable[[registry_pb2.WatchReplicasResponse], bool]) -> Any:
            for message in watch:
                if check(message):
                    return message
            raise AssertionError("the watch ended")

        joined = next_about(lambda m: any(r.replica_id == sent.replica_id for r in m.replicas))
        assert not joined.snapshot
        draining = registry_pb2.HeartbeatRequest(replica_id=sent.replica_id, state=registry_pb2.REPLICA_STATE_DRAINING)
        registry.Heartbeat(draining)
        changed = next_about(lambda m: any(r.replica_id == sent.replica_id for r in m.replicas))
        assert [r.state for r in changed.replicas if r.replica_id == sent.replica_id] == [
            registry_pb2.REPLICA_STATE_DRAINING
        ]
        left = next_about(lambda m: sent.replica_id in m.left)  # no more beats: the lease ends
        assert sent.replica_id not in {r.replica_id for r in left.replicas}
    finally:
        watch.cancel()


# --- a registry with tokens: what a user tenant may do and see ------------------------------------------------


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerProcess, dict[str, str]]]:
    server, tokens = _secured_registry(tmp_path_factory)
    yield server, tokens
    server.terminate()


@pytest.fixture(scope="module")
def secured_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerProcess, dict[str, str], int]]:
    """A registry with tokens on a Redis of its own whose command counts the test can read."""
    redis = EmbeddedRedis(tmp_path_factory.mktemp("fleet-redis")).start()
    server, tokens = _secured_registry(tmp_path_factory, "--redis-url", redis.url)
    yield server, tokens, redis.port
    server.terminate()
    redis.stop()


def _secured_registry(tmp_path_factory: pytest.TempPathFactory, *flags: str) -> tuple[ServerProcess, dict[str, str]]:
    work = tmp_path_factory.mktemp("fleet-registry")
    tokens = {"team-a": "tok-fleet-a", "team-b": "tok-fleet-b", "svc": "tok-fleet-svc"}
    users = {
        tokens["team-a"]: ("team-a", "user"),
        tokens["team-b"]: ("team-b", "user"),
        tokens["svc"]: ("ops", "admin"),
    }
    tokens_file = write_tokens(work / "tokens.json", users)
    return start_registry(work / "registry", "--tokens-file", str(tokens_file), *flags), tokens


def _stub(server: ServerProcess, token: str) -> tuple[Stub, grpc.Channel]:
    channel = grpc.intercept_channel(grpc.insecure_channel(server.address), Bearer(token))
    return registry_pb2_grpc.RegistryServiceStub(channel), channel


def test_a_user_tenant_lists_load_but_only_its_own_resident_versions(
    secured: tuple[ServerProcess, dict[str, str]], tmp_path: Path
) -> None:
    server, tokens = secured
    admin, admin_channel = _stub(server, tokens["svc"])
    user, user_channel = _stub(server, tokens["team-a"])
    try:
        # A sampler's versions and, as a trainer reports them, adapters at no version.
        resident = ["team-a/policy@3", "team-b/secret@1", "untenanted@2", "team-a/trained", "team-b/trained"]
        sent = _replica(resident=resident)
        admin.RegisterReplica(registry_pb2.RegisterReplicaRequest(replica=sent))
        seen = {r.replica_id: r for r in user.ListReplicas(registry_pb2.ListReplicasRequest()).replicas}
        assert list(seen[sent.replica_id].resident) == ["team-a/policy@3", "team-a/trained"]
        assert seen[sent.replica_id].address == sent.address and seen[sent.replica_id].max_slots == 8
        everything = {r.replica_id: r for r in admin.ListReplicas(registry_pb2.ListReplicasRequest()).replicas}
        assert len(everything[sent.replica_id].resident) == 5
        watched = next(user.WatchReplicas(registry_pb2.WatchReplicasRequest(), timeout=10))
        mine = [list(r.resident) for r in watched.replicas if r.replica_id == sent.replica_id]
        assert mine == [["team-a/policy@3", "team-a/trained"]]
        for call, request in (
            (user.RegisterReplica, registry_pb2.RegisterReplicaRequest(replica=_replica())),
            (user.Heartbeat, registry_pb2.HeartbeatRequest(replica_id=sent.replica_id)),
        ):
            assert_status(rpc_error(call, request), grpc.StatusCode.PERMISSION_DENIED, "PERMISSION_DENIED")
        assert len(admin.ListReplicas(registry_pb2.ListReplicasRequest()).replicas) == len(everything)
    finally:
        admin_channel.close()
        user_channel.close()


def _fleet_reads(redis_port: int) -> int:
    """How often the registry has read the fleet (each listing sweeps expired leases first)."""
    client = redis.Redis(port=redis_port)
    try:
        stats: dict[str, Any] = client.info("commandstats")
        return int(stats.get("cmdstat_zremrangebyscore", {}).get("calls", 0))
    finally:
        client.close()


def _fleet_read_rate(redis_port: int, seconds: float = 2.0) -> float:
    before = _fleet_reads(redis_port)
    time.sleep(seconds)
    return (_fleet_reads(redis_port) - before) / seconds


def test_one_tenants_many_watches_neither_load_redis_nor_delay_another_tenants_watch(
    secured_redis: tuple[ServerProcess, dict[str, str], int],
) -> None:
    """Two tenants on one registry: team-a opens as many fleet watches as it may (16) and reads none of them;
    team-b's watch still hears of a new replica at once, and Redis reads the fleet as often as with one watch
    (one reader per registry process, shared by every watch)."""
    server, tokens, redis_port = secured_redis
    admin, admin_channel = _stub(server, tokens["svc"])
    victim, victim_channel = _stub(server, tokens["team-b"])
    abuser, abuser_channel = _stub(server, tokens["team-a"])
    calls: list[Any] = []
    try:
        watch = victim.WatchReplicas(registry_pb2.WatchReplicasRequest(include_load=True), timeout=60)
        calls.append(watch)
        assert next(watch).snapshot
        one_watch = _fleet_read_rate(redis_port)
        for _ in range(16):
            calls.append(abuser.WatchReplicas(registry_pb2.WatchReplicasRequest(include_load=True), timeout=60))
        for call in calls[1:]:
            assert call.initial_metadata() is not None  # each stream is open on the server
        many_watches = _fleet_read_rate(redis_port)
        assert many_watches <= 2 * one_watch + 2, (one_watch, many_watches)
        sent = _replica()
        began = time.monotonic()
        admin.RegisterReplica(registry_pb2.RegisterReplicaRequest(replica=sent))
        for message in watch:
            if any(r.replica_id == sent.replica_id for r in message.replicas):
                break
        assert time.monotonic() - began < 5
        print(f"fleet reads/s: {one_watch:.1f} with one watch, {many_watches:.1f} with 17")
    finally:
        for call in calls:
            call.cancel()
        for channel in (admin_channel, victim_channel, abuser_channel):
            channel.close()

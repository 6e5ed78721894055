"""The trainer pool's placements against a real registry process: spread by rank placed, sticky while the owner
lives, room (max_slots), a dead owner's adapters taken over under a new epoch and the old epoch refused on
publish, moves and state records fenced by compare-and-set, draining trainers skipped, tenants kept apart."""

from __future__ import annotations

import time
import uuid
from collections import Counter
from collections.abc import Iterator

import grpc
import pytest
from registryrpcutil import Stub, assert_status, rpc_error
from registryutil import create_adapter, publish
from serverproc import ServerProcess, start_registry
from tlsutil import Bearer, write_tokens

from opentinker.v1 import registry_pb2, registry_pb2_grpc


def _trainer(registry: Stub, base: str, *, lease: float = 30.0, max_slots: int = 0, port: int = 7201) -> str:
    replica_id = f"trainer-{uuid.uuid4().hex[:12]}"
    record = registry_pb2.Replica(
        replica_id=replica_id,
        role=registry_pb2.REPLICA_ROLE_TRAINER,
        address=f"127.0.0.1:{port}",
        base_fingerprint=base,
        max_slots=max_slots,
        lease_seconds=lease,
    )
    registry.RegisterReplica(registry_pb2.RegisterReplicaRequest(replica=record))
    return replica_id


def _base() -> str:
    return f"sha256-{uuid.uuid4().hex}"  # a base of this test's own: no other test's trainer is a candidate


def _place(registry: Stub, adapter: str, base: str, rank: int = 8) -> registry_pb2.PlaceAdapterResponse:
    request = registry_pb2.PlaceAdapterRequest(adapter=adapter, rank=rank, base_fingerprint=base)
    response: registry_pb2.PlaceAdapterResponse = registry.PlaceAdapter(request)
    return response


def test_adapters_spread_by_rank_and_stay_where_they_are(registry: Stub) -> None:
    base = _base()
    a, b = _trainer(registry, base, port=7201), _trainer(registry, base, port=7202)
    names = [f"pool-{uuid.uuid4().hex[:8]}-{i}" for i in range(6)]
    placed = {n: _place(registry, n, base) for n in names}
    assert all(p.placed and p.placement.epoch == 1 for p in placed.values())
    assert Counter(p.placement.replica_id for p in placed.values()) == {a: 3, b: 3}
    again = _place(registry, names[0], base)
    assert not again.placed and again.placement == placed[names[0]].placement  # sticky
    beat = registry.Heartbeat(registry_pb2.HeartbeatRequest(replica_id=a))
    assert sorted(p.adapter for p in beat.placements) == sorted(n for n in names if placed[n].placement.replica_id == a)
    # A rank-64 adapter weighs as much as eight rank-8 ones: the next three go to the other trainer.
    big = _place(registry, f"pool-big-{uuid.uuid4().hex[:8]}", base, rank=64).placement.replica_id
    after = [_place(registry, f"pool-{uuid.uuid4().hex[:8]}", base).placement.replica_id for _ in range(3)]
    assert after == [a if big == b else b] * 3


def test_room_is_max_slots_and_a_full_pool_says_so(registry: Stub) -> None:
    base = _base()
    only = _trainer(registry, base, max_slots=2)
    assert _place(registry, f"room-{uuid.uuid4().hex[:8]}", base).placement.replica_id == only
    assert _place(registry, f"room-{uuid.uuid4().hex[:8]}", base).placement.replica_id == only
    name = f"room-{uuid.uuid4().hex[:8]}"
    error = rpc_error(registry.PlaceAdapter, registry_pb2.PlaceAdapterRequest(adapter=name, base_fingerprint=base))
    assert_status(error, grpc.StatusCode.FAILED_PRECONDITION, "NO_TRAINER")
    with pytest.raises(grpc.RpcError):
        registry.GetPlacement(registry_pb2.GetPlacementRequest(adapter=name))  # the refusal placed nothing


def test_a_draining_trainer_takes_no_new_adapter(registry: Stub) -> None:
    base = _base()
    draining, serving = _trainer(registry, base), _trainer(registry, base)
    registry.Heartbeat(registry_pb2.HeartbeatRequest(replica_id=draining, state=registry_pb2.REPLICA_STATE_DRAINING))
    owners = {_place(registry, f"drain-{uuid.uuid4().hex[:8]}", base).placement.replica_id for _ in range(3)}
    assert owners == {serving}


def test_a_dead_owner_is_taken_over_and_its_epoch_is_refused(registry: Stub) -> None:
    base = _base()
    name = f"takeover-{uuid.uuid4().hex[:8]}"
    create_adapter(registry, name)
    dying = _trainer(registry, base, lease=0.6)
    first = _place(registry, name, base).placement
    assert first.replica_id == dying and first.epoch == 1
    registry.RecordPlacementState(
        registry_pb2.RecordPlacementStateRequest(adapter=name, epoch=1, state_id="sha256:" + "1" * 64, state_step=5)
    )
    survivor = _trainer(registry, base)
    assert _place(registry, name, base).placement.replica_id == dying  # still leased: nobody takes it
    time.sleep(0.9)  # the lease runs out
    taken = _place(registry, name, base)
    assert taken.placed and taken.placement.replica_id == survivor and taken.placement.epoch == 2
    assert (taken.placement.state_id, taken.placement.state_step) == ("sha256:" + "1" * 64, 5)  # where to resume
    with pytest.raises(grpc.RpcError) as fenced:
        publish(registry, name, owner_epoch=1)
    assert_status(fenced.value, grpc.StatusCode.FAILED_PRECONDITION, "STALE_EPOCH")
    stale = registry_pb2.RecordPlacementStateRequest(adapter=name, epoch=1, state_id="sha256:" + "2" * 64)
    assert_status(rpc_error(registry.RecordPlacementState, stale), grpc.StatusCode.FAILED_PRECONDITION, "STALE_EPOCH")
    assert publish(registry, name, owner_epoch=2).version.version == 1
    assert publish(registry, name).version.version == 2  # unfenced (an explicit trainer=): today's behaviour
    got = registry.GetPlacement(registry_pb2.GetPlacementRequest(adapter=name)).placement
    assert got.epoch == 2 and got.state_id == "sha256:" + "1" * 64  # the stale record changed nothing


def test_a_move_is_a_compare_and_set_on_the_epoch(registry: Stub) -> None:
    base = _base()
    name = f"move-{uuid.uuid4().hex[:8]}"
    a = _trainer(registry, base)
    first = _place(registry, name, base).placement
    assert (first.replica_id, first.base_fingerprint) == (a, base)
    other_base = _trainer(registry, _base())  # idle, so the least loaded: but its base cannot load the state
    b = _trainer(registry, base)
    to_other_base = registry_pb2.MovePlacementRequest(adapter=name, expected_epoch=1, to_replica_id=other_base)
    assert_status(rpc_error(registry.MovePlacement, to_other_base), grpc.StatusCode.FAILED_PRECONDITION, "NO_TRAINER")
    to_self = registry_pb2.MovePlacementRequest(adapter=name, expected_epoch=1, to_replica_id=a)
    assert_status(rpc_error(registry.MovePlacement, to_self), grpc.StatusCode.FAILED_PRECONDITION, "NO_TRAINER")
    moved = registry.MovePlacement(
        registry_pb2.MovePlacementRequest(adapter=name, expected_epoch=1, state_id="sha256:" + "3" * 64, state_step=9)
    ).placement
    assert (moved.replica_id, moved.epoch, moved.state_step) == (b, 2, 9)
    again = registry_pb2.MovePlacementRequest(adapter=name, expected_epoch=1, to_replica_id=a)
    assert_status(rpc_error(registry.MovePlacement, again), grpc.StatusCode.FAILED_PRECONDITION, "STALE_EPOCH")
    assert [p.adapter for p in registry.Heartbeat(registry_pb2.HeartbeatRequest(replica_id=a)).placements] == []
    bad = registry_pb2.MovePlacementRequest(adapter=name, expected_epoch=0)
    assert_status(rpc_error(registry.MovePlacement, bad), grpc.StatusCode.INVALID_ARGUMENT, "INVALID_PLACEMENT")
    unknown = registry_pb2.GetPlacementRequest(adapter=f"nowhere-{uuid.uuid4().hex[:8]}")
    assert_status(rpc_error(registry.GetPlacement, unknown), grpc.StatusCode.NOT_FOUND, "PLACEMENT_NOT_FOUND")


def test_deleting_the_adapter_drops_its_placement(registry: Stub) -> None:
    base = _base()
    name = f"gone-{uuid.uuid4().hex[:8]}"
    create_adapter(registry, name)
    owner = _trainer(registry, base)
    _place(registry, name, base)
    registry.DeleteAdapter(registry_pb2.DeleteAdapterRequest(name=name))
    assert registry.Heartbeat(registry_pb2.HeartbeatRequest(replica_id=owner)).placements == []
    unknown = registry_pb2.GetPlacementRequest(adapter=name)
    assert_status(rpc_error(registry.GetPlacement, unknown), grpc.StatusCode.NOT_FOUND, "PLACEMENT_NOT_FOUND")


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerProcess, dict[str, str]]]:
    work = tmp_path_factory.mktemp("pool-registry")
    tokens = {"team-a": "tok-pool-a", "team-b": "tok-pool-b", "svc": "tok-pool-svc"}
    users = {
        tokens["team-a"]: ("team-a", "user"),
        tokens["team-b"]: ("team-b", "user"),
        tokens["svc"]: ("ops", "admin"),
    }
    server = start_registry(work / "registry", "--tokens-file", str(write_tokens(work / "tokens.json", users)))
    yield server, tokens
    server.terminate()


def test_tenants_place_only_their_own_and_only_trainers_move(secured: tuple[ServerProcess, dict[str, str]]) -> None:
    server, tokens = secured
    stubs = {}
    for who, token in tokens.items():
        channel = grpc.intercept_channel(grpc.insecure_channel(server.address), Bearer(token))
        stubs[who] = registry_pb2_grpc.RegistryServiceStub(channel)
    base = _base()
    _trainer(stubs["svc"], base)
    mine = _place(stubs["team-a"], "team-a/policy", base).placement
    assert mine.epoch == 1
    theirs = registry_pb2.PlaceAdapterRequest(adapter="team-a/policy", base_fingerprint=base)
    assert_status(
        rpc_error(stubs["team-b"].PlaceAdapter, theirs), grpc.StatusCode.PERMISSION_DENIED, "PERMISSION_DENIED"
    )
    peek = registry_pb2.GetPlacementRequest(adapter="team-a/policy")
    assert_status(rpc_error(stubs["team-b"].GetPlacement, peek), grpc.StatusCode.PERMISSION_DENIED, "PERMISSION_DENIED")
    move = registry_pb2.MovePlacementRequest(adapter="team-a/policy", expected_epoch=1)
    assert_status(
        rpc_error(stubs["team-a"].MovePlacement, move), grpc.StatusCode.PERMISSION_DENIED, "PERMISSION_DENIED"
    )
    record = registry_pb2.RecordPlacementStateRequest(adapter="team-a/policy", epoch=1, state_id="sha256:" + "4" * 64)
    denied = rpc_error(stubs["team-a"].RecordPlacementState, record)
    assert_status(denied, grpc.StatusCode.PERMISSION_DENIED, "PERMISSION_DENIED")
    assert stubs["team-a"].GetPlacement(peek).placement.epoch == 1  # nothing changed

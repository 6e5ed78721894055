"""A sampler process as a member of the fleet: it registers with its address, base fingerprint, slots and zone,
beats its load and resident versions, names itself in every response, comes back after the registry restarts
on an emptied Redis, and on SIGTERM is DRAINING in the registry before its health says NOT_SERVING."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import redis
from memberutil import assert_drains_before_health_flips
from registryutil import create_adapter, publish_lora, unique_name
from samplerutil import greedy, prompt, wait_until
from serverproc import ServerProcess, start_registry, start_sampler
from storeservers import free_port
from trainerutil import model_input
from typer.testing import CliRunner

from opentinker.cli.main import app
from opentinker.client import RegistryClient
from opentinker.registry.embedded_redis import EmbeddedRedis
from opentinker.v1 import registry_pb2, registry_pb2_grpc, sampler_pb2, sampler_pb2_grpc

BEAT_S = 0.2


@dataclass
class Member:
    redis: EmbeddedRedis
    registry_args: tuple[str, ...]
    registry: ServerProcess
    sampler_server: ServerProcess
    workdir: Path

    def registry_stub(self) -> registry_pb2_grpc.RegistryServiceStub:
        return registry_pb2_grpc.RegistryServiceStub(grpc.insecure_channel(self.registry.address))

    def sampler(self) -> sampler_pb2_grpc.SamplerServiceStub:
        return sampler_pb2_grpc.SamplerServiceStub(grpc.insecure_channel(self.sampler_server.address))

    def listed(self) -> list[registry_pb2.Replica]:
        replicas = self.registry_stub().ListReplicas(registry_pb2.ListReplicasRequest(), timeout=10).replicas
        return [r for r in replicas if r.address == self.sampler_server.address]


@pytest.fixture(scope="module")
def member(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Member]:
    workdir = tmp_path_factory.mktemp("membership")
    redis_server = EmbeddedRedis(workdir / "redis").start()
    args = ("--redis-url", redis_server.url, "--port", str(free_port()))  # one address across restarts
    registry = start_registry(workdir / "registry", *args)
    flags = ("--heartbeat-s", str(BEAT_S), "--lease-beats", "3", "--zone", "zone-a", "--max-slots", "4")
    sampler = start_sampler(workdir / "sampler", tiny_model, registry, *flags)
    state = Member(redis_server, args, registry, sampler, workdir)
    yield state
    state.sampler_server.terminate()
    state.registry.terminate()
    redis_server.stop()


def test_the_sampler_registers_and_beats_its_load_and_residents(member: Member, tiny_model: Path) -> None:
    assert wait_until(lambda: len(member.listed()) == 1, timeout=20), "the sampler did not register"
    (replica,) = member.listed()
    info = member.sampler().GetSamplerInfo(sampler_pb2.GetSamplerInfoRequest(), timeout=10)
    assert replica.base_fingerprint == info.base_model.model_digest and replica.max_slots == 4
    assert replica.role == registry_pb2.REPLICA_ROLE_SAMPLER and replica.zone == "zone-a"
    assert replica.state == registry_pb2.REPLICA_STATE_SERVING
    assert replica.lease_seconds == pytest.approx(3 * BEAT_S)
    assert replica.load.slots_total == 4
    name = unique_name("member")
    stub = member.registry_stub()
    create_adapter(stub, name)
    publish_lora(stub, tiny_model, name, seed=5)
    sampler = member.sampler()
    greedy(sampler, f"{name}@1", prompt(5), max_tokens=2)
    assert wait_until(lambda: f"{name}@1" in member.listed()[0].resident, timeout=10), member.listed()
    load = member.listed()[0].load
    assert load.slots_used >= 1 and load.kv_blocks_total > 0  # the engine's figures, as GetStats has them
    # Every response names the replica.
    stream = sampler.Sample(
        sampler_pb2.SampleRequest(
            model=f"{name}@1",
            prompt_text="hello",
            sampling_params=sampler_pb2.SamplingParams(max_tokens=3, temperature=0.0),
        ),
        timeout=60,
    )
    assert {m.replica for m in stream} == {member.sampler_server.address}
    scored = sampler.ComputeLogprobs(
        sampler_pb2.ComputeLogprobsRequest(model=f"{name}@1", inputs=[model_input(prompt(6))]), timeout=60
    )
    assert scored.replica == member.sampler_server.address and len(scored.results[0].logprobs) == 7


def test_the_sdk_and_the_cli_show_the_fleet(member: Member) -> None:
    assert wait_until(lambda: len(member.listed()) == 1, timeout=20)
    with RegistryClient(member.registry.address) as client:
        (replica,) = [r for r in client.list_replicas("sampler") if r.address == member.sampler_server.address]
        assert replica.serving and replica.state == "serving" and replica.role == "sampler"
        assert replica.zone == "zone-a" and replica.max_slots == 4 and replica.load.slots_total == 4
        assert replica.heartbeat_time is not None and replica.register_time is not None
        assert not [r for r in client.list_replicas("trainer") if r.address == member.sampler_server.address]
        watch = client.watch_replicas()
        first = next(watch)
        assert first.snapshot and replica.replica_id in {r.replica_id for r in first.replicas}
        watch.close()
    result = CliRunner().invoke(app, ["fleet", "status", "--registry", member.registry.address, "--json"])
    assert result.exit_code == 0, result.output
    shown = [r for r in json.loads(result.stdout) if r["replica_id"] == replica.replica_id]
    assert shown and shown[0]["address"] == member.sampler_server.address and shown[0]["state"] == "serving"
    table = CliRunner().invoke(app, ["fleet", "status", "--registry", member.registry.address], env={"COLUMNS": "250"})
    assert table.exit_code == 0 and replica.replica_id in table.stdout and "zone-a" in table.stdout
    bad = CliRunner().invoke(app, ["fleet", "status", "--registry", member.registry.address, "--role", "x"])
    assert bad.exit_code == 2


def test_membership_comes_back_after_a_registry_restart_on_an_empty_redis(member: Member) -> None:
    assert wait_until(lambda: len(member.listed()) == 1, timeout=20)
    before = member.listed()[0].replica_id
    member.registry.process.kill()
    member.registry.process.wait()
    member.registry.kill()
    redis.Redis.from_url(member.redis.url).flushall()  # everything the registry knew of the fleet is gone
    member.registry = start_registry(member.workdir / "registry", *member.registry_args)
    started = time.monotonic()
    assert wait_until(lambda: len(member.listed()) == 1, timeout=20), "the replica did not register again"
    print(f"replica back {time.monotonic() - started:.2f} s after the registry served again")
    assert member.listed()[0].replica_id == before  # the same process, registered again


def test_sigterm_drains_in_the_registry_before_health_flips(member: Member) -> None:
    assert wait_until(lambda: len(member.listed()) == 1, timeout=20)
    assert_drains_before_health_flips(member.sampler_server, member.listed)

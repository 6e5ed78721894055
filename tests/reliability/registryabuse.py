"""Helpers of the registry's noisy-neighbour tests (test_noisy_registry.py): a client of the module's registry
(tokens, its Redis, its memory), the status a refused call got, team-b's workload run beside an abuse, and the
admin CLI."""

from __future__ import annotations

import os
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc
import redis
from registryutil import create_adapter, publish, unique_name
from serverproc import ServerProcess, opentinker_command

from opentinker.cli.launch import tree_memory
from opentinker.rpc.serving.errors import error_info
from opentinker.v1 import registry_pb2, registry_pb2_grpc

Stub = registry_pb2_grpc.RegistryServiceStub


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

    def redis_clients(self) -> int:
        client = redis.Redis.from_url(self.redis_url)
        try:
            return int(client.info("clients")["connected_clients"]) - 1  # not counting this one
        finally:
            client.close()

    def memory(self) -> int:
        return tree_memory(self.server.process.pid)


def status_of(error: grpc.RpcError) -> tuple[str, str]:
    info = error_info(error)
    return error.code().name, info.reason if info else ""


def wait_until(check: Callable[[], bool], timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.05)
    return check()


@dataclass
class TeamB:
    """team-b's normal registry workload: create, upload + publish, read back, and watch its own events."""

    registry: Registry
    rounds: int
    errors: list[str]
    versions: list[int]
    watched: list[int]

    def run(self) -> None:
        stub, md = self.registry.stub(), self.registry.md("team-b")
        name = f"team-b/{unique_name('steady')}"
        try:
            create_adapter(stub, name, metadata=md)
            watch = stub.WatchEvents(registry_pb2.WatchEventsRequest(adapters=[name], send_snapshot=True), metadata=md)
            assert next(watch).HasField("reconcile")
            for i in range(self.rounds):
                published = publish(stub, name, seed=i, metadata=md)
                self.versions.append(published.version.version)
                stub.GetAdapter(registry_pb2.GetAdapterRequest(name=name), metadata=md)
                self.watched.append(next(watch).event.version)
            watch.cancel()
        except grpc.RpcError as error:
            self.errors.append(f"{error.code().name}: {error.details()}")


def team_b(registry: Registry, rounds: int = 8) -> tuple[TeamB, threading.Thread]:
    workload = TeamB(registry, rounds, [], [], [])
    thread = threading.Thread(target=workload.run)
    return workload, thread


def admin_cli(registry: Registry, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OPENTINKER_")}
    return subprocess.run(
        opentinker_command("registry", *args, "--registry", registry.server.address, "--token", registry.tokens["ops"]),
        capture_output=True,
        text=True,
        timeout=120,
        env={**env, "COLUMNS": "200"},
    )

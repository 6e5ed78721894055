"""Checks every fleet member (a sampler or a trainer process) must pass."""

from __future__ import annotations

import signal
from collections.abc import Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from serverproc import ServerProcess

from opentinker.v1 import registry_pb2


def assert_drains_before_health_flips(server: ServerProcess, listed: Callable[[], list[registry_pb2.Replica]]) -> None:
    """SIGTERM to ``server``: the moment its health leaves SERVING, the registry (``listed``: its records there)
    already has it DRAINING, so routers stopped first; then it exits 0."""
    channel = grpc.insecure_channel(server.address)
    health = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(), timeout=60)
    assert next(health).status == health_pb2.HealthCheckResponse.SERVING
    server.process.send_signal(signal.SIGTERM)
    for update in health:
        if update.status != health_pb2.HealthCheckResponse.SERVING:
            break
    (replica,) = listed()
    assert replica.state == registry_pb2.REPLICA_STATE_DRAINING
    channel.close()
    assert server.process.wait(30) == 0

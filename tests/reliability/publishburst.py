"""Publish bursts of the fault tests (tests/reliability/test_fault_*_kill.py): clients that each upload and
publish a run of distinct snapshots through a registry or Redis kill, and record what was acknowledged."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from registryutil import lora_files, upload

from opentinker.v1 import common_pb2, registry_pb2, registry_pb2_grpc


@dataclass
class Publisher:
    """One client of a publish burst: what it got acknowledged and every failure it saw on the way."""

    index: int
    acked: dict[str, registry_pb2.Version] = field(default_factory=dict)  # request id -> version
    uris: dict[str, str] = field(default_factory=dict)  # request id -> uploaded artifact uri
    failures: list[tuple[grpc.StatusCode, str]] = field(default_factory=list)  # (code, ErrorInfo reason)


def publish_burst(
    stub: registry_pb2_grpc.RegistryServiceStub, model: Path, name: str, me: Publisher, count: int
) -> None:
    """Uploads and publishes `count` distinct snapshots, each with its own request id, retrying through
    UNAVAILABLE with the same request id (a publish that did land is then replayed, not repeated). Stops at
    the first other failure, which the caller sees in `failures`."""
    from opentinker.rpc.serving.errors import error_info

    for n in range(count):
        request_id = f"p{me.index}-{n}"
        deadline = time.monotonic() + 90
        while True:
            try:
                if request_id not in me.uris:  # an acknowledged upload is committed and survives restarts
                    me.uris[request_id] = upload(stub, lora_files(model, seed=1000 * me.index + n), timeout=30)
                request = registry_pb2.PublishVersionRequest(
                    adapter=name,
                    artifact_uri=me.uris[request_id],
                    request_id=request_id,
                    lora_config=common_pb2.LoraConfig(rank=4, alpha=4.0, target_modules=["q_proj", "v_proj"]),
                )
                me.acked[request_id] = stub.PublishVersion(request, timeout=30).version
                break
            except grpc.RpcError as error:
                info = error_info(error)
                me.failures.append((error.code(), info.reason if info else ""))
                if error.code() != grpc.StatusCode.UNAVAILABLE or time.monotonic() > deadline:
                    return
                time.sleep(0.05)

"""What a client reads when a server's own dependencies fail: a stable code, a message that says what to do and
a request id, never the server's internals (a Redis host:port, a file path, an exception's text, a traceback).
The details go to the server's log under the same request id.

One private stack (registry on its own Redis, trainer, sampler, and a gateway keeping its state in the same
Redis) meets three failures in turn, each through every surface a client has: a file missing from the artifact
store, Redis stopped, the registry stopped.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import pytest
from registryutil import create_adapter, publish_lora, unique_name
from serverproc import ServerProcess, opentinker_command, registry_store
from trainerutil import model_input

from opentinker.client.errors import OpenTinkerError, from_rpc_error
from opentinker.registry.embedded_redis import EmbeddedRedis
from opentinker.v1 import (
    common_pb2,
    registry_pb2,
    registry_pb2_grpc,
    sampler_pb2,
    sampler_pb2_grpc,
    trainer_pb2,
    trainer_pb2_grpc,
)

KEY = "tml-redaction-key-0123456789abcdef"
TENANT = "red"
CLIENT_ID = "client-chosen-id.42"


@dataclass
class Stack:
    redis: EmbeddedRedis
    servers: dict[str, ServerProcess]
    gateway: ServerProcess
    registry: registry_pb2_grpc.RegistryServiceStub
    trainer: trainer_pb2_grpc.TrainerServiceStub
    sampler: sampler_pb2_grpc.SamplerServiceStub
    http: httpx.Client
    store: Path
    workdir: Path
    adapter: str

    def internals(self) -> list[str]:
        """Strings no client may see: every address and directory of this stack."""
        found = [str(self.workdir), str(self.store), f"127.0.0.1:{self.redis.port}", str(self.redis.port)]
        for server in [*self.servers.values(), self.gateway]:
            found.append(server.address)
        return found


@pytest.fixture(scope="module")
def stack(
    start_stack: Callable[..., dict[str, ServerProcess]], tmp_path_factory: pytest.TempPathFactory, tiny_model: Path
) -> Iterator[Stack]:
    workdir = tmp_path_factory.mktemp("redaction")
    redis_server = EmbeddedRedis(workdir / "redis").start()
    servers = start_stack("redaction", registry_args=("--redis-url", redis_server.url))
    keys = workdir / "keys.json"
    keys.write_text(json.dumps({"keys": [{"key": KEY, "tenant": TENANT}]}))
    args = opentinker_command(
        "gateway",
        "serve",
        "--trainer",
        servers["trainer"].address,
        "--sampler",
        servers["sampler"].address,
        "--registry",
        servers["registry"].address,
        "--keys-file",
        str(keys),
        "--port",
        "0",
        "--redis-url",
        f"{redis_server.url.rstrip('/')}/1",
    )
    gateway = ServerProcess(args, workdir / "gateway")
    channels = [grpc.insecure_channel(servers[name].address) for name in ("registry", "trainer", "sampler")]
    http = httpx.Client(base_url=f"http://{gateway.address}", timeout=60, headers={"X-API-Key": KEY})
    try:
        registry = registry_pb2_grpc.RegistryServiceStub(channels[0])
        adapter = f"{TENANT}/{unique_name('redact')}"
        create_adapter(registry, adapter)
        publish_lora(registry, tiny_model, adapter, seed=1)
        yield Stack(
            redis_server,
            servers,
            gateway,
            registry,
            trainer_pb2_grpc.TrainerServiceStub(channels[1]),
            sampler_pb2_grpc.SamplerServiceStub(channels[2]),
            http,
            registry_store(servers["registry"]),
            workdir,
            adapter,
        )
    finally:
        http.close()
        for channel in channels:
            channel.close()
        gateway.terminate()
        redis_server.stop()


def assert_clean(text: str, stack: Stack) -> None:
    """No address, path, exception name, errno or traceback of the stack in `text`."""
    for secret in stack.internals():
        assert secret not in text, f"{secret!r} leaked: {text}"
    assert not re.search(r"\d{1,3}(\.\d{1,3}){3}:\d+|localhost:\d+|ipv[46]:", text), text
    assert not re.search(r"(^|[\s'\"(=])/(tmp|home|root|var|work|usr|proc)/", text), text
    assert "Traceback" not in text and 'File "' not in text, text
    assert not re.search(r"\b[A-Z]\w*(Error|Exception)\b|\[Errno \d+\]|errno", text), text


def rpc_failure(call: Callable[[], object]) -> OpenTinkerError:
    try:
        result = call()
        if isinstance(result, Iterable):  # a stream fails at its first message
            list(result)
    except grpc.RpcError as error:
        return from_rpc_error(error)
    raise AssertionError("the call succeeded")


def check_rpc(error: OpenTinkerError, stack: Stack, server: str, code: grpc.StatusCode, reason: str) -> str:
    """The status is the expected one, says nothing internal, carries a request id, and the server's log has
    a line with that id."""
    assert (error.code, error.reason) == (code, reason), error
    assert_clean(error.message, stack)
    assert_clean(json.dumps(error.metadata), stack)
    request_id = error.request_id
    assert request_id and f"(request {request_id})" in error.message, error
    log = stack.servers[server].log()
    assert any(request_id in line for line in log.splitlines()), f"no log line for {request_id}:\n{log[-3000:]}"
    return request_id


def sample(stack: Stack, model: str, request_id: str | None = None) -> OpenTinkerError:
    request = sampler_pb2.SampleRequest(
        model=model,
        prompt=model_input([1, 2, 3]),
        sampling_params=sampler_pb2.SamplingParams(max_tokens=2),
    )
    metadata = (("x-request-id", request_id),) if request_id else None
    return rpc_failure(lambda: stack.sampler.Sample(request, timeout=60, metadata=metadata))


def check_http(response: httpx.Response, stack: Stack, status: int) -> str:
    assert response.status_code == status, response.text
    assert_clean(response.text, stack)
    request_id = str(response.headers.get("x-request-id", ""))
    assert request_id and request_id in response.text, (response.headers, response.text)
    return request_id


def chat(stack: Stack, model: str) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    return stack.http.post("/v1/chat/completions", json=body)


# Each failure builds on the one before (a module-scoped stack, ordered tests): first a file missing from the
# store, then Redis stopped, then the registry stopped.


def test_a_file_missing_from_the_store(stack: Stack, tiny_model: Path) -> None:
    version = publish_lora(stack.registry, tiny_model, stack.adapter, seed=2)
    digest = version.artifact_uri.rpartition(":")[2]
    matches = [p for p in stack.store.rglob("adapter_model.safetensors") if digest in str(p)]
    assert matches, f"artifact {version.artifact_uri} not under {stack.store}"
    matches[0].unlink()
    download = registry_pb2.DownloadArtifactRequest(artifact_uri=version.artifact_uri)
    error = rpc_failure(lambda: stack.registry.DownloadArtifact(download, timeout=30))
    check_rpc(error, stack, "registry", grpc.StatusCode.DATA_LOSS, "DIGEST_MISMATCH")
    reference = f"{stack.adapter}@{version.version}"
    # The caller's own request id is kept: it names the call in the sampler's log.
    request_id = check_rpc(
        sample(stack, reference, CLIENT_ID), stack, "sampler", grpc.StatusCode.DATA_LOSS, "DIGEST_MISMATCH"
    )
    assert request_id == CLIENT_ID
    trainer_error = rpc_failure(
        lambda: stack.trainer.CreateAdapter(
            trainer_pb2.TrainerServiceCreateAdapterRequest(
                name=f"{TENANT}/{unique_name('from')}",
                init_from=f"{stack.adapter}@{version.version}",
                lora_config=common_pb2.LoraConfig(rank=4, alpha=4.0, target_modules=["q_proj", "v_proj"]),
            ),
            timeout=60,
        )
    )
    check_rpc(trainer_error, stack, "trainer", grpc.StatusCode.DATA_LOSS, "DIGEST_MISMATCH")
    response = chat(stack, f"{stack.adapter.partition('/')[2]}@{version.version}")
    check_http(response, stack, 500)
    assert response.json()["error"]["code"] == "digest_mismatch", response.text


def test_redis_stopped(stack: Stack) -> None:
    stack.redis.stop()
    get = registry_pb2.GetAdapterRequest(name=stack.adapter)
    error = rpc_failure(lambda: stack.registry.GetAdapter(get, timeout=30))
    request_id = check_rpc(error, stack, "registry", grpc.StatusCode.UNAVAILABLE, "STORE_UNAVAILABLE")
    # The log line under the id has what the client was not told.
    line = next(line for line in stack.servers["registry"].log().splitlines() if request_id in line)
    assert "detail: Redis:" in line, line
    listing = registry_pb2.ListVersionsRequest(adapter=stack.adapter)
    error = rpc_failure(lambda: stack.registry.ListVersions(listing, timeout=30))
    check_rpc(error, stack, "registry", grpc.StatusCode.UNAVAILABLE, "STORE_UNAVAILABLE")
    # Through the sampler (resolving a version it has not loaded) and the trainer (registering an adapter).
    sampled = sample(stack, f"{stack.adapter}@latest", "through-sampler-1")
    check_rpc(sampled, stack, "sampler", grpc.StatusCode.UNAVAILABLE, "REGISTRY_UNAVAILABLE")
    # The registry logged the sampler's call to it under the client's id.
    assert "through-sampler-1" in stack.servers["registry"].log()
    create = trainer_pb2.TrainerServiceCreateAdapterRequest(
        name=f"{TENANT}/{unique_name('new')}", lora_config=common_pb2.LoraConfig(rank=4, alpha=4.0)
    )
    error = rpc_failure(lambda: stack.trainer.CreateAdapter(create, timeout=60))
    check_rpc(error, stack, "trainer", grpc.StatusCode.UNAVAILABLE, "REGISTRY_UNAVAILABLE")
    # The gateway: its state store is this Redis (tinker's create_session), its servers' registry too (/v1).
    session = stack.http.post("/api/v1/create_session", json={"tags": [], "sdk_version": "0.38.0"})
    request_id = check_http(session, stack, 503)
    assert session.json()["error"] == "STATE_STORE_UNAVAILABLE" and session.json()["request_id"] == request_id
    assert request_id in stack.gateway.log()
    check_http(chat(stack, f"{stack.adapter.partition('/')[2]}@latest"), stack, 503)


def test_registry_stopped(stack: Stack) -> None:
    stack.servers["registry"].terminate()
    error = sample(stack, f"{stack.adapter}@7")
    request_id = check_rpc(error, stack, "sampler", grpc.StatusCode.UNAVAILABLE, "REGISTRY_UNAVAILABLE")
    line = next(line for line in stack.servers["sampler"].log().splitlines() if request_id in line)
    assert stack.servers["registry"].address in line or "registry call failed" in line, line
    check_http(chat(stack, f"{stack.adapter.partition('/')[2]}@7"), stack, 503)


def test_a_server_behind_the_gateway_stopped(stack: Stack) -> None:
    stack.servers["sampler"].terminate()
    response = chat(stack, "base")
    request_id = check_http(response, stack, 503)
    assert "did not answer" in response.text, response.text
    # gRPC's own text (the sampler's address) is in the gateway's log, under the id the client got.
    line = next(line for line in stack.gateway.log().splitlines() if request_id in line)
    assert "backend call failed" in line, line

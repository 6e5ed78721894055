"""Calling and checking of the RPC fuzz tests (test_fuzz_rpcs.py): one fuzzed call as raw bytes, the listings a
refused call must leave unchanged, the per-RPC case counts, and the servers' health."""

from __future__ import annotations

import time
from collections import Counter

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from rpcfuzzstrategies import DELIBERATE, Fuzz, method_of

from opentinker.rpc.serving.errors import ERROR_DOMAIN, error_info
from opentinker.v1 import registry_pb2, sampler_pb2, trainer_pb2

COUNTS: Counter[str] = Counter()
WATCHES = frozenset({"RegistryService/WatchEvents", "RegistryService/WatchReplicas"})
CODES: Counter[tuple[str, str]] = Counter()


# --- calling and checking -----------------------------------------------------------------------------------


def raw(data: bytes) -> bytes:
    """The (de)serializer of fuzzed calls: bytes go on the wire as they are."""
    return data


def call(fuzz: Fuzz, rpc: str, requests: list[bytes]) -> grpc.StatusCode:
    """Sends one fuzzed call (raw bytes) and returns its status; streams are read to their end."""
    label, method = method_of(rpc)
    channel = fuzz.channels[label]
    path = f"/{method.containing_service.full_name}/{method.name}"
    timeout = 0.3 if rpc in WATCHES else 60.0  # a valid watch never ends
    try:
        if method.client_streaming:
            channel.stream_unary(path, raw, raw)(iter(requests), timeout=timeout)
        elif method.server_streaming:
            for _ in channel.unary_stream(path, raw, raw)(requests[0], timeout=timeout):
                pass
        else:
            channel.unary_unary(path, raw, raw)(requests[0], timeout=timeout)
    except grpc.RpcError as error:
        assert isinstance(error, grpc.Call)
        code = error.code()
        if code == grpc.StatusCode.DEADLINE_EXCEEDED and rpc in WATCHES:
            return grpc.StatusCode.OK  # the watch was accepted and stayed open
        assert code in DELIBERATE, f"{rpc}: {code.name}: {error.details()}"
        info = error_info(error)
        assert info is not None and info.domain == ERROR_DOMAIN, f"{rpc}: {code.name} without ErrorInfo: {error}"
        assert "Traceback" not in (error.details() or "")
        return code
    return grpc.StatusCode.OK


def state(fuzz: Fuzz, *, settle: bool = False) -> tuple[bytes, ...]:
    """Every listing a rejected call must leave as it was. settle: after an accepted sampler call, whose
    sequences release their slot references and count their tokens on the engine thread just after the
    stream ends, wait until the sampler is idle and two reads agree."""
    deadline = time.monotonic() + 5
    current = _read_state(fuzz)
    while settle and time.monotonic() < deadline:
        time.sleep(0.02)
        current, previous = _read_state(fuzz), current
        if current == previous and current[-1] == IDLE:
            break
    return current[:-1]


IDLE = b"0"  # the last item of a raw state: sequences running or waiting, plus slot references held


def _read_state(fuzz: Fuzz) -> tuple[bytes, ...]:
    channels = fuzz.channels
    adapters = channels["registry"].unary_unary(
        "/opentinker.v1.RegistryService/ListAdapters",
        request_serializer=registry_pb2.ListAdaptersRequest.SerializeToString,
        response_deserializer=registry_pb2.ListAdaptersResponse.FromString,
    )(registry_pb2.ListAdaptersRequest(page_size=1000), timeout=30)
    training = channels["trainer"].unary_unary(
        "/opentinker.v1.TrainerService/ListAdapters",
        request_serializer=trainer_pb2.TrainerServiceListAdaptersRequest.SerializeToString,
        response_deserializer=trainer_pb2.TrainerServiceListAdaptersResponse.FromString,
    )(trainer_pb2.TrainerServiceListAdaptersRequest(), timeout=30)
    loaded = channels["sampler"].unary_unary(
        "/opentinker.v1.SamplerService/ListLoaded",
        request_serializer=sampler_pb2.ListLoadedRequest.SerializeToString,
        response_deserializer=sampler_pb2.ListLoadedResponse.FromString,
    )(sampler_pb2.ListLoadedRequest(), timeout=30)
    references = sum(a.active_requests for a in loaded.adapters)
    for adapter in loaded.adapters:
        adapter.ClearField("active_requests")  # released at the engine's next step after a stream ends
    stats = channels["sampler"].unary_unary(
        "/opentinker.v1.SamplerService/GetStats",
        request_serializer=sampler_pb2.GetStatsRequest.SerializeToString,
        response_deserializer=sampler_pb2.GetStatsResponse.FromString,
    )(sampler_pb2.GetStatsRequest(), timeout=30)
    counters = sampler_pb2.GetStatsResponse(tokens_generated=stats.tokens_generated, slots_used=stats.slots_used)
    busy = str(references + stats.running_requests + stats.waiting_requests).encode()
    return (*(m.SerializeToString(deterministic=True) for m in (adapters, training, loaded, counters)), busy)


def check_case(fuzz: Fuzz, rpc: str, requests: list[bytes]) -> None:
    # Nothing else changes state here: the state after the previous case is the state before this one.
    before = fuzz.last_state or state(fuzz)
    code = call(fuzz, rpc, requests)
    COUNTS[rpc] += 1
    CODES[rpc, code.name] += 1
    fuzz.last_state = state(fuzz, settle=code == grpc.StatusCode.OK and rpc.startswith("SamplerService/"))
    if code != grpc.StatusCode.OK:
        assert fuzz.last_state == before, f"{rpc} was refused with {code.name} but changed state"


def assert_all_serving(fuzz: Fuzz) -> None:
    for label, server in fuzz.servers.items():
        assert server.process.poll() is None, f"{label} died:\n{server.log()[-3000:]}"
        response = health_pb2_grpc.HealthStub(fuzz.channels[label]).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert response.status == health_pb2.HealthCheckResponse.SERVING, label

"""Grammar compiles are a shared path (the sampler's compile threads, and the engine process's, where a matcher is
compiled again since it cannot cross the pipe): on a real sampler with tokens for two tenants, team-a floods it
with schemas that each take llguidance ~0.3 s to compile (1,000 bounded integers, salted so nothing is cached),
and team-b's free samples and its own constrained requests with fresh schemas, sent once team-a's first request
is done, complete while a quarter or more of team-a's flood is unfinished (~9 of 12 here). Before, both compile
paths served the flood first: two shared threads in arrival order at the edge, and the engine process's reader
thread, which compiled each submit inline while every other submit (free ones too) waited. A tenant's waiting
compiles are bounded (--max-compiles-per-tenant): past it, RESOURCE_EXHAUSTED TENANT_COMPILES_FULL naming the
limit, and the other tenant is not refused.

Asserted by counts and order (which requests were unfinished when team-b's were done), never by timings."""

from __future__ import annotations

import concurrent.futures
import json
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
from samplerutil import Result, collect, params, prompt, request, wait_until
from serverproc import ServerProcess, start_sampler
from tlsutil import write_tokens
from trainerutil import assert_status

from opentinker.v1 import sampler_pb2, sampler_pb2_grpc

TOKENS = {"tok-ct-a": ("team-a", "user"), "tok-ct-b": ("team-b", "user")}
FLOOD = 12  # team-a's slow schemas at once, under the default --max-compiles-per-tenant (16)
LIMIT = 16

Stub = sampler_pb2_grpc.SamplerServiceStub


@pytest.fixture(scope="module")
def server(
    tiny_model: Path, registry_server: ServerProcess, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    workdir = tmp_path_factory.mktemp("constraint-tenants")
    tokens = write_tokens(workdir / "tokens.json", TOKENS)
    proc = start_sampler(workdir, tiny_model, registry_server, "--tokens-file", str(tokens))  # engine process: on
    yield proc
    assert proc.terminate() == 0, proc.log()


@pytest.fixture(scope="module")
def sampler(server: ServerProcess) -> Iterator[Stub]:
    with grpc.insecure_channel(server.address) as channel:
        yield Stub(channel)


def auth(tenant: str) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer tok-ct-{tenant[-1]}")]


def waiting(sampler: Stub, tenant: str) -> int:
    stats: sampler_pb2.GetStatsResponse = sampler.GetStats(sampler_pb2.GetStatsRequest(), metadata=auth(tenant))
    return stats.waiting_requests


def slow_schema(salt: int) -> str:
    """~80 KB: 1,000 required integers, each with bounds (a regex of its own), ~0.3 s of llguidance's compile."""
    fields = {
        f"f{salt}_{i}": {"type": "integer", "minimum": 12345 + i, "maximum": 987654321 + 7 * i} for i in range(1000)
    }
    return json.dumps({"type": "object", "properties": fields, "required": list(fields), "additionalProperties": False})


def small_schema(salt: int) -> str:
    fields = {f"ok{salt}": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 9}}
    return json.dumps({"type": "object", "properties": fields, "required": list(fields), "additionalProperties": False})


class Flood:
    """team-a's requests, each with its own slow schema, sent at once from threads; what became of each."""

    def __init__(self, sampler: Stub, count: int, salt: int) -> None:
        self.count = count
        self.lock = threading.Lock()
        self.finished: list[Result] = []
        self.refused: list[grpc.RpcError] = []
        self.streams: list[grpc.Call] = []
        self._pool = concurrent.futures.ThreadPoolExecutor(count)
        self._jobs = [self._pool.submit(self._one, sampler, salt + i) for i in range(count)]

    def _one(self, sampler: Stub, salt: int) -> None:
        constraint = sampler_pb2.Constraint(json_schema=slow_schema(salt))
        stream = sampler.Sample(
            request("base", prompt(salt), params(max_tokens=2), constraint=constraint),
            metadata=auth("team-a"),
            timeout=120,
        )
        with self.lock:
            self.streams.append(stream)
        try:
            result = collect(stream)
        except grpc.RpcError as error:
            with self.lock:
                self.refused.append(error)
            return
        with self.lock:
            self.finished.append(result)

    def unfinished(self) -> int:
        with self.lock:
            return self.count - len(self.finished) - len(self.refused)

    def admitted(self, sampler: Stub) -> bool:
        """Every request refused or counted in team-a's samples waiting or running on the sampler (the client's
        counts are read first: a request that ends meanwhile is counted nowhere, never twice)."""
        with self.lock:
            ended = len(self.finished) + len(self.refused)
        own: sampler_pb2.GetStatsResponse = sampler.GetStats(
            sampler_pb2.GetStatsRequest(), metadata=auth("team-a"), timeout=30
        )
        return ended + own.waiting_requests + own.running_requests == self.count

    def wait(self) -> None:
        for job in self._jobs:
            job.result(timeout=300)
        self._pool.shutdown()


def team_b(sampler: Stub, salt: int) -> list[Result]:
    """Free samples and constrained requests with schemas never sent before, one after another."""
    results = []
    for i in range(2):
        free = request("base", prompt(500 + salt + i), params(max_tokens=6))
        results.append(collect(sampler.Sample(free, metadata=auth("team-b"), timeout=120)))
        constraint = sampler_pb2.Constraint(json_schema=small_schema(salt + i))
        constrained = request("base", prompt(600 + salt + i), params(max_tokens=60), constraint=constraint)
        results.append(collect(sampler.Sample(constrained, metadata=auth("team-b"), timeout=120)))
    return results


def test_a_tenants_slow_schemas_never_stall_anothers_requests(
    sampler: Stub, record_property: Callable[[str, object], None]
) -> None:
    flood = Flood(sampler, FLOOD, salt=1000)
    # Once team-a's first request is done, the rest of its flood (sent with it) waits for its compiles.
    assert wait_until(lambda: bool(flood.finished or flood.refused), timeout=60), "team-a's flood never started"
    assert not flood.refused, [e.details() for e in flood.refused]
    results = team_b(sampler, salt=1)
    unfinished = flood.unfinished()  # team-a's requests still compiling or queued when team-b's were all done
    record_property("team-a's requests unfinished when team-b's were done", f"{unfinished} of {FLOOD}")
    for index, result in enumerate(results):
        sample = result.only
        if index % 2:  # constrained: complete, valid objects
            assert sample.stop_reason == sampler_pb2.STOP_REASON_STOP_TOKEN, sample.text
            value = json.loads(sample.text)
            assert set(value) == {f"ok{1 + index // 2}", "n"} and 0 <= value["n"] <= 9, value
        else:
            assert len(sample.tokens) == 6
    # Before, team-b's compiles waited behind the whole flood (at the edge and in the engine process): unfinished 0.
    assert unfinished >= FLOOD // 4, f"only {unfinished} of team-a's {FLOOD} requests were unfinished"
    flood.wait()
    assert len(flood.finished) == FLOOD and not flood.refused  # the flood itself completes, each in its turn
    assert all(r.only.stop_reason == sampler_pb2.STOP_REASON_LENGTH for r in flood.finished)


def test_a_tenants_waiting_compiles_are_bounded_and_another_is_not_refused(sampler: Stub) -> None:
    flood = Flood(sampler, LIMIT + 6, salt=2000)  # one compiling, LIMIT waiting: the rest refused at once
    assert wait_until(lambda: flood.admitted(sampler), timeout=60), "team-a's flood never got in"
    with flood.lock:
        refused = list(flood.refused)
    assert refused, "no request of team-a's flood was refused"
    for error in refused:
        metadata = assert_status(error, grpc.StatusCode.RESOURCE_EXHAUSTED, "TENANT_COMPILES_FULL")
        assert metadata["limit"] == str(LIMIT) and metadata["tenant"] == "team-a", metadata
        assert f"{LIMIT} grammars waiting" in (error.details() or "")
        assert "--max-compiles-per-tenant" in (error.details() or "")
    results = team_b(sampler, salt=3)  # team-b's fresh schemas are not refused
    assert all(r.only.stop_reason != sampler_pb2.STOP_REASON_UNSPECIFIED for r in results)
    with flood.lock:
        streams = list(flood.streams)
    for stream in streams:  # team-a leaves: none of its requests stays counted as waiting
        stream.cancel()
    flood.wait()
    assert wait_until(lambda: waiting(sampler, "team-a") == 0)

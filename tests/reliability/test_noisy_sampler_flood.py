"""Noisy neighbours on the sampler's batch (case "sampler batch share"): team-a floods a small sampler (4 KV
slots, a waiting queue of 8) with long requests, more than its queue cap; team-b's normal seeded requests, sent
after the flood, are neither refused (the default cap leaves a quarter of the queue to others) nor kept waiting
(they run at once in the slot team-a may not take). Two user tenants and an admin with tokens, real processes (registry
and sampler with its engine process, the CPU default)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest
from faultutil import wait_for
from registryutil import lora_files, upload
from samplerutil import Outputs, collect, params, request, seeded_samples
from tenantstack import TenantStack, tenant_stack
from trainerutil import assert_status, random_tokens, rpc_error

from opentinker.cli.launch import tree_memory
from opentinker.v1 import common_pb2, registry_pb2, sampler_pb2

MiB = 2**20
MEMORY_BOUND = 64 * MiB  # the sampler's PSS after the flood, above its PSS before
MAX_SEQS = 4
TEAM_A_SLOTS = 3  # --max-seqs-per-tenant's default: 3/4 of --max-seqs
MAX_WAITING = 8
QUEUE_CAP = 6  # --max-queued-per-tenant's default: 3/4 of --max-waiting (equal to it, team-b would be refused)
REFUSED = 4  # team-a's requests beyond its queue cap
LONG = 1000  # tokens of each of team-a's requests: far longer than all of team-b's workload


@dataclass
class Flood(TenantStack):
    baseline: Outputs = field(default_factory=list)  # team-b's workload alone

    def stats(self, who: str) -> sampler_pb2.GetStatsResponse:
        response: sampler_pb2.GetStatsResponse = self.sampler.GetStats(
            sampler_pb2.GetStatsRequest(), metadata=self.md(who), timeout=60
        )
        return response


def workload(flood: Flood) -> Outputs:
    return seeded_samples(flood.sampler, flood.md("team-b"))


def long_prompt(flood: Flood) -> list[int]:
    """A prompt whose greedy base-model continuation runs all LONG tokens (no end-of-sequence token)."""
    for seed in range(20):
        tokens = random_tokens(30_000 + seed, 8)
        req = request("base", tokens, params(max_tokens=LONG))
        result = collect(flood.sampler.Sample(req, metadata=flood.md("team-a"), timeout=300))
        if result.samples[0].stop_reason == sampler_pb2.STOP_REASON_LENGTH:
            return tokens
    raise AssertionError(f"no prompt of 20 runs {LONG} greedy tokens")


class Streams:
    """team-a's open streams, each read to its end on a thread of its own; counts those that finished."""

    def __init__(self, flood: Flood, tokens: list[int]) -> None:
        self.flood, self.tokens = flood, tokens
        self.calls: list[Any] = []  # gRPC's stream calls: iterators with cancel()
        self.threads: list[threading.Thread] = []
        self.finished = 0
        self.errors: list[grpc.StatusCode] = []
        self._lock = threading.Lock()

    def open(self, count: int) -> None:
        for _ in range(count):
            call = self.flood.sampler.Sample(
                request("base", self.tokens, params(max_tokens=LONG)), metadata=self.flood.md("team-a"), timeout=600
            )
            thread = threading.Thread(target=self._read, args=(call,), daemon=True)
            self.calls.append(call)
            self.threads.append(thread)
            thread.start()

    def _read(self, call: Iterator[sampler_pb2.SampleResponse]) -> None:
        try:
            for _ in call:
                pass
        except grpc.RpcError as error:
            with self._lock:
                self.errors.append(error.code())
            return
        with self._lock:
            self.finished += 1

    def close(self) -> None:
        for call in self.calls:
            call.cancel()
        for thread in self.threads:
            thread.join(60)


@pytest.fixture(scope="module")
def flood(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Flood]:
    workdir = tmp_path_factory.mktemp("noisy-sampler-flood")
    sizes = ("--max-slots", "4", "--max-seqs", str(MAX_SEQS), "--max-waiting", str(MAX_WAITING))
    with tenant_stack(workdir, tiny_model, *sizes) as stack:
        flood = Flood(stack.registry_server, stack.sampler_server, stack.tokens, stack.registry, stack.sampler)
        registry = flood.registry
        create = registry_pb2.CreateAdapterRequest(name="team-b/policy", lora_config=common_pb2.LoraConfig(rank=4))
        registry.CreateAdapter(create, metadata=flood.md("team-b"), timeout=60)
        uri = upload(registry, lora_files(tiny_model, seed=5), metadata=flood.md("team-b"), timeout=60)
        publish = registry_pb2.PublishVersionRequest(
            adapter="team-b/policy", artifact_uri=uri, lora_config=common_pb2.LoraConfig(rank=4, alpha=4.0)
        )
        registry.PublishVersion(publish, metadata=flood.md("team-b"), timeout=60)
        flood.baseline = workload(flood)
        assert flood.baseline == workload(flood)  # seeded: the same outputs every run
        yield flood


def test_a_flood_of_long_requests_leaves_team_b_its_share_of_the_batch(
    flood: Flood, figure: Callable[[str, object], None]
) -> None:
    tokens = long_prompt(flood)
    info = flood.sampler.GetSamplerInfo(sampler_pb2.GetSamplerInfoRequest(), metadata=flood.md("ops"), timeout=60)
    assert info.max_seqs == MAX_SEQS
    memory_before = tree_memory(flood.sampler_server.process.pid)
    team_b_before = flood.stats("team-b")
    streams = Streams(flood, tokens)
    try:
        streams.open(TEAM_A_SLOTS + 1)  # one more than team-a may run: it waits, the 4th slot stays free
        assert wait_for(lambda: flood.stats("team-a").running_requests == TEAM_A_SLOTS), flood.stats("team-a")
        streams.open(QUEUE_CAP - 1)
        assert wait_for(lambda: flood.stats("team-a").waiting_requests == QUEUE_CAP), flood.stats("team-a")
        team_a, everyone = flood.stats("team-a"), flood.stats("ops")
        assert (team_a.running_requests, team_a.kv_cache_usage) == (TEAM_A_SLOTS, TEAM_A_SLOTS / MAX_SEQS)
        assert (everyone.running_requests, everyone.waiting_requests) == (TEAM_A_SLOTS, QUEUE_CAP)

        refused = []
        for _ in range(REFUSED):  # beyond the queue cap: refused at once, nothing queued
            req = request("base", tokens, params(max_tokens=LONG))
            refused.append(
                rpc_error(lambda r=req: list(flood.sampler.Sample(r, metadata=flood.md("team-a"), timeout=60)))
            )
        for error in refused:
            metadata = assert_status(error, grpc.StatusCode.RESOURCE_EXHAUSTED, "TENANT_QUEUE_FULL")
            assert "--max-queued-per-tenant" in str(error.details()) and metadata["tenant"] == "team-a"
        assert flood.stats("ops").waiting_requests == QUEUE_CAP

        team_b_errors: list[BaseException] = []
        outputs: Outputs = []
        try:
            outputs = workload(flood)  # sent after the flood: 9 of team-a's requests were there before it
        except grpc.RpcError as error:
            team_b_errors.append(error)
        unfinished = len(streams.calls) - streams.finished
        assert team_b_errors == [] and outputs == flood.baseline
        # team-b's 4 requests all ran while team-a's queued requests had not even started: with the old FIFO
        # admission they waited behind all 9 of team-a's (4 running, 5 queued), i.e. ran after at least 5 ended.
        assert unfinished >= QUEUE_CAP, (unfinished, streams.finished)
        assert streams.errors == []
        team_b = flood.stats("team-b")
        team_b_tokens = sum(len(t) for run in flood.baseline for t in run.values())
        assert team_b.tokens_generated - team_b_before.tokens_generated == team_b_tokens
        assert team_b.running_requests == team_b.waiting_requests == 0
    finally:
        streams.close()
    assert wait_for(lambda: flood.stats("ops").running_requests == flood.stats("ops").waiting_requests == 0)
    assert set(streams.errors) <= {grpc.StatusCode.CANCELLED}
    memory_after = tree_memory(flood.sampler_server.process.pid)
    figure(
        "noisy sampler batch share (4 slots, team-a 3): team-a accepted / refused, team-a unfinished when team-b "
        "done, team-b errors, sampler PSS before -> after (MiB)",
        f"{len(streams.calls)} / {len(refused)} TENANT_QUEUE_FULL, {unfinished} of {len(streams.calls)}, "
        f"{len(team_b_errors)}, {memory_before / MiB:.0f} -> {memory_after / MiB:.0f}",
    )
    assert memory_after - memory_before < MEMORY_BOUND, (memory_before / MiB, memory_after / MiB)

"""A published artifact corrupted on disk (one flipped bit, truncation, a deleted file): direct loads answer
DATA_LOSS, the following sampler keeps serving the previous version when an alias moves onto the corrupt one,
and the failure is recorded (GetStats.recent_reloads and opentinker_sampler_reload_failures_total{code,reason})."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from faultutil import ForkedServer, fork_sampler, wait_for
from metricsutil import metric, scrape
from registryutil import create_adapter, flip_bit, publish_lora, unique_name
from samplerutil import params, prompt, request, stats
from serverproc import ServerProcess, registry_store
from trainerutil import assert_status, rpc_error

from opentinker.v1 import registry_pb2, registry_pb2_grpc, sampler_pb2, sampler_pb2_grpc

FAILURES = "opentinker_sampler_reload_failures_total"
WEIGHTS = "adapter_model.safetensors"


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:-100])


def delete(path: Path) -> None:
    path.unlink()


CORRUPTIONS: dict[str, Callable[[Path], None]] = {"bit flip": flip_bit, "truncation": truncate, "deleted": delete}


@dataclass
class Stack:
    name: str
    model: Path
    store: Path
    registry: registry_pb2_grpc.RegistryServiceStub
    sampler: sampler_pb2_grpc.SamplerServiceStub
    server: ForkedServer


@pytest.fixture(scope="module")
def stack(
    tiny_model: Path, registry_server: ServerProcess, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Stack]:
    name = unique_name("corrupt")
    server = fork_sampler(tmp_path_factory.mktemp("corrupt"), tiny_model, registry_server, "--follow", name)
    with grpc.insecure_channel(registry_server.address) as reg, grpc.insecure_channel(server.address) as smp:
        registry = registry_pb2_grpc.RegistryServiceStub(reg)
        create_adapter(registry, name)
        sampler = sampler_pb2_grpc.SamplerServiceStub(smp)
        yield Stack(name, tiny_model, registry_store(registry_server), registry, sampler, server)
    server.kill()


def served_latest(stack: Stack) -> int:
    first = next(iter(stack.sampler.Sample(request(stack.name, prompt(1), params(max_tokens=1)), timeout=60)))
    return int(first.version.version)


@pytest.mark.parametrize("kind", list(CORRUPTIONS))
def test_corrupt_artifact_is_data_loss_and_never_replaces_the_served_version(stack: Stack, kind: str) -> None:
    good = publish_lora(stack.registry, stack.model, stack.name, seed=len(kind))
    assert wait_for(lambda: served_latest(stack) == good.version), stats(stack.sampler)
    # Published without moving an alias (nothing loads it yet), then damaged on disk.
    bad = publish_lora(stack.registry, stack.model, stack.name, seed=100 + len(kind), skip_latest=True)
    CORRUPTIONS[kind](stack.store / "sha256" / bad.artifact_sha256 / WEIGHTS)

    exact = f"{stack.name}@{bad.version}"
    load = sampler_pb2.LoadAdapterRequest(reference=exact)
    assert_status(rpc_error(stack.sampler.LoadAdapter, load), grpc.StatusCode.DATA_LOSS, "DIGEST_MISMATCH")
    sample = request(exact, prompt(2), params(max_tokens=2))
    assert_status(rpc_error(lambda: list(stack.sampler.Sample(sample))), grpc.StatusCode.DATA_LOSS, "DIGEST_MISMATCH")
    download = registry_pb2.DownloadArtifactRequest(artifact_uri=bad.artifact_uri)
    assert_status(
        rpc_error(lambda: list(stack.registry.DownloadArtifact(download))), grpc.StatusCode.DATA_LOSS, "DIGEST_MISMATCH"
    )

    before = metric(scrape(stack.server.metrics_address), FAILURES, code="DATA_LOSS", reason="DIGEST_MISMATCH")
    stack.registry.SetAlias(registry_pb2.SetAliasRequest(adapter=stack.name, alias="latest", version=bad.version))

    def failure_recorded() -> bool:
        now = metric(scrape(stack.server.metrics_address), FAILURES, code="DATA_LOSS", reason="DIGEST_MISMATCH")
        records = [
            r for r in stats(stack.sampler).recent_reloads if r.to_version == bad.version and r.adapter == stack.name
        ]
        return now > before and any(not r.ok and r.error.startswith("DATA_LOSS") for r in records)

    assert wait_for(failure_recorded), stats(stack.sampler)
    assert served_latest(stack) == good.version  # the alias moved in the registry; the sampler kept the good one
    loaded = {
        a.version.version: a
        for a in stack.sampler.ListLoaded(sampler_pb2.ListLoadedRequest()).adapters
        if a.version.adapter == stack.name
    }
    assert bad.version not in loaded and "latest" in loaded[good.version].serving_aliases

"""GetStats counts what its names say: `reloads_total` the hot reloads of followed aliases, `adapter_loads_total`
every version loaded into a slot (on demand or by hot reload); the follower keeps no other counters."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from samplerutil import greedy, loaded, prompt, snapshot, stats, train, trained_adapter, wait_until
from serverproc import ServerProcess, start_sampler

from opentinker.v1 import sampler_pb2_grpc, trainer_pb2_grpc

Sampler = sampler_pb2_grpc.SamplerServiceStub
Trainer = trainer_pb2_grpc.TrainerServiceStub


@pytest.fixture
def adapter(trainer: Trainer) -> str:
    """Published (v1, alias latest) before the sampler below starts, so it arrives in the registry's snapshot and
    no event about it can race the first request."""
    name, _ = trained_adapter(trainer, seed=531)
    return name


@pytest.fixture
def fresh(adapter: str, tiny_model: Path, registry_server: ServerProcess, tmp_path: Path) -> Iterator[Sampler]:
    server = start_sampler(tmp_path, tiny_model, registry_server, "--max-slots", "4")
    try:
        with grpc.insecure_channel(server.address) as channel:
            yield sampler_pb2_grpc.SamplerServiceStub(channel)
    finally:
        assert server.terminate() == 0, server.log()


def serving_latest(sampler: Sampler, name: str) -> int | None:
    versions = [a.version.version for k, a in loaded(sampler).items() if k.startswith(f"{name}@")]
    return max(versions) if versions else None


def test_reloads_total_counts_hot_reloads_apart_from_on_demand_loads(
    trainer: Trainer, fresh: Sampler, adapter: str
) -> None:
    assert wait_until(lambda: stats(fresh).last_event_id != "", timeout=20)  # the registry's snapshot applied
    start = stats(fresh)
    assert (start.reloads_total, start.adapter_loads_total) == (0, 0)
    greedy(fresh, adapter, prompt(531))  # loads v1 on demand; the traffic makes the sampler follow the adapter
    after_request = stats(fresh)
    assert (after_request.reloads_total, after_request.adapter_loads_total) == (0, 1)
    train(trainer, adapter, seed=532, steps=1)
    v2 = snapshot(trainer, adapter)  # moves latest: a hot reload
    assert wait_until(lambda: stats(fresh).reloads_total == 1, timeout=20), stats(fresh)
    after_reload = stats(fresh)
    assert after_reload.adapter_loads_total == 2 and serving_latest(fresh, adapter) == v2.version
    assert [(r.to_version, r.ok) for r in after_reload.recent_reloads if r.adapter == adapter] == [(v2.version, True)]

"""The prefix cache in a real sampler: a hot reload of `name@latest` (v1 -> v2) never reuses v1's K/V, every
answer equals a `--no-prefix-cache` sampler's for the exact version served, and GetStats reports the cached,
computed and shared prompt tokens and the block counts."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from samplerutil import prompt, request, run, snapshot, stats, train, trained_adapter, wait_until
from serverproc import ServerProcess, start_sampler

from opentinker.v1 import sampler_pb2_grpc, trainer_pb2_grpc

Sampler = sampler_pb2_grpc.SamplerServiceStub
Trainer = trainer_pb2_grpc.TrainerServiceStub
LONG = prompt(941, length=70)  # four full blocks and a bit


@pytest.fixture
def samplers(tiny_model: Path, registry_server: ServerProcess, tmp_path: Path) -> Iterator[tuple[Sampler, Sampler]]:
    on = start_sampler(
        tmp_path / "on", tiny_model, registry_server, "--max-slots", "4", "--num-blocks", "64", "--max-len", "256"
    )
    off = start_sampler(tmp_path / "off", tiny_model, registry_server, "--max-slots", "4", "--no-prefix-cache")
    try:
        with grpc.insecure_channel(on.address) as a, grpc.insecure_channel(off.address) as b:
            yield sampler_pb2_grpc.SamplerServiceStub(a), sampler_pb2_grpc.SamplerServiceStub(b)
    finally:
        assert on.terminate() == 0, on.log()
        assert off.terminate() == 0, off.log()


def answer(sampler: Sampler, model: str) -> tuple[list[int], tuple[str, int]]:
    result = run(sampler, request(model, LONG))
    return result.only.tokens, result.versions[-1]


def test_a_hot_reload_never_reuses_the_previous_versions_blocks(
    trainer: Trainer, samplers: tuple[Sampler, Sampler]
) -> None:
    on, off = samplers
    name, _ = trained_adapter(trainer, seed=941)
    first, version = answer(on, name)
    assert version == (name, 1)
    again, _ = answer(on, name)
    assert again == first == answer(off, f"{name}@1")[0]
    assert wait_until(lambda: stats(on).prompt_tokens_cached == 64), stats(on)  # the 2nd request's 4 full blocks
    figures = stats(on)
    assert figures.kv_block_size == 16 and figures.prompt_tokens_computed == len(LONG) + (len(LONG) - 64)
    assert figures.kv_blocks_total == 64 and figures.kv_blocks_cached >= 4 and figures.kv_blocks_used == 0
    assert stats(off).prompt_tokens_cached == 0 and stats(off).kv_blocks_cached == 0

    train(trainer, name, seed=942, steps=2)
    assert snapshot(trainer, name).version == 2  # latest moves: the sampler hot-reloads
    assert wait_until(lambda: answer(on, name)[1] == (name, 2), timeout=20)
    assert wait_until(lambda: stats(on).kv_blocks_used == 0)  # the figures of the request that saw v2 are in
    cached = stats(on).prompt_tokens_cached
    second, version = answer(on, name)
    assert version == (name, 2)
    assert second == answer(off, f"{name}@2")[0]
    assert second != first  # the contrast: v2 really answers differently, so stale K/V would have shown
    # v2's own blocks, cached by the request that saw v2 first
    assert wait_until(lambda: stats(on).prompt_tokens_cached == cached + 64), stats(on)

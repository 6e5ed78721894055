"""A row whose logits are not finite ends only its own request (FAILED_PRECONDITION NON_FINITE_OUTPUT): the
batch's other rows draw exactly what they would alone. The sampling function row by row, then an in-process
engine (--no-engine-process) serving an overflowing adapter and a seeded base-model request at the same time
(tests/reliability/test_noisy_sampler.py does the same with two tenants on the engine process)."""

from __future__ import annotations

import concurrent.futures
import math
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch
from overflowutil import overflowing_lora_files
from registryutil import create_adapter, unique_name, upload
from samplerutil import collect, params, prompt, request, stats, wait_until
from serverproc import ServerProcess, start_sampler
from trainerutil import assert_status, model_input, rpc_error

from opentinker.sampler_server.sampling import sample
from opentinker.sampler_server.sequence import SamplingParams, Sequence
from opentinker.v1 import common_pb2, registry_pb2, registry_pb2_grpc, sampler_pb2, sampler_pb2_grpc


def _seq(index: int, *, temperature: float = 1.0, seed: int = 5) -> Sequence:
    seq = Sequence(index, f"r{index}", 0, [1], SamplingParams(temperature=temperature), lora_slot=0, seed=seed)
    seq.generator = torch.Generator().manual_seed(seed)
    return seq


def test_sample_draws_the_finite_rows_as_if_alone_and_reports_the_others() -> None:
    logits = torch.randn(4, 32, generator=torch.Generator().manual_seed(0))
    alone = sample(logits[:1].clone(), [_seq(0)])
    logits[1, 3] = math.nan
    logits[2, 0] = math.inf
    logits[3] = 3e38  # finite, but inf once divided by the temperature
    draw = sample(logits, [_seq(0), _seq(1), _seq(2), _seq(3, temperature=0.5)])
    assert draw.failed == {1, 2, 3}
    assert draw.tokens[0] == alone.tokens[0] and draw.logprobs[0] == alone.logprobs[0]
    assert all(math.isnan(draw.logprobs[row]) for row in (1, 2, 3))
    greedy = sample(logits[:3], [_seq(i, temperature=0.0) for i in range(3)])  # the all-greedy path too
    assert greedy.failed == {1, 2} and greedy.tokens[0] == int(logits[0].argmax())


@pytest.fixture(scope="module")
def local(
    tiny_model: Path, registry_server: ServerProcess, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[sampler_pb2_grpc.SamplerServiceStub]:
    server = start_sampler(
        tmp_path_factory.mktemp("non-finite"), tiny_model, registry_server, "--max-slots", "2", "--no-engine-process"
    )
    with grpc.insecure_channel(server.address) as channel:
        yield sampler_pb2_grpc.SamplerServiceStub(channel)
    assert server.terminate() == 0, server.log()


def test_an_overflowing_adapter_fails_only_its_requests_in_process(
    local: sampler_pb2_grpc.SamplerServiceStub, registry: registry_pb2_grpc.RegistryServiceStub, tiny_model: Path
) -> None:
    name = unique_name("exploding")
    create_adapter(registry, name)
    uri = upload(registry, overflowing_lora_files(tiny_model))
    config = common_pb2.LoraConfig(rank=4, alpha=4096.0, target_modules=["gate_proj", "up_proj", "down_proj"])
    registry.PublishVersion(registry_pb2.PublishVersionRequest(adapter=name, artifact_uri=uri, lora_config=config))
    seeded = request("base", prompt(3), params(temperature=1.0, seed=9, max_tokens=16), num_samples=2)
    alone = collect(local.Sample(seeded, timeout=60))
    bad = request(f"{name}@1", prompt(4), params(temperature=1.0, max_tokens=16), num_samples=3)

    def exploding() -> grpc.RpcError:
        return rpc_error(lambda: list(local.Sample(bad, timeout=60)))

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        failures = [pool.submit(exploding) for _ in range(4)]
        together = [pool.submit(lambda: collect(local.Sample(seeded, timeout=60))) for _ in range(4)]
        for future in failures:
            error = future.result()
            assert_status(error, grpc.StatusCode.FAILED_PRECONDITION, "NON_FINITE_OUTPUT")
            assert f"{name}@1" in str(error.details())
        for result in (f.result() for f in together):
            assert {i: s.tokens for i, s in result.samples.items()} == {i: s.tokens for i, s in alone.samples.items()}
    scoring = sampler_pb2.ComputeLogprobsRequest(model=f"{name}@1", inputs=[model_input(prompt(5))])
    assert_status(rpc_error(local.ComputeLogprobs, scoring), grpc.StatusCode.FAILED_PRECONDITION, "NON_FINITE_OUTPUT")
    assert wait_until(lambda: stats(local).running_requests == 0 and stats(local).waiting_requests == 0)
    listed = local.ListLoaded(sampler_pb2.ListLoadedRequest()).adapters
    assert [a.active_requests for a in listed if a.version.adapter == name] == [0]  # every pin ended

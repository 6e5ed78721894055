"""Shared by the sampler bad-input tests: limits of the test model, the published adapter, the error check."""

from __future__ import annotations

from dataclasses import dataclass

import grpc
from samplerutil import Sampler, greedy, prompt, trained_adapter
from trainerutil import Trainer, rpc_error

from opentinker.v1 import registry_pb2, sampler_pb2

INVALID = grpc.StatusCode.INVALID_ARGUMENT


VOCAB = 512


CONTEXT = 2048  # the tiny model's max_position_embeddings


@dataclass(frozen=True)
class Published:
    name: str
    version: registry_pb2.Version
    prompt: list[int]
    tokens: list[int]  # greedy 12 tokens for `prompt`, sampled alone

    @property
    def ref(self) -> str:
        return f"{self.name}@{self.version.version}"


def publish_good(trainer: Trainer, sampler: Sampler, seed: int = 300) -> Published:
    """A freshly trained adapter and its greedy reference tokens, sampled alone."""
    name, version = trained_adapter(trainer, seed=seed)
    p = prompt(seed)
    return Published(name, version, p, greedy(sampler, f"{name}@1", p))


def sample_error(sampler: Sampler, req: sampler_pb2.SampleRequest) -> grpc.RpcError:
    def call() -> None:
        for _ in sampler.Sample(req, timeout=30):
            pass

    return rpc_error(call)


def _sampling(**kw: object) -> sampler_pb2.SamplingParams:
    return sampler_pb2.SamplingParams(**kw)  # type: ignore[arg-type]

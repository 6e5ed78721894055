"""Helpers for the /v1 (OpenAI-compatible) tests: the unmodified openai SDK pointed at a gateway process, and
adapters trained and snapshotted through the SDK's TrainingClient."""

from __future__ import annotations

import openai
from gatewayutil import base_url
from serverproc import ServerProcess

from opentinker.client import AdamParams, Datum, LoraConfig, ModelInput, ServiceClient

TOKENS = [17, 42, 99, 7, 256, 301, 12, 88, 150, 33, 64, 5, 210, 77, 123, 45]


def openai_client(gateway: ServerProcess, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url(gateway)}/v1", api_key=key, max_retries=0, timeout=120)


def async_openai_client(gateway: ServerProcess, key: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{base_url(gateway)}/v1", api_key=key, max_retries=0, timeout=120)


def train_adapter(service: ServiceClient, name: str, snapshots: int = 1, seed: int = 0) -> int:
    """``name`` trained one step per snapshot (forward_backward + optim_step + save_snapshot); the last version."""
    datum = Datum(
        ModelInput.from_ints(TOKENS[:-1]), loss_fn_inputs={"target_tokens": TOKENS[1:], "weights": [1.0] * 15}
    )
    training = service.create_training_client(name, LoraConfig(rank=4), seed=seed)
    number = 0
    for _ in range(snapshots):
        training.forward_backward([datum], "cross_entropy")
        training.optim_step(AdamParams(learning_rate=5e-2))
        number = training.save_snapshot().number
    return number

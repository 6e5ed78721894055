"""Helpers for trainer tests: datums, adapter creation, train steps and readers of saved states/snapshots."""

from __future__ import annotations

import io
import json
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from registryutil import unique_name
from safetensors.torch import load_file

from opentinker.rpc.serving.errors import error_info
from opentinker.v1 import common_pb2, trainer_pb2, trainer_pb2_grpc

Trainer = trainer_pb2_grpc.TrainerServiceStub
VOCAB = 512


def int_tensor(values: Sequence[int]) -> common_pb2.TensorData:
    return common_pb2.TensorData(dtype=common_pb2.D_TYPE_INT64, shape=[len(values)], int64_values=list(values))


def float_tensor(values: Sequence[float]) -> common_pb2.TensorData:
    return common_pb2.TensorData(dtype=common_pb2.D_TYPE_FLOAT32, shape=[len(values)], float32_values=list(values))


def model_input(tokens: Sequence[int]) -> common_pb2.ModelInput:
    chunk = common_pb2.ModelInputChunk(encoded_text=common_pb2.EncodedTextChunk(tokens=list(tokens)))
    return common_pb2.ModelInput(chunks=[chunk])


def sft_datum(tokens: Sequence[int], weights: Sequence[float] | None = None) -> common_pb2.Datum:
    """Next-token prediction over `tokens`: input tokens[:-1], targets tokens[1:], weights default 1."""
    inputs, targets = list(tokens[:-1]), list(tokens[1:])
    w = [1.0] * len(targets) if weights is None else list(weights)
    return common_pb2.Datum(
        model_input=model_input(inputs),
        loss_fn_inputs={"target_tokens": int_tensor(targets), "weights": float_tensor(w)},
    )


def rl_datum(tokens: Sequence[int], logprobs: Sequence[float], advantages: Sequence[float]) -> common_pb2.Datum:
    """Policy-gradient datum: sampler logprobs and advantages, one per target position."""
    inputs, targets = list(tokens[:-1]), list(tokens[1:])
    return common_pb2.Datum(
        model_input=model_input(inputs),
        loss_fn_inputs={
            "target_tokens": int_tensor(targets),
            "logprobs": float_tensor(logprobs),
            "advantages": float_tensor(advantages),
        },
    )


def random_tokens(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, VOCAB) for _ in range(length)]


def sft_batch(seed: int, count: int = 2, length: int = 12) -> list[common_pb2.Datum]:
    """`count` datums of different lengths (so padding is exercised), deterministic in `seed`."""
    return [sft_datum(random_tokens(seed * 1000 + i, length - 3 * i)) for i in range(count)]


def lora(rank: int = 4, alpha: float = 8.0, dropout: float = 0.0, targets: Sequence[str] = ()) -> common_pb2.LoraConfig:
    return common_pb2.LoraConfig(rank=rank, alpha=alpha, dropout=dropout, target_modules=list(targets))


def adam(lr: float = 1e-2) -> common_pb2.AdamParams:
    return common_pb2.AdamParams(learning_rate=lr, beta1=0.9, beta2=0.95, eps=1e-8)


def create(
    trainer: Trainer,
    name: str | None = None,
    *,
    seed: int = 0,
    config: common_pb2.LoraConfig | None = None,
    lr: float = 1e-2,
    **fields: Any,
) -> trainer_pb2.TrainingAdapter:
    request = trainer_pb2.TrainerServiceCreateAdapterRequest(
        name=name or unique_name("tr"), lora_config=config or lora(), adam_params=adam(lr), seed=seed, **fields
    )
    response: trainer_pb2.TrainerServiceCreateAdapterResponse = trainer.CreateAdapter(request)
    return response.adapter


def forward_backward(
    trainer: Trainer,
    name: str,
    datums: Sequence[common_pb2.Datum],
    loss_fn: str = "cross_entropy",
    config: dict[str, float] | None = None,
    trace_ids: Sequence[str] = (),
) -> trainer_pb2.ForwardBackwardResponse:
    request = trainer_pb2.ForwardBackwardRequest(
        adapter=name, datums=list(datums), loss_fn=loss_fn, loss_fn_config=config or {}, trace_ids=list(trace_ids)
    )
    response: trainer_pb2.ForwardBackwardResponse = trainer.ForwardBackward(request)
    return response


def forward(
    trainer: Trainer, name: str, datums: Sequence[common_pb2.Datum], loss_fn: str = "cross_entropy"
) -> trainer_pb2.ForwardResponse:
    response: trainer_pb2.ForwardResponse = trainer.Forward(
        trainer_pb2.ForwardRequest(adapter=name, datums=list(datums), loss_fn=loss_fn)
    )
    return response


def optim_step(trainer: Trainer, name: str) -> trainer_pb2.OptimStepResponse:
    response: trainer_pb2.OptimStepResponse = trainer.OptimStep(trainer_pb2.OptimStepRequest(adapter=name))
    return response


def train_step(
    trainer: Trainer, name: str, datums: Sequence[common_pb2.Datum], loss_fn: str = "cross_entropy"
) -> tuple[float, trainer_pb2.OptimStepResponse]:
    """One ForwardBackward + OptimStep; returns the batch loss and the step response."""
    loss = forward_backward(trainer, name, datums, loss_fn).metrics["loss:sum"]
    return loss, optim_step(trainer, name)


def logprobs(response: trainer_pb2.ForwardResponse | trainer_pb2.ForwardBackwardResponse) -> list[list[float]]:
    return [list(out.tensors["logprobs"].float32_values) for out in response.loss_fn_outputs]


def get_adapter(trainer: Trainer, name: str) -> trainer_pb2.TrainingAdapter:
    response: trainer_pb2.TrainerServiceGetAdapterResponse = trainer.GetAdapter(
        trainer_pb2.TrainerServiceGetAdapterRequest(name=name)
    )
    return response.adapter


def save_state(trainer: Trainer, name: str, label: str = "t") -> str:
    response: trainer_pb2.SaveStateResponse = trainer.SaveState(trainer_pb2.SaveStateRequest(adapter=name, label=label))
    return response.state_id


# --- reading artifacts from the shared store --------------------------------------------------------------


def artifact_dir(store: Path, uri: str) -> Path:
    assert uri.startswith("sha256:"), uri
    path = store / "sha256" / uri.removeprefix("sha256:")
    assert path.is_dir(), path
    return path


@dataclass(frozen=True)
class SavedState:
    uri: str
    meta: dict[str, Any]
    weights: dict[str, torch.Tensor]
    grads: dict[str, torch.Tensor]
    optimizer: dict[str, Any]

    @property
    def step(self) -> int:
        return int(self.meta["step"])


def read_state(store: Path, uri: str) -> SavedState:
    directory = artifact_dir(store, uri)
    optimizer = torch.load(io.BytesIO((directory / "optimizer.pt").read_bytes()), weights_only=True)
    return SavedState(
        uri=uri,
        meta=json.loads((directory / "state.json").read_text()),
        weights=load_file(directory / "weights.safetensors"),
        grads=load_file(directory / "grads.safetensors"),
        optimizer=optimizer,
    )


def snapshot_weights(store: Path, uri: str) -> dict[str, torch.Tensor]:
    return load_file(artifact_dir(store, uri) / "adapter_model.safetensors")


def state_of(trainer: Trainer, store: Path, name: str) -> SavedState:
    return read_state(store, save_state(trainer, name))


def assert_same(a: Any, b: Any, path: str = "") -> None:
    """Bitwise equality of nested dicts/lists of tensors and plain values."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), path
        assert a.dtype == b.dtype and a.shape == b.shape, path
        assert torch.equal(a, b), f"{path}: tensors differ (max abs diff {(a.double() - b.double()).abs().max()})"
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), f"{path}: keys {sorted(a)} != {sorted(b)}"
        for key in a:
            assert_same(a[key], b[key], f"{path}.{key}")
    elif isinstance(a, list | tuple):
        assert isinstance(b, list | tuple) and len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{path}[{i}]")
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


def assert_same_training(a: SavedState, b: SavedState) -> None:
    """Weights, gradients, AdamW state and step of two saved states are bitwise equal."""
    assert a.step == b.step
    assert_same(a.weights, b.weights, "weights")
    assert_same(a.grads, b.grads, "grads")
    assert_same(a.optimizer, b.optimizer, "optimizer")


# --- errors ---------------------------------------------------------------------------------------------------


def rpc_error(fn: object, *args: object) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as caught:
        fn(*args)  # type: ignore[operator]
    return caught.value


def assert_status(error: grpc.RpcError, code: grpc.StatusCode, reason: str) -> dict[str, str]:
    """Checks code and ErrorInfo reason; returns the ErrorInfo metadata."""
    assert isinstance(error, grpc.Call)
    assert error.code() == code, (error.code(), error.details())
    info = error_info(error)
    assert info is not None and info.reason == reason, (info, error.details())
    return dict(info.metadata)

"""Bad CreateAdapter requests and calls on unknown adapters get the precise status and reason, and change nothing."""

from __future__ import annotations

from collections.abc import Callable

import grpc
import pytest
from badinpututil import Code, Victims, fb, fingerprint, fwd, good, make_victims, step
from registryutil import unique_name
from trainerutil import (
    Trainer,
    assert_status,
    lora,
    rpc_error,
)

from opentinker.v1 import common_pb2, registry_pb2, registry_pb2_grpc, trainer_pb2


@pytest.fixture(scope="module")
def victims(trainer: Trainer) -> Victims:
    return make_victims(trainer)


UNKNOWN_CALLS: list[tuple[str, Callable[[Trainer, str], object]]] = [
    ("forward-backward", fb([good()])),
    ("forward", fwd([good()])),
    ("optim-step", step()),
    ("get", lambda t, n: t.GetAdapter(trainer_pb2.TrainerServiceGetAdapterRequest(name=n))),
    ("delete", lambda t, n: t.DeleteAdapter(trainer_pb2.TrainerServiceDeleteAdapterRequest(name=n))),
    ("save-state", lambda t, n: t.SaveState(trainer_pb2.SaveStateRequest(adapter=n))),
    ("save-snapshot", lambda t, n: t.SaveSnapshot(trainer_pb2.SaveSnapshotRequest(adapter=n))),
    ("load-state", lambda t, n: t.LoadState(trainer_pb2.LoadStateRequest(adapter=n, state_id="sha256:" + "0" * 64))),
]


@pytest.mark.parametrize("call", [c for _, c in UNKNOWN_CALLS], ids=[i for i, _ in UNKNOWN_CALLS])
def test_unknown_adapter_is_not_found(trainer: Trainer, call: Callable[[Trainer, str], object]) -> None:
    name = unique_name("ghost")
    metadata = assert_status(rpc_error(call, trainer, name), Code.NOT_FOUND, "ADAPTER_NOT_FOUND")
    assert metadata.get("adapter") == name
    names = [a.name for a in trainer.ListAdapters(trainer_pb2.TrainerServiceListAdaptersRequest()).adapters]
    assert name not in names


BAD_CREATES = [
    ("rank-0", {"lora_config": lora(rank=0)}, Code.INVALID_ARGUMENT, "INVALID_LORA_CONFIG", "lora_config.rank"),
    (
        "rank-huge",
        {"lora_config": lora(rank=100_000)},
        Code.INVALID_ARGUMENT,
        "INVALID_LORA_CONFIG",
        "lora_config.rank",
    ),
    (
        "dropout-1",
        {"lora_config": lora(dropout=1.0)},
        Code.INVALID_ARGUMENT,
        "INVALID_LORA_CONFIG",
        "lora_config.dropout",
    ),
    (
        "negative-alpha",
        {"lora_config": lora(alpha=-1.0)},
        Code.INVALID_ARGUMENT,
        "INVALID_LORA_CONFIG",
        "lora_config.alpha",
    ),
    (
        "unknown-target",
        {"lora_config": lora(targets=["q_proj", "lm_head_proj"])},
        Code.INVALID_ARGUMENT,
        "INVALID_LORA_CONFIG",
        "lora_config.target_modules",
    ),
    (
        "negative-lr",
        {"adam_params": common_pb2.AdamParams(learning_rate=-1.0)},
        Code.INVALID_ARGUMENT,
        "INVALID_ADAM_PARAMS",
        "adam_params.learning_rate",
    ),
    (
        "negative-eps",
        {"adam_params": common_pb2.AdamParams(learning_rate=1e-3, eps=-1.0)},
        Code.INVALID_ARGUMENT,
        "INVALID_ADAM_PARAMS",
        "adam_params.eps",
    ),
    ("unknown-init-from", {"init_from": "no-such-adapter-xyz@1"}, Code.NOT_FOUND, "ADAPTER_NOT_FOUND", None),
    ("bad-name", {"name": "Bad Name"}, Code.INVALID_ARGUMENT, "INVALID_ADAPTER_NAME", None),
]


@pytest.mark.parametrize(
    ("fields", "code", "reason", "field"), [c[1:] for c in BAD_CREATES], ids=[c[0] for c in BAD_CREATES]
)
def test_bad_create_creates_nothing(
    trainer: Trainer,
    registry: registry_pb2_grpc.RegistryServiceStub,
    fields: dict[str, object],
    code: grpc.StatusCode,
    reason: str,
    field: str | None,
) -> None:
    request = trainer_pb2.TrainerServiceCreateAdapterRequest(name=unique_name("bad"), lora_config=lora(), seed=1)
    for key, value in fields.items():
        if isinstance(value, str):
            setattr(request, key, value)
        else:
            getattr(request, key).CopyFrom(value)
    metadata = assert_status(rpc_error(trainer.CreateAdapter, request), code, reason)
    if field is not None:
        assert metadata.get("field") == field, metadata
    if reason != "INVALID_ADAPTER_NAME":
        error = rpc_error(trainer.GetAdapter, trainer_pb2.TrainerServiceGetAdapterRequest(name=request.name))
        assert_status(error, Code.NOT_FOUND, "ADAPTER_NOT_FOUND")
        error = rpc_error(registry.GetAdapter, registry_pb2.GetAdapterRequest(name=request.name))
        assert_status(error, Code.NOT_FOUND, "ADAPTER_NOT_FOUND")


def test_duplicate_create_changes_nothing(trainer: Trainer, victims: Victims) -> None:
    before = fingerprint(trainer, victims.pending)
    request = trainer_pb2.TrainerServiceCreateAdapterRequest(name=victims.pending, lora_config=lora(), seed=5)
    assert_status(rpc_error(trainer.CreateAdapter, request), Code.ALREADY_EXISTS, "ADAPTER_EXISTS")
    request.attach_existing = True  # attaching does not replace an adapter this trainer already holds
    assert_status(rpc_error(trainer.CreateAdapter, request), Code.ALREADY_EXISTS, "ADAPTER_EXISTS")
    assert fingerprint(trainer, victims.pending) == before

"""Shared by the trainer bad-input tests: the victim adapters and what an accepted request would change."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import grpc
from trainerutil import (
    Trainer,
    create,
    forward_backward,
    get_adapter,
    random_tokens,
    save_state,
    sft_batch,
    sft_datum,
    train_step,
)

from opentinker.v1 import common_pb2, trainer_pb2

Code = grpc.StatusCode


@dataclass(frozen=True)
class Victims:
    pending: str  # one step taken, one ForwardBackward pending
    clean: str  # one step taken, nothing pending


def make_victims(trainer: Trainer) -> Victims:
    pending, clean = create(trainer, seed=70).name, create(trainer, seed=71).name
    for name in (pending, clean):
        train_step(trainer, name, sft_batch(seed=70))
    forward_backward(trainer, pending, sft_batch(seed=71))
    return Victims(pending, clean)


def fingerprint(trainer: Trainer, name: str) -> tuple[object, ...]:
    """What an accepted request would change. SaveState itself changes nothing (same content, same id)."""
    a = get_adapter(trainer, name)
    fields = (a.step, a.pending_batches, a.tokens_trained, a.datums_trained, a.last_snapshot_version, a.resident)
    return (*fields, save_state(trainer, name))


def good() -> common_pb2.Datum:
    return sft_datum(random_tokens(1, 8))


def fb(
    datums: list[common_pb2.Datum], loss_fn: str = "cross_entropy", config: dict[str, float] | None = None
) -> Callable[[Trainer, str], object]:
    request = trainer_pb2.ForwardBackwardRequest(datums=datums, loss_fn=loss_fn, loss_fn_config=config or {})

    def call(trainer: Trainer, name: str) -> object:
        request.adapter = name
        return trainer.ForwardBackward(request)

    return call


def fwd(datums: list[common_pb2.Datum], loss_fn: str = "cross_entropy") -> Callable[[Trainer, str], object]:
    def call(trainer: Trainer, name: str) -> object:
        return trainer.Forward(trainer_pb2.ForwardRequest(adapter=name, datums=datums, loss_fn=loss_fn))

    return call


def step(adam: common_pb2.AdamParams | None = None) -> Callable[[Trainer, str], object]:
    def call(trainer: Trainer, name: str) -> object:
        return trainer.OptimStep(trainer_pb2.OptimStepRequest(adapter=name, adam_params=adam))

    return call

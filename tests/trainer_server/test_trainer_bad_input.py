"""Bad input gets the precise status, reason and field, and changes nothing: the adapter's step, pending
batches, totals and saved state (weights, gradients, AdamW, RNG, ledger) are identical before and after."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import grpc
import pytest
from badinpututil import Code, Victims, fb, fingerprint, fwd, good, make_victims, step
from grpc_health.v1 import health_pb2, health_pb2_grpc
from serverproc import ServerProcess
from trainerutil import (
    Trainer,
    assert_status,
    create,
    float_tensor,
    get_adapter,
    int_tensor,
    random_tokens,
    rl_datum,
    rpc_error,
    sft_batch,
    sft_datum,
    train_step,
)

from opentinker.v1 import common_pb2, trainer_pb2

MAX_POSITIONS = 2048


@pytest.fixture(scope="module")
def victims(trainer: Trainer) -> Victims:
    return make_victims(trainer)


def with_input(datum: common_pb2.Datum, key: str, tensor: common_pb2.TensorData) -> common_pb2.Datum:
    out = common_pb2.Datum()
    out.CopyFrom(datum)
    out.loss_fn_inputs[key].CopyFrom(tensor)
    return out


def rl(advantage: float = 1.0, logprob: float = -1.0) -> common_pb2.Datum:
    return rl_datum(random_tokens(2, 6), [-1.0, -2.0, logprob, -1.5, -1.0], [0.0, 1.0, 1.0, advantage, 1.0])


def datum_long(length: int) -> common_pb2.Datum:
    return sft_datum([5 + i % 400 for i in range(length + 1)])


BAD_TOKEN = sft_datum([5, 6, 512, 7])  # input position 2 outside the vocabulary of 512


BAD_TARGET = with_input(good(), "target_tokens", int_tensor([5, 6, 7, 600, 8, 9, 10]))


NEGATIVE_TOKEN = sft_datum([5, -1, 6, 7])


SHORT_WEIGHTS = with_input(good(), "weights", float_tensor([1.0] * 6))


FLOAT_TARGETS = with_input(good(), "target_tokens", float_tensor([5.0, 6.0, 7.5, 8.0, 9.0, 10.0, 11.0]))


SHORT_TARGETS = with_input(good(), "target_tokens", int_tensor([5] * 8))


BAD_SHAPE = with_input(
    good(), "weights", common_pb2.TensorData(dtype=common_pb2.D_TYPE_FLOAT32, shape=[2, 4], float32_values=[1.0] * 7)
)


NAN_WEIGHT = with_input(good(), "weights", float_tensor([1.0, float("nan"), 1, 1, 1, 1, 1]))


INF_WEIGHT = with_input(good(), "weights", float_tensor([1.0, 1, 1, 1, 1, 1, float("inf")]))


NO_WEIGHTS = common_pb2.Datum(model_input=good().model_input, loss_fn_inputs={"target_tokens": int_tensor([5] * 7)})


EMPTY_INPUT = common_pb2.Datum(model_input=common_pb2.ModelInput(), loss_fn_inputs=good().loss_fn_inputs)


UNKNOWN_KEY = with_input(good(), "rewards", float_tensor([1.0] * 7))


NEGATIVE_KL_WEIGHT = with_input(rl(), "weights", float_tensor([0.0, 1.0, -1.0, 1.0, 1.0]))


@dataclass(frozen=True)
class Case:
    id: str
    call: Callable[[Trainer, str], object]
    code: grpc.StatusCode
    reason: str
    field: str | None = None  # ErrorInfo metadata "field" (and the datum index it names is checked)
    victim: str = "pending"


CASES = [
    # datums[0] is always fine: the error must name datums[1].
    Case("input-token", fb([good(), BAD_TOKEN]), Code.INVALID_ARGUMENT, "TOKEN_OUT_OF_RANGE", "datums[1].model_input"),
    Case(
        "target-token",
        fb([good(), BAD_TARGET]),
        Code.INVALID_ARGUMENT,
        "TOKEN_OUT_OF_RANGE",
        "datums[1].loss_fn_inputs['target_tokens']",
    ),
    Case(
        "negative-token",
        fb([good(), NEGATIVE_TOKEN]),
        Code.INVALID_ARGUMENT,
        "TOKEN_OUT_OF_RANGE",
        "datums[1].model_input",
    ),
    Case(
        "forward-token", fwd([good(), BAD_TOKEN]), Code.INVALID_ARGUMENT, "TOKEN_OUT_OF_RANGE", "datums[1].model_input"
    ),
    Case(
        "short-weights",
        fb([good(), SHORT_WEIGHTS]),
        Code.INVALID_ARGUMENT,
        "INVALID_DATUM",
        "datums[1].loss_fn_inputs['weights']",
    ),
    Case(
        "float-targets",
        fb([good(), FLOAT_TARGETS]),
        Code.INVALID_ARGUMENT,
        "INVALID_DATUM",
        "datums[1].loss_fn_inputs['target_tokens']",
    ),
    Case(
        "short-targets",
        fb([good(), SHORT_TARGETS]),
        Code.INVALID_ARGUMENT,
        "INVALID_DATUM",
        "datums[1].loss_fn_inputs['target_tokens']",
    ),
    Case(
        "bad-shape",
        fb([good(), BAD_SHAPE]),
        Code.INVALID_ARGUMENT,
        "INVALID_DATUM",
        "datums[1].loss_fn_inputs['weights']",
    ),
    Case("empty-batch", fb([]), Code.INVALID_ARGUMENT, "EMPTY_BATCH", "datums"),
    Case("empty-input", fb([good(), EMPTY_INPUT]), Code.INVALID_ARGUMENT, "INVALID_DATUM", "datums[1].model_input"),
    Case(
        "nan-weight",
        fb([good(), NAN_WEIGHT]),
        Code.INVALID_ARGUMENT,
        "INVALID_DATUM",
        "datums[1].loss_fn_inputs['weights']",
    ),
    Case(
        "inf-weight",
        fb([good(), INF_WEIGHT]),
        Code.INVALID_ARGUMENT,
        "INVALID_DATUM",
        "datums[1].loss_fn_inputs['weights']",
    ),
    Case(
        "inf-advantage",
        fb([rl(), rl(advantage=float("inf"))], "ppo"),
        Code.INVALID_ARGUMENT,
        "INVALID_DATUM",
        "datums[1].loss_fn_inputs['advantages']",
    ),
    Case(
        "nan-advantage",
        fb([rl(), rl(advantage=float("nan"))], "importance_sampling"),
        Code.INVALID_ARGUMENT,
        "INVALID_DATUM",
        "datums[1].loss_fn_inputs['advantages']",
    ),
    Case(
        "nan-logprob",
        fb([rl(), rl(logprob=float("nan"))], "dro"),
        Code.INVALID_ARGUMENT,
        "INVALID_DATUM",
        "datums[1].loss_fn_inputs['logprobs']",
    ),
    Case(
        "negative-kl-weight",
        fb([rl(), NEGATIVE_KL_WEIGHT], "stable_reinforce", {"kl_coeff": 0.5}),
        Code.INVALID_ARGUMENT,
        "INVALID_DATUM",
        "datums[1].loss_fn_inputs['weights']",
    ),
    Case(
        "missing-weights",
        fb([good(), NO_WEIGHTS]),
        Code.INVALID_ARGUMENT,
        "INVALID_DATUM",
        "datums[1].loss_fn_inputs['weights']",
    ),
    Case(
        "missing-advantages",
        fb([rl(), good()], "cispo"),
        Code.INVALID_ARGUMENT,
        "INVALID_DATUM",
        "datums[1].loss_fn_inputs['logprobs']",
    ),
    Case(
        "unknown-input-key",
        fb([good(), UNKNOWN_KEY]),
        Code.INVALID_ARGUMENT,
        "INVALID_DATUM",
        "datums[1].loss_fn_inputs",
    ),
    Case(
        "too-long",
        fb([good(), datum_long(MAX_POSITIONS + 1)]),
        Code.INVALID_ARGUMENT,
        "SEQUENCE_TOO_LONG",
        "datums[1].model_input",
    ),
    Case("too-many-datums", fb([good()] * 4097), Code.RESOURCE_EXHAUSTED, "BATCH_TOO_LARGE", "datums"),
    Case("unknown-loss-fn", fb([good()], "mse"), Code.INVALID_ARGUMENT, "UNKNOWN_LOSS_FN"),
    Case("no-loss-fn", fb([good()], ""), Code.INVALID_ARGUMENT, "UNKNOWN_LOSS_FN"),
    Case("forward-unknown-loss-fn", fwd([good()], "mse"), Code.INVALID_ARGUMENT, "UNKNOWN_LOSS_FN"),
    Case(
        "unknown-config-key", fb([rl()], "ppo", {"clip_threshold": 0.2}), Code.INVALID_ARGUMENT, "INVALID_LOSS_CONFIG"
    ),
    Case("config-for-ce", fb([good()], "cross_entropy", {"beta": 0.1}), Code.INVALID_ARGUMENT, "INVALID_LOSS_CONFIG"),
    Case(
        "bad-clip-order", fb([rl()], "ppo", {"clip_low_threshold": 1.5}), Code.INVALID_ARGUMENT, "INVALID_LOSS_CONFIG"
    ),
    Case(
        "negative-lr",
        step(common_pb2.AdamParams(learning_rate=-1e-3)),
        Code.INVALID_ARGUMENT,
        "INVALID_ADAM_PARAMS",
        "adam_params.learning_rate",
    ),
    Case(
        "nan-lr",
        step(common_pb2.AdamParams(learning_rate=float("nan"))),
        Code.INVALID_ARGUMENT,
        "INVALID_ADAM_PARAMS",
        "adam_params.learning_rate",
    ),
    Case(
        "beta1-one",
        step(common_pb2.AdamParams(learning_rate=1e-3, beta1=1.0)),
        Code.INVALID_ARGUMENT,
        "INVALID_ADAM_PARAMS",
        "adam_params.beta1",
    ),
    Case("no-gradients", step(), Code.FAILED_PRECONDITION, "NO_GRADIENTS", victim="clean"),
    Case(
        "no-gradients-with-adam",
        step(common_pb2.AdamParams(learning_rate=1e-3)),
        Code.FAILED_PRECONDITION,
        "NO_GRADIENTS",
        victim="clean",
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_request_is_refused_and_changes_nothing(trainer: Trainer, victims: Victims, case: Case) -> None:
    name = victims.pending if case.victim == "pending" else victims.clean
    before = fingerprint(trainer, name)
    error = rpc_error(case.call, trainer, name)
    metadata = assert_status(error, case.code, case.reason)
    assert isinstance(error, grpc.Call)
    if case.field is not None:
        assert metadata.get("field") == case.field, (metadata, error.details())
        if case.field.startswith("datums["):
            assert metadata.get("datum") == "1", metadata
            assert "datums[1]" in (error.details() or "")
    assert fingerprint(trainer, name) == before


def test_sequence_at_the_limit_is_accepted(trainer: Trainer, victims: Victims) -> None:
    before = fingerprint(trainer, victims.pending)
    response = fwd([datum_long(MAX_POSITIONS)])(trainer, victims.pending)
    assert isinstance(response, trainer_pb2.ForwardResponse)
    assert len(response.loss_fn_outputs[0].tensors["logprobs"].float32_values) == MAX_POSITIONS
    assert fingerprint(trainer, victims.pending) == before


def test_no_gradients_keeps_the_step(trainer: Trainer, victims: Victims) -> None:
    name = create(trainer, seed=72).name
    for _ in range(2):
        assert_status(rpc_error(step(), trainer, name), Code.FAILED_PRECONDITION, "NO_GRADIENTS")
    assert get_adapter(trainer, name).step == 0
    assert train_step(trainer, name, sft_batch(seed=72))[1].step == 1
    assert_status(rpc_error(step(), trainer, name), Code.FAILED_PRECONDITION, "NO_GRADIENTS")
    assert get_adapter(trainer, name).step == 1


@pytest.fixture(scope="module")
def health(trainer_server: ServerProcess) -> Iterator[health_pb2_grpc.HealthStub]:
    with grpc.insecure_channel(trainer_server.address) as channel:
        yield health_pb2_grpc.HealthStub(channel)


def test_server_still_serving_and_training(
    trainer: Trainer, victims: Victims, health: health_pb2_grpc.HealthStub
) -> None:
    for service in ("", "opentinker.v1.TrainerService"):
        status = health.Check(health_pb2.HealthCheckRequest(service=service)).status
        assert status == health_pb2.HealthCheckResponse.SERVING
    # The victims still train normally after all that.
    before = get_adapter(trainer, victims.pending)
    response: trainer_pb2.OptimStepResponse = trainer.OptimStep(trainer_pb2.OptimStepRequest(adapter=victims.pending))
    assert response.step == before.step + 1
    assert train_step(trainer, victims.clean, sft_batch(seed=73))[1].step == 2

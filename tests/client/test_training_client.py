"""The training SDK (ServiceClient, TrainingClient and their types) against a real trainer and registry."""

from __future__ import annotations

import asyncio
import itertools
import pickle
import random
import uuid
from collections.abc import Iterator, Sequence

import grpc
import pytest
import torch
from serverproc import ServerProcess

from opentinker.client import (
    AdamParams,
    Datum,
    EncodedTextChunk,
    ForwardBackwardOutput,
    LoraConfig,
    ModelInput,
    OpenTinkerError,
    ServiceClient,
    TensorData,
    TrainingClient,
)
from opentinker.client.wire import datum_from_proto, datum_to_proto, tensor_data_from_proto, tensor_data_to_proto
from opentinker.v1 import trainer_pb2, trainer_pb2_grpc

VOCAB = 512
LR = AdamParams(learning_rate=1e-2)


def adapter_name() -> str:
    return f"sdk-{uuid.uuid4().hex[:12]}"


def sft_datum(tokens: Sequence[int]) -> Datum:
    """Next-token prediction over ``tokens``; the first half of the positions (the "prompt") has weight 0."""
    inputs, targets = list(tokens[:-1]), list(tokens[1:])
    half = len(targets) // 2
    weights = [0.0] * half + [1.0] * (len(targets) - half)
    return Datum(
        model_input=ModelInput.from_ints(inputs), loss_fn_inputs={"target_tokens": targets, "weights": weights}
    )


def sft_batch(seed: int = 0, lengths: Sequence[int] = (12, 9)) -> list[Datum]:
    rng = random.Random(seed)
    return [sft_datum([rng.randrange(VOCAB) for _ in range(n)]) for n in lengths]


def expect_error(code: grpc.StatusCode, reason: str | None, fn: object, *args: object) -> OpenTinkerError:
    with pytest.raises(OpenTinkerError) as caught:
        fn(*args)  # type: ignore[operator]
    error = caught.value
    assert error.code == code, str(error)
    if reason is not None:
        assert error.reason == reason, str(error)
    return error


@pytest.fixture(scope="module")
def service(trainer_server: ServerProcess, registry_server: ServerProcess) -> Iterator[ServiceClient]:
    # The session servers run without a tokens file: any token is accepted, so this also checks that the
    # authorization metadata does not disturb calls.
    with ServiceClient(
        trainer=trainer_server.address, registry=registry_server.address, token="unused-token"
    ) as client:
        yield client


@pytest.fixture
def training(service: ServiceClient) -> TrainingClient:
    return service.create_training_client(adapter_name(), LoraConfig(rank=4), seed=1)


# Types (no server)


def test_datum_tinker_style_from_lists_and_tensors() -> None:
    tokens = [5, 17, 300, 42]
    datum = Datum(
        model_input=ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [0, 1, 1]},
    )
    assert datum.loss_fn_inputs["target_tokens"] == TensorData((17, 300, 42), "int64", (3,))
    assert datum.loss_fn_inputs["weights"] == TensorData((0.0, 1.0, 1.0), "float32", (3,))
    assert isinstance(datum.loss_fn_inputs["weights"].data[0], float)

    from_tensors = Datum.create(
        ModelInput.from_ints(torch.tensor(tokens[:-1])),
        {"target_tokens": torch.tensor(tokens[1:], dtype=torch.int32), "weights": torch.tensor([0, 1, 1])},
    )
    assert from_tensors == datum
    assert Datum.create(datum.model_input, datum.loss_fn_inputs) == datum
    assert pickle.loads(pickle.dumps(datum)) == datum
    assert datum_from_proto(datum_to_proto(datum)) == datum

    with pytest.raises(TypeError):  # token ids must be integers, not silently truncated floats
        Datum(model_input=ModelInput.from_ints([1]), loss_fn_inputs={"target_tokens": [1.5]})
    with pytest.raises(TypeError):
        Datum(model_input=[1, 2], loss_fn_inputs={})  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        LoraConfig(target_modules="attn")  # type: ignore[arg-type]


def test_tensor_data_round_trips() -> None:
    nested = [[1.5, -2.0, 0.1], [3.0, 4.0, 5.0]]
    tensor = TensorData.from_list(nested)
    assert tensor.dtype == "float32" and tensor.shape == (2, 3)
    assert tensor.tolist() == torch.tensor(nested, dtype=torch.float32).tolist()  # 0.1 rounded to float32
    assert TensorData.from_torch(tensor.to_torch()) == tensor
    assert torch.equal(tensor.to_torch(), torch.tensor(nested, dtype=torch.float32))
    assert tensor_data_from_proto(tensor_data_to_proto(tensor)) == tensor

    ints = TensorData.from_list([3, 1, 4])
    assert ints == TensorData([3, 1, 4], "int64") and ints.tolist() == [3, 1, 4]
    assert ints.to_torch().dtype == torch.int64
    assert TensorData.from_torch(torch.arange(6).reshape(3, 2)).tolist() == [[0, 1], [2, 3], [4, 5]]
    assert TensorData.from_list([1, 2], dtype="float32").data == (1.0, 2.0)
    assert tensor_data_from_proto(tensor_data_to_proto(ints)) == ints

    with pytest.raises(ValueError):
        TensorData([1.0, 2.0, 3.0], "float32", (2, 2))
    with pytest.raises(ValueError):
        TensorData.from_list([[1, 2], [3]])


def test_model_input_helpers() -> None:
    empty = ModelInput.empty()
    assert empty.length == 0 and empty.to_ints() == []
    grown = empty.append_int(7).extend_ints([8, 9])
    assert grown == ModelInput.from_ints([7, 8, 9]) and grown.length == 3
    two = grown.append(EncodedTextChunk([10, 11])).append_int(12)
    assert two.to_ints() == [7, 8, 9, 10, 11, 12] and two.length == 6
    assert [c.tokens for c in two.chunks] == [(7, 8, 9), (10, 11, 12)]
    assert empty.length == 0 and grown.length == 3  # helpers return new objects


# Training against the real trainer


def test_trainer_info_and_listing(service: ServiceClient, training: TrainingClient) -> None:
    info = service.get_trainer_info()
    assert info.vocab_size == VOCAB and info.architecture
    assert {"cross_entropy", "ppo"} <= set(info.loss_fns)
    listed = service.list_training_adapters(prefix=training.adapter)
    assert [a.name for a in listed] == [training.adapter]
    adapter = listed[0]
    assert (adapter.rank, adapter.alpha, adapter.target_modules, adapter.step) == (4, 4.0, ("all-linear",), 0)
    assert adapter.num_parameters > 0 and adapter.resident
    assert service.training_client(training.adapter).get_info() == adapter


def test_forward_backward_and_optim_step_lower_the_loss(training: TrainingClient) -> None:
    batch = sft_batch()
    before = training.forward(batch)
    out = training.forward_backward(batch, trace_ids=["t-1"])
    assert isinstance(out, ForwardBackwardOutput)
    assert [len(row) for row in out.logprobs] == [d.model_input.length for d in batch]
    for got, expected in zip(out.logprobs, before.logprobs, strict=True):
        assert got == pytest.approx(expected, abs=1e-5)
    assert out.loss == out.metrics["loss:sum"] == pytest.approx(before.loss, abs=1e-4)
    assert out.loss > 0 and out.metrics["weights:sum"] == 10.0  # 6 + 4 answer positions
    assert out.step == 1 and len(out.batch_digest) == 64
    assert out.loss_fn_outputs[0]["logprobs"].data == out.logprobs[0]
    assert training.get_info().pending_batches == 1

    step = training.optim_step(LR)
    assert step.step == 1 and step.metrics["grad_norm:value"] > 0
    losses = [out.loss]
    for _ in range(4):
        losses.append(training.forward_backward(batch).loss)
        assert training.optim_step(LR).step == len(losses)
    final = training.forward(batch).loss
    losses.append(final)
    assert all(b < a for a, b in itertools.pairwise(losses)), losses  # every step helps
    assert losses[-1] < losses[0] - 1.0, losses
    info = training.get_info()
    assert (info.step, info.pending_batches, info.datums_trained) == (5, 0, 10)
    assert info.tokens_trained == 5 * sum(d.model_input.length for d in batch)


def test_save_snapshot_publishes_a_version_with_lineage(service: ServiceClient, training: TrainingClient) -> None:
    training.forward_backward(sft_batch(1), trace_ids=["episode-1", "episode-2"])
    training.optim_step(LR)
    version = training.save_snapshot(aliases=["stable"], metrics={"eval:mean": 0.25})
    assert version.adapter == training.adapter and version.number >= 1
    assert {"latest", "stable"} <= set(version.aliases)
    assert version.lineage.trainer_step == 1 and version.lineage.metrics == {"eval:mean": 0.25}
    assert training.get_info().last_snapshot_version == version.number

    registry = service.registry_client()
    resolved = registry.resolve(f"{training.adapter}@stable")
    assert (resolved.number, resolved.sha256) == (version.number, version.sha256)
    chain = registry.get_lineage(version.reference)
    assert chain[0].number == version.number
    traces = [t for batch in chain[0].lineage.batches for t in batch.trace_ids]
    assert traces == ["episode-1", "episode-2"]


def test_save_and_load_state_round_trip(service: ServiceClient, training: TrainingClient) -> None:
    batch = sft_batch(2)
    training.forward_backward(batch)
    training.optim_step(LR)
    saved = training.save_state(label="after-one")
    assert saved.state_id.startswith("sha256:") and saved.step == 1 and saved.size_bytes > 0
    at_save = training.forward(batch).logprobs

    training.forward_backward(batch)
    assert training.optim_step(LR).step == 2
    info = training.load_state(saved.state_id)
    assert info.step == saved.step == training.get_info().step
    assert training.forward(batch).logprobs == at_save

    resumed = service.create_training_client(adapter_name(), LoraConfig(rank=4), resume_state=saved.state_id)
    assert resumed.get_info().step == 1
    assert resumed.forward(batch).logprobs == at_save


def test_async_twins(service: ServiceClient, trainer_server: ServerProcess) -> None:
    batch = sft_batch(3)

    async def train(client: ServiceClient) -> tuple[ForwardBackwardOutput, int, int]:
        training = await client.create_training_client_async(adapter_name(), LoraConfig(rank=4))
        out, before = await asyncio.gather(training.forward_backward_async(batch), training.get_info_async())
        step = await training.optim_step_async(LR)
        forward = await training.forward_async(batch)
        assert forward.loss < out.loss
        with pytest.raises(OpenTinkerError) as caught:  # the reason survives the async path too
            await training.optim_step_async()
        assert (caught.value.code, caught.value.reason) == (grpc.StatusCode.FAILED_PRECONDITION, "NO_GRADIENTS")
        saved = await training.save_state_async()
        assert (await training.load_state_async(saved.state_id)).step == 1
        return out, before.step, step.step

    out, before, after = asyncio.run(train(service))
    assert [len(row) for row in out.logprobs] == [d.model_input.length for d in batch] and out.step == 1
    assert (before, after) == (0, 1)
    # A second event loop gets its own async channel on the same client.
    assert asyncio.run(train(service))[2] == 1

    async def scoped() -> ServiceClient:
        async with ServiceClient(trainer=trainer_server.address) as client:
            await train(client)
        return client

    closed = asyncio.run(scoped())
    expect_error(grpc.StatusCode.CANCELLED, "CLIENT_CLOSED", closed.get_trainer_info)


def test_errors_carry_code_and_reason(
    service: ServiceClient, training: TrainingClient, trainer: trainer_pb2_grpc.TrainerServiceStub
) -> None:
    expect_error(grpc.StatusCode.FAILED_PRECONDITION, "NO_GRADIENTS", training.optim_step)
    expect_error(grpc.StatusCode.NOT_FOUND, "ADAPTER_NOT_FOUND", service.training_client, adapter_name())

    bad = [sft_datum([1, 2, VOCAB, 3])]
    expect_error(grpc.StatusCode.INVALID_ARGUMENT, "TOKEN_OUT_OF_RANGE", training.forward_backward, bad)
    expect_error(grpc.StatusCode.INVALID_ARGUMENT, "TOKEN_OUT_OF_RANGE", training.forward, bad)
    expect_error(grpc.StatusCode.INVALID_ARGUMENT, "UNKNOWN_LOSS_FN", training.forward_backward, sft_batch(), "nope")
    assert training.get_info().pending_batches == 0  # rejected batches change nothing

    expect_error(grpc.StatusCode.ALREADY_EXISTS, "ADAPTER_EXISTS", service.create_training_client, training.adapter)
    dropped = service.create_training_client(adapter_name(), LoraConfig(rank=4))
    trainer.DeleteAdapter(trainer_pb2.TrainerServiceDeleteAdapterRequest(name=dropped.adapter))
    expect_error(grpc.StatusCode.NOT_FOUND, "ADAPTER_NOT_FOUND", dropped.get_info)
    expect_error(grpc.StatusCode.NOT_FOUND, "ADAPTER_NOT_FOUND", dropped.forward_backward, sft_batch())

    with ServiceClient(registry="127.0.0.1:1") as no_trainer, pytest.raises(ValueError):
        no_trainer.get_trainer_info()
    with ServiceClient(trainer="127.0.0.1:1") as no_registry, pytest.raises(ValueError):
        no_registry.registry_client()

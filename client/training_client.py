"""TrainingClient: train one LoRA adapter on a trainer server (Tinker-style).

    from opentinker.client import AdamParams, Datum, LoraConfig, ModelInput, ServiceClient

    with ServiceClient(trainer="127.0.0.1:7071") as service:
        training = service.create_training_client("team-a/agent", LoraConfig(rank=16))
        datum = Datum(
            model_input=ModelInput.from_ints(tokens[:-1]),
            loss_fn_inputs={"target_tokens": tokens[1:], "weights": weights},
        )
        out = training.forward_backward([datum], trace_ids=["episode-17"])
        training.optim_step(AdamParams(learning_rate=1e-4))
        version = training.save_snapshot(aliases=["canary"])  # a registry Version

Each method is one RPC. The plain methods use a synchronous gRPC channel; each has an ``*_async`` twin
on a grpc.aio channel (one per event loop, opened on first use). Requests of one adapter run on the
trainer in arrival order. Every failure is an `OpenTinkerError` with the gRPC status code and the
server's ErrorInfo reason.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, TypeVar

from google.protobuf.message import Message

from opentinker.client.connection import Connection
from opentinker.client.datum import Datum
from opentinker.client.registry_types import Version
from opentinker.client.registry_wire import version_from_proto as _version
from opentinker.client.training_types import (
    AdamParams,
    ForwardBackwardOutput,
    OptimStepResult,
    ResetResult,
    SavedState,
    StartedFrom,
    TrainingAdapterInfo,
)
from opentinker.client.wire import (
    adam_params_to_proto,
    datum_to_proto,
    forward_output_from_proto,
    reset_result_from_proto,
    training_adapter_from_proto,
)
from opentinker.v1 import trainer_pb2, trainer_pb2_grpc

__all__ = ["TrainingClient"]


def _strings(values: Iterable[str], what: str) -> list[str]:
    if isinstance(values, str):
        raise TypeError(f"{what} must be a sequence of strings, not a single string")
    return list(values)


# Connection


class TrainerConnection(Connection[trainer_pb2_grpc.TrainerServiceStub]):
    """The channels to one trainer server, shared by the ServiceClient and its TrainingClients."""

    def __init__(
        self, address: str, token: str | None = None, *, timeout: float | None = None, ca_cert: Path | None = None
    ) -> None:
        super().__init__(address, trainer_pb2_grpc.TrainerServiceStub, token, timeout=timeout, ca_cert=ca_cert)


# Requests and replies, shared by the sync and async methods


def _forward_backward_request(
    adapter: str,
    data: Sequence[Datum],
    loss_fn: str,
    loss_fn_config: Mapping[str, float] | None,
    trace_ids: Iterable[str],
) -> trainer_pb2.ForwardBackwardRequest:
    return trainer_pb2.ForwardBackwardRequest(
        adapter=adapter,
        datums=[datum_to_proto(d) for d in data],
        loss_fn=loss_fn,
        loss_fn_config=dict(loss_fn_config or {}),
        trace_ids=_strings(trace_ids, "trace_ids"),
    )


def _forward_backward_output(response: trainer_pb2.ForwardBackwardResponse) -> ForwardBackwardOutput:
    return forward_output_from_proto(response.loss_fn_outputs, response.metrics, response.batch_digest, response.step)


def _forward_request(
    adapter: str, data: Sequence[Datum], loss_fn: str, loss_fn_config: Mapping[str, float] | None
) -> trainer_pb2.ForwardRequest:
    return trainer_pb2.ForwardRequest(
        adapter=adapter,
        datums=[datum_to_proto(d) for d in data],
        loss_fn=loss_fn,
        loss_fn_config=dict(loss_fn_config or {}),
    )


def _forward_output(response: trainer_pb2.ForwardResponse) -> ForwardBackwardOutput:
    return forward_output_from_proto(response.loss_fn_outputs, response.metrics)


def _optim_step_request(adapter: str, adam_params: AdamParams | None) -> trainer_pb2.OptimStepRequest:
    return trainer_pb2.OptimStepRequest(
        adapter=adapter, adam_params=adam_params_to_proto(adam_params) if adam_params is not None else None
    )


def _optim_step_result(response: trainer_pb2.OptimStepResponse) -> OptimStepResult:
    return OptimStepResult(step=response.step, metrics=dict(response.metrics))


def _save_snapshot_request(
    adapter: str,
    aliases: Iterable[str] | None,
    skip_latest: bool,
    metrics: Mapping[str, float] | None,
    request_id: str,
) -> trainer_pb2.SaveSnapshotRequest:
    return trainer_pb2.SaveSnapshotRequest(
        adapter=adapter,
        aliases=_strings(aliases or (), "aliases"),
        skip_latest=skip_latest,
        metrics=dict(metrics or {}),
        request_id=request_id,
    )


def _saved_state(response: trainer_pb2.SaveStateResponse) -> SavedState:
    return SavedState(state_id=response.state_id, step=response.step, size_bytes=response.size_bytes)


def expand_reference(adapter: str, to: str) -> str:
    """A reset target as a registry reference: "5" or "@5" -> "adapter@5", "stable" -> "adapter@stable"; a
    reference naming an adapter ("team-a/other@3", "name@4") stays as it is."""
    if to.startswith("@"):
        return adapter + to
    if "@" in to or "/" in to:
        return to
    return f"{adapter}@{to}"


def _reset_request(adapter: str, to: str, keep_optimizer: bool) -> trainer_pb2.ResetAdapterRequest:
    return trainer_pb2.ResetAdapterRequest(
        adapter=adapter, reference=expand_reference(adapter, to), keep_optimizer=keep_optimizer
    )


_M = TypeVar("_M", bound=Message)
_Reply = TypeVar("_Reply")


class PoolRoute(Protocol):
    """What a TrainingClient in the trainer pool sends its calls through (trainer_pool.PoolRoute)."""

    @property
    def connection(self) -> TrainerConnection | None: ...
    @property
    def failovers(self) -> list[Any]: ...  # trainer_pool.Failover records
    @property
    def journal_bytes(self) -> int: ...
    @property
    def journal_steps(self) -> int: ...
    def call(self, method: str, request: Message, response_type: type[_M]) -> _M: ...


class TrainingClient:
    """Trains one adapter on one trainer. Obtain it from `ServiceClient.create_training_client` (or
    `ServiceClient.training_client` for an adapter the trainer already holds); it shares the
    ServiceClient's channels, so closing the ServiceClient ends it too. Thread-safe.

    Made by a ServiceClient with a registry and no trainer address, it trains in the trainer pool
    (trainer_pool.py): calls follow the adapter to its owner, and a dead owner's adapter continues on another
    trainer with nothing lost (``failovers`` lists each change; ``journal_bytes`` is what the journal holds).
    """

    def __init__(
        self,
        adapter: str,
        connection: TrainerConnection,
        started_from: StartedFrom | None = None,
        *,
        pool: PoolRoute | None = None,
    ) -> None:
        self.adapter = adapter
        self._connection = connection
        self._pool = pool
        # What create_training_client started the adapter from (None for training_client(name)).
        self.started_from = started_from

    def __repr__(self) -> str:
        return f"TrainingClient({self.adapter!r}, trainer={self.trainer_address!r})"

    @property
    def trainer_address(self) -> str:
        """The trainer this adapter trains on now (in the pool: its current owner)."""
        connection = self._pool.connection if self._pool is not None else None
        return (connection or self._connection).address

    @property
    def failovers(self) -> list[Any]:
        """Each change of trainer so far, oldest first (pool mode; always empty with an explicit trainer)."""
        return list(self._pool.failovers) if self._pool is not None else []

    @property
    def journal_bytes(self) -> int:
        """Bytes of requests the pool's failover journal holds (0 with an explicit trainer)."""
        return self._pool.journal_bytes if self._pool is not None else 0

    def _call(self, method: str, request: Message, response_type: type[_M], convert: Callable[[_M], _Reply]) -> _Reply:
        if self._pool is not None:
            return convert(self._pool.call(method, request, response_type))
        return convert(self._connection.unary(method, request, response_type))

    async def _call_async(
        self, method: str, request: Message, response_type: type[_M], convert: Callable[[_M], _Reply]
    ) -> _Reply:
        if self._pool is not None:  # one ordered history: the journal's calls run one at a time, on a thread
            return convert(await asyncio.to_thread(self._pool.call, method, request, response_type))
        return convert(await self._connection.unary_async(method, request, response_type))

    # Training

    def forward_backward(
        self,
        data: Sequence[Datum],
        loss_fn: str = "cross_entropy",
        loss_fn_config: Mapping[str, float] | None = None,
        trace_ids: Iterable[str] = (),
    ) -> ForwardBackwardOutput:
        """Computes the loss over ``data`` and adds its gradients to the adapter's gradient buffers.

        loss_fn: "cross_entropy", "importance_sampling", "ppo", "cispo", "dro" or "stable_reinforce" (whose
        ``logprobs`` must be the sampler's own, e.g. ``SampledSequence.logprobs``); loss_fn_config e.g.
        {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2} for ppo. ``trace_ids`` are recorded in
        the adapter's data ledger and in the lineage of the next snapshot.
        """
        request = _forward_backward_request(self.adapter, data, loss_fn, loss_fn_config, trace_ids)
        return self._call("ForwardBackward", request, trainer_pb2.ForwardBackwardResponse, _forward_backward_output)

    async def forward_backward_async(
        self,
        data: Sequence[Datum],
        loss_fn: str = "cross_entropy",
        loss_fn_config: Mapping[str, float] | None = None,
        trace_ids: Iterable[str] = (),
    ) -> ForwardBackwardOutput:
        request = _forward_backward_request(self.adapter, data, loss_fn, loss_fn_config, trace_ids)
        return await self._call_async(
            "ForwardBackward", request, trainer_pb2.ForwardBackwardResponse, _forward_backward_output
        )

    def forward(
        self, data: Sequence[Datum], loss_fn: str = "cross_entropy", loss_fn_config: Mapping[str, float] | None = None
    ) -> ForwardBackwardOutput:
        """Logprobs and loss without gradients (dropout off); batch_digest and step are unset."""
        request = _forward_request(self.adapter, data, loss_fn, loss_fn_config)
        return self._call("Forward", request, trainer_pb2.ForwardResponse, _forward_output)

    async def forward_async(
        self, data: Sequence[Datum], loss_fn: str = "cross_entropy", loss_fn_config: Mapping[str, float] | None = None
    ) -> ForwardBackwardOutput:
        request = _forward_request(self.adapter, data, loss_fn, loss_fn_config)
        return await self._call_async("Forward", request, trainer_pb2.ForwardResponse, _forward_output)

    def optim_step(self, adam_params: AdamParams | None = None) -> OptimStepResult:
        """One AdamW step with the accumulated gradients, then zeroes them. adam_params None: the
        adapter's defaults (set at creation). FAILED_PRECONDITION / NO_GRADIENTS without gradients."""
        request = _optim_step_request(self.adapter, adam_params)
        return self._call("OptimStep", request, trainer_pb2.OptimStepResponse, _optim_step_result)

    async def optim_step_async(self, adam_params: AdamParams | None = None) -> OptimStepResult:
        request = _optim_step_request(self.adapter, adam_params)
        return await self._call_async("OptimStep", request, trainer_pb2.OptimStepResponse, _optim_step_result)

    # Snapshots and states

    def save_snapshot(
        self,
        aliases: Iterable[str] | None = None,
        *,
        skip_latest: bool = False,
        metrics: Mapping[str, float] | None = None,
        request_id: str = "",
    ) -> Version:
        """Publishes the adapter's current weights as its next registry version, with its lineage (the
        batches trained since the last snapshot), and moves "latest" (unless skip_latest) and ``aliases``
        to it. ``metrics`` (e.g. eval scores) go into the lineage; a retry with the same ``request_id``
        publishes nothing new."""
        request = _save_snapshot_request(self.adapter, aliases, skip_latest, metrics, request_id)
        return self._call("SaveSnapshot", request, trainer_pb2.SaveSnapshotResponse, _snapshot_version)

    async def save_snapshot_async(
        self,
        aliases: Iterable[str] | None = None,
        *,
        skip_latest: bool = False,
        metrics: Mapping[str, float] | None = None,
        request_id: str = "",
    ) -> Version:
        request = _save_snapshot_request(self.adapter, aliases, skip_latest, metrics, request_id)
        return await self._call_async("SaveSnapshot", request, trainer_pb2.SaveSnapshotResponse, _snapshot_version)

    def save_state(self, label: str = "") -> SavedState:
        """Saves weights, optimizer state, pending gradients, step, RNG and data ledger for an exact resume."""
        request = trainer_pb2.SaveStateRequest(adapter=self.adapter, label=label)
        return self._call("SaveState", request, trainer_pb2.SaveStateResponse, _saved_state)

    async def save_state_async(self, label: str = "") -> SavedState:
        request = trainer_pb2.SaveStateRequest(adapter=self.adapter, label=label)
        return await self._call_async("SaveState", request, trainer_pb2.SaveStateResponse, _saved_state)

    def load_state(self, state_id: str, *, weights_only: bool = False) -> TrainingAdapterInfo:
        """Restores a state saved by save_state (of an adapter with the same LoRA config); ``weights_only``:
        only its LoRA weights, with cleared gradients and fresh AdamW moments."""
        request = trainer_pb2.LoadStateRequest(adapter=self.adapter, state_id=state_id, weights_only=weights_only)
        return self._call("LoadState", request, trainer_pb2.LoadStateResponse, _adapter_of)

    async def load_state_async(self, state_id: str, *, weights_only: bool = False) -> TrainingAdapterInfo:
        request = trainer_pb2.LoadStateRequest(adapter=self.adapter, state_id=state_id, weights_only=weights_only)
        return await self._call_async("LoadState", request, trainer_pb2.LoadStateResponse, _adapter_of)

    def reset(self, to: str, *, keep_optimizer: bool = False) -> ResetResult:
        """Loads a registry version's weights into this adapter ("5", "stable", "team-a/other@3"): a rollback
        carried into training, the next save_snapshot's parent is that version. Pending gradients go; the AdamW
        moments too unless ``keep_optimizer``; the step count stays."""
        request = _reset_request(self.adapter, to, keep_optimizer)
        return self._call("ResetAdapter", request, trainer_pb2.ResetAdapterResponse, reset_result_from_proto)

    async def reset_async(self, to: str, *, keep_optimizer: bool = False) -> ResetResult:
        request = _reset_request(self.adapter, to, keep_optimizer)
        return await self._call_async(
            "ResetAdapter", request, trainer_pb2.ResetAdapterResponse, reset_result_from_proto
        )

    def get_info(self) -> TrainingAdapterInfo:
        request = trainer_pb2.TrainerServiceGetAdapterRequest(name=self.adapter)
        return self._call("GetAdapter", request, trainer_pb2.TrainerServiceGetAdapterResponse, _adapter_of)

    async def get_info_async(self) -> TrainingAdapterInfo:
        request = trainer_pb2.TrainerServiceGetAdapterRequest(name=self.adapter)
        return await self._call_async("GetAdapter", request, trainer_pb2.TrainerServiceGetAdapterResponse, _adapter_of)


def _snapshot_version(response: trainer_pb2.SaveSnapshotResponse) -> Version:
    return _version(response.version)


def _adapter_of(
    response: trainer_pb2.LoadStateResponse
    | trainer_pb2.TrainerServiceGetAdapterResponse
    | trainer_pb2.TrainerServiceCreateAdapterResponse,
) -> TrainingAdapterInfo:
    return training_adapter_from_proto(response.adapter)

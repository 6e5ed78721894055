"""Helpers of the trainer's noisy-neighbour tests: a tenant's stub, its seeded workload, the abuse run beside it,
the status a refused call got, and the trainer's memory."""

from __future__ import annotations

import concurrent.futures
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
from serverproc import ServerProcess
from trainerutil import adam, logprobs, lora, random_tokens, sft_batch, sft_datum

from opentinker.cli.launch import tree_memory
from opentinker.rpc.serving.errors import error_info
from opentinker.v1 import common_pb2, trainer_pb2, trainer_pb2_grpc

T = TypeVar("T")
MiB = 1 << 20


@dataclass(frozen=True)
class Tenant:
    """One principal's view of the trainer: every call carries its bearer token."""

    name: str
    stub: trainer_pb2_grpc.TrainerServiceStub
    metadata: list[tuple[str, str]]

    def call(self, method: str, request: Any) -> Any:
        return getattr(self.stub, method)(request, metadata=self.metadata, timeout=120)

    def create(self, adapter: str, seed: int = 0, rank: int = 4, **fields: Any) -> trainer_pb2.TrainingAdapter:
        request = trainer_pb2.TrainerServiceCreateAdapterRequest(
            name=adapter, lora_config=lora(rank=rank), adam_params=adam(), seed=seed, **fields
        )
        created: trainer_pb2.TrainingAdapter = self.call("CreateAdapter", request).adapter
        return created

    def delete(self, adapter: str) -> None:
        self.call("DeleteAdapter", trainer_pb2.TrainerServiceDeleteAdapterRequest(name=adapter))

    def forward_backward(self, adapter: str, datums: list[common_pb2.Datum]) -> trainer_pb2.ForwardBackwardResponse:
        request = trainer_pb2.ForwardBackwardRequest(adapter=adapter, datums=datums, loss_fn="cross_entropy")
        response: trainer_pb2.ForwardBackwardResponse = self.call("ForwardBackward", request)
        return response

    def optim_step(self, adapter: str, lr: float = 1e-2, clip: float = 0.0) -> trainer_pb2.OptimStepResponse:
        params = adam(lr)
        params.grad_clip_norm = clip  # clipping scales the gradients in place: an undone step restores them too
        request = trainer_pb2.OptimStepRequest(adapter=adapter, adam_params=params)
        response: trainer_pb2.OptimStepResponse = self.call("OptimStep", request)
        return response

    def forward_logprobs(self, adapter: str, datums: list[common_pb2.Datum]) -> list[list[float]]:
        request = trainer_pb2.ForwardRequest(adapter=adapter, datums=datums, loss_fn="cross_entropy")
        return logprobs(self.call("Forward", request))

    def save_state(self, adapter: str, label: str = "s") -> str:
        state_id: str = self.call("SaveState", trainer_pb2.SaveStateRequest(adapter=adapter, label=label)).state_id
        return state_id


def tenant(server: ServerProcess, name: str, token: str) -> Tenant:
    channel = grpc.insecure_channel(server.address)
    return Tenant(name, trainer_pb2_grpc.TrainerServiceStub(channel), [("authorization", f"Bearer {token}")])


def seeded_training(who: Tenant, adapter: str, *, seed: int = 7, steps: int = 3) -> list[float]:
    """team-b's normal workload: a fresh adapter from a seed, `steps` seeded SFT steps, then the logprobs of a
    held-out batch. Returns every loss and logprob (the same on every run of the same seed)."""
    who.create(adapter, seed=seed)
    outputs: list[float] = []
    for step in range(steps):
        outputs.append(who.forward_backward(adapter, sft_batch(100 + step, count=3)).metrics["loss:sum"])
        who.optim_step(adapter)
    outputs.extend(v for row in who.forward_logprobs(adapter, sft_batch(999, count=2)) for v in row)
    return outputs


def status(call: Callable[[], object]) -> tuple[grpc.StatusCode | None, str]:
    """(code, ErrorInfo reason) of a call that fails; (None, "") when it succeeds."""
    try:
        call()
    except grpc.RpcError as error:
        info = error_info(error)
        return error.code(), info.reason if info is not None else ""
    return None, ""


def alongside(abuse: Callable[[], T], workload: Callable[[], list[float]]) -> tuple[T, list[float]]:
    """Runs team-a's abuse and team-b's workload at the same time; returns both results (raises their errors)."""
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        abused, normal = pool.submit(abuse), pool.submit(workload)
        return abused.result(), normal.result()


def memory_mib(server: ServerProcess) -> float:
    """The trainer's proportional set size (PSS), MiB."""
    return tree_memory(server.process.pid) / MiB


def fresh(who: str) -> str:
    """A new adapter name of tenant `who`."""
    return f"{who}/{uuid.uuid4().hex[:8]}"


def beside(team_b: Tenant, abuse: Callable[[], T], reference: list[float]) -> T:
    """team-a's abuse while team-b runs its workload on a fresh adapter: team-b's outputs equal the run alone."""
    result, outputs = alongside(abuse, lambda: seeded_training(team_b, fresh("team-b")))
    assert outputs == reference, "team-b's seeded training changed while team-a abused the trainer"
    return result


# --- helpers of single cases of test_noisy_trainer.py (cases 7, 8, 3 and 11) ----------------------------------


def _snapshot(who: Tenant, name: str) -> tuple[int, int]:
    """(version, lineage parent) of a new snapshot of `name`."""
    version = who.call("SaveSnapshot", trainer_pb2.SaveSnapshotRequest(adapter=name)).version
    return int(version.version), int(version.lineage.parent_version)


Refusal = tuple[grpc.StatusCode | None, str, str]


def refusal(call: Callable[[], object], *ids: str) -> Refusal:
    """(code, reason, message with the given ids and its request id blanked) of a refused call."""
    try:
        call()
    except grpc.RpcError as error:
        info = error_info(error)
        message = re.sub(r" \(request [^)]*\)$", "", str(error.details()))  # each call has its own id
        for value in ids:
            message = message.replace(value, "<id>")
        return error.code(), info.reason if info is not None else "", message
    return None, "", ""


def padded(short: int) -> list[common_pb2.Datum]:
    """One 2,047-position datum and `short` one-position datums: few real tokens, (short + 1) x 2047 padded."""
    return [sft_datum(random_tokens(1, 2048)), *(sft_datum([5, 6]) for _ in range(short))]


def team_adapters(who: Tenant) -> list[str]:
    listing = who.call("ListAdapters", trainer_pb2.TrainerServiceListAdaptersRequest(prefix=f"{who.name}/"))
    return [adapter.name for adapter in listing.adapters]


def micro_groups(lengths: list[int], limit: int) -> list[list[int]]:
    """Consecutive datums, each group padded to its longest within `limit` (the trainer's rule)."""
    groups: list[list[int]] = []
    for index, length in enumerate(lengths):
        if groups and (len(groups[-1]) + 1) * max(length, *(lengths[i] for i in groups[-1])) <= limit:
            groups[-1].append(index)
        else:
            groups.append([index])
    return groups

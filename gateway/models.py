"""Tinker training models: each is one OpenTinker adapter under its key's tenant.

The SDK numbers every request of a model (``seq_id`` 1, 2, ...; the chunks of one forward_backward take
consecutive ids and may arrive in any order). A model's `Lane` runs them strictly in ``seq_id`` order, one
at a time; once one fails, every later request of the model fails too (the SDK treats a training client
whose request failed as poisoned), naming the request that failed first.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from opentinker.gateway.errors import GatewayError, RequestFailed, bad_request, not_found
from opentinker.gateway.futures import Future, Job, Outcome, run_job
from opentinker.v1 import common_pb2


@dataclass(slots=True)
class Lane:
    """One model's queue of numbered requests."""

    model_id: str
    next_seq: int = 1
    pending: dict[int, tuple[Future, Job]] = field(default_factory=dict)
    accepted: dict[int, str] = field(default_factory=dict)  # seq_id -> request_id, for resent requests
    poisoned: str | None = None
    _task: asyncio.Task[None] | None = None

    def resent(self, seq_id: int) -> str | None:
        """The request id already given to ``seq_id`` (the SDK resends a request after a lost answer)."""
        return self.accepted.get(seq_id)

    def submit(self, seq_id: int, future: Future, job: Job) -> None:
        """Queues ``job`` as request ``seq_id``."""
        if seq_id < self.next_seq or seq_id in self.pending:
            raise bad_request(f"seq_id {seq_id} of model {self.model_id} was already used", "SEQ_ID_REUSED")
        self.accepted[seq_id] = future.request_id
        self.pending[seq_id] = (future, job)
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._drain())

    async def _drain(self) -> None:
        while self.next_seq in self.pending:
            seq_id = self.next_seq
            future, job = self.pending.pop(seq_id)
            self.next_seq += 1
            if self.poisoned is not None:
                future.finish(Outcome(failure=RequestFailed(self.poisoned)))
                continue
            outcome = await run_job(job)
            if outcome.failure is not None:
                self.poisoned = (
                    f"an earlier request of model {self.model_id} (seq_id {seq_id}) failed: {outcome.failure.message}"
                )
            future.finish(outcome)
            if len(self.accepted) > 4096:  # only recent ids can be resent
                for old in sorted(self.accepted)[:2048]:
                    del self.accepted[old]


@dataclass(slots=True)
class TrainingModel:
    model_id: str
    tenant: str
    session_id: str
    adapter: str
    lora: common_pb2.LoraConfig
    base_model: str
    lane: Lane


class ModelTable:
    def __init__(self) -> None:
        self._models: dict[str, TrainingModel] = {}
        self.creating: dict[str, str] = {}  # model_id -> request id of its create (or create-via-load)

    def add(self, model: TrainingModel) -> None:
        if model.model_id in self._models:
            raise GatewayError(409, "MODEL_EXISTS", f"model {model.model_id} already exists")
        self._models[model.model_id] = model

    def get(self, model_id: str, tenant: str) -> TrainingModel:
        model = self._models.get(model_id)
        if model is None or model.tenant != tenant:  # another tenant's model reads as unknown
            raise not_found(f"unknown model_id {model_id!r}", "UNKNOWN_MODEL")
        return model

    def find(self, model_id: str) -> TrainingModel | None:
        return self._models.get(model_id)

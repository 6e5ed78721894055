"""Tinker training models: each is one OpenTinker adapter under its key's tenant.

The SDK numbers every request of a model (``seq_id`` 1, 2, ...; the chunks of one forward_backward take
consecutive ids and may arrive in any order). A model's `Lane` runs them strictly in ``seq_id`` order, one
at a time; once one fails, every later request of the model fails too, naming the request that failed first
(a failed chunk of a forward_backward leaves part of a batch's gradients behind) - unless the failure left the
model exactly as before (an OptimStep the trainer undid, see errors.py), so that the client can go on from the
previous weights.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from opentinker.gateway.errors import GatewayError, RequestFailed, bad_request, not_found
from opentinker.gateway.tinker.futures import Future, Job, Outcome, run_job
from opentinker.v1 import common_pb2


@dataclass(slots=True)
class Waiting:
    """A numbered request waiting for its turn, and the bytes it holds."""

    future: Future
    job: Job
    size: int


@dataclass(slots=True)
class Lane:
    """One model's queue of numbered requests: at most ``window`` ids ahead of the next expected one and
    ``max_pending_bytes`` of bodies waiting; a lane stalled on a seq_id that never comes is failed by `expire`."""

    model_id: str
    window: int = 256
    max_pending_bytes: int = 256 << 20
    next_seq: int = 1
    pending: dict[int, Waiting] = field(default_factory=dict)
    pending_bytes: int = 0
    accepted: dict[int, str] = field(default_factory=dict)  # seq_id -> request_id, for resent requests
    poisoned: str | None = None
    stalled_since: float | None = None  # waiting for next_seq since (monotonic), None while it makes progress
    _task: asyncio.Task[None] | None = None

    def resent(self, seq_id: int) -> str | None:
        """The request id already given to ``seq_id`` (the SDK resends a request after a lost answer)."""
        return self.accepted.get(seq_id)

    def check(self, seq_id: int) -> None:
        """400 for a seq_id already used or (on a lane that still runs requests) beyond the window."""
        if seq_id < self.next_seq or seq_id in self.pending:
            raise bad_request(f"seq_id {seq_id} of model {self.model_id} was already used", "SEQ_ID_REUSED")
        if self.poisoned is None and seq_id >= self.next_seq + self.window:
            raise bad_request(
                f"seq_id {seq_id} of model {self.model_id} is more than {self.window} ahead of the next expected "
                f"one ({self.next_seq})",
                "SEQ_ID_TOO_FAR_AHEAD",
            )

    def submit(self, seq_id: int, future: Future, job: Job, size: int = 0) -> None:
        """Queues ``job`` as request ``seq_id`` holding ``size`` bytes; 400 beyond the window, 429 beyond the
        pending bytes (nothing is queued then)."""
        self.check(seq_id)
        if self.poisoned is not None:  # fails anyway: nothing to keep
            self.accepted[seq_id] = future.request_id
            future.finish(Outcome(failure=RequestFailed(self.poisoned)))
            return
        if self.pending and self.pending_bytes + size > self.max_pending_bytes:
            raise GatewayError(
                429,
                "TOO_MUCH_PENDING",
                f"model {self.model_id} has {self.pending_bytes} bytes of requests waiting for seq_id {self.next_seq}"
                f"; at most {self.max_pending_bytes}",
            )
        self.accepted[seq_id] = future.request_id
        self.pending[seq_id] = Waiting(future, job, size)
        self.pending_bytes += size
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._drain())

    async def _drain(self) -> None:
        while self.next_seq in self.pending:
            seq_id = self.next_seq
            waiting = self.pending.pop(seq_id)
            self.pending_bytes -= waiting.size
            self.stalled_since = None
            self.next_seq += 1
            if self.poisoned is not None:
                waiting.future.finish(Outcome(failure=RequestFailed(self.poisoned)))
                continue
            outcome = await run_job(waiting.job)
            if outcome.failure is not None and outcome.failure.poisons:
                self.poisoned = (
                    f"an earlier request of model {self.model_id} (seq_id {seq_id}) failed: {outcome.failure.message}"
                )
            waiting.future.finish(outcome)
            del waiting  # the job's body goes with it
            if len(self.accepted) > 4096:  # only recent ids can be resent
                for old in sorted(self.accepted)[:2048]:
                    del self.accepted[old]
        if self.pending and self.stalled_since is None:
            self.stalled_since = time.monotonic()

    def expire(self, stalled_before: float, reason: str) -> int:
        """Fails every waiting request when the lane has waited for ``next_seq`` since before ``stalled_before``
        (or at once when ``stalled_before`` is inf); later requests of the model fail too. The bytes freed."""
        if not self.pending or (self._task is not None and not self._task.done()):
            return 0
        if self.stalled_since is not None and self.stalled_since >= stalled_before:
            return 0
        self.poisoned = f"model {self.model_id}: {reason}"
        freed = self.pending_bytes
        for waiting in self.pending.values():
            waiting.future.finish(Outcome(failure=RequestFailed(self.poisoned)))
        self.pending.clear()
        self.pending_bytes = 0
        self.stalled_since = None
        return freed


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

    def pending_bytes(self, tenant: str) -> int:
        """Bytes of requests waiting in the lanes of all models of ``tenant``."""
        return sum(model.lane.pending_bytes for model in self._models.values() if model.tenant == tenant)

    def lanes(self) -> list[Lane]:
        return [model.lane for model in self._models.values()]

    def drop_sessions(self, session_ids: set[str], reason: str) -> int:
        """Forgets the models of these sessions (their adapters stay in the trainer and the registry); their
        waiting requests fail with ``reason``. The bytes freed."""
        freed = 0
        for model_id in [m for m, model in self._models.items() if model.session_id in session_ids]:
            freed += self._models.pop(model_id).lane.expire(float("inf"), reason)
        for model_id in [m for m in self.creating if m.partition(":")[0] in session_ids]:
            del self.creating[model_id]
        return freed

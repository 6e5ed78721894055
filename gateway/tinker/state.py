"""The tinker surface's own state, hung off the aiohttp app: futures, sessions, models, checkpoints, training runs,
their state store and the stability records."""

from __future__ import annotations

from dataclasses import dataclass, field

from aiohttp import web

from opentinker.gateway.config import GatewayConfig
from opentinker.gateway.tinker.checkpoints import CheckpointTable
from opentinker.gateway.tinker.durable import MemoryState, Saved
from opentinker.gateway.tinker.futures import FutureStore
from opentinker.gateway.tinker.models import Lane, ModelTable, TrainingModel
from opentinker.gateway.tinker.runs import RunTable
from opentinker.gateway.tinker.sessions import SessionTable
from opentinker.gateway.tinker.stability import StabilityRecords


@dataclass(slots=True)
class TinkerState:
    config: GatewayConfig = field(default_factory=GatewayConfig)  # the gateway's (Gateway.config)
    futures: FutureStore = field(default_factory=FutureStore)
    sessions: SessionTable = field(default_factory=SessionTable)
    models: ModelTable = field(default_factory=ModelTable)
    checkpoints: CheckpointTable = field(default_factory=CheckpointTable)
    runs: RunTable = field(default_factory=RunTable)
    durable: MemoryState = field(default_factory=MemoryState)  # durable.py: Redis with --redis-url
    stability: StabilityRecords = field(default_factory=StabilityRecords)

    def __post_init__(self) -> None:
        self.futures.poll_seconds = self.config.poll_seconds
        self.futures.max_inflight = self.config.max_inflight_per_tenant
        self.futures.results.max_bytes = self.config.max_tenant_result_bytes or None
        self.stability.ttl_seconds = self.config.stability_ttl_seconds
        self.stability.max_tenant_tokens = self.config.max_tenant_stability_tokens

    def restore(self, saved: Saved) -> None:
        """The tables as the state store kept them: the models of sessions that have not expired get their lanes
        back, expecting the seq_id after the last one accepted."""
        self.sessions.restore(saved.sessions, saved.samplers)
        for run in saved.runs:
            self.runs.add(run)
            session = self.sessions.find(run.session_id)
            if session is None or session.finished == "expired":
                continue
            lane = self.lane(run.model_id)
            lane.next_seq = saved.seq.get(run.model_id, 0) + 1
            self.models.add(
                TrainingModel(run.model_id, run.tenant, run.session_id, run.adapter, run.lora, run.base_model, lane)
            )
        for checkpoint in saved.checkpoints:
            self.checkpoints.add(checkpoint)

    def lane(self, model_id: str) -> Lane:
        """A new model's request lane, within the configured window and pending bytes."""
        return Lane(model_id, window=self.config.seq_window, max_pending_bytes=self.config.max_pending_bytes)


TINKER = web.AppKey("tinker", TinkerState)


def tinker_of(request: web.Request) -> TinkerState:
    return request.app[TINKER]

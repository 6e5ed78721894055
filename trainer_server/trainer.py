"""The trainer's compute core: many adapters on one frozen base, by name. Synchronous; the scheduler runs every
call on one compute thread, so at most one adapter's weights are routed into the base model at a time.

Each method finds the adapter (bringing it back to the device if it was offloaded) and hands it to the plain
function of its job: forward_backward.py (accumulate, forward, record_batch, undo), optim_step.py, snapshot.py,
saved_state.py, residency.py. Path of a training step: build_batch (validation, service) -> accumulate per
micro-batch -> record_batch into the ledger -> optim_step (AdamW over the adapter's explicit parameter list, then
clear its gradients).
"""

from __future__ import annotations

import gc
import time
from collections import OrderedDict
from pathlib import Path

import torch

from opentinker.rpc.process.memory import release_freed_memory
from opentinker.rpc.serving.auth import LOCAL_PRINCIPAL, Principal
from opentinker.rpc.serving.errors import AlreadyExists, NotFound
from opentinker.trainer_server import forward_backward, saved_state, snapshot
from opentinker.trainer_server.adapter import AdapterState, new_adapter
from opentinker.trainer_server.adapter_config import DEFAULT_ADAM, AdamParams, LoraConfig, lora_or_default
from opentinker.trainer_server.base_model import BaseModel
from opentinker.trainer_server.batch import Batch
from opentinker.trainer_server.forward_backward import GradientMark, StepOutput
from opentinker.trainer_server.optim_step import optim_step
from opentinker.trainer_server.residency import offload, restore
from opentinker.trainer_server.spill import spill_path
from opentinker.weights.artifact_bucket import Bucket
from opentinker.weights.artifact_manifest import ArtifactRef
from opentinker.weights.artifact_store import ArtifactStore


class Trainer:
    def __init__(
        self,
        base: BaseModel,
        artifacts: ArtifactStore,
        *,
        max_resident: int = 0,
        spill_dir: Path | None = None,
        bucket: Bucket | None = None,
    ) -> None:
        self.base = base
        self.artifacts = artifacts  # with a bucket: its verified cache; snapshots and states move in the handlers
        self.bucket = bucket
        self.max_resident = max_resident
        self.spill_dir = spill_dir
        self.adapters: OrderedDict[str, AdapterState] = OrderedDict()  # LRU order: oldest first
        # Padding is masked out, so any valid id does; eos may be a list (every Llama 3 Instruct config).
        ids = (base.shape.pad_token_id, *base.shape.eos_token_ids)
        self.pad_id = next((i for i in ids if i is not None), 0)

    # Adapters

    def get(self, name: str) -> AdapterState:
        state = self.adapters.get(name)
        if state is None:
            raise NotFound(f"adapter {name!r} is not loaded in this trainer", reason="ADAPTER_NOT_FOUND", adapter=name)
        return state

    def create(self, name: str, lora: LoraConfig, adam: AdamParams | None, seed: int) -> AdapterState:
        if name in self.adapters:
            raise AlreadyExists(
                f"adapter {name!r} already exists in this trainer", reason="ADAPTER_EXISTS", adapter=name
            )
        # check_lora / check_adam ran at the RPC boundary (the handlers), before anything was created.
        lora = lora_or_default(lora)
        targets = self.base.resolve_targets(list(lora.target_modules))
        shapes = self.base.module_shapes()
        state = new_adapter(name, lora, adam or DEFAULT_ADAM, seed, {t: shapes[t] for t in targets}, self.base.device)
        self.adapters[name] = state
        self._make_room(keep=name)
        return state

    def delete(self, name: str) -> None:
        self.get(name)
        del self.adapters[name]
        if self.spill_dir is not None:
            spill_path(self.spill_dir, name).unlink(missing_ok=True)
        # Give the memory back: tensors freed from the compute thread's heap stay resident until trimmed.
        gc.collect()
        if self.base.device.type == "cuda":
            torch.cuda.empty_cache()
        release_freed_memory()

    # Compute (forward_backward.py, optim_step.py)

    def accumulate(self, name: str, batch: Batch, loss_fn: str, config: dict[str, float]) -> StepOutput:
        return forward_backward.accumulate(self.base, self._use(name), batch, loss_fn, config)

    def forward(self, name: str, batch: Batch, loss_fn: str, config: dict[str, float]) -> StepOutput:
        return forward_backward.forward(self.base, self._use(name), batch, loss_fn, config)

    def record_batch(self, name: str, batch: Batch, loss_fn: str, trace_ids: list[str]) -> None:
        forward_backward.record_batch(self._use(name), batch, loss_fn, trace_ids)

    def gradient_mark(self, name: str) -> GradientMark:
        return forward_backward.gradient_mark(self._use(name))

    def undo_forward_backward(self, name: str, mark: GradientMark) -> None:
        forward_backward.undo_forward_backward(self._use(name), mark)

    def optim_step(self, name: str, adam: AdamParams | None) -> tuple[int, dict[str, float]]:
        return optim_step(self._use(name), adam)

    # Snapshots (snapshot.py) and states (saved_state.py)

    def write_snapshot(self, name: str) -> ArtifactRef:
        return snapshot.write_snapshot(self.base, self.artifacts, self._use(name))

    def check_snapshot(self, uri: str, lora: LoraConfig) -> None:
        snapshot.check_snapshot(self.base, self.artifacts, uri, lora)

    def load_snapshot(self, name: str, uri: str) -> None:
        snapshot.load_snapshot(self.artifacts, self._use(name), uri)

    def reset_to_snapshot(self, name: str, uri: str, *, keep_optimizer: bool) -> AdapterState:
        state = self._use(name)
        snapshot.reset_to_snapshot(self.artifacts, state, uri, keep_optimizer=keep_optimizer)
        return state

    def save_state(self, name: str, label: str, *, owner: str | None = None) -> ArtifactRef:
        return saved_state.save_state(self.base, self.artifacts, self._use(name), label, owner=owner)

    def check_state(self, uri: str, lora: LoraConfig, principal: Principal = LOCAL_PRINCIPAL) -> None:
        saved_state.check_state(self.base, self.artifacts, uri, lora, principal)

    def delete_state(self, uri: str, principal: Principal = LOCAL_PRINCIPAL) -> int:
        return saved_state.delete_state(self.artifacts, uri, principal)

    def load_state(
        self, name: str, uri: str, *, weights_only: bool = False, principal: Principal = LOCAL_PRINCIPAL
    ) -> AdapterState:
        state = self._use(name)
        saved_state.load_state(self.base, self.artifacts, state, uri, weights_only=weights_only, principal=principal)
        return state

    # Residency (residency.py): idle adapters leave the device, least recently used first.

    def _use(self, name: str) -> AdapterState:
        state = self.get(name)
        if not state.resident:
            # first: a refused spill file leaves the adapter, LRU order included, as it was
            restore(state, self.base.device, self.spill_dir)
        self.adapters.move_to_end(name)
        state.last_used = time.monotonic()
        self._make_room(keep=name)
        return state

    def _make_room(self, keep: str) -> None:
        if self.max_resident <= 0:
            return
        resident = [n for n, s in self.adapters.items() if s.resident and n != keep]
        excess = len(resident) + 1 - self.max_resident
        for name in resident[: max(0, excess)]:
            offload(self.adapters[name], self.base.device, self.spill_dir)

"""The trainer's compute core: many adapters on one frozen base. Synchronous; the scheduler runs every
call on one compute thread, so at most one adapter's weights are routed into the base model at a time.

Path of a training step: build_batch (validation, service) -> accumulate per micro-batch (this file: activate
the adapter's LoRA weights, run the base model, gather target logprobs, loss, backward into the adapter's own
parameters), record_batch into the ledger -> optim_step (AdamW over the adapter's explicit parameter list,
then clear its gradients).
"""

from __future__ import annotations

import gc
import io
import json
import math
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from google.protobuf.json_format import MessageToDict, ParseDict
from safetensors import safe_open
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from opentinker.rpc import faults
from opentinker.rpc.auth import LOCAL_PRINCIPAL, Principal
from opentinker.rpc.errors import AlreadyExists, DataLoss, FailedPrecondition, InvalidArgument, NotFound
from opentinker.rpc.memory import release_freed_memory
from opentinker.trainer_server.adapter import AdapterState, Ledger, adam_or_default, new_adapter
from opentinker.trainer_server.base_model import BaseModel
from opentinker.trainer_server.batch import Batch
from opentinker.trainer_server.losses import compute_loss
from opentinker.trainer_server.ownership import may_load
from opentinker.trainer_server.spill import Moments, Offloaded, read_spill, spill_path, write_spill
from opentinker.trainer_server.step_guard import check_weights, mark_step, undo_step
from opentinker.v1 import common_pb2, registry_pb2
from opentinker.weights.artifact_manifest import ArtifactRef
from opentinker.weights.artifact_store import ArtifactStore
from opentinker.weights.peft import (
    CONFIG_FILE,
    MAX_LORA_SCALING,
    MAX_RANK,
    WEIGHTS_FILE,
    alpha_or_rank,
    lora_a_key,
    lora_b_key,
    lora_modules,
    read_peft_config,
)

STATE_FORMAT = 1


@dataclass(frozen=True, slots=True)
class StepOutput:
    logprobs: list[list[float]]  # per datum, one per target token
    metrics: dict[str, float]


@dataclass(frozen=True, slots=True)
class GradientMark:
    grads: list[torch.Tensor | None]  # copies, in the adapter's parameter order
    pending: int  # batches awaiting the optimizer step
    rng: torch.Tensor  # dropout generator state


def check_lora(lora: common_pb2.LoraConfig) -> None:
    if lora.rank <= 0 or lora.rank > MAX_RANK:
        raise InvalidArgument(
            f"lora_config.rank must be in 1..{MAX_RANK}, got {lora.rank}",
            reason="INVALID_LORA_CONFIG",
            field="lora_config.rank",
        )
    if not math.isfinite(lora.alpha) or lora.alpha < 0:
        raise InvalidArgument("lora_config.alpha must be >= 0", reason="INVALID_LORA_CONFIG", field="lora_config.alpha")
    scaling = alpha_or_rank(lora.alpha, lora.rank) / lora.rank
    if scaling > MAX_LORA_SCALING:
        raise InvalidArgument(
            f"lora_config.alpha / rank = {scaling:g} is beyond the limit of {MAX_LORA_SCALING:g}",
            reason="INVALID_LORA_CONFIG",
            field="lora_config.alpha",
        )
    if not 0 <= lora.dropout < 1:
        raise InvalidArgument(
            "lora_config.dropout must be in [0, 1)", reason="INVALID_LORA_CONFIG", field="lora_config.dropout"
        )


def lora_or_default(lora: common_pb2.LoraConfig) -> common_pb2.LoraConfig:
    """A copy with the documented defaults filled in: alpha 0 means alpha = rank (scaling 1)."""
    filled = common_pb2.LoraConfig()
    filled.CopyFrom(lora)
    filled.alpha = alpha_or_rank(filled.alpha, filled.rank)
    return filled


def check_adam(adam: common_pb2.AdamParams) -> None:
    checks = {
        "learning_rate": adam.learning_rate >= 0,
        "beta1": 0 <= adam.beta1 < 1,
        "beta2": 0 <= adam.beta2 < 1,
        "eps": adam.eps >= 0,
        "weight_decay": adam.weight_decay >= 0,
        "grad_clip_norm": adam.grad_clip_norm >= 0,
    }
    for name, ok in checks.items():
        value = getattr(adam, name)
        if not ok or not math.isfinite(value):
            raise InvalidArgument(
                f"adam_params.{name} = {value} is out of range",
                reason="INVALID_ADAM_PARAMS",
                field=f"adam_params.{name}",
            )


class Trainer:
    def __init__(
        self,
        base: BaseModel,
        artifacts: ArtifactStore,
        *,
        max_resident: int = 0,
        spill_dir: Path | None = None,
    ) -> None:
        self.base = base
        self.artifacts = artifacts
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

    def create(
        self, name: str, lora: common_pb2.LoraConfig, adam: common_pb2.AdamParams | None, seed: int
    ) -> AdapterState:
        if name in self.adapters:
            raise AlreadyExists(
                f"adapter {name!r} already exists in this trainer", reason="ADAPTER_EXISTS", adapter=name
            )
        # check_lora / check_adam ran at the RPC boundary (service.py), before anything was created.
        lora = lora_or_default(lora)
        adam = adam_or_default(adam)
        targets = self.base.resolve_targets(list(lora.target_modules))
        shapes = self.base.module_shapes()
        state = new_adapter(name, lora, adam, seed, {t: shapes[t] for t in targets}, self.base.device)
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

    # Compute

    def _target_logprobs(self, state: AdapterState, batch: Batch, *, training: bool) -> torch.Tensor:
        device = self.base.device
        with self.base.activate(state.modules, training=training):
            logits = self.base.model(
                input_ids=batch.input_ids.to(device), attention_mask=batch.attention_mask.to(device)
            ).logits  # [B, T, V]
        valid = batch.attention_mask.to(device).bool()  # [B, T]
        flat = logits[valid].float()  # [N, V], datums in order
        logprobs: torch.Tensor = flat.log_softmax(-1).gather(1, batch.targets.to(device)[:, None]).squeeze(1)  # [N]
        return logprobs

    def _outputs(self, logprobs: torch.Tensor, batch: Batch) -> list[list[float]]:
        values = logprobs.detach().cpu().tolist()
        out, start = [], 0
        for length in batch.lengths:
            out.append(values[start : start + length])
            start += length
        return out

    def accumulate(self, name: str, batch: Batch, loss_fn: str, config: dict[str, float]) -> StepOutput:
        """Forward and backward of one (micro-)batch: adds its gradients to the adapter's; no ledger entry."""
        state = self._use(name)
        logprobs = self._target_logprobs(state, batch, training=True)
        inputs = {key: value.to(logprobs.device) for key, value in batch.inputs.items()}
        result = compute_loss(loss_fn, logprobs, inputs, config)
        result.loss.backward()  # type: ignore[no-untyped-call]
        metrics = {
            **result.metrics,
            "tokens:sum": float(batch.num_tokens),
            "datums:sum": float(len(batch.lengths)),
        }
        return StepOutput(self._outputs(logprobs, batch), metrics)

    def record_batch(self, name: str, batch: Batch, loss_fn: str, trace_ids: list[str]) -> None:
        """The request's batch (all its micro-batches) goes into the ledger, for the next optimizer step."""
        state = self._use(name)
        state.ledger.pending.append(
            registry_pb2.BatchRecord(
                digest=batch.digest,
                trace_ids=trace_ids,
                step=state.step + 1,
                num_datums=len(batch.lengths),
                num_tokens=batch.num_tokens,
                loss_fn=loss_fn,
            )
        )
        state.ledger.pending[-1].time.GetCurrentTime()

    def gradient_mark(self, name: str) -> GradientMark:
        """What a ForwardBackward changes (gradients, pending batches, dropout RNG), to undo it if its client
        gave up before the answer (the work must then leave no trace, or a retry would count twice)."""
        state = self._use(name)
        grads = [None if p.grad is None else p.grad.clone() for p in state.params]
        return GradientMark(grads, len(state.ledger.pending), state.generator.get_state())

    def undo_forward_backward(self, name: str, mark: GradientMark) -> None:
        state = self._use(name)
        for param, grad in zip(state.params, mark.grads, strict=True):
            param.grad = grad
        del state.ledger.pending[mark.pending :]
        state.generator.set_state(mark.rng)

    def forward(self, name: str, batch: Batch, loss_fn: str, config: dict[str, float]) -> StepOutput:
        state = self._use(name)
        with torch.no_grad():
            logprobs = self._target_logprobs(state, batch, training=False)
            inputs = {key: value.to(logprobs.device) for key, value in batch.inputs.items()}
            result = compute_loss(loss_fn, logprobs, inputs, config)
        metrics = {
            **result.metrics,
            "tokens:sum": float(batch.num_tokens),
            "datums:sum": float(len(batch.lengths)),
        }
        return StepOutput(self._outputs(logprobs, batch), metrics)

    def optim_step(self, name: str, adam: common_pb2.AdamParams | None) -> tuple[int, dict[str, float]]:
        state = self._use(name)
        params = adam_or_default(adam) if adam is not None else state.adam  # a request's own: checked by the service
        if not state.ledger.pending or not state.has_gradients():
            raise FailedPrecondition(
                f"no gradients accumulated for {name!r} since its last optim_step: call forward_backward first",
                reason="NO_GRADIENTS",
                adapter=name,
            )
        mark = mark_step(state)  # before clipping, which scales the gradients in place
        grads = [p.grad for p in state.params if p.grad is not None]
        grad_norm = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])))
        if params.grad_clip_norm > 0:
            torch.nn.utils.clip_grad_norm_(state.params, params.grad_clip_norm)
        for group in state.optimizer.param_groups:
            group.update(
                lr=params.learning_rate,
                betas=(params.beta1, params.beta2),
                eps=params.eps,
                weight_decay=params.weight_decay,
            )
        what = f"OptimStep (learning_rate {params.learning_rate:g}) was undone"
        try:
            try:
                state.optimizer.step()
            except RuntimeError as exc:  # e.g. "value cannot be converted to type float without overflow"
                if "overflow" not in str(exc):
                    raise
                raise FailedPrecondition(
                    f"{what}: the update overflows ({exc})", reason="WEIGHTS_OUT_OF_RANGE", adapter=name
                ) from None
            check_weights(state, what)
        except BaseException:
            undo_step(state, mark)  # weights, gradients, moments and hyperparameters as before the call
            raise
        del mark
        state.optimizer.zero_grad(set_to_none=True)
        state.step += 1
        for record in state.ledger.pending:
            state.ledger.tokens_trained += record.num_tokens
            state.ledger.datums_trained += record.num_datums
        state.ledger.batches.extend(state.ledger.pending)
        state.ledger.pending.clear()
        return state.step, {"grad_norm:value": grad_norm, "learning_rate:value": params.learning_rate}

    # Snapshots and states

    def write_snapshot(self, name: str) -> ArtifactRef:
        state = self._use(name)
        check_weights(state, "SaveSnapshot refused")  # e.g. a state loaded from elsewhere
        config = json.dumps(state.peft_config(self.base.model_path), indent=2, sort_keys=True) + "\n"
        files = {
            "adapter_config.json": config.encode(),
            "adapter_model.safetensors": save_safetensors(state.peft_state_dict()),
        }
        with faults.scope("save_snapshot"):
            return self.artifacts.commit_files(files)

    def check_snapshot(self, uri: str, lora: common_pb2.LoraConfig) -> None:
        """FAILED_PRECONDITION INCOMPATIBLE_SNAPSHOT unless the snapshot holds exactly the LoRA tensors (names
        and shapes) of an adapter with this config. Reads only: changes nothing."""
        directory = self.artifacts.path(uri)  # verifies every digest
        try:
            with safe_open(str(directory / WEIGHTS_FILE), framework="pt") as handle:
                shapes = {key: tuple(handle.get_slice(key).get_shape()) for key in handle.keys()}  # noqa: SIM118
            # The format rules every process applies (a snapshot the sampler would refuse is refused here too).
            lora_modules(shapes, read_peft_config(directory / CONFIG_FILE))
        except Exception as exc:
            why = str(exc).replace(str(directory), uri)  # the store's paths are not the client's business
            raise FailedPrecondition(
                f"snapshot {uri} is not a peft LoRA snapshot: {why}", reason="INCOMPATIBLE_SNAPSHOT"
            ) from None
        module_shapes = self.base.module_shapes()
        expected: dict[str, tuple[int, ...]] = {}
        for target in self.base.resolve_targets(list(lora.target_modules)):
            expected[lora_a_key(target)] = (lora.rank, module_shapes[target].d_in)
            expected[lora_b_key(target)] = (module_shapes[target].d_out, lora.rank)
        if shapes != expected:
            differ = sorted(k for k in shapes.keys() | expected.keys() if shapes.get(k) != expected.get(k))
            raise FailedPrecondition(
                f"snapshot {uri} does not fit LoRA config {MessageToDict(lora)}: {len(differ)} tensors differ in "
                f"name or shape, e.g. {differ[0]} is {shapes.get(differ[0])}, expected {expected.get(differ[0])}",
                reason="INCOMPATIBLE_SNAPSHOT",
            )

    def load_snapshot(self, name: str, uri: str) -> None:
        """Initialise an adapter's weights from a published snapshot (verified by the store)."""
        state = self._use(name)
        directory = self.artifacts.path(uri)
        try:
            state.load_peft_state_dict(load_safetensors((directory / WEIGHTS_FILE).read_bytes()))
        except ValueError as exc:
            raise FailedPrecondition(
                f"snapshot {uri} does not fit adapter {name!r}: {exc}", reason="INCOMPATIBLE_SNAPSHOT"
            ) from None

    def reset_to_snapshot(self, name: str, uri: str, *, keep_optimizer: bool) -> AdapterState:
        """Loads a published snapshot's weights into the live adapter: its gradients and pending batches go (they
        were computed on other weights); AdamW moments too unless keep_optimizer. The step count stays."""
        state = self._use(name)
        self.load_snapshot(name, uri)  # checks every tensor before it copies one: a misfit changes nothing
        for param in state.params:
            param.grad = None
        state.ledger.pending.clear()
        if not keep_optimizer:
            state.optimizer.state.clear()  # moments and AdamW's own step counter: as if never stepped
        return state

    def save_state(self, name: str, label: str, *, owner: str | None = None) -> ArtifactRef:
        """owner: the tenant the state belongs to (ownership.py), recorded for LoadState's check."""
        state = self._use(name)
        meta = {
            "format": STATE_FORMAT,
            "adapter": name,
            "owner": owner,
            "label": label,
            "base_model_digest": self.base.digest,
            "lora": MessageToDict(state.lora),
            "adam": MessageToDict(state.adam),
            "seed": state.seed,
            "step": state.step,
            "last_snapshot_version": state.last_snapshot_version,
            "ledger": json.loads(state.ledger.to_json()),
        }
        grads = {f"{i}": p.grad.detach().cpu() for i, p in enumerate(state.params) if p.grad is not None}
        files = {
            "state.json": (json.dumps(meta, indent=2, sort_keys=True) + "\n").encode(),
            "weights.safetensors": save_safetensors(state.peft_state_dict()),
            "grads.safetensors": save_safetensors(grads),
            "optimizer.pt": _torch_bytes(state.optimizer.state_dict()),
            "rng.pt": _torch_bytes(state.generator.get_state()),
        }
        with faults.scope("save_state"):
            return self.artifacts.commit_files(files)

    def check_state(
        self, uri: str, lora: common_pb2.LoraConfig, principal: Principal = LOCAL_PRINCIPAL
    ) -> tuple[Path, dict[str, Any]]:
        """The directory and metadata of a saved state that fits an adapter with this LoRA config.

        NOT_FOUND STATE_NOT_FOUND when no state has this id (a snapshot is not a state) or `principal` may not
        load it (the same answer: existence is not revealed); FAILED_PRECONDITION when it was saved on another
        base model or with another LoRA config. Reads only: changes nothing."""
        missing = NotFound(f"state {uri} not found", reason="STATE_NOT_FOUND", state_id=uri)
        try:
            directory = self.artifacts.path(uri)  # verifies every digest (DATA_LOSS otherwise)
        except NotFound:
            raise missing from None
        if not (directory / "state.json").is_file():
            raise missing
        meta: dict[str, Any] = json.loads((directory / "state.json").read_text())
        if not isinstance(meta, dict) or not may_load(meta, principal):
            raise missing
        if meta.get("format") != STATE_FORMAT:
            raise DataLoss(f"state {uri} has unknown format {meta.get('format')}", reason="INVALID_STATE")
        if meta["base_model_digest"] != self.base.digest:
            raise FailedPrecondition("state was saved on another base model", reason="BASE_MODEL_MISMATCH")
        saved = ParseDict(meta["lora"], common_pb2.LoraConfig())
        if saved != lora_or_default(lora):
            raise FailedPrecondition(
                f"state was saved with LoRA config {meta['lora']}, the adapter has {MessageToDict(lora)}",
                reason="INCOMPATIBLE_STATE",
            )
        return directory, meta

    def delete_state(self, uri: str, principal: Principal = LOCAL_PRINCIPAL) -> int:
        """Removes a saved state from the store; the bytes freed. NOT_FOUND STATE_NOT_FOUND for what check_state
        would not show `principal` (no such state, a snapshot, another tenant's state)."""
        missing = NotFound(f"state {uri} not found", reason="STATE_NOT_FOUND", state_id=uri)
        try:
            directory = self.artifacts.path(uri)
        except NotFound:
            raise missing from None
        meta_file = directory / "state.json"
        meta = json.loads(meta_file.read_text()) if meta_file.is_file() else None
        if not isinstance(meta, dict) or not may_load(meta, principal):
            raise missing
        return self.artifacts.delete(uri)

    def load_state(
        self, name: str, uri: str, *, weights_only: bool = False, principal: Principal = LOCAL_PRINCIPAL
    ) -> AdapterState:
        state = self._use(name)
        directory, meta = self.check_state(uri, state.lora, principal)
        state.load_peft_state_dict(load_safetensors((directory / "weights.safetensors").read_bytes()))
        if weights_only:
            for param in state.params:
                param.grad = None
            state.ledger.pending.clear()  # their gradients are gone: those batches will never be stepped
            state.optimizer.state.clear()  # moments and AdamW's own step counter: as if never stepped
            return state
        grads = load_safetensors((directory / "grads.safetensors").read_bytes())
        device = self.base.device
        for index, param in enumerate(state.params):
            param.grad = grads[str(index)].to(device) if str(index) in grads else None
        state.optimizer.load_state_dict(
            torch.load(io.BytesIO((directory / "optimizer.pt").read_bytes()), map_location=device, weights_only=True)
        )
        state.generator.set_state(torch.load(io.BytesIO((directory / "rng.pt").read_bytes()), weights_only=True))
        state.adam = ParseDict(meta["adam"], common_pb2.AdamParams())
        state.step = int(meta["step"])
        if meta["adapter"] == name:  # a state of another adapter: the next snapshot's parent is this one's own
            state.last_snapshot_version = int(meta["last_snapshot_version"])
        state.ledger = Ledger.from_json(json.dumps(meta["ledger"]))
        return state

    # Residency: idle adapters leave the device (to CPU memory, or to disk when the device is the CPU).

    def _use(self, name: str) -> AdapterState:
        state = self.get(name)
        if not state.resident:
            self._restore(state)  # first: a refused spill file leaves the adapter, LRU order included, as it was
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
            self._offload(self.adapters[name])

    def _offload(self, state: AdapterState) -> None:
        cpu = torch.device("cpu")
        offloaded = Offloaded(
            params=[p.detach().cpu() for p in state.params],
            grads=[None if p.grad is None else p.grad.detach().cpu() for p in state.params],
            # AdamW moments in parameter order (the state dict is keyed by the parameter objects).
            moments=[_to(state.optimizer.state.get(p), cpu) for p in state.params],
        )
        if self.base.device.type == "cpu":
            assert self.spill_dir is not None, "offloading on CPU needs a spill directory"
            state.spill_digest = write_spill(self.spill_dir, state.name, offloaded)
            state.offloaded = None
        else:
            state.offloaded = offloaded
        for param in state.params:
            param.data = torch.empty(0, device=param.device)
            param.grad = None
        state.optimizer.state.clear()
        state.resident = False

    def _restore(self, state: AdapterState) -> None:
        device = self.base.device
        offloaded = state.offloaded
        if offloaded is None:
            assert self.spill_dir is not None
            offloaded = read_spill(self.spill_dir, state.name, state.spill_digest)  # DATA_LOSS: nothing changed
        for param, data, grad in zip(state.params, offloaded.params, offloaded.grads, strict=True):
            param.data = data.to(device)
            param.grad = None if grad is None else grad.to(device)
        for param, saved in zip(state.params, offloaded.moments, strict=True):
            if saved is not None:
                state.optimizer.state[param] = _to(saved, device)
        if state.offloaded is None and self.spill_dir is not None:
            spill_path(self.spill_dir, state.name).unlink(missing_ok=True)
        state.offloaded = None
        state.spill_digest = ""
        state.resident = True


def _to(moments: Moments | None, device: torch.device) -> Moments | None:
    if moments is None:
        return None
    return {key: value.to(device) if isinstance(value, torch.Tensor) else value for key, value in moments.items()}


def _torch_bytes(value: object) -> bytes:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()

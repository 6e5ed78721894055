"""An adapter's full training state in the artifact store (weights, gradients, AdamW moments, RNG, step and
ledger, with its owner): save one, check that one may be loaded into an adapter, load one, delete one."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from opentinker.rpc.process import faults
from opentinker.rpc.serving.auth import Principal
from opentinker.rpc.serving.errors import DataLoss, FailedPrecondition, NotFound
from opentinker.trainer_server.adapter import AdapterState
from opentinker.trainer_server.adapter_config import (
    LoraConfig,
    adam_dict,
    adam_from_dict,
    lora_dict,
    lora_from_dict,
    lora_or_default,
)
from opentinker.trainer_server.base_model import BaseModel
from opentinker.trainer_server.ledger import Ledger
from opentinker.trainer_server.ownership import may_load
from opentinker.weights.artifact_manifest import ArtifactRef
from opentinker.weights.artifact_store import ArtifactStore

STATE_FORMAT = 1


def save_state(
    base: BaseModel, artifacts: ArtifactStore, state: AdapterState, label: str, *, owner: str | None
) -> ArtifactRef:
    """owner: the tenant the state belongs to (ownership.py), recorded for LoadState's check."""
    meta = {
        "format": STATE_FORMAT,
        "adapter": state.name,
        "owner": owner,
        "label": label,
        "base_model_digest": base.digest,
        "lora": lora_dict(state.lora),
        "adam": adam_dict(state.adam),
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
        return artifacts.commit_files(files)


def check_state(
    base: BaseModel, artifacts: ArtifactStore, uri: str, lora: LoraConfig, principal: Principal
) -> tuple[Path, dict[str, Any]]:
    """The directory and metadata of a saved state that fits an adapter with this LoRA config.

    NOT_FOUND STATE_NOT_FOUND when no state has this id (a snapshot is not a state) or `principal` may not
    load it (the same answer: existence is not revealed); FAILED_PRECONDITION when it was saved on another
    base model or with another LoRA config. Reads only: changes nothing."""
    missing = NotFound(f"state {uri} not found", reason="STATE_NOT_FOUND", state_id=uri)
    try:
        directory = artifacts.path(uri)  # verifies every digest (DATA_LOSS otherwise)
    except NotFound:
        raise missing from None
    if not (directory / "state.json").is_file():
        raise missing
    meta: dict[str, Any] = json.loads((directory / "state.json").read_text())
    if not isinstance(meta, dict) or not may_load(meta, principal):
        raise missing
    if meta.get("format") != STATE_FORMAT:
        raise DataLoss(f"state {uri} has unknown format {meta.get('format')}", reason="INVALID_STATE")
    if meta["base_model_digest"] != base.digest:
        raise FailedPrecondition("state was saved on another base model", reason="BASE_MODEL_MISMATCH")
    if lora_from_dict(meta["lora"]) != lora_or_default(lora):
        raise FailedPrecondition(
            f"state was saved with LoRA config {meta['lora']}, the adapter has {lora_dict(lora)}",
            reason="INCOMPATIBLE_STATE",
        )
    return directory, meta


def delete_state(artifacts: ArtifactStore, uri: str, principal: Principal) -> int:
    """Removes a saved state from the store; the bytes freed. NOT_FOUND STATE_NOT_FOUND for what check_state
    would not show `principal` (no such state, a snapshot, another tenant's state)."""
    missing = NotFound(f"state {uri} not found", reason="STATE_NOT_FOUND", state_id=uri)
    try:
        directory = artifacts.path(uri)
    except NotFound:
        raise missing from None
    meta_file = directory / "state.json"
    meta = json.loads(meta_file.read_text()) if meta_file.is_file() else None
    if not isinstance(meta, dict) or not may_load(meta, principal):
        raise missing
    return artifacts.delete(uri)


def load_state(
    base: BaseModel,
    artifacts: ArtifactStore,
    state: AdapterState,
    uri: str,
    *,
    weights_only: bool,
    principal: Principal,
) -> None:
    directory, meta = check_state(base, artifacts, uri, state.lora, principal)
    state.load_peft_state_dict(load_safetensors((directory / "weights.safetensors").read_bytes()))
    if weights_only:
        for param in state.params:
            param.grad = None
        state.ledger.pending.clear()  # their gradients are gone: those batches will never be stepped
        state.optimizer.state.clear()  # moments and AdamW's own step counter: as if never stepped
        return
    grads = load_safetensors((directory / "grads.safetensors").read_bytes())
    device = base.device
    for index, param in enumerate(state.params):
        param.grad = grads[str(index)].to(device) if str(index) in grads else None
    state.optimizer.load_state_dict(
        torch.load(io.BytesIO((directory / "optimizer.pt").read_bytes()), map_location=device, weights_only=True)
    )
    state.generator.set_state(torch.load(io.BytesIO((directory / "rng.pt").read_bytes()), weights_only=True))
    state.adam = adam_from_dict(meta["adam"])
    state.step = int(meta["step"])
    if meta["adapter"] == state.name:  # a state of another adapter: the next snapshot's parent is this one's own
        state.last_snapshot_version = int(meta["last_snapshot_version"])
    state.ledger = Ledger.from_json(json.dumps(meta["ledger"]))


def _torch_bytes(value: object) -> bytes:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()

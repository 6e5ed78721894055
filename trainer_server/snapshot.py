"""An adapter's weights as a published snapshot (a peft LoRA directory in the artifact store): write one, check
that one fits a LoRA config, and load one into a live adapter."""

from __future__ import annotations

import json

from safetensors import safe_open
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from opentinker.rpc.process import faults
from opentinker.rpc.serving.errors import FailedPrecondition
from opentinker.trainer_server.adapter import AdapterState
from opentinker.trainer_server.adapter_config import LoraConfig, lora_dict
from opentinker.trainer_server.base_model import BaseModel
from opentinker.trainer_server.step_guard import check_weights
from opentinker.weights.artifact_manifest import ArtifactRef
from opentinker.weights.artifact_store import ArtifactStore
from opentinker.weights.peft import CONFIG_FILE, WEIGHTS_FILE, lora_a_key, lora_b_key, lora_modules, read_peft_config


def write_snapshot(base: BaseModel, artifacts: ArtifactStore, state: AdapterState) -> ArtifactRef:
    check_weights(state, "SaveSnapshot refused")  # e.g. a state loaded from elsewhere
    config = json.dumps(state.peft_config(base.model_path), indent=2, sort_keys=True) + "\n"
    files = {
        "adapter_config.json": config.encode(),
        "adapter_model.safetensors": save_safetensors(state.peft_state_dict()),
    }
    with faults.scope("save_snapshot"):
        return artifacts.commit_files(files)


def check_snapshot(base: BaseModel, artifacts: ArtifactStore, uri: str, lora: LoraConfig) -> None:
    """FAILED_PRECONDITION INCOMPATIBLE_SNAPSHOT unless the snapshot holds exactly the LoRA tensors (names
    and shapes) of an adapter with this config. Reads only: changes nothing."""
    directory = artifacts.path(uri)  # verifies every digest
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
    module_shapes = base.module_shapes()
    expected: dict[str, tuple[int, ...]] = {}
    for target in base.resolve_targets(list(lora.target_modules)):
        expected[lora_a_key(target)] = (lora.rank, module_shapes[target].d_in)
        expected[lora_b_key(target)] = (module_shapes[target].d_out, lora.rank)
    if shapes != expected:
        differ = sorted(k for k in shapes.keys() | expected.keys() if shapes.get(k) != expected.get(k))
        raise FailedPrecondition(
            f"snapshot {uri} does not fit LoRA config {lora_dict(lora)}: {len(differ)} tensors differ in "
            f"name or shape, e.g. {differ[0]} is {shapes.get(differ[0])}, expected {expected.get(differ[0])}",
            reason="INCOMPATIBLE_SNAPSHOT",
        )


def load_snapshot(artifacts: ArtifactStore, state: AdapterState, uri: str) -> None:
    """Initialise an adapter's weights from a published snapshot (verified by the store)."""
    directory = artifacts.path(uri)
    try:
        state.load_peft_state_dict(load_safetensors((directory / WEIGHTS_FILE).read_bytes()))
    except ValueError as exc:
        raise FailedPrecondition(
            f"snapshot {uri} does not fit adapter {state.name!r}: {exc}", reason="INCOMPATIBLE_SNAPSHOT"
        ) from None


def reset_to_snapshot(artifacts: ArtifactStore, state: AdapterState, uri: str, *, keep_optimizer: bool) -> None:
    """Loads a published snapshot's weights into the live adapter: its gradients and pending batches go (they
    were computed on other weights); AdamW moments too unless keep_optimizer. The step count stays."""
    load_snapshot(artifacts, state, uri)  # checks every tensor before it copies one: a misfit changes nothing
    for param in state.params:
        param.grad = None
    state.ledger.pending.clear()
    if not keep_optimizer:
        state.optimizer.state.clear()  # moments and AdamW's own step counter: as if never stepped

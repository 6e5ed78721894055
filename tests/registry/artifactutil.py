"""Helpers shared by the artifact store tests: a tiny PEFT folder, store listings, the DataLoss check."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
import torch
from safetensors.torch import save_file

from opentinker.rpc.serving.errors import DataLoss
from opentinker.weights.artifact_store import ArtifactStore

CONFIG = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}


def write_peft_folder(folder: Path, seed: int = 0) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(seed)
    tensors = {
        "base_model.model.layers.0.q_proj.lora_A.weight": torch.randn(4, 32, generator=generator),
        "base_model.model.layers.0.q_proj.lora_B.weight": torch.randn(32, 4, generator=generator),
    }
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps(CONFIG, indent=2))
    return folder


def folder_bytes(folder: Path) -> dict[str, bytes]:
    return {path.relative_to(folder).as_posix(): path.read_bytes() for path in folder.rglob("*") if path.is_file()}


def objects(store: ArtifactStore) -> list[str]:
    return sorted(os.listdir(store.root / "sha256"))


def temp_entries(store: ArtifactStore) -> list[str]:
    return sorted(os.listdir(store.root / "tmp"))


def assert_data_loss(call: Callable[[], object]) -> DataLoss:
    with pytest.raises(DataLoss) as caught:
        call()
    assert caught.value.reason == "DIGEST_MISMATCH"
    assert caught.value.code == grpc.StatusCode.DATA_LOSS
    assert caught.value.to_status().code == grpc.StatusCode.DATA_LOSS.value[0]
    return caught.value

"""The trainer's builder (what `opentinker trainer serve` calls once its flags are parsed) on its own: the base
model loaded, one TrainerService binding, a clean stop before serving; a base model in pickled weights refused."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from opentinker.rpc.process.model_server_setup import ModelServerSetup
from opentinker.rpc.serving.errors import InvalidArgument
from opentinker.rpc.serving.server import ServerOptions
from opentinker.trainer_server.base_model import BaseModel
from opentinker.trainer_server.build import TrainerConfig, build_trainer


def test_build_trainer(tiny_model: Path, tmp_path: Path) -> None:
    built = build_trainer(
        TrainerConfig(
            setup=ModelServerSetup(
                model=str(tiny_model), registry="127.0.0.1:1", store=tmp_path / "store", device="cpu"
            ),
            server=ServerOptions(port=0),
        )
    )
    assert [b.name for b in built.bindings] == ["opentinker.v1.TrainerService"]
    assert (tmp_path / "store").is_dir()
    asyncio.run(built.on_stop())


def test_pickled_base_weights_are_refused(tiny_model: Path, tmp_path: Path) -> None:
    """A base model whose weights are only a pytorch_model.bin (a pickle) is refused before anything is read,
    as the sampler refuses it."""
    pickled = tmp_path / "pickled-model"
    pickled.mkdir()
    for path in tiny_model.iterdir():
        if path.suffix != ".safetensors":
            shutil.copy(path, pickled / path.name)
    torch.save(load_file(tiny_model / "model.safetensors"), pickled / "pytorch_model.bin")
    with pytest.raises(InvalidArgument) as info:
        BaseModel(str(pickled))
    assert info.value.reason == "INVALID_MODEL_WEIGHTS" and "no *.safetensors weights" in info.value.message

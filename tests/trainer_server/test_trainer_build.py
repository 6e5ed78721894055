"""The trainer's builder (what `opentinker trainer serve` calls once its flags are parsed) on its own: the base
model loaded, one TrainerService binding, a clean stop before serving."""

from __future__ import annotations

import asyncio
from pathlib import Path

from opentinker.rpc.server import ServerOptions
from opentinker.trainer_server.build import TrainerConfig, build_trainer


def test_build_trainer(tiny_model: Path, tmp_path: Path) -> None:
    built = build_trainer(TrainerConfig(model=str(tiny_model), registry="127.0.0.1:1", store=tmp_path / "store",
                                        server=ServerOptions(port=0), device="cpu"))  # fmt: skip
    assert [b.name for b in built.bindings] == ["opentinker.v1.TrainerService"]
    assert (tmp_path / "store").is_dir()
    asyncio.run(built.on_stop())

"""The sampler's builder (what `opentinker sampler serve` calls once its flags are parsed) on its own: an
in-process engine running the kernel it was given, one SamplerService binding, a clean stop; and the refusal of an
engine process on CUDA, which the CLI turns into its --engine-process error."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from opentinker.rpc.server import ServerOptions
from opentinker.sampler_server.build import BadOption, SamplerConfig, build_sampler
from opentinker.weights import base_model


def config(tiny_model: Path, tmp_path: Path, **overrides: object) -> SamplerConfig:
    values: dict[str, object] = {"max_slots": 2, "max_seqs": 2, "engine_process": False, "kernel": "reference"}
    values.update(overrides)
    return SamplerConfig(model=str(tiny_model), registry="127.0.0.1:1", store=tmp_path / "store",
                         server=ServerOptions(port=0), **values)  # type: ignore[arg-type]  # fmt: skip


def test_build_in_process(tiny_model: Path, tmp_path: Path) -> None:
    built = build_sampler(config(tiny_model, tmp_path))
    assert built.engine.kernel == "reference" and built.engine.max_seqs == 2
    assert [b.name for b in built.bindings] == ["opentinker.v1.SamplerService"]
    asyncio.run(built.on_stop())  # never served: stops what was built without touching the registry


def test_engine_process_on_cuda_is_refused(tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(base_model, "pick_device", lambda device: "cuda")
    with pytest.raises(BadOption, match="on CUDA the engine runs in the server process") as caught:
        build_sampler(config(tiny_model, tmp_path, engine_process=True))
    assert caught.value.option == "--engine-process"

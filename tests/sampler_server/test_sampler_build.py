"""The sampler's builder (what `opentinker sampler serve` calls once its flags are parsed) on its own: an
in-process engine running the kernel it was given, one SamplerService binding, a clean stop; the KV cache's size
from its flags."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from opentinker.rpc.process.model_server_setup import ModelServerSetup
from opentinker.rpc.serving.server import ServerOptions
from opentinker.sampler_server.build import BadOption, SamplerConfig, build_sampler
from opentinker.sampler_server.engine import Engine


def config(tiny_model: Path, tmp_path: Path, **overrides: object) -> SamplerConfig:
    values: dict[str, object] = {"max_slots": 2, "max_seqs": 2, "engine_process": False, "kernel": "reference"}
    values.update(overrides)
    return SamplerConfig(
        setup=ModelServerSetup(model=str(tiny_model), registry="127.0.0.1:1", store=tmp_path / "store"),
        server=ServerOptions(port=0),
        **values,  # type: ignore[arg-type]
    )


def test_build_in_process(tiny_model: Path, tmp_path: Path) -> None:
    built = build_sampler(config(tiny_model, tmp_path))
    assert built.engine.kernel == "reference" and built.engine.max_seqs == 2
    assert [b.name for b in built.bindings] == ["opentinker.v1.SamplerService"]
    asyncio.run(built.on_stop())  # never served: stops what was built without touching the registry


def test_kv_cache_size_flags(tiny_model: Path, tmp_path: Path) -> None:
    import torch

    from opentinker.sampler_server.build import kv_blocks
    from opentinker.sampler_server.model.kv_cache import KVCache
    from opentinker.weights.model_config import load_config

    model_config = load_config(tiny_model)
    # Default: at most the memory of the 3 + 1 fixed slots of 100 positions the slot cache took (25 blocks of 16),
    # less the blocks the engine keeps out of the pool (one 100-token sequence: 7 blocks).
    assert kv_blocks(config(tiny_model, tmp_path, max_seqs=3), model_config, 100, torch.float32) == 25 - 7
    assert kv_blocks(config(tiny_model, tmp_path, max_seqs=64), model_config, 4096, torch.float32) == 64 * 256
    assert kv_blocks(config(tiny_model, tmp_path, num_blocks=50), model_config, 100, torch.float32) == 50
    one_block = KVCache.bytes_for(model_config, 1, 16, torch.float32)
    by_size = config(tiny_model, tmp_path, kv_cache_mb=40 * one_block / 2**20)
    assert kv_blocks(by_size, model_config, 100, torch.float32) == 40
    with pytest.raises(BadOption, match="cannot hold one 100-token sequence") as caught:
        kv_blocks(config(tiny_model, tmp_path, num_blocks=6), model_config, 100, torch.float32)
    assert caught.value.option == "--num-blocks"
    built = build_sampler(config(tiny_model, tmp_path, num_blocks=40, max_len=64))
    assert isinstance(built.engine, Engine) and built.engine.blocks.num_blocks == 40
    assert built.engine.cache.num_blocks == 40 + 4  # + one max_len sequence's kept out of the pool
    asyncio.run(built.on_stop())


def test_dynamic_rope_serves_without_the_prefix_cache(tiny_model: Path, tmp_path: Path) -> None:
    """Dynamic NTK keys past the context depend on the whole sequence's length: no block reuse for such models."""
    import json
    import shutil

    dynamic = tmp_path / "dynamic"
    shutil.copytree(tiny_model, dynamic)
    settings = json.loads((dynamic / "config.json").read_text())
    settings["rope_parameters"] = settings.get("rope_parameters", {}) | {"rope_type": "dynamic", "factor": 2.0}
    (dynamic / "config.json").write_text(json.dumps(settings))
    plain = build_sampler(config(tiny_model, tmp_path / "a"))
    scaled = build_sampler(config(dynamic, tmp_path / "b"))
    assert isinstance(plain.engine, Engine) and isinstance(scaled.engine, Engine)
    assert plain.engine.blocks.prefix_cache and not scaled.engine.blocks.prefix_cache
    for built in (plain, scaled):
        asyncio.run(built.on_stop())

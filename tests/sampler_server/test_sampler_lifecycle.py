"""Slot references across cancellation, in process (deterministic where timing over gRPC is not): a scoring job
cancelled before the engine runs it still releases its pin; a load cancelled while its weights are being copied
neither frees the slot under the copy nor lets another version be served from it."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save
from samplerutil import wait_until

from opentinker.rpc.serving.errors import ResourceExhausted
from opentinker.sampler_server.adapters import AdapterLoader, Resolved
from opentinker.sampler_server.engine import Engine
from opentinker.sampler_server.model.kv_cache import KVCache
from opentinker.sampler_server.model.llama import LlamaForCausalLM
from opentinker.sampler_server.scheduler import Scheduler
from opentinker.sampler_server.slot_pool import SlotPool
from opentinker.v1 import common_pb2, registry_pb2
from opentinker.weights.artifact_store import ArtifactStore

CPU = torch.device("cpu")
Q0 = "model.layers.0.self_attn.q_proj"


def lora_files(rank: int = 4, seed: int = 0) -> dict[str, bytes]:
    generator = torch.Generator().manual_seed(seed)
    tensors = {
        f"base_model.model.{Q0}.lora_A.weight": torch.randn(rank, 64, generator=generator),
        f"base_model.model.{Q0}.lora_B.weight": torch.randn(64, rank, generator=generator),
    }
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": ["q_proj"]}
    return {"adapter_config.json": json.dumps(config).encode(), "adapter_model.safetensors": bytes(save(tensors))}


class SlowFillPool(SlotPool):
    """Copies take `delay` seconds (a big adapter), so that a cancellation can land in the middle of one."""

    def __init__(self, *args: Any, delay: float, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.delay = delay
        self.copying = threading.Event()

    def fill(self, index: int, weights: dict[str, tuple[torch.Tensor, torch.Tensor]], **kw: Any) -> None:
        self.copying.set()
        time.sleep(self.delay)
        super().fill(index, weights, **kw)


@pytest.fixture(scope="module")
def runner(tiny_model: Path) -> LlamaForCausalLM:
    return LlamaForCausalLM.from_pretrained(tiny_model, device=CPU, dtype=torch.float32)


def make_engine(runner: LlamaForCausalLM, pool: SlotPool) -> Engine:
    cache = KVCache(runner.config, 3, 64, CPU, torch.float32)
    scheduler = Scheduler(max_seqs=2, max_batch_tokens=256)
    return Engine(
        runner,
        cache,
        pool.tensors,
        scheduler,
        release=pool.release,
        max_len=64,
        eos_token_ids=runner.config.eos_token_ids,
    )


def test_cancelled_score_releases_its_slot(runner: LlamaForCausalLM) -> None:
    pool = SlotPool(runner.linear_shapes(), max_slots=2, max_rank=8, device=CPU)
    index = pool.reserve(("a", 1))
    a, b = torch.randn(4, 64), torch.randn(64, 4)
    pool.fill(index, {Q0: (a, b)}, rank=4, scaling=2.0, artifact_sha256="")
    engine = make_engine(runner, pool)
    pool.acquire(index)  # as ComputeLogprobs does before handing the job over
    cancelled = engine.score([1, 2, 3, 4], index)
    assert cancelled.cancel()  # the client went away before the engine picked the job up
    pool.acquire(index)
    kept = engine.score([1, 2, 3, 4], index)
    engine.start()
    try:
        assert len(kept.result(timeout=10)) == 3
        assert wait_until(lambda: pool.total_refs() == 0, timeout=2.0), [s.refs for s in pool.slots]
    finally:
        engine.stop()
    assert pool.unload(("a", 1)) is True  # nothing holds it: freed now


def test_load_cancelled_mid_copy_keeps_the_slot_consistent(runner: LlamaForCausalLM, tmp_path: Path) -> None:
    store = ArtifactStore(tmp_path / "store")
    ref = store.commit_files(lora_files(seed=1))
    version = registry_pb2.Version(adapter="a", version=1, artifact_uri=ref.uri, artifact_sha256=ref.sha256)
    resolved = Resolved(("a", 1), common_pb2.ResolvedVersion(adapter="a", version=1), version)
    pool = SlowFillPool(runner.linear_shapes(), max_slots=1, max_rank=8, device=CPU, delay=0.4)
    loader = AdapterLoader(pool, store, registry=None, metadata=None, model_digest="")  # type: ignore[arg-type]

    async def scenario() -> None:
        task = asyncio.create_task(loader.acquire(resolved))
        while not pool.copying.is_set():
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        # The copy is still running in its thread: its slot must not be handed to another version meanwhile.
        with pytest.raises(ResourceExhausted):
            pool.reserve(("b", 1))
        await asyncio.sleep(pool.delay + 0.2)

    asyncio.run(scenario())
    index = pool.lookup(("a", 1))
    # The copy finished: the version is resident (a cache entry nobody holds), consistent, evictable.
    assert index is not None and pool.slots[index].refs == 0 and pool.slots[index].rank == 4
    assert pool.total_refs() == 0
    evicted = pool.reserve(("b", 1))
    assert evicted == index and pool.lookup(("a", 1)) is None

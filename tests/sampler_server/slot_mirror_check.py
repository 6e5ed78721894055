"""An engine process that keeps its own copy of the adapter slots (`SlotMirror`, what it does on CUDA), run on
the CPU: it must sample and score what an engine reading the shared pool directly does, for a version loaded
after it started and for another version written later into the same slot. Prints one JSON line.

Started as a subprocess by test_engine_process.py: the engine process is forked before this process runs any
torch op (a fork from a process whose OpenMP threads started inherits them broken), which pytest's process
cannot promise.
"""

from __future__ import annotations

import json
import sys
import threading
from pathlib import Path

import torch

from opentinker.sampler_server.block_manager import BLOCK_SIZE
from opentinker.sampler_server.engine import Engine
from opentinker.sampler_server.engine_api import EngineAPI
from opentinker.sampler_server.engine_process import EngineProcess
from opentinker.sampler_server.model.kv_cache import KVCache
from opentinker.sampler_server.model.llama import LlamaForCausalLM
from opentinker.sampler_server.model.weights import linear_shapes
from opentinker.sampler_server.scheduler import Scheduler
from opentinker.sampler_server.sequence import SamplingParams, Sequence
from opentinker.sampler_server.slot_pool import SlotPool, SlotTensors
from opentinker.sampler_server.updates import SequenceUpdate
from opentinker.weights.model_config import load_config

MAX_LEN, RANK = 64, 4
MODEL = Path(sys.argv[1])
CPU = torch.device("cpu")


def build(release: object, on_iteration: object, slots: SlotTensors) -> Engine:
    runner = LlamaForCausalLM.from_pretrained(MODEL, device=CPU, dtype=torch.float32)
    cache = KVCache(runner.config, 4 * (MAX_LEN // BLOCK_SIZE), BLOCK_SIZE, CPU, torch.float32)
    return Engine(
        runner,
        cache,
        slots,
        Scheduler(max_seqs=2, max_batch_tokens=256),
        release=release,  # type: ignore[arg-type]
        max_len=MAX_LEN,
        eos_token_ids=(),
        kernel="segments",
        on_iteration=on_iteration,  # type: ignore[arg-type]
    )


def generate(engine: EngineAPI, slot: int, name: str) -> tuple[list[int], list[float]]:
    done = threading.Event()
    tokens: list[int] = []
    logprobs: list[float] = []

    def on_update(update: SequenceUpdate) -> None:
        assert not update.error, update.error
        tokens.extend(update.tokens)
        logprobs.extend(update.logprobs)
        if update.finished:
            done.set()

    pool.acquire(slot)  # the request's pin, which the engine releases
    params = SamplingParams(temperature=1.0, max_tokens=12, logprobs=True)
    engine.submit(
        [
            Sequence(
                seq_id=0,
                request_id=name,
                sample_index=0,
                prompt=[3, 1, 4, 1, 5, 9, 2, 6],
                params=params,
                lora_slot=slot,
                seed=5,
            )
        ],
        on_update,
    )
    assert done.wait(60), "no tokens"
    return tokens, logprobs


def score(engine: EngineAPI, slot: int) -> list[float]:
    pool.acquire(slot)
    return engine.score(list(range(3, 23)), slot).result(60)


def version(seed: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return {
        m: (torch.randn(RANK, d_in, generator=gen) * 0.3, torch.randn(d_out, RANK, generator=gen) * 0.3)
        for m, (d_in, d_out) in shapes.items()
    }


config = load_config(MODEL)
shapes = linear_shapes(config)
pool = SlotPool(shapes, max_slots=2, max_rank=RANK, device=CPU, shared=True)
process = EngineProcess(build, pool, max_len=MAX_LEN, max_seqs=2, max_batch_tokens=256, device=CPU, mirror_slots=True)
process.wait_ready()
process.start()
local = build(pool.release, None, pool.tensors)  # reads the shared pool as the CPU engine process does
local.start()
results: dict[str, object] = {}
for name, seed in (("x", 1), ("y", 2)):  # y goes into the slot x held
    slot = pool.reserve((name, 1))
    pool.fill(slot, version(seed), rank=RANK, scaling=2.0, artifact_sha256="")
    mirrored, direct = generate(process, slot, f"{name}-m"), generate(local, slot, f"{name}-d")
    results[name] = {
        "slot": slot,
        "same_tokens": mirrored[0] == direct[0],
        "logprob_diff": max(abs(a - b) for a, b in zip(mirrored[1], direct[1], strict=True)),
        "score_diff": max(abs(a - b) for a, b in zip(score(process, slot), score(local, slot), strict=True)),
        "tokens": mirrored[0],
    }
    assert pool.unload((name, 1)) is True  # both requests ended: freed now
results["base_same"] = generate(process, 0, "b-m")[0] == generate(local, 0, "b-d")[0]
results["refs"] = pool.total_refs()
local.stop()
process.stop()
print(json.dumps(results))

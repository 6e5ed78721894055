"""The sampler engine in the benchmark's own process, built as `opentinker sampler serve` builds it, with the
engine thread running (Engine.start), requests submitted through Engine.submit and timed from the callbacks.
No gRPC, no registry: adapters go straight into the slot pool."""

from __future__ import annotations

import itertools
import math
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from workload import ALPHA, RANK, Weights

from opentinker.sampler_server.block_manager import BLOCK_SIZE
from opentinker.sampler_server.engine import Engine
from opentinker.sampler_server.model.kv_cache import KVCache
from opentinker.sampler_server.model.llama import LlamaForCausalLM
from opentinker.sampler_server.scheduler import Scheduler
from opentinker.sampler_server.sequence import SamplingParams, Sequence
from opentinker.sampler_server.slot_pool import SlotPool
from opentinker.sampler_server.updates import SequenceUpdate, UpdateCallback


def build_engine(
    model: Path,
    *,
    max_slots: int,
    max_seqs: int,
    max_len: int,
    max_batch_tokens: int = 4096,
    stop_on_eos: bool = True,
    cpu_gemm: str = "onednn",
) -> tuple[Engine, SlotPool]:
    """float32 on the CPU, max_rank = RANK; one extra KV slot for scoring and the base matmuls packed for oneDNN
    where this torch build can (`cpu_gemm="onednn"`), as the server's defaults are."""
    device = torch.device("cpu")
    runner = LlamaForCausalLM.from_pretrained(model, device=device, dtype=torch.float32)
    if cpu_gemm == "onednn":
        runner.pack_for_cpu()
    pool = SlotPool(runner.linear_shapes(), max_slots=max_slots, max_rank=RANK, device=device)
    eos = runner.config.eos_token_ids if stop_on_eos else ()
    engine = engine_over(
        runner, pool, max_seqs=max_seqs, max_len=max_len, max_batch_tokens=max_batch_tokens, eos_token_ids=eos
    )
    return engine, pool


def engine_over(
    runner: LlamaForCausalLM,
    pool: SlotPool,
    *,
    max_seqs: int,
    max_len: int,
    max_batch_tokens: int,
    eos_token_ids: tuple[int, ...],
) -> Engine:
    """An engine (not started) over a loaded model and slot pool, with a CPU KV cache and a scheduler of its own:
    several engines can share one runner and pool."""
    blocks = -(-max_len // BLOCK_SIZE)  # per sequence; + one sequence's for ComputeLogprobs, as the server
    cache = KVCache(runner.config, (max_seqs + 1) * blocks, BLOCK_SIZE, torch.device("cpu"), torch.float32)
    return Engine(
        runner,
        cache,
        pool.tensors,
        Scheduler(max_seqs=max_seqs, max_batch_tokens=max_batch_tokens),
        release=pool.release,
        max_len=max_len,
        eos_token_ids=eos_token_ids,
        kernel="auto",
    )


def fill_slots(pool: SlotPool, adapters: list[Weights]) -> list[int]:
    """Loads each adapter into its own slot (as version 1 of `bench-i`); returns the slot indices."""
    slots = []
    for i, weights in enumerate(adapters):
        index = pool.reserve((f"bench-{i}", 1))
        pool.fill(index, weights, rank=RANK, scaling=ALPHA / RANK, artifact_sha256="")
        slots.append(index)
    return slots


@dataclass
class Timing:
    """One request as the in-process caller saw it (monotonic seconds)."""

    submit: float = math.nan
    first: float = math.nan  # first update with tokens
    end: float = math.nan
    tokens: int = 0
    error: str = ""


@dataclass(frozen=True, slots=True)
class Request:
    prompt: list[int]
    slot: int  # 0 = base model
    max_tokens: int


class Client:
    """Submits requests to a started engine and records their timings from the engine's callbacks."""

    def __init__(self, engine: Engine, pool: SlotPool) -> None:
        self.engine = engine
        self.pool = pool
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._open = 0
        self._idle = threading.Condition(self._lock)

    def submit(self, requests: list[Request]) -> list[Timing]:
        """Submits each request on its own (as separate clients would); returns their live Timing records."""
        timings = [Timing() for _ in requests]
        with self._lock:
            self._open += len(requests)
        for req, timing in zip(requests, timings, strict=True):
            n = next(self._ids)
            self.pool.acquire(req.slot)  # the request's pin; the engine releases it when the request ends
            params = SamplingParams(temperature=0.0, max_tokens=req.max_tokens)
            seq = Sequence(
                seq_id=n,
                request_id=f"bench-{n}",
                sample_index=0,
                prompt=list(req.prompt),
                params=params,
                lora_slot=req.slot,
            )
            timing.submit = time.monotonic()
            self.engine.submit([seq], self._callback(timing))
        return timings

    def _callback(self, timing: Timing) -> UpdateCallback:
        def on_update(update: SequenceUpdate) -> None:  # on the engine thread
            now = time.monotonic()
            timing.error = update.error
            if update.tokens and math.isnan(timing.first):
                timing.first = now
            timing.tokens += len(update.tokens)
            if update.finished or update.error:
                timing.end = now
                with self._lock:
                    self._open -= 1
                    self._idle.notify_all()

        return on_update

    def wait(self, timeout: float = 600.0) -> None:
        """Until every submitted request has finished."""
        with self._idle:
            if not self._idle.wait_for(lambda: self._open == 0, timeout):
                raise TimeoutError(f"{self._open} requests still running after {timeout} s")

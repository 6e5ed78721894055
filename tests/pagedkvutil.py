"""Helpers for the paged KV cache tests: an engine over a block pool, random adapters, a run that checks every
block went back, and output comparisons."""

from __future__ import annotations

import threading

import torch
from samplerutil import max_diff

from opentinker.sampler_server.engine import Engine
from opentinker.sampler_server.model.kv_cache import KVCache
from opentinker.sampler_server.model.llama import LlamaForCausalLM
from opentinker.sampler_server.scheduler import Scheduler
from opentinker.sampler_server.sequence import SamplingParams, Sequence
from opentinker.sampler_server.slot_pool import SlotPool
from opentinker.sampler_server.updates import SequenceUpdate

CPU = torch.device("cpu")
MAX_LEN = 64
ADAPTERS = 2  # slots 1 and 2 hold random LoRA weights; slot 0 is the base model


def make_pool(runner: LlamaForCausalLM, adapters: int = ADAPTERS) -> SlotPool:
    """Slots 1..adapters hold random LoRA weights (artifact sha256 "sha-N"); slot 0 is the base model."""
    pool = SlotPool(runner.linear_shapes(), max_slots=adapters, max_rank=4, device=CPU)
    for n in range(adapters):
        fill_random(pool, runner, pool.reserve((f"paged/a{n}", 1)), seed=7 + n, sha=f"sha-{n}")
    return pool


def fill_random(pool: SlotPool, runner: LlamaForCausalLM, index: int, *, seed: int, sha: str) -> None:
    generator = torch.Generator().manual_seed(seed)
    weights = {
        module: (torch.randn(4, d_in, generator=generator) * 0.2, torch.randn(d_out, 4, generator=generator) * 0.2)
        for module, (d_in, d_out) in runner.linear_shapes().items()
    }
    pool.fill(index, weights, rank=4, scaling=2.0, artifact_sha256=sha)


def prompt(length: int, salt: int) -> list[int]:
    return [(13 * i + 7 * salt) % 200 + 3 for i in range(length)]


def engine(
    runner: LlamaForCausalLM,
    pool: SlotPool,
    *,
    block_size: int,
    num_blocks: int,
    max_seqs: int = 8,
    prefix_cache: bool = True,
    max_len: int = MAX_LEN,
) -> Engine:
    """An engine over a pool of num_blocks blocks (+ the max_len sequence's blocks the engine keeps out of it)."""
    score = -(-max_len // block_size)
    cache = KVCache(runner.config, num_blocks + score, block_size, CPU, torch.float32)
    return Engine(
        runner,
        cache,
        pool.tensors,
        Scheduler(max_seqs=max_seqs, max_batch_tokens=4096),
        release=lambda slot: None,
        max_len=max_len,
        eos_token_ids=(),
        burst_wait=0.05,
        prefix_cache=prefix_cache,
    )


def run(engine: Engine, requests: list[list[Sequence]], *, cancel: str = "", stop: bool = True) -> list[int]:
    """Submits every request, cancels `cancel` at its first update, waits until the rest finished; returns the
    most sequences that ran at once and the most blocks held at once."""
    left = sum(len(seqs) for seqs in requests if seqs[0].request_id != cancel)
    done, lock, most = threading.Event(), threading.Lock(), [0, 0]

    def on_update(update: SequenceUpdate) -> None:
        nonlocal left
        with lock:
            most[0] = max(most[0], engine.num_running)
            most[1] = max(most[1], engine.blocks.num_used)
            if update.request_id == cancel:
                engine.abort(cancel)
                return
            assert not update.error, update.error
            left -= update.finished
            if left == 0:
                done.set()

    if not engine.started:
        engine.start()
    try:
        for sequences in requests:
            engine.submit(sequences, on_update)
        assert done.wait(120), "the sequences did not finish"
        # A request submitted after the abort finishes after it was handled (one inbox, in order).
        probe = Sequence(
            seq_id=999,
            request_id="probe",
            sample_index=0,
            prompt=[5, 6, 7],
            params=SamplingParams(temperature=0.0, max_tokens=2),
            lora_slot=0,
        )
        finished = threading.Event()
        engine.submit([probe], lambda update: finished.set() if update.finished else None)
        assert finished.wait(30)
        with lock:
            held = [engine.blocks.refs[b] for b in range(engine.blocks.num_blocks)]
        assert held == [0] * engine.blocks.num_blocks, "blocks still referenced after every request ended"
        assert engine.blocks.num_free == engine.blocks.num_blocks
    finally:
        if stop:
            engine.stop()
    return most


def outputs(requests: list[list[Sequence]]) -> dict[tuple[str, int], Sequence]:
    return {(seq.request_id, seq.sample_index): seq for seqs in requests for seq in seqs}


# fp32 logprobs of the same tokens computed in different batches and chunks (a cached prefix's K/V came from
# another prefill): summation order alone moved one by 1.1e-5 at -6.9 (1.6e-6 relative), as in the family matrix.
LOGPROB_TOLERANCE = 3e-5


def assert_same(ours: list[list[Sequence]], reference: list[list[Sequence]], skip: str = "") -> None:
    theirs = outputs(reference)
    for key, seq in outputs(ours).items():
        if key[0] == skip:
            continue
        ref = theirs[key]
        assert seq.output == ref.output, key
        assert len(seq.output) == seq.params.max_tokens
        assert max_diff(seq.output_logprobs, ref.output_logprobs) < LOGPROB_TOLERANCE, key
        assert (seq.prompt_logprobs is None) == (ref.prompt_logprobs is None), key
        if seq.prompt_logprobs is not None and ref.prompt_logprobs is not None:
            assert max_diff(seq.prompt_logprobs, ref.prompt_logprobs) < LOGPROB_TOLERANCE, key

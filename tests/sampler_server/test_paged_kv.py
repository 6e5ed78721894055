"""The paged KV cache: sequences hold 16-token blocks of one pool instead of fixed max_len slots. Outputs equal a
slot-layout engine's (one max_len block per sequence, the old design) for single, n-sample and mixed-adapter
batches; under a tiny pool, sequences are preempted and recomputed and still finish with the same tokens; every
block goes back to the pool when requests end or are cancelled mid-stream."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
from samplerutil import max_diff

from opentinker.sampler_server.engine import Engine, SequenceUpdate
from opentinker.sampler_server.model.kv_cache import KVCache
from opentinker.sampler_server.model.llama import LlamaForCausalLM
from opentinker.sampler_server.scheduler import Scheduler
from opentinker.sampler_server.sequence import SamplingParams, Sequence
from opentinker.sampler_server.slot_pool import SlotPool

CPU = torch.device("cpu")
MAX_LEN = 64
ADAPTERS = 2  # slots 1 and 2 hold random LoRA weights; slot 0 is the base model


@pytest.fixture(scope="module")
def runner(tiny_model: Path) -> LlamaForCausalLM:
    return LlamaForCausalLM.from_pretrained(tiny_model, device=CPU, dtype=torch.float32)


@pytest.fixture(scope="module")
def pool(runner: LlamaForCausalLM) -> SlotPool:
    pool = SlotPool(runner.linear_shapes(), max_slots=ADAPTERS, max_rank=4, device=CPU)
    generator = torch.Generator().manual_seed(7)
    for n in range(ADAPTERS):
        index = pool.reserve((f"paged/a{n}", 1))
        weights = {module: (torch.randn(4, d_in, generator=generator) * 0.2,
                            torch.randn(d_out, 4, generator=generator) * 0.2)
                   for module, (d_in, d_out) in runner.linear_shapes().items()}  # fmt: skip
        pool.fill(index, weights, rank=4, scaling=2.0, artifact_sha256=f"sha-{n}")
    return pool


def prompt(length: int, salt: int) -> list[int]:
    return [(13 * i + 7 * salt) % 200 + 3 for i in range(length)]


def workload() -> list[list[Sequence]]:
    """Requests of mixed prompt lengths, greedy and seeded, 1 or 4 samples, on the base model and two adapters."""
    requests: list[list[Sequence]] = []
    for r in range(9):
        length, slot, samples = 5 + 9 * r % 37, r % (ADAPTERS + 1), 4 if r % 3 == 0 else 1
        seeded = r % 2 == 0
        params = SamplingParams(temperature=1.0 if seeded else 0.0, max_tokens=10 + r % 4 * 5, logprobs=True)
        requests.append([
            Sequence(seq_id=10 * r + i, request_id=f"r{r}", sample_index=i, prompt=prompt(length, r), params=params,
                     lora_slot=slot, want_prompt_logprobs=r % 4 == 1, seed=1000 * r + i if seeded else None)
            for i in range(samples)
        ])  # fmt: skip
    return requests


def engine(runner: LlamaForCausalLM, pool: SlotPool, *, block_size: int, num_blocks: int, max_seqs: int = 8) -> Engine:
    """An engine over a pool of num_blocks blocks (+ one max_len sequence's for ComputeLogprobs)."""
    score = -(-MAX_LEN // block_size)
    cache = KVCache(runner.config, num_blocks + score, block_size, CPU, torch.float32)
    return Engine(runner, cache, pool.tensors, Scheduler(max_seqs=max_seqs, max_batch_tokens=4096),
                  release=lambda slot: None, max_len=MAX_LEN, eos_token_ids=(), burst_wait=0.05)  # fmt: skip


def run(engine: Engine, requests: list[list[Sequence]], *, cancel: str = "") -> list[int]:
    """Submits every request, cancels `cancel` at its first update, waits until the rest finished; returns the
    most sequences that ran at once."""
    left = sum(len(seqs) for seqs in requests if seqs[0].request_id != cancel)
    done, lock, most = threading.Event(), threading.Lock(), [0]

    def on_update(update: SequenceUpdate) -> None:
        nonlocal left
        with lock:
            most[0] = max(most[0], engine.num_running)
            if update.request_id == cancel:
                engine.abort(cancel)
                return
            assert not update.error, update.error
            left -= update.finished
            if left == 0:
                done.set()

    engine.start()
    try:
        for sequences in requests:
            engine.submit(sequences, on_update)
        assert done.wait(120), "the sequences did not finish"
        # A request submitted after the abort finishes after it was handled (one inbox, in order).
        probe = Sequence(seq_id=999, request_id="probe", sample_index=0, prompt=[5, 6, 7],
                         params=SamplingParams(temperature=0.0, max_tokens=2), lora_slot=0)  # fmt: skip
        finished = threading.Event()
        engine.submit([probe], lambda update: finished.set() if update.finished else None)
        assert finished.wait(30)
        with lock:
            held = [engine.blocks.refs[b] for b in range(engine.blocks.num_blocks)]
        assert held == [0] * engine.blocks.num_blocks, "blocks still referenced after every request ended"
        assert engine.blocks.num_free == engine.blocks.num_blocks
    finally:
        engine.stop()
    return most


def outputs(requests: list[list[Sequence]]) -> dict[tuple[str, int], Sequence]:
    return {(seq.request_id, seq.sample_index): seq for seqs in requests for seq in seqs}


def assert_same(ours: list[list[Sequence]], reference: list[list[Sequence]], skip: str = "") -> None:
    theirs = outputs(reference)
    for key, seq in outputs(ours).items():
        if key[0] == skip:
            continue
        ref = theirs[key]
        assert seq.output == ref.output, key
        assert len(seq.output) == seq.params.max_tokens
        assert max_diff(seq.output_logprobs, ref.output_logprobs) < 1e-5, key
        assert (seq.prompt_logprobs is None) == (ref.prompt_logprobs is None), key
        if seq.prompt_logprobs is not None and ref.prompt_logprobs is not None:
            assert max_diff(seq.prompt_logprobs, ref.prompt_logprobs) < 1e-5, key


@pytest.fixture(scope="module")
def reference(runner: LlamaForCausalLM, pool: SlotPool) -> list[list[Sequence]]:
    """The old slot layout: one max_len block per sequence."""
    requests = workload()
    run(engine(runner, pool, block_size=MAX_LEN, num_blocks=8), requests)
    return requests


def test_paged_blocks_give_the_slot_layouts_tokens_and_logprobs(
    runner: LlamaForCausalLM, pool: SlotPool, reference: list[list[Sequence]]
) -> None:
    requests = workload()
    paged = engine(runner, pool, block_size=16, num_blocks=8 * MAX_LEN // 16)
    run(paged, requests)
    assert paged.stats.preemptions == 0
    assert len({tuple(seq.output) for seq in requests[0]}) == 4  # seeded samples that really differ
    assert_same(requests, reference)


def test_a_tiny_pool_preempts_and_recomputes_to_the_same_outputs(
    runner: LlamaForCausalLM, pool: SlotPool, reference: list[list[Sequence]]
) -> None:
    requests = workload()
    tiny = engine(runner, pool, block_size=16, num_blocks=6)  # 96 positions for 8 seats of up to 64 tokens
    run(tiny, requests)
    assert tiny.stats.preemptions > 0  # the test must exercise preemption
    assert_same(requests, reference)


def test_requests_cancelled_mid_stream_give_their_blocks_back(
    runner: LlamaForCausalLM, pool: SlotPool, reference: list[list[Sequence]]
) -> None:
    requests = workload()
    run(engine(runner, pool, block_size=16, num_blocks=10), requests, cancel="r3")
    assert_same(requests, reference, skip="r3")
    assert all(len(seq.output) < seq.params.max_tokens for seq in requests[3])  # it really was cut short


def test_memory_follows_the_tokens_held(runner: LlamaForCausalLM, pool: SlotPool) -> None:
    # The same KV bytes as 2 slots of 64 positions hold 8 short sequences at once in blocks of 16.
    def short() -> list[list[Sequence]]:
        params = SamplingParams(temperature=0.0, max_tokens=4)
        return [[Sequence(seq_id=i, request_id=f"s{i}", sample_index=0, prompt=prompt(8, i), params=params,
                          lora_slot=0)] for i in range(8)]  # fmt: skip

    slots = engine(runner, pool, block_size=MAX_LEN, num_blocks=2)
    paged = engine(runner, pool, block_size=16, num_blocks=8)
    assert slots.cache.bytes == paged.cache.bytes
    assert run(slots, short())[0] == 2
    assert run(paged, short())[0] == 8

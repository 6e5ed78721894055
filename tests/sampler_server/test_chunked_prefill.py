"""Chunked prefill: a prompt is computed a few tokens per step, beside the decode token of every running
sequence (mixed steps). Tokens and logprobs (prompt logprobs included) equal a whole-prompt engine's for single,
n-sample and mixed-adapter requests, with the prefix cache on, and under a tiny pool where partly prefilled
prompts are preempted and recomputed; every block goes back. A running stream gets a token every step while a
long prompt enters, where whole-prompt prefill makes it skip one."""

from __future__ import annotations

import threading

import pytest
from chunkedutil import chunked_engine
from pagedkvutil import ADAPTERS, assert_same, prompt, run

from opentinker.sampler_server.block_manager import BlockManager
from opentinker.sampler_server.model.llama import LlamaForCausalLM
from opentinker.sampler_server.scheduler import Scheduler
from opentinker.sampler_server.sequence import SamplingParams, Sequence
from opentinker.sampler_server.slot_pool import SlotPool
from opentinker.sampler_server.updates import SequenceUpdate

MAX_LEN = 96
SYSTEM = prompt(21, 77)  # a prefix several requests share: one full block and a bit


def workload() -> list[list[Sequence]]:
    """Prompts of 6 to 61 tokens (some behind a shared prefix, cached per adapter), greedy and seeded, 1 or 3
    samples, some with prompt logprobs, on the base model and two adapters."""
    requests: list[list[Sequence]] = []
    for r in range(10):
        body = prompt(6 + 11 * r % 41, r)
        tokens = [*SYSTEM, *body] if r % 3 == 1 else body
        slot, samples, seeded = r % (ADAPTERS + 1), 3 if r % 4 == 0 else 1, r % 2 == 0
        params = SamplingParams(temperature=1.0 if seeded else 0.0, max_tokens=8 + r % 3 * 4, logprobs=True)
        requests.append(
            [
                Sequence(
                    seq_id=10 * r + i,
                    request_id=f"r{r}",
                    sample_index=i,
                    prompt=list(tokens),
                    params=params,
                    lora_slot=slot,
                    cache_key=f"key-{slot}",
                    want_prompt_logprobs=r % 5 == 2,
                    seed=1000 * r + i if seeded else None,
                )
                for i in range(samples)
            ]
        )
    return requests


@pytest.fixture(scope="module")
def reference(runner: LlamaForCausalLM, pool: SlotPool) -> list[list[Sequence]]:
    """Whole prompts, a pool that never runs out, no prefix cache."""
    requests = workload()
    engine, _ = chunked_engine(runner, pool, num_blocks=64, chunk=0, max_len=MAX_LEN, prefix_cache=False)
    run(engine, requests)
    assert engine.stats.preemptions == 0
    return requests


def test_chunked_prompts_give_the_whole_prompts_tokens_and_logprobs(
    runner: LlamaForCausalLM, pool: SlotPool, reference: list[list[Sequence]]
) -> None:
    requests = workload()
    engine, steps = chunked_engine(runner, pool, num_blocks=64, chunk=7, max_len=MAX_LEN)
    run(engine, requests)  # checks every block's reference count is back to 0
    assert steps.partial_chunks() > 10  # prompts really were split (7 tokens a step, blocks of 16)
    mixed = [
        step
        for step in steps.steps
        if any(0 < chunk < lacked for _, _, chunk, lacked in step) and any(lacked == 1 for *_, lacked in step)
    ]
    assert mixed  # decodes and prompt chunks in one step
    assert all(sum(chunk for _, _, chunk, lacked in step if lacked > 1) <= 7 for step in steps.steps)
    assert engine.stats.prompt_tokens_cached > 0 and engine.stats.preemptions == 0
    assert len({tuple(seq.output) for seq in requests[0]}) == 3  # seeded samples that really differ
    assert requests[2][0].prompt_logprobs is not None and len(requests[2][0].prompt_logprobs) > 7
    assert_same(requests, reference)


def test_a_tiny_pool_preempts_partly_prefilled_prompts_and_recomputes_the_same(
    runner: LlamaForCausalLM, pool: SlotPool, reference: list[list[Sequence]]
) -> None:
    requests = workload()
    engine, steps = chunked_engine(runner, pool, num_blocks=6, chunk=5, max_len=MAX_LEN)  # 96 positions, 8 seats
    run(engine, requests)
    assert engine.stats.preemptions > 0 and any(partial for *_, partial in steps.preempted)
    assert_same(requests, reference)


def stream_and_long_prompt(runner: LlamaForCausalLM, pool: SlotPool, chunk: int) -> tuple[list[int], list[Sequence]]:
    """A stream decoding 24 tokens; at its first token a 300-token prompt arrives. Returns, for each step from
    the stream's first to its last token, whether it was in it, and both sequences."""
    params = SamplingParams(temperature=0.0, max_tokens=24, logprobs=True)
    stream = Sequence(seq_id=1, request_id="stream", sample_index=0, prompt=prompt(10, 1), params=params, lora_slot=1)
    long = Sequence(seq_id=2, request_id="long", sample_index=0, prompt=prompt(300, 2), params=params, lora_slot=2)
    engine, steps = chunked_engine(runner, pool, num_blocks=64, chunk=chunk, max_len=512)
    done, left = threading.Event(), [2]

    def on_update(update: SequenceUpdate) -> None:
        assert not update.error, update.error
        if update.request_id == "stream" and len(stream.output) == 1:
            engine.submit([long], on_update)  # handled before the next step: one inbox, drained between steps
        left[0] -= update.finished
        if not left[0]:
            done.set()

    engine.start()
    try:
        engine.submit([stream], on_update)
        assert done.wait(120), "the sequences did not finish"
    finally:
        engine.stop()
    with_stream = [any(request == "stream" for request, *_ in step) for step in steps.steps]
    first, last = with_stream.index(True), len(with_stream) - 1 - with_stream[::-1].index(True)
    return [int(x) for x in with_stream[first + 1 : last + 1]], [stream, long]


def test_a_long_prompt_entering_in_chunks_never_stalls_a_running_stream(
    runner: LlamaForCausalLM, pool: SlotPool
) -> None:
    chunked, outputs = stream_and_long_prompt(runner, pool, chunk=32)
    whole, whole_outputs = stream_and_long_prompt(runner, pool, chunk=0)
    # Every step from the stream's first token to its last gives it a token: 23 steps for 23 tokens...
    assert chunked == [1] * 23
    # ...where the whole prompt's prefill is a step without it: its gap there is 2 steps.
    assert whole.count(0) == 1 and len(whole) == 24
    assert_same([[seq] for seq in outputs], [[seq] for seq in whole_outputs])


def test_samples_wait_for_their_leaders_last_chunk_and_go_back_with_it_when_it_is_preempted() -> None:
    blocks = BlockManager(32, block_size=4)
    scheduler = Scheduler(max_seqs=8, max_batch_tokens=4096, prefill_chunk_tokens=4)
    scheduler.use_blocks(blocks)
    params = SamplingParams(temperature=0.0, max_tokens=4)
    group = [
        Sequence(seq_id=i, request_id="g", sample_index=i, prompt=list(range(1, 15)), params=params, lora_slot=0)
        for i in range(3)
    ]
    for seq in group:
        scheduler.add(seq)
    batch = scheduler.schedule()
    assert batch is not None and (batch.sequences, batch.chunks) == ([group[0]], [4])  # the others wait outside
    assert group[1].leader is group[0] and blocks.num_used == 4  # 14 tokens: 4 blocks, held once
    group[0].num_cached += 4
    scheduler.preempt(group[0])  # before its prompt is computed: its samples cannot use the blocks either
    assert [seq.sample_index for seq in scheduler.waiting] == [0, 1, 2] and blocks.num_used == 0
    assert all(seq.leader is None for seq in group) and scheduler.preemptions == 3
    chunks = []
    for _ in range(4):  # admitted again together; the first recomputes from token 0, 4 tokens a step
        batch = scheduler.schedule()
        assert batch is not None
        chunks.append(batch.chunks)
        group[0].num_cached += batch.chunks[0]
    assert chunks == [[4], [4], [4], [2, 0, 0]]  # the last chunk's step takes the samples in
    assert batch.sequences == group

"""The paged KV cache: sequences hold 16-token blocks of one pool instead of fixed max_len slots. Outputs equal a
slot-layout engine's (one max_len block per sequence, the old design) for single, n-sample and mixed-adapter
batches; the n samples of a request hold one copy of their prompt (copy-on-write of its partial last block);
under a tiny pool, sequences are preempted and recomputed and still finish with the same tokens; every
block goes back to the pool when requests end or are cancelled mid-stream."""

from __future__ import annotations

import pytest
from pagedkvutil import ADAPTERS, MAX_LEN, assert_same, engine, prompt, run
from samplerutil import max_diff

from opentinker.sampler_server.model.llama import LlamaForCausalLM
from opentinker.sampler_server.sequence import SamplingParams, Sequence
from opentinker.sampler_server.slot_pool import SlotPool


def workload() -> list[list[Sequence]]:
    """Requests of mixed prompt lengths, greedy and seeded, 1 or 4 samples, on the base model and two adapters."""
    requests: list[list[Sequence]] = []
    for r in range(9):
        length, slot, samples = 5 + 9 * r % 37, r % (ADAPTERS + 1), 4 if r % 3 == 0 else 1
        seeded = r % 2 == 0
        params = SamplingParams(temperature=1.0 if seeded else 0.0, max_tokens=10 + r % 4 * 5, logprobs=True)
        requests.append(
            [
                Sequence(
                    seq_id=10 * r + i,
                    request_id=f"r{r}",
                    sample_index=i,
                    prompt=prompt(length, r),
                    params=params,
                    lora_slot=slot,
                    want_prompt_logprobs=r % 4 == 1,
                    seed=1000 * r + i if seeded else None,
                )
                for i in range(samples)
            ]
        )
    return requests


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
        return [
            [Sequence(seq_id=i, request_id=f"s{i}", sample_index=0, prompt=prompt(8, i), params=params, lora_slot=0)]
            for i in range(8)
        ]

    slots = engine(runner, pool, block_size=MAX_LEN, num_blocks=2)
    paged = engine(runner, pool, block_size=16, num_blocks=8)
    assert slots.cache.bytes == paged.cache.bytes
    assert run(slots, short())[0] == 2
    assert run(paged, short())[0] == 8


def test_the_samples_of_a_request_share_their_prompt_blocks(runner: LlamaForCausalLM, pool: SlotPool) -> None:
    # 40 prompt tokens: 2 full blocks and a partial one, held once by 4 samples; each but the last to write takes
    # its own copy of the partial block (copy-on-write): 3 + 3 blocks, where a copy per sample took 4 x 3.
    params = SamplingParams(temperature=1.0, max_tokens=4, logprobs=True)
    group = [
        Sequence(
            seq_id=i, request_id="g", sample_index=i, prompt=prompt(40, 5), params=params, lora_slot=1, seed=70 + i
        )
        for i in range(4)
    ]
    paged = engine(runner, pool, block_size=16, num_blocks=32)
    assert run(paged, [group])[1] == 6
    assert paged.stats.prompt_tokens_computed == 40 + 3  # + run()'s 3-token probe
    assert paged.stats.prompt_tokens_shared == 3 * 40
    alone = [
        [
            Sequence(
                seq_id=i,
                request_id=f"a{i}",
                sample_index=i,
                prompt=prompt(40, 5),
                params=params,
                lora_slot=1,
                seed=70 + i,
            )
        ]
        for i in range(4)
    ]
    run(engine(runner, pool, block_size=MAX_LEN, num_blocks=8), alone)
    assert len({tuple(seq.output) for seq in group}) > 1
    for together, [by_itself] in zip(group, alone, strict=True):
        assert together.output == by_itself.output
        assert max_diff(together.output_logprobs, by_itself.output_logprobs) < 1e-5

"""The per-tenant KV block bound: a tenant holds at most its share of the block pool (admission and growth
respect it), a block several tenants reference counts against each, and when the pool runs out the tenant most
over its fair share is preempted first, not blindly the newest sequence. Two tenants on a real engine: team-a
floods long prompts until the blocks run out; team-b's requests are admitted, never preempted on team-a's behalf,
and give the tokens they give alone."""

from __future__ import annotations

import itertools
import threading

import pytest
from chunkedutil import RecordingScheduler, chunked_engine
from pagedkvutil import assert_same, prompt, run

from opentinker.sampler_server.block_manager import BlockManager
from opentinker.sampler_server.model.llama import LlamaForCausalLM
from opentinker.sampler_server.scheduler import ScheduledBatch
from opentinker.sampler_server.sequence import SamplingParams, Sequence
from opentinker.sampler_server.slot_pool import SlotPool
from opentinker.sampler_server.tenant_bounds import default_tenant_blocks
from opentinker.sampler_server.updates import SequenceUpdate

_ids = itertools.count(1)


def seq(tenant: str, length: int, max_tokens: int = 8, *, key: str = "") -> Sequence:
    return Sequence(
        seq_id=next(_ids),
        request_id=f"{tenant}-{next(_ids)}",
        sample_index=0,
        prompt=prompt(length, 3),
        params=SamplingParams(temperature=0.0, max_tokens=max_tokens),
        lora_slot=0,
        tenant=tenant,
        cache_key=key,
    )


def scheduler(num_blocks: int, *, bound: int, chunk: int = 0) -> tuple[RecordingScheduler, BlockManager]:
    blocks = BlockManager(num_blocks, block_size=4)
    sched = RecordingScheduler(max_seqs=8, max_batch_tokens=4096, chunk=chunk, tenant_blocks=bound)
    sched.use_blocks(blocks)
    return sched, blocks


def advance(sched: RecordingScheduler, batch: ScheduledBatch | None) -> None:
    """What the engine does with a step: chunks advance num_cached; a sequence computed to its end samples."""
    assert batch is not None
    for s, chunk in zip(batch.sequences, batch.chunks, strict=True):
        if chunk and s.num_cached + chunk < s.num_tokens:
            s.num_cached += chunk
            continue
        s.num_cached, s.leader = s.num_tokens, None
        s.output.append(5)
        if len(s.output) >= s.params.max_tokens:
            sched.finish(s)


def test_the_default_bound_is_three_quarters_of_the_pool_and_at_least_one() -> None:
    assert [default_tenant_blocks(n) for n in (1, 2, 4, 100)] == [1, 1, 3, 75]


def test_a_block_several_tenants_reference_counts_against_each() -> None:
    blocks = BlockManager(8, block_size=4)
    first, second = seq("team-a", 13, key="shared"), seq("team-b", 13, key="shared")
    assert blocks.admit(first) == 0
    first.num_cached = first.num_tokens
    blocks.register(first)  # its 3 full blocks join the cache
    assert blocks.admit(second) == 12  # team-b rides them (a prefix shared on purpose)
    assert (blocks.held_by("team-a"), blocks.held_by("team-b"), blocks.num_used) == (4, 4, 5)
    assert blocks.admit(seq("team-b", 13), limit=7) < 0  # 4 + 4 fresh > 7: refused, nothing taken
    assert blocks.held_by("team-b") == 4 and blocks.num_used == 5
    blocks.release(first)
    blocks.release(second)
    assert blocks.held_by("team-a") == blocks.held_by("team-b") == 0 and blocks.num_used == 0


@pytest.mark.parametrize("chunk", [0, 6])
def test_a_tenant_at_its_bound_preempts_its_own_and_leaves_the_rest_to_others(chunk: int) -> None:
    sched, blocks = scheduler(16, bound=12, chunk=chunk)
    flood = [seq("team-a", 14, max_tokens=12) for _ in range(6)]  # 4 blocks each, growing to 7
    for s in flood:
        sched.add(s)
    advance(sched, sched.schedule())
    most = blocks.held_by("team-a")
    for s in (seq("team-b", 6, max_tokens=10), seq("team-b", 6, max_tokens=10)):
        sched.add(s)
    while sched.has_work():
        advance(sched, sched.schedule())
        most = max(most, blocks.held_by("team-a"))
        assert blocks.held_by("team-a") <= 12
    assert most > 12 - 4  # the flood came within one prompt's blocks of its bound (not of the 16-block pool)...
    assert [tenant for tenant, *_ in sched.preempted].count("team-a") > 0  # ...and grew past it, at its own cost
    assert all(tenant == "team-a" for tenant, *_ in sched.preempted)
    assert blocks.num_used == 0


def test_an_exhausted_pool_preempts_the_tenant_most_over_its_share_not_the_newest() -> None:
    sched, blocks = scheduler(14, bound=0)  # no bound: only the victim choice protects team-b
    for _ in range(3):
        sched.add(seq("team-a", 13, max_tokens=6))  # 4 blocks each: room for 3 tokens more
    advance(sched, sched.schedule())  # team-a's prefill: 12 blocks
    late = seq("team-b", 8, max_tokens=6)  # 2 blocks; its first decode starts a third
    sched.add(late)
    advance(sched, sched.schedule())  # a decode (never two prefills in a row)
    advance(sched, sched.schedule())  # team-b's prefill: the pool is full
    assert blocks.num_free == 0
    batch = sched.schedule()  # team-b needs a block: team-a (12 of 14, share 7) gives one, not team-b (newest)
    assert batch is not None and late in batch.sequences
    assert [tenant for tenant, *_ in sched.preempted] == ["team-a"]


def team_b() -> list[list[Sequence]]:
    params = SamplingParams(temperature=1.0, max_tokens=10, logprobs=True)
    return [
        [
            Sequence(
                seq_id=100 + i,
                request_id=f"b{i}",
                sample_index=0,
                prompt=prompt(20, 50 + i),
                params=params,
                lora_slot=1,
                tenant="team-b",
                seed=7 + i,
            )
        ]
        for i in range(3)
    ]


def flood_and_b(runner: LlamaForCausalLM, pool: SlotPool, bound: int) -> tuple[list[list[Sequence]], int, list[str]]:
    """team-a's 6 long prompts (3 blocks each, growing to 5); at team-a's first token, team-b's 3 requests
    (2 blocks each) arrive. Returns team-b's requests, the most blocks team-a held, and who was preempted."""
    params = SamplingParams(temperature=0.0, max_tokens=40)
    flood = [
        [
            Sequence(
                seq_id=i,
                request_id=f"a{i}",
                sample_index=0,
                prompt=prompt(40, i),
                params=params,
                lora_slot=2,
                tenant="team-a",
            )
        ]
        for i in range(6)
    ]
    theirs = team_b()
    engine, sched = chunked_engine(runner, pool, num_blocks=12, chunk=16, max_len=96, tenant_blocks=bound)
    done, left, most, sent = threading.Event(), [9], [0], [False]

    def on_update(update: SequenceUpdate) -> None:
        assert not update.error, update.error
        most[0] = max(most[0], engine.blocks.held_by("team-a"))
        if not sent[0]:
            sent[0] = True
            for request in theirs:
                engine.submit(request, on_update)
        left[0] -= update.finished
        if not left[0]:
            done.set()

    engine.start()
    try:
        for request in flood:
            engine.submit(request, on_update)
        assert done.wait(180), "the sequences did not finish"
    finally:
        engine.stop()
    assert engine.blocks.num_used == 0 and engine.stats.preemptions == len(sched.preempted)
    return theirs, most[0], [tenant for tenant, *_ in sched.preempted]


def test_a_flood_of_long_prompts_never_preempts_another_tenant(runner: LlamaForCausalLM, pool: SlotPool) -> None:
    bounded, most, preempted = flood_and_b(runner, pool, bound=default_tenant_blocks(12))
    assert most == 9 and preempted and set(preempted) == {"team-a"}  # team-a grew into its bound, at its own cost
    alone = team_b()
    engine, _ = chunked_engine(runner, pool, num_blocks=12, chunk=16, max_len=96)
    run(engine, alone)
    assert_same(bounded, alone)
    # The contrast: unbounded, team-a takes more than 3/4 of the pool.
    _, unbounded_most, _ = flood_and_b(runner, pool, bound=0)
    assert unbounded_most > 9

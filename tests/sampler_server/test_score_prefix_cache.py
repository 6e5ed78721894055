"""ComputeLogprobs and the prefix cache: a score computes its whole input (every position's logprob needs its
hidden state) and registers its full blocks under its weights identity, so the next Sample extending the scored
text (an RL loop's next turn) finds them. Its logprobs equal a cache-off engine's, another version's or tenant's
Sample never finds its blocks, and no reference outlives it."""

from __future__ import annotations

from pagedkvutil import assert_same, prompt, run
from pagedkvutil import engine as paged_engine
from samplerutil import max_diff

from opentinker.sampler_server.engine import Engine
from opentinker.sampler_server.model.llama import LlamaForCausalLM
from opentinker.sampler_server.sequence import SamplingParams, Sequence
from opentinker.sampler_server.slot_pool import SlotPool

MAX_LEN = 128
TURN = prompt(50, 17) + prompt(21, 4)  # a prompt and a completion: four full blocks and 7 tokens


def engine(runner: LlamaForCausalLM, pool: SlotPool, *, prefix_cache: bool = True, num_blocks: int = 32) -> Engine:
    return paged_engine(runner, pool, block_size=16, num_blocks=num_blocks, prefix_cache=prefix_cache, max_len=MAX_LEN)


def ask(request_id: str, tokens: list[int], *, slot: int, key: str) -> list[Sequence]:
    params = SamplingParams(temperature=0.0, max_tokens=6, logprobs=True)
    return [
        Sequence(
            seq_id=0,
            request_id=request_id,
            sample_index=0,
            prompt=list(tokens),
            params=params,
            lora_slot=slot,
            cache_key=key,
        )
    ]


def score(engine: Engine, tokens: list[int], *, slot: int, key: str) -> list[float]:
    if not engine.started:
        engine.start()
    return engine.score(tokens, slot, key).result(60)


def test_a_score_caches_its_blocks_for_the_next_turn(runner: LlamaForCausalLM, pool: SlotPool) -> None:
    for slot in (0, 1):
        on, off = engine(runner, pool), engine(runner, pool, prefix_cache=False)
        key = f"lora:sha-{slot - 1}" if slot else "base:digest:tenant:a"
        try:
            scored, reference = score(on, TURN, slot=slot, key=key), score(off, TURN, slot=slot, key=key)
            assert len(scored) == len(TURN) - 1 and max_diff(scored, reference) < 1e-5
            assert on.stats.blocks_cached == 4 and on.stats.blocks_used == 0  # cached, idle: no reference left
            assert off.stats.blocks_cached == 0
            assert on.stats.prompt_tokens_computed == len(TURN)  # computed as a prompt is, none of it reused
            # The next turn: the scored text plus an observation. Its 4 full blocks come from the score.
            turn, turn_ref = (
                ask("next", TURN + prompt(9, 5), slot=slot, key=key),
                ask("next", TURN + prompt(9, 5), slot=slot, key=key),
            )
            run(on, [turn], stop=False)  # checks every block's reference count is back to 0
            run(off, [turn_ref], stop=False)
            assert on.stats.prompt_tokens_cached == 64
            assert turn[0].tokens_cached == 64 and turn[0].tokens_computed == len(TURN) + 9 - 64
            assert_same([turn], [turn_ref])
            # The score's blocks stayed cached after it; a second score of the same text recomputes (it must,
            # for its logits) and keeps the cached copies: no duplicate, nothing held.
            again = score(on, TURN, slot=slot, key=key)
            assert max_diff(again, scored) < 1e-5
            assert on.blocks.num_free == on.blocks.num_blocks and set(on.blocks.refs) == {0}
        finally:
            on.stop()
            off.stop()


def test_another_versions_or_tenants_sample_never_finds_a_scores_blocks(
    runner: LlamaForCausalLM, pool: SlotPool
) -> None:
    on = engine(runner, pool)
    try:
        score(on, TURN, slot=1, key="lora:sha-0")
        score(on, TURN, slot=0, key="base:digest:tenant:a")
        other_version = ask("v2", [*TURN, 3], slot=2, key="lora:sha-1")
        other_tenant = ask("b", [*TURN, 3], slot=0, key="base:digest:tenant:b")
        run(on, [other_version, other_tenant], stop=False)
        assert on.stats.prompt_tokens_cached == 0
        same = ask("v1", [*TURN, 3], slot=1, key="lora:sha-0")
        run(on, [same], stop=False)
        assert on.stats.prompt_tokens_cached == 64  # the contrast: the scored version's own Sample hits
    finally:
        on.stop()
    off = engine(runner, pool, prefix_cache=False)
    references = [ask(r, [*TURN, 3], slot=s, key="") for r, s in (("v2", 2), ("b", 0), ("v1", 1))]
    run(off, references)
    assert_same([other_version, other_tenant, same], references)

"""The prefix cache: a request reuses the K/V of its longest cached prefix of full blocks, keyed by a hash chain
seeded with the exact weights identity. Outputs equal a cache-off engine's; a hot reload, a rollback and a
re-created adapter each get their own version's K/V; two tenants on the base model share nothing by default;
requests of one tenant with different cache_salt share nothing either; idle cached blocks are evicted LRU under a
small pool and every reference ends with its request."""

from __future__ import annotations

import asyncio
import hashlib
import types
from collections.abc import Coroutine
from typing import Any, TypeVar, cast

import pytest
from pagedkvutil import CPU, assert_same, fill_random, make_pool, prompt, run
from pagedkvutil import engine as paged_engine
from trainerutil import model_input

from opentinker.rpc.serving import auth
from opentinker.rpc.serving.auth import Principal, Role
from opentinker.rpc.serving.errors import InvalidArgument
from opentinker.sampler_server.adapters import BASE_RESOLVED, Resolved
from opentinker.sampler_server.engine import Engine
from opentinker.sampler_server.model.llama import LlamaForCausalLM
from opentinker.sampler_server.sample_request import cache_salt
from opentinker.sampler_server.sequence import SamplingParams, Sequence
from opentinker.sampler_server.service import SamplerServicer
from opentinker.sampler_server.slot_pool import SlotPool
from opentinker.v1 import common_pb2, sampler_pb2

SYSTEM = prompt(35, 99)  # a shared "system prompt": two full blocks and a bit
MAX_LEN = 128
T = TypeVar("T")


def engine(runner: LlamaForCausalLM, pool: SlotPool, *, num_blocks: int, prefix_cache: bool = True) -> Engine:
    return paged_engine(runner, pool, block_size=16, num_blocks=num_blocks, prefix_cache=prefix_cache, max_len=MAX_LEN)


def ask(
    request_id: str,
    tokens: list[int],
    *,
    slot: int = 0,
    key: str = "k",
    seed: int | None = None,
    samples: int = 1,
    max_tokens: int = 8,
    prompt_logprobs: bool = False,
) -> list[Sequence]:
    params = SamplingParams(temperature=0.0 if seed is None else 1.0, max_tokens=max_tokens, logprobs=True)
    return [
        Sequence(
            seq_id=i,
            request_id=request_id,
            sample_index=i,
            prompt=list(tokens),
            params=params,
            lora_slot=slot,
            cache_key=key,
            seed=None if seed is None else seed + i,
            want_prompt_logprobs=prompt_logprobs,
        )
        for i in range(samples)
    ]


def conversation(engine: Engine, *, slot: int = 0, key: str = "k") -> list[list[Sequence]]:
    """Three turns, each re-sending the conversation so far (the shared system prompt, every earlier turn's
    observation and answer) plus a new observation; turn by turn, as an agent does."""
    turns: list[list[Sequence]] = []
    history = list(SYSTEM)
    for turn in range(3):
        history += prompt(5 + 3 * turn, turn)
        request = ask(f"t{turn}", history, slot=slot, key=key, seed=50 + turn if turn % 2 else None, samples=2)
        run(engine, [request], stop=False)
        turns.append(request)
        history += request[0].output
    return turns


def test_multi_turn_with_the_cache_equals_without(runner: LlamaForCausalLM, pool: SlotPool) -> None:
    for slot in (0, 1):
        on, off = (
            engine(runner, pool, num_blocks=32),
            engine(runner, pool, num_blocks=32, prefix_cache=False),
        )
        try:
            cached_turns, plain_turns = conversation(on, slot=slot), conversation(off, slot=slot)
            logprobs = ask("lp", [*SYSTEM, 4, 5, 6], slot=slot, prompt_logprobs=True)  # computes every position
            logprobs_ref = ask("lp", [*SYSTEM, 4, 5, 6], slot=slot, prompt_logprobs=True)
            run(on, [logprobs], stop=False)
            run(off, [logprobs_ref], stop=False)
        finally:
            on.stop()
            off.stop()
        assert_same(cached_turns, plain_turns)
        assert_same([logprobs], [logprobs_ref])
        assert on.stats.prompt_tokens_cached >= 2 * 32  # every later turn found at least the system prompt
        assert on.stats.prompt_tokens_computed < off.stats.prompt_tokens_computed
        assert off.stats.prompt_tokens_cached == 0 and off.stats.blocks_cached == 0


def test_each_version_gets_its_own_kv(runner: LlamaForCausalLM) -> None:
    # name@latest at v1 (slot 1), v2 published (slot 2), rollback to v1, then the adapter deleted and re-created
    # with other weights (loaded into slot 2 again): the key is each slot's artifact sha256, never the name. Each
    # answer is compared with a cache-off engine's for the weights served at that moment.
    pool = make_pool(runner, adapters=2)
    on, off = engine(runner, pool, num_blocks=32), engine(runner, pool, num_blocks=32, prefix_cache=False)
    long = SYSTEM + prompt(20, 3)
    served = [(1, "sha-0"), (2, "sha-1"), (1, "sha-0"), (2, "sha-recreated")]
    answers, references = [], []
    try:
        for step, (slot, sha) in enumerate(served):
            if sha == "sha-recreated":
                assert on.stats.prompt_tokens_cached == 48  # the rollback found v1's 3 full blocks; v2 none
                fill_random(pool, runner, 2, seed=1234, sha=sha)  # same name, other weights, same slot
            answers.append(ask(f"v{step}", long, slot=slot, key=f"lora:{sha}"))
            references.append(ask(f"v{step}", long, slot=slot, key=""))
            run(on, [answers[-1]], stop=False)
            run(off, [references[-1]], stop=False)
        assert on.stats.prompt_tokens_cached == 48  # the re-created adapter reused nothing
    finally:
        on.stop()
        off.stop()
    assert_same(answers, references)
    # The contrast that makes this test able to fail: the three weights really answer differently.
    assert len({tuple(seqs[0].output) for seqs in references}) == 3


def test_two_tenants_on_the_base_model_share_nothing_by_default(runner: LlamaForCausalLM, pool: SlotPool) -> None:
    def key(tenant: str, *, share: bool) -> str:
        fake = types.SimpleNamespace(
            info=types.SimpleNamespace(model_digest="base-digest"), pool=pool, share_base_prefix_cache=share
        )
        return SamplerServicer._cache_key(cast(Any, fake), 0, tenant)

    assert key("team-a", share=False) != key("team-b", share=False)
    assert key("team-a", share=True) == key("team-b", share=True)
    fake = types.SimpleNamespace(
        info=types.SimpleNamespace(model_digest="base-digest"), pool=pool, share_base_prefix_cache=False
    )
    assert SamplerServicer._cache_key(cast(Any, fake), 1, "team-a") == "lora:base-digest:sha-0:tenant:paged"

    on = engine(runner, pool, num_blocks=32)
    try:
        run(on, [ask("a1", SYSTEM, key=key("team-a", share=False))], stop=False)
        run(on, [ask("b1", SYSTEM, key=key("team-b", share=False))], stop=False)
        assert on.stats.prompt_tokens_cached == 0  # team-b cannot time team-a's prompt
        run(on, [ask("a2", SYSTEM, key=key("team-a", share=False))], stop=False)
        assert on.stats.prompt_tokens_cached == 32  # team-a finds its own
        run(on, [ask("s1", SYSTEM, key=key("team-a", share=True))], stop=False)
        run(on, [ask("s2", SYSTEM, key=key("team-b", share=True))], stop=False)
        assert on.stats.prompt_tokens_cached == 64  # shared on purpose: team-b finds team-a's
    finally:
        on.stop()


def test_a_small_pool_evicts_idle_blocks_lru_and_keeps_outputs(runner: LlamaForCausalLM, pool: SlotPool) -> None:
    def requests() -> list[list[Sequence]]:
        return [
            ask(f"e{i}", SYSTEM + prompt(4 + i, i), slot=i % 3, key=f"k{i % 3}", samples=1 + i % 2, seed=i)
            for i in range(8)
        ]

    tiny = engine(runner, pool, num_blocks=8)  # one 128-token sequence; each of these takes 4 blocks
    ours = requests()
    run(tiny, ours[:4], stop=False)
    run(tiny, ours[4:])  # checks every reference ended with its request
    assert tiny.stats.blocks_evicted > 0 and tiny.stats.prompt_tokens_cached > 0
    reference = requests()
    run(engine(runner, pool, num_blocks=64, prefix_cache=False), reference)
    assert_same(ours, reference)


def test_byte_identical_adapters_of_two_tenants_share_no_blocks(runner: LlamaForCausalLM) -> None:
    """Both imported one public peft folder: one content digest, but the keys are salted with the owner, so
    team-b's prompt cannot find (and time) team-a's blocks; a tenant's own copies, or an admin's request on
    team-a's adapter (the caller's tenant does not enter a LoRA key), still share."""
    shared = SlotPool(runner.linear_shapes(), max_slots=3, max_rank=4, device=CPU)
    for name in ("team-a/imported", "team-b/imported", "team-a/copy"):
        fill_random(shared, runner, shared.reserve((name, 1)), seed=3, sha="sha-public")
    fake = types.SimpleNamespace(
        info=types.SimpleNamespace(model_digest="base-digest"), pool=shared, share_base_prefix_cache=True
    )

    def key(slot: int, caller: str) -> str:
        return SamplerServicer._cache_key(cast(Any, fake), slot, caller)

    assert key(1, "team-a") != key(2, "team-b")
    assert key(1, "team-a") == key(3, "team-a") == key(1, "ops")
    on = engine(runner, shared, num_blocks=32)
    try:
        run(on, [ask("a", SYSTEM, slot=1, key=key(1, "team-a"))], stop=False)
        run(on, [ask("b", SYSTEM, slot=2, key=key(2, "team-b"))], stop=False)
        assert on.stats.prompt_tokens_cached == 0  # team-b reused none of team-a's blocks
        run(on, [ask("a-copy", SYSTEM, slot=3, key=key(3, "team-a"))], stop=False)
        assert on.stats.prompt_tokens_cached == 32  # the contrast: within team-a the identical copy hits
    finally:
        on.stop()


class OneVersion:
    """A servicer's loader over the pool's slot 1 (paged/a0@1, artifact "sha-0", owned by tenant "paged") and
    the base model; counts acquires, the first step that queues anything for a request."""

    def __init__(self, pool: SlotPool) -> None:
        self.pool = pool
        self.acquired = 0

    async def resolve(self, reference: str) -> Resolved:
        if reference == "base":
            return BASE_RESOLVED
        message = common_pb2.ResolvedVersion(
            adapter="paged/a0", version=1, reference=reference, artifact_sha256="sha-0"
        )
        return Resolved(("paged/a0", 1), message, None)

    async def acquire(self, resolved: Resolved, count: int = 1) -> int:
        self.acquired += 1
        return 0 if resolved.key == ("", 0) else 1


def as_tenant(call: Coroutine[Any, Any, T]) -> T:
    """`call` run as a user of tenant "paged", the owner of paged/a0 (what the auth interceptor sets)."""

    async def scoped() -> T:
        token = auth.set_principal(Principal("paged", Role.USER))
        try:
            return await call
        finally:
            auth.reset_principal(token)

    return asyncio.run(scoped())


def test_requests_of_one_tenant_with_different_cache_salts_share_no_blocks(
    runner: LlamaForCausalLM, pool: SlotPool
) -> None:
    """One tenant, one adapter (and the base model), one prompt, through the real servicer: a request salted
    "b" reuses none of the blocks of one salted "a"; "a" again, or no salt twice, reuses them (prompt tokens
    found in the cache, counted at admission). A ComputeLogprobs salts the blocks it registers the same way.
    Only the salt's SHA-256 enters the key, and no salt keeps the key unsalted requests had before."""
    loader = OneVersion(pool)
    on = engine(runner, pool, num_blocks=32)
    info = common_pb2.BaseModelInfo(model_digest="base-digest", vocab_size=runner.config.vocab_size)
    servicer = SamplerServicer(cast(Any, on), cast(Any, loader), info=info, tokenizer=None, max_waiting=64)
    assert servicer._cache_key(1, "paged") == "lora:base-digest:sha-0:tenant:paged"  # as before cache_salt
    assert servicer._cache_key(0, "paged") == "base:base-digest:tenant:paged"
    digest = hashlib.sha256(b"a").hexdigest()
    assert servicer._cache_key(1, "paged", cache_salt("a")) == f"lora:base-digest:sha-0:tenant:paged:salt:{digest}"
    assert servicer._cache_key(0, "paged", cache_salt("a")) == f"base:base-digest:tenant:paged:salt:{digest}"
    servicer.share_base_prefix_cache = True  # tenants share base blocks on purpose; salts still split them
    assert servicer._cache_key(0, "paged", cache_salt("a")) == f"base:base-digest:salt:{digest}"
    servicer.share_base_prefix_cache = False

    def found(model: str, salt: str, tokens: list[int] = SYSTEM) -> int:
        """The prompt tokens one Sample found in the prefix cache."""
        before = on.scheduler.prompt_tokens_cached
        greedy = sampler_pb2.SamplingParams(temperature=0.0, max_tokens=4)
        request = sampler_pb2.SampleRequest(
            model=model, prompt=model_input(tokens), sampling_params=greedy, cache_salt=salt
        )

        async def sample() -> list[sampler_pb2.SampleResponse]:
            return [message async for message in servicer.Sample(request, None)]

        assert as_tenant(sample())[-1].stop_reason != sampler_pb2.STOP_REASON_UNSPECIFIED
        return on.scheduler.prompt_tokens_cached - before

    on.start()
    try:
        for model in ("paged/a0@1", "base"):
            assert found(model, "a") == 0
            assert found(model, "b") == 0  # salt "b" reuses none of salt "a"'s blocks
            assert found(model, "a") == 32  # the contrast: salt "a" again finds its two full blocks
            assert found(model, "") == 0  # no salt: its own blocks, not salt "a"'s
            assert found(model, "") == 32  # no salt twice shares as before
            assert found(model, "é" * 128) == 0  # 256 UTF-8 bytes: the most a salt may have
        scored = [*SYSTEM, 7, 8, 9]
        logprobs = sampler_pb2.ComputeLogprobsRequest(model="paged/a0@1", inputs=[model_input(scored)], cache_salt="c")
        assert len(as_tenant(servicer.ComputeLogprobs(logprobs, None)).results[0].logprobs) == len(scored) - 1
        assert found("paged/a0@1", "d", scored) == 0  # another salt cannot find the score's blocks
        assert found("paged/a0@1", "c", scored) == 32  # its own salt does
    finally:
        on.stop()


def test_an_over_long_cache_salt_is_refused_before_anything_is_queued(runner: LlamaForCausalLM, pool: SlotPool) -> None:
    loader = OneVersion(pool)
    on = engine(runner, pool, num_blocks=32)
    info = common_pb2.BaseModelInfo(model_digest="base-digest", vocab_size=runner.config.vocab_size)
    servicer = SamplerServicer(cast(Any, on), cast(Any, loader), info=info, tokenizer=None, max_waiting=64)
    salt = "é" * 129  # 129 characters, 258 UTF-8 bytes: the bound is in bytes
    sample = sampler_pb2.SampleRequest(model="paged/a0@1", prompt=model_input(SYSTEM), cache_salt=salt)
    logprobs = sampler_pb2.ComputeLogprobsRequest(model="paged/a0@1", inputs=[model_input(SYSTEM)], cache_salt=salt)

    async def drain() -> None:
        async for _ in servicer.Sample(sample, None):
            pass

    calls = [drain(), servicer.ComputeLogprobs(logprobs, None)]
    for call in calls:
        with pytest.raises(InvalidArgument) as refused:
            as_tenant(call)
        assert refused.value.reason == "INVALID_CACHE_SALT"
        assert refused.value.metadata["field"] == "cache_salt"
        assert "258 bytes" in refused.value.message and "256" in refused.value.message
    assert loader.acquired == 0 and on.num_waiting == 0 and on.scheduler.prompt_tokens_cached == 0
    assert servicer.tenants.of("paged").waiting == 0

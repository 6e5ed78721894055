"""A chunked step's prompt tokens are shared between tenants (scheduler.py, `_prompt_allowances`): one tenant's
long partly computed prompts do not keep another tenant's new request out until they are done, a tenant computes
at most `mixed_prefill_tokens` prompt tokens in a step where another tenant's sequences decode, and what one
tenant cannot use goes to the others. Steps are simulated: a computed prompt samples one token."""

from __future__ import annotations

import itertools

from opentinker.sampler_server.scheduler import ScheduledBatch, Scheduler
from opentinker.sampler_server.sequence import SamplingParams, Sequence

PARAMS = SamplingParams(temperature=0.0, max_tokens=64)
_ids = itertools.count(1)


def sequence(tenant: str, name: str, prompt_len: int) -> Sequence:
    return Sequence(
        seq_id=next(_ids),
        request_id=name,
        sample_index=0,
        prompt=list(range(1, prompt_len + 1)),
        params=PARAMS,
        lora_slot=0,
        tenant=tenant,
    )


def step(scheduler: Scheduler) -> dict[str, int]:
    """Schedules and 'runs' one step: each sequence's chunk is computed, one that reaches its end samples a
    token. Returns the tokens each request computed."""
    batch = scheduler.schedule()
    assert isinstance(batch, ScheduledBatch)
    computed: dict[str, int] = {}
    for seq, chunk in zip(batch.sequences, batch.chunks, strict=True):
        computed[seq.request_id] = computed.get(seq.request_id, 0) + chunk
        seq.num_cached += chunk
        if seq.num_cached == seq.num_tokens:
            seq.output.append(7)
    return computed


def scheduler(mixed: int = 0) -> Scheduler:
    return Scheduler(max_seqs=16, max_batch_tokens=4096, prefill_chunk_tokens=512, mixed_prefill_tokens=mixed)


def test_a_new_request_is_admitted_in_the_next_step_beside_another_tenant_s_long_prompts() -> None:
    s = scheduler()
    for i in range(4):
        s.add(sequence("team-a", f"a{i}", 2047))
    assert sum(step(s).values()) == 512  # team-a alone takes the whole budget
    s.add(sequence("team-b", "b0", 24))
    computed = step(s)
    # Before: team-a's partly computed prompts took the whole budget first and b0 waited for one of them to end.
    assert computed["b0"] == 24, computed
    assert sum(computed.values()) == 512  # what b0 did not need stayed with team-a
    assert step(s)["b0"] == 1  # and it decodes from then on


def test_a_tenant_s_prompt_chunk_is_bounded_while_another_tenant_decodes() -> None:
    s = scheduler(mixed=32)
    s.add(sequence("team-b", "b0", 8))
    step(s)  # b0's prompt: it decodes from the next step
    for i in range(3):
        s.add(sequence("team-a", f"a{i}", 2047))
    for _ in range(5):
        computed = step(s)
        assert computed["b0"] == 1
        assert sum(n for name, n in computed.items() if name.startswith("a")) == 32, computed
    s.finish(next(seq for seq in s.running if seq.request_id == "b0"))
    computed = step(s)  # nobody else decodes: the whole budget again
    assert sum(computed.values()) == 512, computed


def test_a_tenant_s_own_decodes_do_not_bound_its_prompt_chunks() -> None:
    s = scheduler(mixed=32)
    s.add(sequence("team-a", "a0", 8))
    step(s)
    s.add(sequence("team-a", "a1", 2047))
    computed = step(s)
    assert computed == {"a0": 1, "a1": 512}


def test_the_budget_is_shared_evenly_and_a_small_demand_leaves_its_rest_to_the_others() -> None:
    s = scheduler()
    s.add(sequence("team-a", "a0", 2047))
    s.add(sequence("team-b", "b0", 2047))
    s.add(sequence("team-c", "c0", 40))
    computed = step(s)
    assert computed["c0"] == 40
    assert computed["a0"] + computed["b0"] == 472 and abs(computed["a0"] - computed["b0"]) <= 1, computed
    computed = step(s)  # c0 decodes; the two long prompts split the budget
    assert computed["c0"] == 1 and computed["a0"] + computed["b0"] == 512, computed

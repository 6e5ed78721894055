"""The scheduler shares the batch between tenants: waiting requests are admitted round-robin across tenants (the
one holding the fewest KV slots first), FIFO within a tenant, the samples of a request together; no tenant holds
more than its slot cap; the prefill token budget and the decode-between-prefills rule still hold. And the service's
side: whose share a Sample uses, and the per-tenant queue cap."""

from __future__ import annotations

import itertools
from types import SimpleNamespace
from typing import Any, cast

import pytest

from opentinker.rpc.serving.auth import LOCAL_PRINCIPAL, Principal, Role
from opentinker.rpc.serving.errors import ResourceExhausted
from opentinker.sampler_server.scheduler import ScheduledBatch, Scheduler
from opentinker.sampler_server.sequence import SamplingParams, Sequence, Status
from opentinker.sampler_server.service import SamplerServicer
from opentinker.sampler_server.tenant_bounds import default_tenant_slots
from opentinker.sampler_server.tenant_stats import TenantActivity, batch_tenant

PARAMS = SamplingParams(temperature=0.0, max_tokens=8)
_ids = itertools.count(1)


def request(tenant: str, name: str, samples: int = 1, prompt_len: int = 3) -> list[Sequence]:
    return [
        Sequence(
            seq_id=next(_ids),
            request_id=name,
            sample_index=i,
            prompt=list(range(1, prompt_len + 1)),
            params=PARAMS,
            lora_slot=0,
            tenant=tenant,
        )
        for i in range(samples)
    ]


def add(scheduler: Scheduler, *requests: list[Sequence]) -> None:
    for sequences in requests:
        for seq in sequences:
            scheduler.add(seq)


def names(batch: ScheduledBatch | None) -> list[str]:
    assert batch is not None
    return [f"{seq.request_id}.{seq.sample_index}" for seq in batch.sequences]


def prefill(scheduler: Scheduler) -> list[str]:
    batch = scheduler.schedule()
    assert batch is not None and batch.is_prefill, batch
    return names(batch)


def finish_request(scheduler: Scheduler, name: str) -> None:
    for seq in [s for s in scheduler.running if s.request_id == name]:
        scheduler.finish(seq)


def test_the_default_slot_cap_is_three_quarters_of_the_batch_and_at_least_one() -> None:
    assert [default_tenant_slots(n) for n in (1, 2, 3, 4, 8, 64)] == [1, 1, 2, 3, 6, 48]


def test_waiting_requests_are_admitted_round_robin_across_tenants_fifo_within_each() -> None:
    scheduler = Scheduler(max_seqs=64, max_batch_tokens=4096)
    add(scheduler, *(request("team-a", f"a{i}") for i in range(4)))  # team-a's flood came first
    add(scheduler, request("team-b", "b0"), request("team-b", "b1"), request("team-c", "c0"))
    assert prefill(scheduler) == ["a0.0", "b0.0", "c0.0", "a1.0", "b1.0", "a2.0", "a3.0"]


def test_a_freed_slot_goes_to_the_waiting_tenant_holding_the_fewest() -> None:
    scheduler = Scheduler(max_seqs=4, max_batch_tokens=4096, max_seqs_per_tenant=4)
    add(scheduler, *(request("team-a", f"a{i}") for i in range(10)))
    assert prefill(scheduler) == ["a0.0", "a1.0", "a2.0", "a3.0"]  # alone, team-a may take the whole batch
    add(scheduler, request("team-b", "b0"), request("team-b", "b1"))
    assert scheduler.schedule() is not None  # a decode: no slot is free
    finish_request(scheduler, "a0")
    assert prefill(scheduler) == ["b0.0"]  # not a4, which waited longer: team-b holds nothing
    scheduler.schedule()  # decode
    finish_request(scheduler, "a1")
    assert prefill(scheduler) == ["b1.0"]  # team-b holds 1, team-a 2
    scheduler.schedule()
    finish_request(scheduler, "a2")
    assert prefill(scheduler) == ["a4.0"]  # team-b has nothing left waiting
    assert scheduler.waiting_of("team-a") == 5 and scheduler.waiting_of("team-b") == 0


def test_a_tenant_holds_at_most_its_slot_cap_and_the_rest_stays_free_for_others() -> None:
    scheduler = Scheduler(max_seqs=4, max_batch_tokens=4096, max_seqs_per_tenant=3)
    add(scheduler, *(request("team-a", f"a{i}", prompt_len=50) for i in range(20)))
    assert prefill(scheduler) == ["a0.0", "a1.0", "a2.0"]
    assert len(scheduler.free_kv_slots) == 1 and scheduler.held["team-a"] == 3
    for _ in range(3):  # team-a's flood never gets the 4th slot
        batch = scheduler.schedule()
        assert batch is not None and not batch.is_prefill and len(batch.sequences) == 3
    add(scheduler, request("team-b", "b0"))
    assert prefill(scheduler) == ["b0.0"]  # at once, though 17 of team-a's requests waited before it
    finish_request(scheduler, "a0")
    scheduler.schedule()
    assert prefill(scheduler) == ["a3.0"]
    assert dict(scheduler.held) == {"team-a": 3, "team-b": 1} and scheduler.num_waiting == 16


def test_multi_sample_requests_stay_together_and_share_fairly() -> None:
    scheduler = Scheduler(max_seqs=8, max_batch_tokens=4096, max_seqs_per_tenant=5)
    add(scheduler, request("team-a", "a0", samples=4), request("team-a", "a1", samples=4))
    add(scheduler, request("team-b", "b0", samples=2), request("team-b", "b1", samples=2))
    # a0 whole, then b0 whole (team-b holds fewer), then b1 (still fewer: 2 < 4): the batch is full.
    assert prefill(scheduler) == ["a0.0", "a0.1", "a0.2", "a0.3", "b0.0", "b0.1", "b1.0", "b1.1"]
    scheduler.schedule()
    finish_request(scheduler, "b0")
    assert prefill(scheduler) == ["a1.0"]  # a1's first sample: team-a's cap of 5 leaves the other slot free
    assert len(scheduler.free_kv_slots) == 1
    scheduler.schedule()
    finish_request(scheduler, "a0")
    assert prefill(scheduler) == ["a1.1", "a1.2", "a1.3"]  # the rest of a1, in order, at team-a's next turn
    assert scheduler.num_waiting == 0 and dict(scheduler.held) == {"team-a": 4, "team-b": 2}


def test_a_request_with_more_samples_than_the_cap_runs_them_cap_at_a_time() -> None:
    scheduler = Scheduler(max_seqs=4, max_batch_tokens=4096, max_seqs_per_tenant=3)
    add(scheduler, request("team-a", "a0", samples=5))
    assert prefill(scheduler) == ["a0.0", "a0.1", "a0.2"]
    scheduler.schedule()
    for seq in list(scheduler.running)[:2]:
        scheduler.finish(seq)
    assert prefill(scheduler) == ["a0.3", "a0.4"]


def test_the_token_budget_skips_a_tenant_whose_prompt_does_not_fit_and_it_goes_first_next_prefill() -> None:
    scheduler = Scheduler(max_seqs=16, max_batch_tokens=100)
    add(scheduler, request("team-a", "a0", prompt_len=60), request("team-a", "a1", prompt_len=60))
    add(scheduler, request("team-b", "b0", prompt_len=10), request("team-b", "b1", prompt_len=10))
    assert prefill(scheduler) == ["a0.0", "b0.0", "b1.0"]  # a1 does not fit the 30 tokens left; team-b's do
    batch = scheduler.schedule()
    assert batch is not None and not batch.is_prefill  # a decode between two prefills
    assert prefill(scheduler) == ["a1.0"]


def test_running_sequences_still_get_a_decode_between_two_prefills_of_many_tenants() -> None:
    scheduler = Scheduler(max_seqs=64, max_batch_tokens=4096)
    add(scheduler, request("team-b", "victim"))
    assert prefill(scheduler) == ["victim.0"]
    kinds = []
    for step in range(10):
        add(scheduler, request(f"team-{step}", f"r{step}"))  # a new tenant's request before every step
        batch = scheduler.schedule()
        assert batch is not None
        kinds.append(batch.is_prefill)
        if batch.is_prefill:
            for seq in batch.sequences:
                scheduler.finish(seq)
    assert kinds == [False, True] * 5


def test_finishing_waiting_and_running_sequences_keeps_the_books() -> None:
    scheduler = Scheduler(max_seqs=2, max_batch_tokens=4096, max_seqs_per_tenant=1)
    add(scheduler, request("team-a", "a0"), request("team-a", "a1"), request("team-b", "b0", samples=2))
    assert prefill(scheduler) == ["a0.0", "b0.0"]
    waiting = {f"{s.request_id}.{s.sample_index}": s for s in scheduler.waiting}
    assert sorted(waiting) == ["a1.0", "b0.1"]
    scheduler.finish(waiting["a1.0"])  # aborted while waiting
    assert waiting["a1.0"].status is Status.FINISHED and scheduler.waiting_of("team-a") == 0
    finish_request(scheduler, "a0")
    finish_request(scheduler, "b0")
    assert scheduler.held == {} and len(scheduler.free_kv_slots) == 2
    assert prefill(scheduler) == ["b0.1"]
    assert scheduler.num_waiting == 0 and not scheduler.waiting


# --- whose share a Sample uses, and the per-tenant queue cap (service side) --------------------------------------

USER_A = Principal(tenant="team-a", role=Role.USER)
ADMIN = Principal(tenant="ops", role=Role.ADMIN)


def test_a_sample_uses_its_caller_s_share_or_for_an_admin_the_adapter_owner_s() -> None:
    assert batch_tenant(USER_A, "base") == "team-a" and batch_tenant(USER_A, "team-a/x@3") == "team-a"
    assert batch_tenant(ADMIN, "team-b/x@3") == "team-b" and batch_tenant(ADMIN, "team-b/x:prod") == "team-b"
    assert batch_tenant(LOCAL_PRINCIPAL, "team-c/y") == "team-c"  # a sampler without tokens
    assert batch_tenant(ADMIN, "base") == batch_tenant(LOCAL_PRINCIPAL, "") == ""


def check_queue(principal: Principal, waiting: int, count: int, limit: int = 6) -> None:
    servicer = cast(Any, SimpleNamespace(max_queued_per_tenant=limit))
    SamplerServicer._check_tenant_queue(servicer, principal, TenantActivity(waiting=waiting), count)


def test_a_user_tenant_s_waiting_samples_stay_within_its_queue_cap() -> None:
    check_queue(USER_A, 4, 2)  # exactly the cap
    with pytest.raises(ResourceExhausted) as refused:
        check_queue(USER_A, 5, 2)
    assert refused.value.reason == "TENANT_QUEUE_FULL" and "--max-queued-per-tenant" in refused.value.message
    assert refused.value.metadata == {"tenant": "team-a", "waiting": "5", "limit": "6"}
    check_queue(USER_A, 500, 64, limit=0)  # 0: no limit
    check_queue(ADMIN, 500, 64)  # admins: --max-waiting only
    check_queue(LOCAL_PRINCIPAL, 500, 64)

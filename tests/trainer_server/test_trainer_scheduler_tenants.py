"""The compute scheduler's two-level fair share: a ring of tenants, inside each a ring of its adapters.

Orders are recorded by the job functions themselves; a gate holds the compute thread until every job is queued.
"""

from __future__ import annotations

import asyncio
import functools
import threading
from collections.abc import Callable, Coroutine
from typing import Any

import pytest

from opentinker.rpc.serving.auth import Principal, Role
from opentinker.rpc.serving.errors import ResourceExhausted
from opentinker.trainer_server.admission import QueueAdmission
from opentinker.trainer_server.scheduler import AdapterScheduler, lane_of

Queue = Callable[[str, str], "asyncio.Future[Any]"]


def gated(build: Callable[[AdapterScheduler, Queue], Coroutine[Any, Any, None]]) -> list[str]:
    """Runs build(scheduler, queue) while a blocker job holds the compute thread, then lets everything run;
    returns the labels in the order the jobs ran (the blocker's first)."""
    order: list[str] = []

    def record(label: str) -> str:
        order.append(label)
        return label

    async def main() -> None:
        scheduler = AdapterScheduler()
        scheduler.start()
        gate = threading.Event()
        blocker = asyncio.ensure_future(scheduler.run("blocker", lambda: gate.wait(5) and record("blocker")))
        await asyncio.sleep(0.05)
        jobs: list[asyncio.Future[Any]] = []

        def queue(adapter: str, label: str) -> asyncio.Future[Any]:
            job = asyncio.ensure_future(scheduler.run(adapter, functools.partial(record, label)))
            jobs.append(job)
            return job

        await build(scheduler, queue)
        await asyncio.sleep(0.05)  # every job is in the scheduler before the first one runs
        gate.set()
        await asyncio.gather(blocker, *jobs)
        await scheduler.stop()

    asyncio.run(main())
    assert order[0] == "blocker"
    return order[1:]


def test_a_tenant_with_many_adapters_does_not_outvote_a_tenant_with_one() -> None:
    async def build(scheduler: AdapterScheduler, queue: Queue) -> None:
        for job in range(3):
            for adapter in range(8):
                queue(f"a/{adapter}", f"a{adapter}.{job}")
        queue("b/only", "b")  # queued last, behind 24 jobs of team a

    order = gated(build)
    assert order.index("b") == 1  # tenant b's turn comes right after tenant a's first
    # Inside tenant a, its adapters take turns, and each adapter's jobs keep their arrival order.
    a_jobs = [label for label in order if label != "b"]
    assert a_jobs == [f"a{adapter}.{job}" for job in range(3) for adapter in range(8)]


def test_tenants_alternate_job_by_job() -> None:
    async def build(scheduler: AdapterScheduler, queue: Queue) -> None:
        for job in range(3):
            for adapter in range(4):
                queue(f"a/{adapter}", f"a{adapter}.{job}")
        for job in range(3):
            queue("b/x", f"bx.{job}")
        for job in range(2):
            queue("c/y", f"cy.{job}")

    order = gated(build)
    assert order[:8] == ["a0.0", "bx.0", "cy.0", "a1.0", "bx.1", "cy.1", "a2.0", "bx.2"]
    assert order[8:] == [f"a{adapter}.{job}" for job in range(3) for adapter in range(4)][3:]


def test_names_without_a_tenant_share_one_lane() -> None:
    assert lane_of("team-a/policy") == "team-a" and lane_of("policy") == "" and lane_of("other") == ""

    async def build(scheduler: AdapterScheduler, queue: Queue) -> None:
        for adapter in ("p", "q", "r"):
            queue(adapter, adapter)
        queue("t/x", "t")

    assert gated(build) == ["p", "t", "q", "r"]  # p, q and r share the "" tenant's turns


def test_parts_take_one_turn_each_and_keep_the_adapters_later_requests_behind() -> None:
    order: list[str] = []

    async def main() -> list[str]:
        scheduler = AdapterScheduler()
        scheduler.start()
        gate = threading.Event()

        def record(label: str) -> str:
            order.append(label)
            return label

        blocker = asyncio.ensure_future(scheduler.run("z/0", lambda: gate.wait(5) and record("z")))
        await asyncio.sleep(0.05)
        big = asyncio.ensure_future(
            scheduler.run_parts("a/big", [functools.partial(record, f"a.{i}") for i in range(3)])
        )
        later = asyncio.ensure_future(scheduler.run("a/big", functools.partial(record, "a-next")))
        sibling = [
            asyncio.ensure_future(scheduler.run("a/other", functools.partial(record, f"o{i}"))) for i in range(2)
        ]
        others = [asyncio.ensure_future(scheduler.run("b/x", functools.partial(record, f"b{i}"))) for i in range(3)]
        await asyncio.sleep(0.05)
        gate.set()
        parts = await big
        await asyncio.gather(blocker, later, *sibling, *others)
        await scheduler.stop()
        return parts

    assert asyncio.run(main()) == ["a.0", "a.1", "a.2"]
    # Tenant a and tenant b alternate; inside a, a/big's parts and a/other's jobs alternate; a-next after a.2.
    assert order == ["z", "a.0", "b0", "o0", "b1", "a.1", "b2", "o1", "a.2", "a-next"]


def test_cancelled_job_is_skipped_and_the_order_of_the_rest_holds() -> None:
    order: list[str] = []

    async def main() -> None:
        scheduler = AdapterScheduler()
        scheduler.start()
        gate = threading.Event()

        def record(label: str) -> None:
            order.append(label)

        blocker = asyncio.ensure_future(scheduler.run("z/0", lambda: gate.wait(5)))
        await asyncio.sleep(0.05)
        kept = [asyncio.ensure_future(scheduler.run("a/1", functools.partial(record, "a1")))]
        doomed = asyncio.ensure_future(scheduler.run("a/2", functools.partial(record, "a2")))
        kept.append(asyncio.ensure_future(scheduler.run("b/1", functools.partial(record, "b1"))))
        kept.append(asyncio.ensure_future(scheduler.run("a/2", functools.partial(record, "a2-after"))))
        await asyncio.sleep(0.01)
        doomed.cancel()
        gate.set()
        await asyncio.gather(blocker, *kept)
        await scheduler.stop()

    asyncio.run(main())
    assert order == ["a1", "b1", "a2-after"]


USER_A = Principal(tenant="a", role=Role.USER)
USER_B = Principal(tenant="b", role=Role.USER)


def test_queue_places_are_held_until_the_job_leaves_the_scheduler() -> None:
    """A tenant's places count requests being converted, queued and running, and one whose client gave up
    until the scheduler drops it; other tenants and admins are not affected."""
    answers: list[str] = []

    async def main() -> None:
        scheduler = AdapterScheduler()
        admission = QueueAdmission(2)
        scheduler.start()
        gate = threading.Event()

        async def request(principal: Principal, adapter: str, fn: Callable[[], object]) -> object:
            with admission.admit(principal):
                return await scheduler.run(adapter, fn)

        blocker = asyncio.ensure_future(request(USER_A, "a/1", lambda: gate.wait(5)))
        await asyncio.sleep(0.05)
        doomed = asyncio.ensure_future(request(USER_A, "a/2", lambda: answers.append("doomed")))
        await asyncio.sleep(0.01)
        assert admission.held("a") == 2
        with pytest.raises(ResourceExhausted) as caught, admission.admit(USER_A):
            pass
        assert caught.value.reason == "TOO_MANY_REQUESTS" and "--max-queued-per-tenant 2" in str(caught.value)
        doomed.cancel()  # the client gave up: its job still sits in the queue
        await asyncio.sleep(0.01)
        assert admission.held("a") == 2
        other = asyncio.ensure_future(request(USER_B, "b/1", lambda: answers.append("b")))
        admin = asyncio.ensure_future(
            request(Principal(tenant="ops", role=Role.ADMIN), "a/3", lambda: answers.append("admin"))
        )
        await asyncio.sleep(0.01)
        gate.set()
        await asyncio.gather(blocker, other, admin)
        await scheduler.run("a/2", lambda: None)  # the doomed job was dropped before this one
        assert admission.held("a") == 0 and admission.held("b") == 0
        with admission.admit(USER_A):  # places are free again
            pass
        await scheduler.stop()

    asyncio.run(main())
    assert sorted(answers) == ["admin", "b"]


def test_a_request_refused_before_it_queues_gives_its_place_back() -> None:
    admission = QueueAdmission(1)
    with pytest.raises(ValueError), admission.admit(USER_A):
        raise ValueError("bad batch")  # e.g. INVALID_ARGUMENT while converting the payload
    assert admission.held("a") == 0
    with admission.admit(USER_A):
        pass


def test_zero_means_no_queue_limit() -> None:
    admission = QueueAdmission(0)
    with admission.admit(USER_A), admission.admit(USER_A), admission.admit(USER_A):
        assert admission.held("a") == 0

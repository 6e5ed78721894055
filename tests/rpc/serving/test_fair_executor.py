"""The tenant-fair executor (rpc/serving/fair_executor.py) as the gateway's tokenizer thread uses it: tenants take
turns, so one tenant's backlog delays another tenant's job by the one job running; a tenant's queue is bounded; a
cancelled job never runs; a failing job fails only its caller. With two workers, from threads (`submit`, the
sampler's grammar compiles): a tenant runs one job at a time."""

from __future__ import annotations

import asyncio
import functools
import threading

import pytest

from opentinker.rpc.serving.fair_executor import FairExecutor, TenantQueueFull


class Gate:
    """Jobs that record the order they start in and block until released, one by one."""

    def __init__(self) -> None:
        self.started: list[str] = []
        self._release = threading.Semaphore(0)
        self._lock = threading.Lock()  # two worker threads may start jobs at once

    def job(self, name: str) -> str:
        with self._lock:
            self.started.append(name)
        if not self._release.acquire(timeout=30):
            raise TimeoutError(name)
        return name

    def release(self, n: int = 1) -> None:
        for _ in range(n):
            self._release.release()


async def _until(condition: object, what: str) -> None:
    for _ in range(3000):
        if callable(condition) and condition():
            return
        await asyncio.sleep(0.001)
    raise AssertionError(f"timed out waiting for {what}")


def test_a_tenants_backlog_delays_another_by_one_job() -> None:
    async def main() -> list[str]:
        gate, pool = Gate(), FairExecutor(max_queued_per_tenant=0)
        noisy = [asyncio.create_task(pool.run("noisy", functools.partial(gate.job, f"noisy-{i}"))) for i in range(6)]
        await _until(lambda: gate.started == ["noisy-0"], "the first noisy job")
        assert pool.waiting("noisy") == 5
        quiet = asyncio.create_task(pool.run("quiet", lambda: gate.job("quiet-0")))
        await asyncio.sleep(0)
        gate.release(7)
        assert await quiet == "quiet-0"
        assert await asyncio.gather(*noisy) == [f"noisy-{i}" for i in range(6)]
        pool.close()
        return gate.started

    started = asyncio.run(main())
    # FIFO would run quiet-0 seventh; in turns it runs right after the job that was running when it came.
    assert started == ["noisy-0", "quiet-0", *(f"noisy-{i}" for i in range(1, 6))]


def test_turns_alternate_between_tenants_with_backlogs() -> None:
    async def main() -> list[str]:
        gate, pool = Gate(), FairExecutor(max_queued_per_tenant=0)
        first = asyncio.create_task(pool.run("a", lambda: gate.job("a-0")))
        await _until(lambda: gate.started == ["a-0"], "a-0")
        tasks = [first]
        for i in range(1, 4):
            tasks.append(asyncio.create_task(pool.run("a", functools.partial(gate.job, f"a-{i}"))))
        for i in range(3):
            tasks.append(asyncio.create_task(pool.run("b", functools.partial(gate.job, f"b-{i}"))))
        await asyncio.sleep(0)
        gate.release(7)
        await asyncio.gather(*tasks)
        pool.close()
        return gate.started

    assert asyncio.run(main()) == ["a-0", "b-0", "a-1", "b-1", "a-2", "b-2", "a-3"]


def test_a_tenant_over_its_bound_is_refused_and_another_is_not() -> None:
    async def main() -> None:
        gate, pool = Gate(), FairExecutor(max_queued_per_tenant=2)
        running = asyncio.create_task(pool.run("noisy", lambda: gate.job("noisy-0")))
        await _until(lambda: gate.started == ["noisy-0"], "noisy-0")
        queued = [asyncio.create_task(pool.run("noisy", functools.partial(gate.job, f"noisy-{i}"))) for i in (1, 2)]
        await asyncio.sleep(0)
        with pytest.raises(TenantQueueFull) as refused:
            await pool.run("noisy", lambda: gate.job("noisy-3"))
        assert refused.value.tenant == "noisy" and refused.value.limit == 2
        quiet = asyncio.create_task(pool.run("quiet", lambda: gate.job("quiet-0")))
        await asyncio.sleep(0)
        gate.release(4)
        assert await quiet == "quiet-0"
        await asyncio.gather(running, *queued)
        assert "noisy-3" not in gate.started
        assert pool.waiting("noisy") == pool.waiting("quiet") == 0
        pool.close()

    asyncio.run(main())


def test_a_cancelled_job_never_runs_and_a_failing_one_fails_only_its_caller() -> None:
    async def main() -> None:
        gate, pool = Gate(), FairExecutor()
        running = asyncio.create_task(pool.run("a", lambda: gate.job("a-0")))
        await _until(lambda: gate.started == ["a-0"], "a-0")
        dropped = asyncio.create_task(pool.run("a", lambda: gate.job("a-dropped")))

        def fail() -> str:
            raise ValueError("template refused")

        failing = asyncio.create_task(pool.run("b", fail))
        after = asyncio.create_task(pool.run("b", lambda: gate.job("b-after")))
        await asyncio.sleep(0)
        dropped.cancel()
        gate.release(2)
        assert await running == "a-0"
        with pytest.raises(ValueError, match="template refused"):
            await failing
        assert await after == "b-after"
        with pytest.raises(asyncio.CancelledError):
            await dropped
        assert gate.started == ["a-0", "b-after"]
        pool.close()

    asyncio.run(main())


# From threads (`submit`), two workers, as the sampler's engine compiles its grammars: a tenant runs one job at a
# time, so another tenant's job starts at once beside a backlog; a cancelled future's job never runs.


def _until_on_thread(condition: object) -> None:
    event = threading.Event()
    for _ in range(3000):
        if callable(condition) and condition():
            return
        event.wait(0.001)
    raise AssertionError("timed out")


def test_a_tenant_holds_one_thread_so_another_starts_at_once() -> None:
    gate, pool = Gate(), FairExecutor(max_queued_per_tenant=0, workers=2)
    noisy = [pool.submit("noisy", functools.partial(gate.job, f"noisy-{i}")) for i in range(5)]
    _until_on_thread(lambda: gate.started == ["noisy-0"])
    assert pool.running("noisy") and pool.waiting("noisy") == 4  # the second thread stays free for others
    quiet = pool.submit("quiet", lambda: gate.job("quiet-0"))
    _until_on_thread(lambda: len(gate.started) == 2)
    assert gate.started == ["noisy-0", "quiet-0"]  # started before any more of noisy's backlog
    gate.release(6)
    assert quiet.result(timeout=30) == "quiet-0"
    assert [f.result(timeout=30) for f in noisy] == [f"noisy-{i}" for i in range(5)]
    assert pool.started == 6 and not pool.running("noisy") and pool.waiting("noisy") == 0
    pool.close()


def test_a_cancelled_job_never_runs_and_the_queue_is_bounded() -> None:
    gate, pool = Gate(), FairExecutor(max_queued_per_tenant=2, workers=2)
    first = pool.submit("a", lambda: gate.job("a-0"))
    _until_on_thread(lambda: gate.started == ["a-0"])
    dropped = pool.submit("a", lambda: gate.job("a-dropped"))
    after = pool.submit("a", lambda: gate.job("a-after"))
    with pytest.raises(TenantQueueFull) as refused:
        pool.submit("a", lambda: gate.job("a-refused"))
    assert refused.value.tenant == "a" and refused.value.limit == 2
    assert dropped.cancel()
    gate.release(2)
    assert first.result(timeout=30) == "a-0" and after.result(timeout=30) == "a-after"
    assert gate.started == ["a-0", "a-after"]
    pool.close()

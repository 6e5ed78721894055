"""Worker threads shared by every tenant, taken in turns: each tenant's jobs wait in a queue of their own, a tenant
runs at most one job at a time, and a free thread takes the next job of the waiting tenant it served least
recently (a tenant it has not served yet first). With one thread (the gateway's tokenizer), a tenant that sends a
hundred huge chat templates delays another tenant's request by the one job running, not by its whole backlog;
with two (the sampler's grammar compiles), another tenant's job starts at once, since the flooding tenant holds
one thread at most. A tenant's queue is bounded too: past ``max_queued_per_tenant`` waiting jobs the next one is
refused at once (TenantQueueFull) instead of queuing memory without limit. A job whose caller went away
(cancelled) is dropped before it runs.

Event-loop callers ``await run(tenant, call)``; threads ``submit(tenant, call)`` and get a concurrent future.
The bookkeeping is under one lock; the jobs run outside it."""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

_T = TypeVar("_T")


class TenantQueueFull(Exception):
    """The tenant already has ``max_queued_per_tenant`` jobs waiting."""

    def __init__(self, tenant: str, limit: int, lane: str = "") -> None:
        super().__init__(f"tenant {tenant!r} already has {limit} jobs waiting for {lane or 'its turn'}")
        self.tenant, self.limit = tenant, limit


def _never() -> bool:
    return False


@dataclass(slots=True)
class _Job:
    tenant: str
    call: Callable[[], Any]
    done: concurrent.futures.Future[Any]
    abandoned: Callable[[], bool] = _never  # an event-loop caller's own future, cancelled with its task


@dataclass(slots=True)
class _Turns:
    waiting: dict[str, collections.deque[_Job]] = field(default_factory=dict)
    running: set[str] = field(default_factory=set)  # tenants with a job on a thread
    served: dict[str, int] = field(default_factory=dict)  # the turn each tenant's latest job started in
    turn: int = 0


class FairExecutor:
    def __init__(self, max_queued_per_tenant: int = 64, thread_name: str = "fair", workers: int = 1) -> None:
        self.max_queued_per_tenant = max_queued_per_tenant  # 0: no bound
        self.thread_name = thread_name
        self.workers = workers
        self.started = 0  # jobs started, for the tests and the metrics
        self._turns = _Turns()
        self._lock = threading.Lock()
        self._threads: concurrent.futures.ThreadPoolExecutor | None = None
        self._closed = False

    def waiting(self, tenant: str) -> int:
        """Jobs of ``tenant`` not yet started."""
        with self._lock:
            queue = self._turns.waiting.get(tenant)
            return 0 if queue is None else len(queue)

    def running(self, tenant: str) -> bool:
        with self._lock:
            return tenant in self._turns.running

    async def run(self, tenant: str, call: Callable[[], _T]) -> _T:
        """``call()`` on a worker thread in ``tenant``'s turn; cancelling the caller drops a job not yet started."""
        done: concurrent.futures.Future[_T] = concurrent.futures.Future()
        waiter = asyncio.wrap_future(done)
        self._add(_Job(tenant, call, done, waiter.cancelled))
        result: _T = await waiter  # cancelling this cancels `waiter`: the job is dropped when its turn comes
        return result

    def submit(self, tenant: str, call: Callable[[], _T]) -> concurrent.futures.Future[_T]:
        """``call()`` on a worker thread in ``tenant``'s turn; cancelling the future drops a job not yet started."""
        done: concurrent.futures.Future[_T] = concurrent.futures.Future()
        self._add(_Job(tenant, call, done))
        return done

    def _add(self, job: _Job) -> None:
        with self._lock:
            if self._closed:
                raise RuntimeError(f"the {self.thread_name} threads are closed")
            queue = self._turns.waiting.setdefault(job.tenant, collections.deque())
            if self.max_queued_per_tenant and len(queue) >= self.max_queued_per_tenant:
                if not queue:
                    del self._turns.waiting[job.tenant]
                raise TenantQueueFull(job.tenant, self.max_queued_per_tenant, f"the {self.thread_name} threads")
            queue.append(job)
            self._start_next()

    def _start_next(self) -> None:
        """Under the lock: hands free threads the next jobs, one per tenant, least recently served tenant first."""
        turns = self._turns
        while len(turns.running) < self.workers:
            ready = [t for t in turns.waiting if t not in turns.running]
            if not ready:
                return
            tenant = min(ready, key=lambda t: turns.served.get(t, -1))
            queue = turns.waiting[tenant]
            job = queue.popleft()
            if not queue:
                del turns.waiting[tenant]
            if job.abandoned() or not job.done.set_running_or_notify_cancel():
                self._forget_if_idle(tenant)
                continue
            turns.served[tenant], turns.turn = turns.turn, turns.turn + 1
            turns.running.add(tenant)
            self.started += 1
            if self._threads is None:
                self._threads = concurrent.futures.ThreadPoolExecutor(self.workers, thread_name_prefix=self.thread_name)
            self._threads.submit(self._work, job)

    def _work(self, job: _Job) -> None:
        try:
            result = job.call()
        except BaseException as exc:  # the caller gets it, as from any executor
            job.done.set_exception(exc)
        else:
            job.done.set_result(result)
        finally:
            with self._lock:
                self._turns.running.discard(job.tenant)
                self._forget_if_idle(job.tenant)
                if not self._closed:
                    self._start_next()

    def _forget_if_idle(self, tenant: str) -> None:
        """A tenant with nothing waiting and nothing running leaves the turn order (the table stays bounded)."""
        if tenant not in self._turns.waiting and tenant not in self._turns.running:
            self._turns.served.pop(tenant, None)

    def close(self) -> None:
        """Jobs not yet started are cancelled; the ones running finish on their threads."""
        with self._lock:
            self._closed = True
            waiting = [job for queue in self._turns.waiting.values() for job in queue]
            self._turns.waiting.clear()
        for job in waiting:
            job.done.cancel()
        if self._threads is not None:
            self._threads.shutdown(wait=False, cancel_futures=True)

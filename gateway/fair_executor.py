"""One worker thread shared by every tenant, taken in turns: each tenant's jobs wait in a queue of their own, and
the thread runs the next job of the waiting tenant it served least recently (a tenant it has not served yet first),
so a tenant that sends a hundred huge chat templates delays another tenant's request by the one job running, not
by its whole backlog. A
tenant's queue is bounded too: past ``max_queued_per_tenant`` waiting jobs the next one is refused at once (429)
instead of queuing memory without limit. Jobs of a request that goes away are dropped before they run.

Everything but the job itself runs on the event loop, so the bookkeeping needs no lock."""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

_T = TypeVar("_T")


class TenantQueueFull(Exception):
    """The tenant already has ``max_queued_per_tenant`` jobs waiting."""

    def __init__(self, tenant: str, limit: int) -> None:
        super().__init__(f"tenant {tenant!r} already has {limit} jobs waiting for the gateway's tokenizer")
        self.tenant, self.limit = tenant, limit


@dataclass(slots=True)
class _Job:
    tenant: str
    call: Callable[[], Any]
    done: asyncio.Future[Any]


@dataclass
class FairExecutor:
    max_queued_per_tenant: int = 64  # 0: no bound
    thread_name: str = "gateway-fair"
    _waiting: dict[str, collections.deque[_Job]] = field(default_factory=dict)
    _served: dict[str, int] = field(default_factory=dict)  # the turn each tenant's latest job started in
    _turn: int = 0
    _busy: bool = False
    _thread: concurrent.futures.ThreadPoolExecutor | None = None

    def waiting(self, tenant: str) -> int:
        """Jobs of ``tenant`` not yet started."""
        queue = self._waiting.get(tenant)
        return 0 if queue is None else len(queue)

    async def run(self, tenant: str, call: Callable[[], _T]) -> _T:
        """``call()`` on the worker thread in ``tenant``'s turn; cancelling the caller drops a job not yet started."""
        queue = self._waiting.setdefault(tenant, collections.deque())
        if self.max_queued_per_tenant and len(queue) >= self.max_queued_per_tenant:
            raise TenantQueueFull(tenant, self.max_queued_per_tenant)
        job = _Job(tenant, call, asyncio.get_running_loop().create_future())
        queue.append(job)
        self._start_next()
        result: _T = await job.done  # cancelling this cancels job.done: _start_next skips it
        return result

    def _start_next(self) -> None:
        while not self._busy and self._waiting:
            tenant = min(self._waiting, key=lambda t: self._served.get(t, -1))  # least recently served
            queue = self._waiting[tenant]
            job = queue.popleft()
            if not queue:
                del self._waiting[tenant]
            if job.done.cancelled():
                self._forget_if_idle(tenant)
                continue
            self._served[tenant], self._turn = self._turn, self._turn + 1
            if self._thread is None:
                self._thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=self.thread_name)
            self._busy = True
            running = asyncio.get_running_loop().run_in_executor(self._thread, job.call)
            running.add_done_callback(lambda f, job=job: self._finished(f, job))  # type: ignore[misc]

    def _finished(self, running: asyncio.Future[Any], job: _Job) -> None:
        self._busy = False
        if not job.done.cancelled():
            if running.cancelled():
                job.done.cancel()
            elif (exc := running.exception()) is not None:
                job.done.set_exception(exc)
            else:
                job.done.set_result(running.result())
        self._forget_if_idle(job.tenant)
        self._start_next()

    def _forget_if_idle(self, tenant: str) -> None:
        """A tenant with nothing waiting and nothing running leaves the turn order (the table stays bounded)."""
        if tenant not in self._waiting and not self._busy:
            self._served.pop(tenant, None)

    def close(self) -> None:
        if self._thread is not None:
            self._thread.shutdown(wait=False, cancel_futures=True)

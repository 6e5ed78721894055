"""Compute scheduling: one compute thread; FIFO per adapter; round-robin across tenants, then across adapters.

A request's payload is fully received and validated before it is queued, so a slow client never holds
the compute thread. Fair share is by tenant (the adapter name's first segment, ownership.py tenant_of; names
without one share the lane ""): a ring of tenants with ready work, and inside each tenant a ring of its
adapters. One job (or one part of a run_parts job) per turn, after which the tenant goes to the back of the
tenant ring and the adapter to the back of its tenant's ring: a tenant with 40 busy adapters gets one turn for
each turn of a tenant with one, and inside a tenant no adapter starves another.

Admission (admission.py) bounds the jobs one tenant has waiting here: the handler takes a ticket before it
converts its payload, and the ticket is given back when the job leaves the scheduler (done, failed, skipped).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from prometheus_client import Counter

from opentinker.trainer_server.admission import Ticket, claim_ticket
from opentinker.trainer_server.ownership import tenant_of

T = TypeVar("T")

CANCELLED_JOBS = Counter(
    "opentinker_trainer_cancelled_jobs",
    "Jobs whose client gave up (deadline, cancel): skipped while queued, or undone after running",
    ["stage"],
)


def lane_of(adapter: str) -> str:
    """The tenant whose turn an adapter's jobs take: its name's first segment, "" for names without one."""
    return tenant_of(adapter) or ""


@dataclass(slots=True)
class _Job:
    fn: Callable[[], Any]
    future: asyncio.Future[Any]
    undo: Callable[[Any], None] | None
    rest: list[Callable[[], Any]] = field(default_factory=list)  # parts still to run after fn (run_parts)
    done: list[Any] | None = None  # results of the parts run so far (run_parts only)
    ticket: Ticket | None = None  # the admission place it holds until it leaves the scheduler


class AdapterScheduler:
    def __init__(self) -> None:
        self._queues: dict[str, collections.deque[_Job]] = {}  # per adapter; present iff it has queued jobs
        self._lanes: dict[str, collections.deque[str]] = {}  # per tenant: its adapters with queued jobs, in turn
        self._ring: collections.deque[str] = collections.deque()  # tenants with queued jobs, in turn
        self._wakeup = asyncio.Event()
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="trainer-compute")
        self._task: asyncio.Task[None] | None = None
        self.completed = 0
        self.running = 0  # jobs on the compute thread now (0 or 1)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._dispatch())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
        self._executor.shutdown(wait=True)

    @property
    def queued(self) -> int:
        return sum(len(q) for q in self._queues.values())

    async def run(self, adapter: str, fn: Callable[[], T], undo: Callable[[T], None] | None = None) -> T:
        """Queue fn behind the adapter's earlier requests; returns its result (or raises its error).

        A job whose caller gave up while it was queued never runs; one that finished after its caller gave up
        is reverted by undo(result) before the next job starts, so an unacknowledged request leaves no trace.
        """
        future: asyncio.Future[T] = asyncio.get_running_loop().create_future()
        self._enqueue(adapter, _Job(fn, future, undo, ticket=claim_ticket()))
        return await future

    async def run_parts(
        self, adapter: str, parts: Sequence[Callable[[], T]], undo: Callable[[list[T]], None] | None = None
    ) -> list[T]:
        """Like run, for a request in parts: one part per turn (other tenants' and adapters' jobs run between
        them), and none of this adapter's later requests starts before the last part. A request whose caller
        gave up, or whose part failed, is reverted by undo(results of the parts that ran)."""
        future: asyncio.Future[list[T]] = asyncio.get_running_loop().create_future()
        self._enqueue(adapter, _Job(parts[0], future, undo, rest=list(parts[1:]), done=[], ticket=claim_ticket()))
        return await future

    def _enqueue(self, adapter: str, job: _Job, *, first: bool = False) -> None:
        """Adds a job to its adapter's queue (first: the next part of a job, ahead of the adapter's later
        requests); an adapter that had none joins the back of its tenant's ring, a tenant that had none the
        back of the tenant ring."""
        queue = self._queues.get(adapter)
        if queue is None:
            queue = self._queues[adapter] = collections.deque()
            tenant = lane_of(adapter)
            lane = self._lanes.get(tenant)
            if lane is None:
                lane = self._lanes[tenant] = collections.deque()
                self._ring.append(tenant)
            lane.append(adapter)
        if first:
            queue.appendleft(job)
        else:
            queue.append(job)
        self._wakeup.set()

    def _next(self) -> tuple[str, _Job]:
        """The job whose turn it is; its adapter and tenant go to the back of their rings if they have more."""
        tenant = self._ring.popleft()
        lane = self._lanes[tenant]
        adapter = lane.popleft()
        queue = self._queues[adapter]
        job = queue.popleft()
        if queue:
            lane.append(adapter)
        else:
            del self._queues[adapter]
        if lane:
            self._ring.append(tenant)
        else:
            del self._lanes[tenant]
        return adapter, job

    async def _dispatch(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self._wakeup.wait()
            self._wakeup.clear()
            while self._ring:
                adapter, job = self._next()
                if job.future.cancelled():  # the client gave up while queued: skip the work
                    if job.done and job.undo is not None:  # between parts: revert the parts that ran
                        await loop.run_in_executor(self._executor, job.undo, job.done)
                    CANCELLED_JOBS.labels("undone" if job.done else "queued").inc()
                    _leave(job)
                    continue
                self.running = 1
                try:
                    result = await loop.run_in_executor(self._executor, job.fn)
                except Exception as exc:
                    if job.done and job.undo is not None:
                        await loop.run_in_executor(self._executor, job.undo, job.done)
                    if not job.future.cancelled():
                        job.future.set_exception(exc)
                else:
                    if job.done is not None:  # a job in parts
                        job.done.append(result)
                        result = job.done
                        if job.rest and not job.future.cancelled():
                            job.fn = job.rest.pop(0)
                            self._enqueue(adapter, job, first=True)
                            continue  # (the finally below runs: running back to 0)
                    if not job.future.cancelled():
                        job.future.set_result(result)
                    elif job.undo is not None:
                        await loop.run_in_executor(self._executor, job.undo, result)
                        CANCELLED_JOBS.labels("undone").inc()
                finally:
                    self.running = 0
                self.completed += 1
                _leave(job)


def _leave(job: _Job) -> None:
    """The job is out of the scheduler: its admission place is free once its handler is done too."""
    if job.ticket is not None:
        job.ticket.release()
        job.ticket = None

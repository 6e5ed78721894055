"""Compute scheduling: one compute thread; FIFO per adapter; round-robin across adapters.

A request's payload is fully received and validated before it is queued, so a slow client never holds
the compute thread, and an adapter with a long queue cannot starve the others: after each job its adapter
goes to the back of the ready ring.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from prometheus_client import Counter

T = TypeVar("T")

CANCELLED_JOBS = Counter(
    "opentinker_trainer_cancelled_jobs",
    "Jobs whose client gave up (deadline, cancel): skipped while queued, or undone after running",
    ["stage"],
)


@dataclass(slots=True)
class _Job:
    fn: Callable[[], Any]
    future: asyncio.Future[Any]
    undo: Callable[[Any], None] | None
    rest: list[Callable[[], Any]] = field(default_factory=list)  # parts still to run after fn (run_parts)
    done: list[Any] | None = None  # results of the parts run so far (run_parts only)


class AdapterScheduler:
    def __init__(self) -> None:
        self._queues: dict[str, collections.deque[_Job]] = {}
        self._ring: collections.deque[str] = collections.deque()
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
        queue = self._queues.setdefault(adapter, collections.deque())
        queue.append(_Job(fn, future, undo))
        if len(queue) == 1:
            self._ring.append(adapter)
        self._wakeup.set()
        return await future

    async def run_parts(
        self, adapter: str, parts: Sequence[Callable[[], T]], undo: Callable[[list[T]], None] | None = None
    ) -> list[T]:
        """Like run, for a request in parts: one part per turn of the adapter's lane, other adapters' jobs run
        between them, and none of this adapter's later requests starts before the last part. A request whose
        caller gave up, or whose part failed, is reverted by undo(results of the parts that ran)."""
        future: asyncio.Future[list[T]] = asyncio.get_running_loop().create_future()
        queue = self._queues.setdefault(adapter, collections.deque())
        queue.append(_Job(parts[0], future, undo, rest=list(parts[1:]), done=[]))
        if len(queue) == 1:
            self._ring.append(adapter)
        self._wakeup.set()
        return await future

    def _again(self, adapter: str, job: _Job) -> None:
        """The next part of a job: first in its adapter's queue, its adapter at the back of the ring."""
        queue = self._queues.setdefault(adapter, collections.deque())
        queue.appendleft(job)
        if adapter not in self._ring:
            self._ring.append(adapter)

    async def _dispatch(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self._wakeup.wait()
            self._wakeup.clear()
            while self._ring:
                adapter = self._ring.popleft()
                queue = self._queues[adapter]
                job = queue.popleft()
                if queue:
                    self._ring.append(adapter)
                else:
                    del self._queues[adapter]
                if job.future.cancelled():  # the client gave up while queued: skip the work
                    if job.done and job.undo is not None:  # between parts: revert the parts that ran
                        await loop.run_in_executor(self._executor, job.undo, job.done)
                    CANCELLED_JOBS.labels("undone" if job.done else "queued").inc()
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
                            self._again(adapter, job)
                            continue  # (the finally below runs: running back to 0)
                    if not job.future.cancelled():
                        job.future.set_result(result)
                    elif job.undo is not None:
                        await loop.run_in_executor(self._executor, job.undo, result)
                        CANCELLED_JOBS.labels("undone").inc()
                finally:
                    self.running = 0
                self.completed += 1

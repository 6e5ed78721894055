"""The future store: every accepted request gets a request id the SDK long-polls with ``retrieve_future``.

A future ends with a JSON result, a protobuf result (ForwardBackwardOutput, SampleResponse) or a failure.
``wait`` holds a poll open until the future ends or ``poll_seconds`` pass (then the SDK gets
``try_again`` and asks again). Finished futures stay retrievable for ``ttl_seconds``, and within
``max_tenant_result_bytes`` per tenant (see results.py): beyond it the tenant's oldest results are dropped, and
retrieving a dropped one answers 404 RESULT_DROPPED.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from opentinker.client.errors import OpenTinkerError
from opentinker.gateway.errors import GatewayError, RequestFailed, from_backend, not_found
from opentinker.gateway.tinker.results import ResultLedger

log = logging.getLogger(__name__)

Json = dict[str, object]
RESULT_OVERHEAD_BYTES = 1024  # a finished future and its bookkeeping: ~1.2 KiB measured (tracemalloc), counted as 1 KiB


@dataclass(frozen=True, slots=True)
class Outcome:
    """A finished request: exactly one of ``json``, ``proto`` or ``failure``."""

    json: Json | None = None
    proto: bytes | None = None
    failure: RequestFailed | None = None


Job = Callable[[], Awaitable[Outcome]]


@dataclass(slots=True)
class Future:
    request_id: str
    tenant: str
    done: asyncio.Event = field(default_factory=asyncio.Event)
    outcome: Outcome | None = None
    finished_at: float = 0.0
    on_finish: Callable[[], None] | None = None

    def finish(self, outcome: Outcome) -> None:
        if self.outcome is None:
            self.outcome = outcome
            self.finished_at = time.monotonic()
            self.done.set()
            if self.on_finish is not None:
                self.on_finish()
                self.on_finish = None


def result_size(outcome: Outcome) -> int:
    """The bytes a finished result holds: its body (a JSON result as its encoding's length) plus what each held
    future costs, so that many tiny results count too."""
    if outcome.proto is not None:
        body = len(outcome.proto)
    elif outcome.json is not None:
        body = len(json.dumps(outcome.json, default=str))
    else:
        body = len(outcome.failure.message) if outcome.failure is not None else 0
    return body + RESULT_OVERHEAD_BYTES


async def run_job(job: Job) -> Outcome:
    """Runs ``job``; any error becomes a failed outcome (a bug is logged with an incident id, never sent)."""
    try:
        return await job()
    except RequestFailed as exc:
        return Outcome(failure=exc)
    except GatewayError as exc:
        return Outcome(failure=RequestFailed(exc.message))
    except OpenTinkerError as exc:
        return Outcome(failure=from_backend(exc))
    except Exception:
        incident = uuid.uuid4().hex[:12]
        log.exception("request failed unexpectedly (incident %s)", incident)
        return Outcome(failure=RequestFailed(f"internal gateway error (incident {incident})", "server"))


class FutureStore:
    def __init__(
        self,
        *,
        poll_seconds: float = 20.0,
        ttl_seconds: float = 3600.0,
        max_inflight: int | None = None,
        max_result_bytes: int | None = None,
    ) -> None:
        self.poll_seconds = poll_seconds
        self.ttl_seconds = ttl_seconds
        self.max_inflight = max_inflight  # unfinished requests per tenant
        self.results = ResultLedger(max_result_bytes)  # finished ones per tenant, in bytes
        self._futures: dict[str, Future] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._inflight: Counter[str] = Counter()

    def create(self, tenant: str) -> Future:
        """A new future of ``tenant``; 429 TOO_MANY_REQUESTS (which the SDK retries after a backoff) while the
        tenant has ``max_inflight`` unfinished ones."""
        if self.max_inflight is not None and self._inflight[tenant] >= self.max_inflight:
            raise GatewayError(
                429, "TOO_MANY_REQUESTS", f"tenant {tenant} has {self.max_inflight} unfinished requests", retry=True
            )
        self._inflight[tenant] += 1
        future = Future(request_id=uuid.uuid4().hex, tenant=tenant)
        future.on_finish = lambda: self._finished(future)
        self._futures[future.request_id] = future
        return future

    def _release(self, tenant: str) -> None:
        self._inflight[tenant] -= 1
        if self._inflight[tenant] <= 0:
            del self._inflight[tenant]

    def _finished(self, future: Future) -> None:
        self._release(future.tenant)
        assert future.outcome is not None
        for request_id in self.results.add(future.tenant, future.request_id, result_size(future.outcome)):
            self._futures.pop(request_id, None)  # the tenant's oldest results, beyond --max-tenant-result-bytes

    def discard(self, future: Future) -> None:
        """Forgets a future whose request was refused before it was queued (it holds no result)."""
        if future.outcome is None:
            future.on_finish = lambda: self._release(future.tenant)
        future.finish(Outcome(failure=RequestFailed("the request was refused")))
        self._futures.pop(future.request_id, None)

    def inflight(self, tenant: str) -> int:
        return self._inflight[tenant]

    def start(self, future: Future, job: Job) -> None:
        """Runs ``job`` in the background; its outcome ends ``future``."""

        async def run() -> None:
            future.finish(await run_job(job))

        task = asyncio.get_running_loop().create_task(run())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def get(self, request_id: str, tenant: str) -> Future:
        future = self._futures.get(request_id)
        if future is None or future.tenant != tenant:  # another tenant's id reads as unknown
            if self.results.was_dropped(tenant, request_id):
                raise self.results.dropped_error(tenant, request_id)
            raise not_found(f"unknown request_id {request_id!r}", "UNKNOWN_REQUEST")
        return future

    async def wait(self, request_id: str, tenant: str) -> Future:
        """The future once finished, or still pending after ``poll_seconds``."""
        future = self.get(request_id, tenant)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(future.done.wait(), self.poll_seconds)
        if future.outcome is not None:
            self.results.retrieved(tenant, request_id)
        return future

    def prune(self) -> None:
        """Forgets futures finished more than ``ttl_seconds`` ago (the gateway's sweep calls it)."""
        cutoff = time.monotonic() - self.ttl_seconds
        expired = [rid for rid, f in self._futures.items() if f.outcome is not None and f.finished_at < cutoff]
        for rid in expired:
            self.results.forget(self._futures.pop(rid).tenant, rid)

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

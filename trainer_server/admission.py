"""Per-tenant bound on the compute jobs waiting in the trainer (--max-queued-per-tenant).

Every queued ForwardBackward/Forward holds its converted batch (up to --max-message-mb on the wire, more as
tensors) until its turn: without a bound, one tenant can queue requests until the trainer runs out of memory, and
its queue is what the fair-share scheduler has to work through. A handler marked @queued takes a place for its
tenant before it converts anything; the place is given back when both the handler is done and the job it queued
has left the scheduler (a job whose client gave up stays counted until the scheduler drops it, so cancelling and
re-sending does not get around the bound). Admins (and a server without tokens) are not counted.
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import functools
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, Protocol, TypeVar

from opentinker.rpc.serving.auth import Principal, current_principal
from opentinker.rpc.serving.errors import ResourceExhausted

DEFAULT_MAX_QUEUED_PER_TENANT = 64

R = TypeVar("R")


class Ticket:
    """One admission place: held by the handler and, once claimed, by the job the handler queued."""

    def __init__(self, give_back: Callable[[], None]) -> None:
        self._give_back = give_back
        self._holders = 1  # the handler
        self.claimed = False

    def hold(self) -> None:
        self._holders += 1

    def release(self) -> None:
        self._holders -= 1
        if self._holders == 0:
            self._give_back()


_current: contextvars.ContextVar[Ticket | None] = contextvars.ContextVar("opentinker_trainer_ticket", default=None)


def claim_ticket() -> Ticket | None:
    """The current handler's place, for the first job it queues (later ones, e.g. SaveSnapshot's bookkeeping
    after the publish, finish a request already admitted and take none)."""
    ticket = _current.get()
    if ticket is None or ticket.claimed:
        return None
    ticket.claimed = True
    ticket.hold()
    return ticket


class QueueAdmission:
    def __init__(self, max_queued_per_tenant: int) -> None:
        self.max_queued = max_queued_per_tenant  # 0: no limit
        self._held: collections.Counter[str] = collections.Counter()  # places taken, per tenant

    def held(self, tenant: str) -> int:
        return self._held[tenant]

    @contextlib.contextmanager
    def admit(self, principal: Principal) -> Iterator[None]:
        """Takes one of the tenant's places for the request being handled; RESOURCE_EXHAUSTED TOO_MANY_REQUESTS
        when none is left."""
        tenant = principal.tenant
        if tenant is None or principal.is_admin or self.max_queued <= 0:
            yield
            return
        held = self._held[tenant]
        if held >= self.max_queued:
            raise ResourceExhausted(
                f"tenant {tenant!r} has {held} requests queued or running on this trainer's compute thread, its "
                f"limit (--max-queued-per-tenant {self.max_queued}): wait for some to finish before sending more",
                reason="TOO_MANY_REQUESTS",
                tenant=tenant,
            )
        self._held[tenant] += 1
        ticket = Ticket(functools.partial(self._give_back, tenant))
        token = _current.set(ticket)
        try:
            yield
        finally:
            _current.reset(token)
            ticket.release()

    def _give_back(self, tenant: str) -> None:
        self._held[tenant] -= 1
        if not self._held[tenant]:
            del self._held[tenant]


class _Admitting(Protocol):
    admission: QueueAdmission


S = TypeVar("S", bound=_Admitting)


def queued(handler: Callable[[S, Any, Any], Awaitable[R]]) -> Callable[[S, Any, Any], Awaitable[R]]:
    """Marks a handler whose request queues a compute job: admitted (or refused) before its body runs."""

    @functools.wraps(handler)
    async def admitted(self: S, request: Any, context: Any) -> R:
        with self.admission.admit(current_principal()):
            return await handler(self, request, context)

    return admitted

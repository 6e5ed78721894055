"""The registry's bounds per request and quotas per tenant (each a `registry serve` flag)."""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass

from opentinker.rpc.auth import Principal
from opentinker.rpc.errors import ResourceExhausted


@dataclass(frozen=True, slots=True)
class RegistryLimits:
    max_watches_per_tenant: int = 16
    max_artifact_bytes: int = 8 << 30


class WatchSlots:
    """Open WatchEvents streams per tenant. Admins (the servers' service tokens, the operators) and the
    auth-off local principal are not counted: the samplers' follow streams must never be refused."""

    def __init__(self, per_tenant: int) -> None:
        self.per_tenant = per_tenant
        self.open: Counter[str] = Counter()

    @contextlib.contextmanager
    def hold(self, principal: Principal) -> Iterator[None]:
        tenant = principal.tenant
        if tenant is None or principal.is_admin:
            yield
            return
        if self.open[tenant] >= self.per_tenant:
            raise ResourceExhausted(
                f"tenant {tenant!r} already has {self.open[tenant]} open watches (limit {self.per_tenant})",
                reason="TOO_MANY_WATCHES",
                limit=self.per_tenant,
            )
        self.open[tenant] += 1
        try:
            yield
        finally:
            self.open[tenant] -= 1
            if not self.open[tenant]:
                del self.open[tenant]

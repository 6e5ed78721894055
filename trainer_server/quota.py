"""Per-tenant quotas of the trainer: how many adapters one tenant may hold in it.

Each adapter holds its LoRA weights, gradients and AdamW moments in this process (and on its device): without a
bound, one tenant creating rank-1024 adapters in a loop takes the memory every other tenant trains in. Admins
(and a server without tokens) are not counted against any quota.
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Iterable, Iterator

from opentinker.rpc.auth import Principal
from opentinker.rpc.errors import ResourceExhausted

DEFAULT_MAX_ADAPTERS_PER_TENANT = 64


class TenantQuota:
    def __init__(self, max_adapters: int) -> None:
        self.max_adapters = max_adapters  # 0: no limit
        self._creating: collections.Counter[str] = collections.Counter()  # creations in flight, per tenant

    @contextlib.contextmanager
    def reserve(self, principal: Principal, adapters: Iterable[str]) -> Iterator[None]:
        """Holds one of the tenant's places while its CreateAdapter runs (concurrent creations count too);
        RESOURCE_EXHAUSTED TENANT_QUOTA when none is left."""
        tenant = principal.tenant
        if tenant is None or principal.is_admin or self.max_adapters <= 0:
            yield
            return
        held = sum(1 for name in adapters if name.startswith(tenant + "/")) + self._creating[tenant]
        if held >= self.max_adapters:
            raise ResourceExhausted(
                f"tenant {tenant!r} holds {held} adapters in this trainer, its quota "
                f"(--max-adapters-per-tenant {self.max_adapters}): delete one (DeleteAdapter) first",
                reason="TENANT_QUOTA", tenant=tenant,
            )  # fmt: skip
        self._creating[tenant] += 1
        try:
            yield
        finally:
            self._creating[tenant] -= 1
            if not self._creating[tenant]:
                del self._creating[tenant]

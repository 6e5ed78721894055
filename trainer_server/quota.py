"""Per-tenant quotas of the trainer: how many adapters one tenant may hold in it, and how much LoRA memory.

Each adapter holds its LoRA weights, gradients and AdamW moments in this process (and on its device): without a
bound, one tenant creating rank-1024 adapters in a loop takes the memory every other tenant trains in. The
adapter count alone does not bound it (64 rank-512 adapters of a big model are many GiB), so a creation is also
weighed, from its LoRA config and the base model's module shapes, before anything is allocated. Admins (and a
server without tokens) are not counted against any quota.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Protocol

from opentinker.rpc.serving.auth import Principal
from opentinker.rpc.serving.errors import ResourceExhausted
from opentinker.trainer_server.base_model import ModuleShape

DEFAULT_MAX_ADAPTERS_PER_TENANT = 64
DEFAULT_MAX_TENANT_MEMORY_MB = 16384
# LoRA tensors are float32 whatever the base model's dtype (adapter.py new_adapter), and each parameter has four
# copies of that size: the weight, its gradient and AdamW's two moments.
PARAM_BYTES = 4
COPIES_PER_PARAM = 4
MiB = 1 << 20


def lora_parameters(rank: int, shapes: Iterable[ModuleShape]) -> int:
    """Parameters of a rank-`rank` adapter over these modules: A [r, d_in] and B [d_out, r] each."""
    return sum(rank * (shape.d_in + shape.d_out) for shape in shapes)


def lora_bytes(num_parameters: int) -> int:
    """What an adapter of that many parameters holds: weights + gradients + AdamW's two moments."""
    return COPIES_PER_PARAM * num_parameters * PARAM_BYTES


class HeldAdapter(Protocol):
    @property
    def num_parameters(self) -> int: ...


@dataclass(frozen=True, slots=True)
class _Creation:
    tenant: str
    name: str
    num_parameters: int


class TenantQuota:
    def __init__(self, max_adapters: int, max_memory_mb: int = DEFAULT_MAX_TENANT_MEMORY_MB) -> None:
        self.max_adapters = max_adapters  # 0: no limit
        self.max_memory_mb = max_memory_mb  # 0: no limit
        self._creating: list[_Creation] = []  # creations in flight (their adapter may already be in the trainer)

    def held_bytes(self, tenant: str, adapters: Mapping[str, HeldAdapter]) -> int:
        """The LoRA memory the tenant's adapters hold in this trainer, creations in flight included."""
        creating = [c for c in self._creating if c.tenant == tenant]
        names = {c.name for c in creating}
        held = sum(state.num_parameters for name, state in adapters.items() if _owned(tenant, name, names))
        return lora_bytes(held + sum(c.num_parameters for c in creating))

    @contextlib.contextmanager
    def reserve(
        self, principal: Principal, name: str, adapters: Mapping[str, HeldAdapter], num_parameters: int
    ) -> Iterator[None]:
        """Holds one of the tenant's places, and the new adapter's memory, while its CreateAdapter runs
        (concurrent creations count too); RESOURCE_EXHAUSTED TENANT_QUOTA when either is used up."""
        tenant = principal.tenant
        if tenant is None or principal.is_admin:
            yield
            return
        creating = [c for c in self._creating if c.tenant == tenant]
        names = {c.name for c in creating}
        count = sum(1 for n in adapters if _owned(tenant, n, names)) + len(creating)
        if self.max_adapters > 0 and count >= self.max_adapters:
            raise ResourceExhausted(
                f"tenant {tenant!r} holds {count} adapters in this trainer, its quota "
                f"(--max-adapters-per-tenant {self.max_adapters}): delete one (DeleteAdapter) first",
                reason="TENANT_QUOTA",
                tenant=tenant,
            )
        held, requested = self.held_bytes(tenant, adapters), lora_bytes(num_parameters)
        if self.max_memory_mb > 0 and held + requested > self.max_memory_mb * MiB:
            raise ResourceExhausted(
                f"tenant {tenant!r} holds {held / MiB:.1f} MiB of LoRA weights, gradients and AdamW moments in "
                f"this trainer and this adapter needs {requested / MiB:.1f} MiB more, over its quota "
                f"(--max-tenant-memory-mb {self.max_memory_mb}): delete adapters or use a lower rank",
                reason="TENANT_QUOTA",
                tenant=tenant,
            )
        creation = _Creation(tenant, name, num_parameters)
        self._creating.append(creation)
        try:
            yield
        finally:
            self._creating.remove(creation)


def _owned(tenant: str, name: str, creating: set[str]) -> bool:
    """An adapter of the tenant's, not counted among its creations in flight."""
    return name.startswith(tenant + "/") and name not in creating

"""The registry's bounds per request and quotas per tenant (each a `registry serve` flag)."""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from opentinker.rpc.serving.auth import Principal
from opentinker.rpc.serving.errors import InvalidArgument, ResourceExhausted


@dataclass(frozen=True, slots=True)
class RegistryLimits:
    max_watches_per_tenant: int = 16
    max_artifact_bytes: int = 8 << 30
    max_description_bytes: int = 4096
    max_labels: int = 32
    max_label_bytes: int = 256  # each key and each value
    max_page_bytes: int = 8 << 20  # a listing page ends early past this: far below the 64 MiB receive cap
    max_artifact_files: int = 64
    tenant_storage_quota_bytes: int = 20 << 30  # 0: no quota
    upload_grace_s: float = 3600.0  # unpublished uploads older than this are collected (0: never)


def check_metadata(limits: RegistryLimits, description: str, labels: Mapping[str, str]) -> None:
    """Descriptions and labels are stored in every adapter record and sent in every listing: bounded."""
    size = len(description.encode())
    if size > limits.max_description_bytes:
        raise InvalidArgument(
            f"description of {size} bytes is longer than {limits.max_description_bytes}",
            reason="DESCRIPTION_TOO_LONG",
            limit=limits.max_description_bytes,
        )
    if len(labels) > limits.max_labels:
        raise InvalidArgument(
            f"{len(labels)} labels are more than {limits.max_labels}", reason="TOO_MANY_LABELS", limit=limits.max_labels
        )
    for key, value in labels.items():
        if not key or len(key.encode()) > limits.max_label_bytes or len(value.encode()) > limits.max_label_bytes:
            raise InvalidArgument(
                f"label {key[:64]!r}: keys must be non-empty, keys and values at most {limits.max_label_bytes} bytes",
                reason="LABEL_TOO_LONG",
                limit=limits.max_label_bytes,
            )


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

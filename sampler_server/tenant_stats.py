"""What each tenant's own requests did on this sampler, for GetStats: a tenant's caller sees its own figures,
an admin (or a sampler without tokens) the sampler's. Updated on the event loop only (the Sample handler).
Also whose share of the batch a request uses (`batch_tenant`)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from opentinker.rpc.serving.auth import Principal

RATE_WINDOW = 5.0  # seconds of recent tokens that decode_tokens_per_second averages over


def tokens_per_second(recent: list[tuple[float, int]], window: float = RATE_WINDOW) -> float:
    """Tokens per second over the (monotonic time, tokens) points of the last `window` seconds."""
    now = time.monotonic()
    points = [(t, n) for t, n in recent if now - t <= window]
    if len(points) < 2:
        return 0.0
    return sum(n for _, n in points[1:]) / max(points[-1][0] - points[0][0], 1e-9)


def batch_tenant(principal: Principal, model: str) -> str:
    """The tenant whose share of the batch a Sample uses: a user's own tenant; for an admin (or any caller of a
    sampler without tokens) the tenant that owns the adapter, its name's first segment ("team-a/x@3" ->
    "team-a"), so an operator's run on team-a's adapter competes as team-a's; the base model: ""."""
    if principal.tenant is not None and not principal.is_admin:
        return principal.tenant
    owner, slash, _ = model.partition("/")
    return owner if slash else ""


_RECENT = 256  # (time, tokens) points kept per tenant


@dataclass(slots=True)
class TenantActivity:
    waiting: int = 0  # samples admitted that have not streamed a token yet
    running: int = 0  # samples streaming
    tokens_generated: int = 0
    recent: list[tuple[float, int]] = field(default_factory=list)  # (monotonic time, tokens) of recent messages
    # Its samples' prompt tokens by where their K/V came from (prefix cache, a prefill forward, another sample)
    prompt_tokens_cached: int = 0
    prompt_tokens_computed: int = 0
    prompt_tokens_shared: int = 0

    def add_prompt_sources(self, before: tuple[int, int, int], now: tuple[int, int, int]) -> None:
        """Adds what a sample's (cached, computed, shared) counts gained since `before`."""
        self.prompt_tokens_cached += now[0] - before[0]
        self.prompt_tokens_computed += now[1] - before[1]
        self.prompt_tokens_shared += now[2] - before[2]

    def add_tokens(self, count: int) -> None:
        if count:
            self.tokens_generated += count
            self.recent = [*self.recent[-(_RECENT - 1) :], (time.monotonic(), count)]

    def tokens_per_second(self) -> float:
        return tokens_per_second(self.recent)


class TenantStats:
    def __init__(self) -> None:
        self._tenants: dict[str, TenantActivity] = {}

    def all(self) -> list[TenantActivity]:
        return list(self._tenants.values())

    def of(self, tenant: str) -> TenantActivity:
        activity = self._tenants.get(tenant)
        if activity is None:
            activity = self._tenants[tenant] = TenantActivity()
        return activity

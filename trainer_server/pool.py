"""The trainer's side of the trainer pool: which of its adapters the registry placed on it, under which epoch,
and until when it may train them without hearing from the registry again.

A lease is renewed by every beat whose answer lists the adapter at its epoch, until the beat's send time plus
LEASE_FRACTION of the replica lease: the registry moves an adapter away only after the replica lease ran out
there, which is measured from when the beat arrived, so this side's lease always ends first. A beat whose
answer no longer lists an adapter revokes it (another trainer took it over while this one was unheard of, e.g.
stopped); so does a move of our own. Revoked adapters are refused with FAILED_PRECONDITION NOT_OWNER naming the
new owner; an adapter whose lease ran out is checked with one beat before it trains again (a process woken
from SIGSTOP finds out there that it was replaced). Adapters created without a placement are not fenced.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Final

from opentinker.rpc.serving.errors import FailedPrecondition, Unavailable
from opentinker.v1 import registry_pb2

LEASE_FRACTION: Final = 0.8  # of the replica lease: room for the clocks' rates and the beat's travel


@dataclass(slots=True)
class Lease:
    epoch: int
    valid_until: float  # time.monotonic()
    owner: str = ""  # once revoked: the new owner's address ("?" until known)
    moving: bool = False  # MoveAdapter under way: new calls wait for it to end (UNAVAILABLE, retried)
    granted_at: float = 0.0  # a beat sent before this cannot know of the placement: it revokes nothing


def not_owner(adapter: str, owner: str) -> FailedPrecondition:
    where = f"trainer {owner}" if owner and owner != "?" else "another trainer"
    return FailedPrecondition(
        f"adapter {adapter!r} is now owned by {where}; this trainer no longer trains it (the SDK follows on its own)",
        reason="NOT_OWNER",
        adapter=adapter,
        owner=owner if owner != "?" else "",
    )


def unconfirmed(adapter: str) -> Unavailable:
    return Unavailable(
        f"this trainer's lease on adapter {adapter!r} ran out and the registry could not be reached to renew it; "
        "retry shortly",
        reason="OWNERSHIP_UNCONFIRMED",
        adapter=adapter,
    )


class PoolLeases:
    def __init__(self, lease_s: float) -> None:
        self.lease_s = lease_s
        self.leases: dict[str, Lease] = {}

    def epoch(self, adapter: str) -> int:
        """The adapter's epoch here; 0 for one that is not a pool adapter (not fenced)."""
        lease = self.leases.get(adapter)
        return lease.epoch if lease is not None and not lease.owner else 0

    def grant(self, adapter: str, epoch: int) -> None:
        """A lease that has yet to be renewed by a beat (the first call beats at once)."""
        self.leases[adapter] = Lease(epoch, 0.0, granted_at=time.monotonic())

    def forget(self, adapter: str) -> None:
        self.leases.pop(adapter, None)

    def revoke(self, adapter: str, owner: str) -> None:
        if (lease := self.leases.get(adapter)) is not None:
            lease.owner, lease.moving = owner or "?", False

    def on_beat(self, placements: Iterable[registry_pb2.Placement], sent_at: float) -> list[str]:
        """Renews what the registry still places here; returns the adapters that were taken away."""
        held = {p.adapter: p.epoch for p in placements}
        lost = []
        for adapter, lease in self.leases.items():
            if lease.owner or lease.granted_at >= sent_at:
                continue
            if held.get(adapter) == lease.epoch:
                lease.valid_until = max(lease.valid_until, sent_at + self.lease_s * LEASE_FRACTION)
            else:
                lease.owner = "?"
                lost.append(adapter)
        return lost

    def state(self, adapter: str, now: float | None = None) -> str:
        """ "free" (not a pool adapter), "owned", "expired", "moving" or "revoked"."""
        lease = self.leases.get(adapter)
        if lease is None:
            return "free"
        if lease.owner:
            return "revoked"
        if lease.moving:
            return "moving"
        return "owned" if (time.monotonic() if now is None else now) < lease.valid_until else "expired"

    def check(self, adapter: str) -> int:
        """On the compute lane, right before the work: the epoch it runs under, or the refusal."""
        match self.state(adapter):
            case "free":
                return 0
            case "owned":
                return self.leases[adapter].epoch
            case "revoked":
                raise not_owner(adapter, self.leases[adapter].owner)
            case "moving":
                raise Unavailable(f"adapter {adapter!r} is moving to another trainer; retry", reason="ADAPTER_MOVING")
            case _:
                raise unconfirmed(adapter)

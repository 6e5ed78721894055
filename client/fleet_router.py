"""Which sampler replica takes a request: rendezvous (highest-random-weight) hashing of the adapter over the
serving replicas of its base, with bounded load. Written once here for the SDK, the gateway and `opentinker
sample`; docs/fleet.md gives the same rule precisely, so a service in another language routes alike.

- score(adapter, replica) = the first 8 bytes, big-endian, of SHA-256(adapter + "\\n" + replica address).
  An adapter's replicas in descending score are its hash order: one adapter's traffic goes to its first
  replica (one load, warm prefix cache), and only that adapter moves when a replica joins or leaves.
- bounded load (consistent hashing with bounded loads): with n candidate replicas and L requests in flight
  from this router, a replica holding ceil((1 + eps) * (L + 1) / n) or more is skipped; the first in hash
  order below the bound takes the request. A hot adapter spills to its next replicas, and no replica holds
  more than (1 + eps) times the average plus one.
- base-model requests (no adapter) go to the least loaded replica: fewest in flight from this router, then
  fewest waiting sequences as the replica last reported, then address.

Only replicas that are SERVING (not draining) and whose base fingerprint is the request's are candidates.
"""

from __future__ import annotations

import hashlib
import math
import threading
from collections import Counter
from collections.abc import Collection, Iterator, Sequence
from contextlib import contextmanager
from typing import Final

from opentinker.client.fleet_types import Replica

DEFAULT_EPS: Final = 0.25


def score(adapter: str, address: str) -> int:
    """The rendezvous weight of ``address`` for ``adapter`` (an unsigned 64-bit integer)."""
    digest = hashlib.sha256(f"{adapter}\n{address}".encode()).digest()
    return int.from_bytes(digest[:8], "big")


def hash_order(adapter: str, replicas: Sequence[Replica]) -> list[Replica]:
    """``replicas`` by descending score for ``adapter`` (ties, 2^-64 likely, by address)."""
    return sorted(replicas, key=lambda r: (-score(adapter, r.address), r.address))


def candidates(replicas: Sequence[Replica], base_fingerprint: str) -> list[Replica]:
    """The serving sampler replicas of one base ("" accepts every base: a caller that does not know it)."""
    return [
        r
        for r in replicas
        if r.role == "sampler" and r.serving and (not base_fingerprint or r.base_fingerprint == base_fingerprint)
    ]


def load_bound(in_flight_total: int, replicas: int, eps: float) -> int:
    """Requests in flight a replica may hold before it is skipped, counting the one being placed."""
    return math.ceil((1 + eps) * (in_flight_total + 1) / max(replicas, 1))


class FleetRouter:
    """Orders replicas for each request and counts this router's requests in flight per replica. Thread-safe.
    ``route`` gives the whole order: the first is where to send, the rest are where to retry or continue."""

    def __init__(self, eps: float = DEFAULT_EPS) -> None:
        if not eps > 0:
            raise ValueError("eps must be positive")
        self.eps = eps
        # Re-entrant: `placed` routes (which reads the counts) and counts under one hold.
        self._lock = threading.RLock()
        self._in_flight: Counter[str] = Counter()

    def route(
        self, adapter: str | None, replicas: Sequence[Replica], base_fingerprint: str = "", skip: Collection[str] = ()
    ) -> list[Replica]:
        """Every candidate but those in ``skip`` (addresses), best first: for an adapter the first in hash order
        under the load bound, then the rest in hash order; for the base model, least loaded first."""
        pool = [r for r in candidates(replicas, base_fingerprint) if r.address not in skip]
        with self._lock:
            in_flight = dict(self._in_flight)
        if not adapter:
            return sorted(pool, key=lambda r: (in_flight.get(r.address, 0), r.load.waiting_sequences, r.address))
        ordered = hash_order(adapter, pool)
        bound = load_bound(sum(in_flight.get(r.address, 0) for r in pool), len(pool), self.eps)
        for index, replica in enumerate(ordered):
            if in_flight.get(replica.address, 0) < bound:
                return [replica, *ordered[:index], *ordered[index + 1 :]]
        return ordered  # unreachable: the bound always leaves room somewhere

    @contextmanager
    def placed(
        self, adapter: str | None, replicas: Sequence[Replica], base_fingerprint: str = "", skip: Collection[str] = ()
    ) -> Iterator[Replica | None]:
        """The replica that takes one request (None: no candidate), counted in flight for the block. Chosen and
        counted under one lock, so requests placed at the same moment see each other and the bound holds."""
        with self._lock:
            order = self.route(adapter, replicas, base_fingerprint, skip)
            if not order:
                chosen = None
            else:
                chosen = order[0]
                self._in_flight[chosen.address] += 1
        try:
            yield chosen
        finally:
            if chosen is not None:
                self._release(chosen.address)

    def _release(self, address: str) -> None:
        with self._lock:
            self._in_flight[address] -= 1
            if self._in_flight[address] <= 0:
                del self._in_flight[address]

    def in_flight(self) -> dict[str, int]:
        with self._lock:
            return dict(self._in_flight)

"""The bytes of finished results each tenant holds for ``retrieve_future``, within ``--max-tenant-result-bytes``.

A result stays retrievable for an hour after its request finished (the SDK may ask again after a lost answer).
A tenant that never retrieves its results (or retrieves only some) would otherwise hold an hour of them; beyond
the bound its own oldest results are dropped: first those already retrieved once, then the oldest not retrieved
yet; the newest result is always kept. Dropping rather than refusing new requests keeps a tenant's live work
running (a refusal would stop every new request of a client that merely forgot old futures, until they expire);
the results dropped are the ones least likely to be asked for. Retrieving a dropped result answers 404
``RESULT_DROPPED`` naming the flag: the SDK raises it at once (it would resend the whole request on a 410).
Another tenant's results are never touched.
"""

from __future__ import annotations

from collections import Counter, OrderedDict

from opentinker.gateway.errors import GatewayError

MAX_DROPPED_IDS = 4096  # dropped request ids remembered per tenant (older ones then read as unknown)


class ResultLedger:
    """Per tenant: the finished results held (request id -> bytes, oldest first) and the ids dropped."""

    def __init__(self, max_bytes: int | None) -> None:
        self.max_bytes = max_bytes  # None: no bound
        self._unretrieved: dict[str, OrderedDict[str, int]] = {}
        self._retrieved: dict[str, OrderedDict[str, int]] = {}
        self._bytes: Counter[str] = Counter()
        self._dropped: dict[str, OrderedDict[str, None]] = {}
        self.dropped_total: Counter[str] = Counter()  # results dropped per tenant, since start

    def held(self, tenant: str) -> int:
        return self._bytes[tenant]

    def add(self, tenant: str, request_id: str, size: int) -> list[str]:
        """Records a finished result; the request ids of the tenant's results dropped to stay within the bound."""
        self._unretrieved.setdefault(tenant, OrderedDict())[request_id] = size
        self._bytes[tenant] += size
        dropped: list[str] = []
        while self.max_bytes is not None and self._bytes[tenant] > self.max_bytes:
            victim = self._oldest(tenant, keep=request_id)
            if victim is None:
                break
            self.forget(tenant, victim)
            self._remember_dropped(tenant, victim)
            dropped.append(victim)
        return dropped

    def _oldest(self, tenant: str, keep: str) -> str | None:
        for held in (self._retrieved.get(tenant), self._unretrieved.get(tenant)):
            for request_id in held or ():
                if request_id != keep:
                    return request_id
        return None

    def _remember_dropped(self, tenant: str, request_id: str) -> None:
        ids = self._dropped.setdefault(tenant, OrderedDict())
        ids[request_id] = None
        if len(ids) > MAX_DROPPED_IDS:
            ids.popitem(last=False)
        self.dropped_total[tenant] += 1

    def retrieved(self, tenant: str, request_id: str) -> None:
        """A result was answered once: it is among the first to go when the tenant is over its bound."""
        size = self._unretrieved.get(tenant, OrderedDict()).pop(request_id, None)
        if size is not None:
            self._retrieved.setdefault(tenant, OrderedDict())[request_id] = size

    def forget(self, tenant: str, request_id: str) -> None:
        """The result is gone (expired, or its request was refused): its bytes no longer count."""
        for table in (self._unretrieved, self._retrieved):
            held = table.get(tenant)
            size = held.pop(request_id, None) if held is not None else None
            if size is not None:
                self._bytes[tenant] -= size
                if not held:
                    del table[tenant]
        if self._bytes[tenant] <= 0:
            del self._bytes[tenant]

    def was_dropped(self, tenant: str, request_id: str) -> bool:
        return request_id in self._dropped.get(tenant, ())

    def dropped_error(self, tenant: str, request_id: str) -> GatewayError:
        return GatewayError(
            404,
            "RESULT_DROPPED",
            f"the result of request {request_id} was dropped: tenant {tenant} held more than {self.max_bytes} bytes "
            "of finished results not yet expired; retrieve results as they finish, or raise "
            "--max-tenant-result-bytes",
        )

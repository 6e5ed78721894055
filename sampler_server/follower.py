"""Hot reload: follow the registry's event stream and keep the versions this sampler serves current.

The follower holds the alias map the sampler *serves*: an alias flips to a new version only after that
version is loaded into a slot and verified, so a request never waits on, or gets, a half-loaded version.
Requests already running keep the version they pinned at admission; the old version's slot is freed when
its last request ends. A version that fails to load is logged, counted and retried with backoff (not when
it is refused for what it is: FAILED_PRECONDITION), and the alias keeps serving the previous version meanwhile.

Which adapters are followed (preloaded on every alias move): those matching `--follow` patterns and those
with traffic in the last `--follow-window` seconds. For the others the follower only forgets stale
mappings, and their requests resolve through the registry (loading on demand).

The stream is resumed from the last event id after any disconnect (with backoff); a "reconcile" message, or
a fresh start, rebuilds the map from the registry's full alias snapshot.
"""

from __future__ import annotations

import asyncio
import collections
import fnmatch
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import grpc
from prometheus_client import Counter, Histogram

from opentinker.rpc.serving.errors import ServiceError
from opentinker.rpc.serving.registry_link import Metadata, registry_error
from opentinker.sampler_server.adapters import AdapterLoader
from opentinker.v1 import registry_pb2, registry_pb2_grpc, sampler_pb2
from opentinker.weights.names import LATEST

log = logging.getLogger("opentinker.sampler.follower")

RELOAD_SECONDS = Histogram(
    "opentinker_sampler_reload_seconds",
    "Registry event (publish or alias move) to the new version being served",
    buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
)
RELOADS = Counter("opentinker_sampler_reloads_total", "Hot reloads by result", ["result"])
# Why loads failed (e.g. DATA_LOSS/DIGEST_MISMATCH for a corrupt artifact), so operators can alert on it.
RELOAD_FAILURES = Counter(
    "opentinker_sampler_reload_failures_total", "Hot reloads that failed, by status code and reason", ["code", "reason"]
)


@dataclass(frozen=True, slots=True)
class _Target:
    adapter: str
    alias: str
    version: int
    event_time: float | None  # seconds since the epoch; None for snapshot-driven loads


class AliasFollower:
    def __init__(
        self,
        registry: registry_pb2_grpc.RegistryServiceStub,
        loader: AdapterLoader,
        *,
        follow: Sequence[str] = (),
        follow_window: float = 300.0,
        metadata: Metadata = None,
        max_backoff: float = 5.0,
        max_attempts: int = 8,
    ) -> None:
        self.registry = registry
        self.loader = loader
        self.follow = list(follow)
        self.follow_window = follow_window
        self.metadata = metadata
        self.max_backoff = max_backoff
        self.max_attempts = max_attempts
        self.served: dict[str, dict[str, int]] = {}  # adapter -> alias -> version served now
        self.wanted: dict[str, dict[str, int]] = {}  # adapter -> alias -> version the registry says
        self.serving: dict[str, str] = {}  # adapter -> the alias its bare name resolves to (absent: latest)
        self.last_event_id = ""
        self.traffic: dict[str, float] = {}  # adapter -> monotonic time of its last request
        self.recent: collections.deque[sampler_pb2.ReloadRecord] = collections.deque(maxlen=256)
        self.reloads_total = 0  # hot reloads served (GetStats.reloads_total)
        self.reloads_by_adapter: collections.Counter[str] = collections.Counter()  # a tenant's GetStats sums its own
        self._tasks: dict[tuple[str, str], asyncio.Task[None]] = {}
        self._runner: asyncio.Task[None] | None = None

    # Queries from the request path

    def note_traffic(self, adapter: str) -> None:
        self.traffic[adapter] = time.monotonic()

    def followed(self, adapter: str) -> bool:
        if any(fnmatch.fnmatchcase(adapter, pattern) for pattern in self.follow):
            return True
        seen = self.traffic.get(adapter)
        return seen is not None and time.monotonic() - seen <= self.follow_window

    def adopt(self, adapter: str, alias: str, version: int) -> None:
        """A request resolved alias -> version through the registry: serve that mapping from now on, if it is
        still what the event stream says (an older answer must not overwrite a newer event)."""
        if self.wanted.get(adapter, {}).get(alias) == version:
            self.served.setdefault(adapter, {})[alias] = version

    def served_version(self, adapter: str, alias: str) -> int | None:
        return self.served.get(adapter, {}).get(alias)

    def serving_alias(self, adapter: str) -> str | None:
        """The alias a bare name of `adapter` serves, as the event stream says; None: this sampler has not
        seen the adapter (resolve through the registry, which knows)."""
        if adapter not in self.wanted:
            return None
        return self.serving.get(adapter, LATEST)

    def serving_aliases(self, adapter: str, version: int) -> list[str]:
        return sorted(a for a, v in self.served.get(adapter, {}).items() if v == version)

    # The stream

    def start(self) -> None:
        self._runner = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        tasks = [t for t in [self._runner, *self._tasks.values()] if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _run(self) -> None:
        backoff = 0.1
        while True:
            request = registry_pb2.WatchEventsRequest(
                after_event_id=self.last_event_id, send_snapshot=not self.last_event_id
            )
            try:
                async for message in self.registry.WatchEvents(request, metadata=self.metadata):
                    backoff = 0.1
                    if message.HasField("reconcile"):
                        self._reconcile(message.reconcile)
                    else:
                        self._event(message.event)
            except grpc.aio.AioRpcError as exc:
                log.warning("registry watch interrupted (%s); resuming after %s", exc.code().name, self.last_event_id)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, self.max_backoff)

    def _reconcile(self, reconcile: registry_pb2.Reconcile) -> None:
        snapshot = {entry.adapter: dict(entry.aliases) for entry in reconcile.adapters}
        for adapter in set(self.wanted) - set(snapshot):
            self._apply(adapter, {}, None)
        for entry in reconcile.adapters:
            self._serve(entry.adapter, entry.serving_alias)
        for adapter, aliases in snapshot.items():
            self._apply(adapter, aliases, None)
        self.last_event_id = reconcile.event_id

    def _event(self, event: registry_pb2.Event) -> None:
        # Events carry the adapter's whole alias map and serving alias, so applying one is idempotent.
        self._serve(event.adapter, event.serving_alias)
        self._apply(event.adapter, dict(event.aliases), event.time.ToNanoseconds() / 1e9)
        self.last_event_id = event.event_id

    def _serve(self, adapter: str, alias: str) -> None:
        if alias and alias != LATEST:
            self.serving[adapter] = alias
        else:
            self.serving.pop(adapter, None)

    def _apply(self, adapter: str, aliases: dict[str, int], event_time: float | None) -> None:
        self.wanted[adapter] = aliases
        served = self.served.setdefault(adapter, {})
        for alias in [a for a in served if a not in aliases]:
            del served[alias]  # the alias is gone: requests must resolve through the registry again
        followed = self.followed(adapter)
        for alias, version in aliases.items():
            if served.get(alias) == version:
                continue
            if not followed:
                served.pop(alias, None)  # stale: the next request resolves through the registry
                continue
            key = (adapter, alias)
            if key not in self._tasks or self._tasks[key].done():
                target = _Target(adapter, alias, version, event_time)
                self._tasks[key] = asyncio.get_running_loop().create_task(self._reload(target))
        if not aliases:
            self.served.pop(adapter, None)
            self.serving.pop(adapter, None)

    async def _reload(self, target: _Target) -> None:
        """Load the wanted version, then flip the alias; retry with backoff until loaded or superseded."""
        backoff = 0.2
        for _attempt in range(self.max_attempts):
            version = self.wanted.get(target.adapter, {}).get(target.alias)
            if version is None or self.served.get(target.adapter, {}).get(target.alias) == version:
                return
            if version != target.version:  # a newer move arrived while we worked: chase that one instead
                target = _Target(target.adapter, target.alias, version, target.event_time)
            try:
                resolved = await self.loader.resolve(f"{target.adapter}@{target.version}")
                slot = await self.loader.acquire(resolved)
                self.loader.pool.release(slot)  # loaded and verified; requests take their own references
            except (ServiceError, grpc.aio.AioRpcError) as exc:
                error = exc if isinstance(exc, ServiceError) else registry_error(exc)
                self._record(target, ok=False, error=f"{error.code.name}: {error.message}")
                RELOAD_FAILURES.labels(error.code.name, error.reason).inc()
                log.warning(
                    "loading %s@%s failed (%s); still serving the previous version",
                    target.adapter,
                    target.version,
                    error.message,
                )
                if error.code == grpc.StatusCode.FAILED_PRECONDITION:
                    return  # refused for what the version is (out of range, incompatible): no retry will load it
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, self.max_backoff)
                continue
            if self.wanted.get(target.adapter, {}).get(target.alias) != target.version:
                continue  # superseded while loading
            served = self.served.setdefault(target.adapter, {})
            previous = served.get(target.alias)
            served[target.alias] = target.version  # the flip: new requests get the new version from now on
            self._record(target, ok=True, previous=previous or 0)
            if previous and previous not in served.values():
                # Freed now if idle, else when its last running request ends.
                self.loader.pool.unload((target.adapter, previous))
            return
        log.error("giving up on %s@%s until the registry moves %s again", target.adapter, target.version, target.alias)

    def _record(self, target: _Target, *, ok: bool, previous: int = 0, error: str = "") -> None:
        now = time.time()
        latency = now - target.event_time if target.event_time else 0.0
        record = sampler_pb2.ReloadRecord(
            adapter=target.adapter,
            alias=target.alias,
            from_version=previous,
            to_version=target.version,
            latency_seconds=latency,
            ok=ok,
            error=error,
        )
        record.time.FromNanoseconds(int(now * 1e9))
        self.recent.append(record)
        if ok:
            self.reloads_total += 1
            self.reloads_by_adapter[target.adapter] += 1
            RELOADS.labels("ok").inc()
            if target.event_time:
                RELOAD_SECONDS.observe(latency)
        else:
            RELOADS.labels("failed").inc()

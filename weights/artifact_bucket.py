"""A trainer's or sampler's view of a bucket: it pushes the artifacts it writes and pulls the ones it reads
straight from the store (the registry moves no bytes), through a verified local cache bounded in bytes.

Keys: versions' snapshots under ``<prefix>/sha256/<digest>/...`` (artifact_remote.py), the trainer's saved
states under ``<prefix>/states/sha256/<digest>/...``. States have their own key space because no version
names most of them: the registry's collection of unpublished uploads scans ``sha256/`` only, and must never
see a state a client will resume from.

The cache is an ArtifactStore, so every read of a cached copy verifies it against its digest, and a pull of
what is cached verifies it first (a damaged copy is dropped and fetched again, never served). The least
recently used entries are deleted once the cache holds more than ``max_bytes``, and an evicted artifact is
simply pulled again. Entries used in the last ``HOLD_S`` seconds
are never evicted: a pull is followed by a read in another thread, and evicting between the two would turn a
full cache into a failed load. The cache may therefore exceed its bound by what was used that recently.
Recency survives restarts as the entry directory's mtime.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final, Literal, TypeVar

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from opentinker.rpc.serving.errors import DataLoss, InvalidArgument, NotFound, ServiceError
from opentinker.weights.artifact_fs import tree_bytes
from opentinker.weights.artifact_manifest import format_uri, parse_uri
from opentinker.weights.artifact_remote import Pushed, delete_remote, pull, push
from opentinker.weights.artifact_store import ArtifactStore
from opentinker.weights.object_store import ObjectStore, credential_env, parse_store_url

HOLD_S: Final = 60.0
STORE_HEALTH: Final = "opentinker.store"  # the store's name in a trainer's or sampler's health service
PROBE_KEY: Final = "opentinker-health-probe"  # HEAD-ed by Bucket.healthy; need not exist
STORE_THREADS: Final = 8  # store calls at once; each file's ranged reads add their own (object_store.PARALLEL)
Kind = Literal["snapshot", "state"]
_R = TypeVar("_R")


@dataclass
class BucketStats:
    """What /metrics and health detail report about the bucket."""

    bytes_pulled: int = 0
    bytes_pushed: int = 0
    pulls: int = 0
    pushes: int = 0
    evictions: int = 0
    failures: int = 0  # calls that failed on the store (unreachable, refused, corrupt)
    last_error: str = ""  # "" once a call succeeded after it
    last_error_at: float = 0.0
    cached_bytes: int = 0
    by_reason: dict[str, int] = field(default_factory=dict)


class Bucket:
    """Thread-safe: pulls and pushes run in worker threads, several at once."""

    def __init__(self, remote: ObjectStore, cache: ArtifactStore, max_bytes: int = 0) -> None:
        self.remote = remote
        self.states = remote.child("states")
        self.cache = cache
        self.max_bytes = max_bytes  # 0: unbounded
        self.stats = BucketStats()
        self._lock = threading.Lock()
        self._executor = ThreadPoolExecutor(STORE_THREADS, thread_name_prefix="store")
        self._entries: OrderedDict[str, tuple[int, float]] = OrderedDict()  # digest -> (bytes, last use)
        for digest, size, used in _scan(cache.root):
            self._entries[digest] = (size, used)
        self.stats.cached_bytes = sum(size for size, _ in self._entries.values())

    def describe(self) -> str:
        return self.remote.describe()

    async def run(self, fn: Callable[..., _R], *args: object) -> _R:
        """``fn`` (a pull, push or delete) on the bucket's own threads: a slow or hung store ties up only these,
        never the default executor that every other handler's file and registry work shares."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, functools.partial(fn, *args))

    def pull(self, uri: str, kind: Kind = "snapshot", *, guess: Sequence[str] = (), size_hint: int = 0) -> int:
        """Makes ``uri`` present in the cache (fetching and verifying it if absent); returns the bytes fetched.
        A cached copy is verified first: a damaged one is dropped and fetched again rather than refused.
        ``guess`` and ``size_hint``: the files expected and the artifact's size (see artifact_remote.pull)."""
        if self.cache.exists(uri):
            try:
                self.cache.ref(uri)
            except DataLoss:
                self.cache.delete(uri)
        fetched = self._call(lambda: pull(self._remote(kind), self.cache, uri, guess=guess, size_hint=size_hint))
        with self._lock:
            self.stats.pulls += 1 if fetched else 0
            self.stats.bytes_pulled += fetched
        self._used(uri)
        return fetched

    async def healthy(self) -> bool:
        """For the health service (``opentinker.store``): False while the last call to the store failed. A store
        marked down is asked again (a HEAD of a key that need not exist), so it is seen back without waiting
        for the next load; one that is up costs nothing."""
        if self.stats.last_error:
            with contextlib.suppress(ServiceError):
                await self.run(self._call, lambda: self.remote.head(PROBE_KEY))
        return not self.stats.last_error

    def push(self, uri: str, kind: Kind = "snapshot") -> Pushed:
        """Uploads a cached artifact (what is already in the bucket is not sent again)."""
        pushed = self._call(lambda: push(self.cache, self._remote(kind), uri))
        with self._lock:
            self.stats.pushes += 1
            self.stats.bytes_pushed += pushed.bytes_sent
        self._used(uri)
        return pushed

    def delete(self, uri: str, kind: Kind = "state") -> int:
        """Removes the artifact from the bucket and the cache (the trainer's DeleteState); returns bucket bytes."""
        removed = self._call(lambda: delete_remote(self._remote(kind), uri))
        self.cache.delete(uri)
        with self._lock:
            self._entries.pop(parse_uri(uri), None)
        return removed

    def _remote(self, kind: Kind) -> ObjectStore:
        return self.states if kind == "state" else self.remote

    def _call(self, fn: Callable[[], _R]) -> _R:
        try:
            result = fn()
        except NotFound:
            with self._lock:
                self.stats.last_error = ""  # the store answered: what was asked for is not there
            raise
        except ServiceError as error:
            with self._lock:
                self.stats.failures += 1
                self.stats.last_error = error.message
                self.stats.last_error_at = time.time()
                self.stats.by_reason[error.reason] = self.stats.by_reason.get(error.reason, 0) + 1
            raise
        with self._lock:
            self.stats.last_error = ""
        return result

    def _used(self, uri: str) -> None:
        digest = parse_uri(uri)
        directory = self.cache.root / "sha256" / digest
        now = time.time()
        try:
            os.utime(directory, (now, now))
            size = tree_bytes(directory)
        except FileNotFoundError:
            return
        with self._lock:
            self._entries.pop(digest, None)
            self._entries[digest] = (size, now)
            victims = self._victims(now)
        for victim in victims:
            freed = self.cache.delete(format_uri(victim))
            with self._lock:
                self.stats.evictions += 1
                self.stats.cached_bytes -= freed
        with self._lock:
            self.stats.cached_bytes = sum(size for size, _ in self._entries.values())

    def _victims(self, now: float) -> list[str]:
        """Least recently used first, until the rest fits; called with the lock held."""
        if not self.max_bytes:
            return []
        total = sum(size for size, _ in self._entries.values())
        victims: list[str] = []
        for digest, (size, used) in list(self._entries.items()):
            if total <= self.max_bytes:
                break
            if now - used < HOLD_S:
                continue
            victims.append(digest)
            del self._entries[digest]
            total -= size
        return victims


def _scan(root: Path) -> list[tuple[str, int, float]]:
    """(digest, bytes, last use) of every cached artifact, oldest use first."""
    objects = root / "sha256"
    if not objects.is_dir():
        return []
    found = []
    for entry in objects.iterdir():
        if entry.is_dir() and not entry.is_symlink():
            found.append((entry.name, tree_bytes(entry), entry.stat().st_mtime))
    return sorted(found, key=lambda item: item[2])


def open_artifacts(
    store: str, cache_dir: Path | None, cache_max_bytes: int = 0, *, fault_hook: Callable[[str], None] | None = None
) -> tuple[ArtifactStore, Bucket | None]:
    """What ``--store`` names: a folder (the local store itself, no bucket) or a bucket, then read and written
    through a verified cache in ``cache_dir`` (required with a bucket)."""
    location = parse_store_url(store)
    if not location.remote:
        return ArtifactStore(Path(location.prefix), fault_hook=fault_hook), None
    if cache_dir is None:
        raise InvalidArgument(f"--store {location.url} needs --cache-dir: a local folder for verified copies")
    # No fsyncs in the cache: the bucket holds the durable copy, and every read of the cache verifies it.
    cache = ArtifactStore(cache_dir, fault_hook=fault_hook, durable=False)
    return cache, Bucket(ObjectStore(location), cache, cache_max_bytes)


def store_health_checks(bucket: Bucket | None) -> dict[str, Callable[[], Awaitable[bool]]]:
    """The health service's detail for a server with a bucket (rpc.serving.server.report_health); none without."""
    return {} if bucket is None else {STORE_HEALTH: bucket.healthy}


def store_metrics(prefix: str, bucket: Bucket | None) -> Iterator[Metric]:
    """The bucket's figures for a server's /metrics, under ``opentinker_<prefix>_``; nothing without a bucket."""
    if bucket is None:
        return
    stats = bucket.stats
    yield GaugeMetricFamily(
        f"opentinker_{prefix}_store_up", "1 unless the last call to the object store failed", value=not stats.last_error
    )
    failures = CounterMetricFamily(
        f"opentinker_{prefix}_store_failures", "Object-store calls that failed, by reason", labels=["reason"]
    )
    for reason, count in sorted(stats.by_reason.items()):
        failures.add_metric([reason], count)
    yield failures
    moved = CounterMetricFamily(
        f"opentinker_{prefix}_store_bytes",
        "Artifact bytes pulled from or pushed to the object store",
        labels=["direction"],
    )
    moved.add_metric(["pulled"], stats.bytes_pulled)
    moved.add_metric(["pushed"], stats.bytes_pushed)
    yield moved
    yield GaugeMetricFamily(
        f"opentinker_{prefix}_cache_bytes", "Bytes in the verified local cache", value=stats.cached_bytes
    )
    yield CounterMetricFamily(
        f"opentinker_{prefix}_cache_evictions", "Artifacts evicted from the local cache", value=stats.evictions
    )


def store_environment(store: object) -> dict[str, str]:
    """For --print-config: the credential and endpoint variables the store's backend reads, secrets masked."""
    if not isinstance(store, str | Path) or not str(store):
        return {}
    try:
        location = parse_store_url(str(store))
    except InvalidArgument:
        return {}
    return credential_env(location.scheme)

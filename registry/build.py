"""The registry server from its settings: Redis (a private embedded one unless a URL is given), the artifact
store, the servicer, and what `serve_forever` runs. `opentinker registry serve` parses the flags and calls this;
tests and `opentinker up` reach it through that command."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from opentinker.registry.artifact_backend import open_registry_artifacts
from opentinker.registry.data_dir import lock_data_dir
from opentinker.registry.embedded_redis import EmbeddedRedis
from opentinker.registry.limits import RegistryLimits
from opentinker.registry.service import RegistryServicer
from opentinker.registry.store import RegistryStore
from opentinker.rpc.process.dir_lock import DirLock
from opentinker.rpc.serving.server import ServiceBinding
from opentinker.v1 import registry_pb2, registry_pb2_grpc


@dataclass(slots=True)
class RegistryServer:
    binding: ServiceBinding
    store: RegistryStore
    embedded: EmbeddedRedis | None
    servicer: RegistryServicer
    lock: DirLock | None = None  # the data dir's, while the embedded Redis may write there

    async def on_stop(self) -> None:
        """After the server stopped: stop the event reader, close the Redis connections, then the embedded Redis."""
        await self.servicer.events.close()
        await self.servicer.replica_hub.close()
        await self.servicer.sweeper.close()
        await self.store.close()
        self.stop_redis()

    def stop_redis(self) -> None:
        """Stops the embedded Redis (if any), then frees the data dir; safe to call again."""
        if self.embedded is not None:
            self.embedded.stop()
        if self.lock is not None:
            self.lock.release()


def build_registry(
    redis_url: str | None,
    data_dir: Path,
    store: str | Path | None,
    events_maxlen: int,
    limits: RegistryLimits | None = None,
) -> RegistryServer:
    embedded = None
    lock = None
    if redis_url is None:
        # Locked before Redis starts; Redis inherits the descriptor, so the lock lasts until it has exited too.
        lock = lock_data_dir(data_dir)
        try:
            embedded = EmbeddedRedis(data_dir / "redis", keep_fds=(lock.fd,)).start()
        except BaseException:
            lock.release()
            raise
        redis_url = embedded.url
    artifacts = open_registry_artifacts(store, data_dir)
    artifacts.cleanup_temp()
    registry_store = RegistryStore.from_url(redis_url, events_maxlen=events_maxlen)
    servicer = RegistryServicer(registry_store, artifacts, limits)
    binding = ServiceBinding(
        registry_pb2.DESCRIPTOR.services_by_name["RegistryService"].full_name,
        lambda server: registry_pb2_grpc.add_RegistryServiceServicer_to_server(servicer, server),
    )
    return RegistryServer(binding, registry_store, embedded, servicer, lock)

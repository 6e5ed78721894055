"""RegistryService: validate, authorize, then one store call. The store holds the truth.

Artifact files never pass through Redis: they live in the content-addressed ArtifactStore or a bucket
(artifact_backend.py), and a version is only published after every file of its artifact has been checked.
The handlers are grouped by what they serve: adapter_handlers.py, version_handlers.py, alias_handlers.py,
watch_handlers.py, artifact_handlers.py, replica_handlers.py (the fleet), placement_handlers.py (the trainer pool).
"""

from __future__ import annotations

from opentinker.registry.adapter_handlers import AdapterHandlers
from opentinker.registry.alias_handlers import AliasHandlers
from opentinker.registry.artifact_backend import RegistryArtifacts
from opentinker.registry.artifact_handlers import ArtifactHandlers
from opentinker.registry.event_hub import EventHub
from opentinker.registry.limits import RegistryLimits, WatchSlots
from opentinker.registry.placement_handlers import PlacementHandlers
from opentinker.registry.replica_handlers import ReplicaHandlers
from opentinker.registry.replica_hub import ReplicaHub
from opentinker.registry.store import RegistryStore
from opentinker.registry.uploads import UploadSweeper
from opentinker.registry.version_handlers import VersionHandlers
from opentinker.registry.watch_handlers import WatchHandlers


class RegistryServicer(
    AdapterHandlers, VersionHandlers, AliasHandlers, WatchHandlers, ArtifactHandlers, ReplicaHandlers, PlacementHandlers
):
    def __init__(
        self, store: RegistryStore, artifacts: RegistryArtifacts, limits: RegistryLimits | None = None
    ) -> None:
        self.store = store
        self.artifacts = artifacts
        self.limits = limits or RegistryLimits()
        self.max_artifact_bytes = self.limits.max_artifact_bytes
        self.events = EventHub(store)
        self.replica_hub = ReplicaHub(store)
        self.sweeper = UploadSweeper(store, artifacts, self.limits.upload_grace_s)
        self.watches = WatchSlots(self.limits.max_watches_per_tenant)

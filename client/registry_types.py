"""The registry SDK's records: frozen dataclasses, so no protobuf message reaches a caller of RegistryClient
(their wire conversion is in registry_wire)."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime

__all__ = [
    "Adapter",
    "AliasMove",
    "ArtifactInfo",
    "BatchRecord",
    "Event",
    "GarbageCollection",
    "Lineage",
    "Reconcile",
    "ServingAliasMove",
    "Version",
]


@dataclass(frozen=True, slots=True)
class BatchRecord:
    """One training batch that went into a version (what ForwardBackward saw)."""

    digest: str
    trace_ids: tuple[str, ...] = ()
    step: int = 0
    num_datums: int = 0
    num_tokens: int = 0
    loss_fn: str = ""
    # None when the trainer did not record a time.
    time: datetime | None = None


@dataclass(frozen=True, slots=True)
class Lineage:
    """Where a version came from: its parent, cumulative training totals and the batches since the parent."""

    parent_version: int = 0
    trainer_step: int = 0
    tokens_trained: int = 0
    datums_trained: int = 0
    batches: tuple[BatchRecord, ...] = ()
    metrics: dict[str, float] = field(default_factory=dict)
    base_model_digest: str = ""
    parent_adapter: str = ""  # the parent version's adapter when it is another one (a fork); "": this adapter
    state_id: str = ""  # the full state saved with this version (trainer --persist-state)


@dataclass(frozen=True, slots=True)
class Adapter:
    """A registered adapter name with its LoRA shape and current aliases."""

    name: str
    tenant: str
    rank: int
    alpha: float
    target_modules: tuple[str, ...]
    aliases: dict[str, int]
    latest_version: int
    version_count: int
    created_at: datetime
    created_by: str
    labels: dict[str, str]
    description: str
    base_model_digest: str = ""
    dropout: float = 0.0
    # The alias a bare name ("team/agent") resolves to: "latest" unless the operator set another one.
    serving_alias: str = "latest"
    # The ADAPTER_CREATED event's id when create_adapter returned this record (watch_events can resume there).
    event_id: str = field(default="", compare=False)


@dataclass(frozen=True, slots=True)
class Version:
    """One published, immutable version of an adapter."""

    adapter: str
    number: int
    sha256: str
    artifact_uri: str
    size_bytes: int
    created_at: datetime
    aliases: tuple[str, ...]
    published_by: str
    artifact_deleted: bool
    lineage: Lineage
    rank: int
    alpha: float
    # The version's own LoRA shape ("" / empty: all linear modules), which an imported version may set.
    target_modules: tuple[str, ...] = ()
    dropout: float = 0.0

    @property
    def reference(self) -> str:
        """The exact reference of this version, "name@N"."""
        return f"{self.adapter}@{self.number}"


@dataclass(frozen=True, slots=True)
class AliasMove:
    """The outcome of set_alias or rollback. previous_version 0: the alias did not exist."""

    adapter: str
    alias: str
    previous_version: int
    version: int
    event_id: str


@dataclass(frozen=True, slots=True)
class ServingAliasMove:
    """The outcome of set_serving_alias: bare names of ``adapter`` now resolve to ``alias`` (at ``version``;
    0: it points nowhere yet, as latest before the first publish)."""

    adapter: str
    previous_alias: str
    alias: str
    version: int
    event_id: str


@dataclass(frozen=True, slots=True)
class Event:
    """One registry change, carrying absolute state (replaying or repeating one is harmless).

    ``type`` is the EventType name without its prefix: "ADAPTER_CREATED", "ADAPTER_DELETED",
    "VERSION_PUBLISHED", "ALIAS_SET", "ALIAS_DELETED", "ARTIFACT_DELETED" or "SERVING_ALIAS_SET".
    ``serving_alias`` is the adapter's serving alias after the change ("latest" unless set).
    """

    event_id: str
    type: str
    adapter: str
    version: int
    alias: str
    previous_version: int
    aliases: dict[str, int]
    time: datetime
    actor: str
    cause: str
    artifact_sha256: str
    serving_alias: str = "latest"


@dataclass(frozen=True, slots=True)
class Reconcile:
    """A full alias snapshot (adapter -> alias -> version), sent first when asked for or when the
    requested resume point was trimmed. Apply it, then keep reading: events resume after ``event_id``."""

    event_id: str
    aliases: dict[str, dict[str, int]]
    reason: str
    # adapter -> its serving alias, for adapters whose serving alias is not latest.
    serving_aliases: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class GarbageCollection:
    """What garbage collection removed (or would remove, on a dry run): (adapter, version) pairs."""

    collected: tuple[tuple[str, int], ...]
    bytes_freed: int
    # The artifact of each collected version, in the same order.
    artifacts: tuple[ArtifactInfo, ...] = ()


@dataclass(frozen=True, slots=True)
class ArtifactInfo:
    """A committed artifact. size_bytes counts the payload files plus its manifest.json."""

    uri: str
    sha256: str
    size_bytes: int

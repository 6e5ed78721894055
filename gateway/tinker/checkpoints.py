"""``tinker://`` checkpoint paths and what they stand for here.

    tinker://<model_id>/weights/<name>          a trainer saved state (weights + AdamW state + step + RNG)
    tinker://<model_id>/sampler_weights/<name>  an exact registry version "tenant/adapter@N"

The table is kept in the gateway's state store (durable.py: Redis with --redis-url, else memory only). A deleted,
overwritten or expired checkpoint becomes a tombstone (its path free at once) until checkpoint_gc.py has deleted what
it stood for: the trainer's saved state, or the registry version (kept while an alias points to it).
"""

from __future__ import annotations

import re
import time
import uuid
from dataclasses import dataclass, field
from typing import Literal

from google.protobuf.json_format import MessageToDict, ParseDict

from opentinker.gateway.errors import RequestFailed
from opentinker.v1 import common_pb2

Kind = Literal["state", "sampler"]
SEGMENT: dict[Kind, str] = {"state": "weights", "sampler": "sampler_weights"}
KIND_OF_SEGMENT: dict[str, Kind] = {segment: kind for kind, segment in SEGMENT.items()}
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
MAX_TTL_SECONDS = 10 * 365 * 24 * 3600  # as the tinker service: at most 10 years


@dataclass(slots=True)
class Checkpoint:
    path: str
    tenant: str
    kind: Kind
    target: str  # state: "sha256:<digest>" state id; sampler: "tenant/adapter@N"
    lora: common_pb2.LoraConfig
    model_id: str
    created: float = field(default_factory=time.time)  # unix seconds
    expires_at: float | None = None  # unix seconds; None: kept until deleted
    size_bytes: int | None = None
    public: bool = False
    user_metadata: dict[str, str] | None = None
    key: str = ""  # the table key: the path, or a tombstone's own key once deleted
    deleted: bool = False  # a tombstone: hidden, its target deleted by the GC

    def __post_init__(self) -> None:
        self.key = self.key or self.path

    @property
    def name(self) -> str:
        return self.path.rsplit("/", 1)[-1]

    @property
    def checkpoint_id(self) -> str:
        return f"{SEGMENT[self.kind]}/{self.name}"

    def due(self, now: float) -> bool:
        """Its target should go now: deleted, or past its expiry."""
        return self.deleted or (self.expires_at is not None and self.expires_at <= now)

    def to_json(self) -> dict[str, object]:
        return {
            "path": self.path,
            "tenant": self.tenant,
            "kind": self.kind,
            "target": self.target,
            "lora": MessageToDict(self.lora),
            "model_id": self.model_id,
            "created": self.created,
            "expires_at": self.expires_at,
            "size_bytes": self.size_bytes,
            "public": self.public,
            "user_metadata": self.user_metadata,
            "key": self.key,
            "deleted": self.deleted,
        }

    @classmethod
    def from_json(cls, data: dict[str, object]) -> Checkpoint:
        kind = data["kind"]
        assert kind in ("state", "sampler"), kind
        lora, metadata, expires, size = (
            data["lora"],
            data.get("user_metadata"),
            data.get("expires_at"),
            data.get("size_bytes"),
        )
        return cls(
            path=str(data["path"]),
            tenant=str(data["tenant"]),
            kind=kind,
            target=str(data["target"]),
            lora=ParseDict(lora if isinstance(lora, dict) else {}, common_pb2.LoraConfig()),
            model_id=str(data["model_id"]),
            created=float(str(data["created"])),
            expires_at=None if expires is None else float(str(expires)),
            size_bytes=None if size is None else int(str(size)),
            public=bool(data.get("public")),
            user_metadata={str(k): str(v) for k, v in metadata.items()} if isinstance(metadata, dict) else None,
            key=str(data.get("key") or data["path"]),
            deleted=bool(data.get("deleted")),
        )


def checkpoint_path(model_id: str, kind: Kind, name: str) -> str:
    if not _NAME_RE.match(name):
        raise RequestFailed(f"invalid checkpoint name {name!r}: letters, digits, '.', '_', '-' (at most 128)")
    return f"tinker://{model_id}/{SEGMENT[kind]}/{name}"


def expiry(ttl_seconds: object, now: float | None = None) -> float | None:
    """The expiry time of a checkpoint saved or updated with ``ttl_seconds`` (None: never). ValueError for a TTL
    that is not a whole number of seconds between 1 and 10 years."""
    if ttl_seconds is None:
        return None
    if isinstance(ttl_seconds, bool) or not isinstance(ttl_seconds, int) or not 1 <= ttl_seconds <= MAX_TTL_SECONDS:
        raise ValueError(
            f"ttl_seconds must be a whole number of seconds from 1 to {MAX_TTL_SECONDS} (10 years), or null"
        )
    return (time.time() if now is None else now) + ttl_seconds


class CheckpointTable:
    def __init__(self) -> None:
        self._entries: dict[str, Checkpoint] = {}  # by key: live ones by path, tombstones by their own key

    def add(self, checkpoint: Checkpoint) -> None:
        self._entries[checkpoint.key] = checkpoint

    def exists(self, path: str) -> bool:
        return path in self._entries

    def find(self, path: str) -> Checkpoint | None:
        return self._entries.get(path)

    def get(self, path: str, tenant: str) -> Checkpoint:
        if not path.startswith("tinker://"):
            raise RequestFailed(f"checkpoint path must start with tinker://, got {path!r}")
        checkpoint = self._entries.get(path)
        if checkpoint is None or checkpoint.tenant != tenant:  # another tenant's path reads as unknown
            raise RequestFailed(f"unknown checkpoint {path!r}")
        return checkpoint

    def retire(self, path: str) -> Checkpoint | None:
        """Turns the checkpoint at ``path`` into a tombstone (the path is free again); the tombstone, or None."""
        checkpoint = self._entries.pop(path, None)
        if checkpoint is None:
            return None
        checkpoint.deleted, checkpoint.key = True, f"{path}#deleted-{uuid.uuid4().hex[:12]}"
        self._entries[checkpoint.key] = checkpoint
        return checkpoint

    def remove(self, key: str) -> None:
        self._entries.pop(key, None)

    def of_run(self, model_id: str, tenant: str) -> list[Checkpoint]:
        """The live checkpoints of one run, oldest first."""
        found = [c for c in self._entries.values() if c.model_id == model_id and c.tenant == tenant and not c.deleted]
        return sorted(found, key=lambda c: c.created)

    def of_tenant(self, tenant: str) -> list[Checkpoint]:
        """Every live checkpoint of the tenant, newest first."""
        return sorted(
            (c for c in self._entries.values() if c.tenant == tenant and not c.deleted), key=lambda c: -c.created
        )

    def due(self, now: float) -> list[Checkpoint]:
        return [c for c in self._entries.values() if c.due(now)]

    def target_in_use(self, checkpoint: Checkpoint, now: float) -> bool:
        """Whether another checkpoint that is not due stands for the same target (states are content-addressed:
        two saves of identical state share one id)."""
        return any(
            c.target == checkpoint.target and c.key != checkpoint.key and not c.due(now) for c in self._entries.values()
        )

    def __len__(self) -> int:
        return len(self._entries)

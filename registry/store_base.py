"""What every part of the registry store shares: its Redis keys, the mapping of script errors to statuses, the
page tokens, and the client with its registered Lua scripts (registry/scripts.py)."""

from __future__ import annotations

import base64
import binascii
import contextlib
import time
from collections.abc import Iterator, Sequence
from typing import Any

import redis
import redis.asyncio as aioredis
from google.protobuf.timestamp_pb2 import Timestamp

from opentinker.registry import placement_scripts, scripts
from opentinker.rpc.serving.errors import (
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ServiceError,
    Unavailable,
)

EVENTS_KEY = "ot:events"
ADAPTERS_KEY = "ot:adapters"

_ERRORS: dict[str, type[ServiceError]] = {
    "ADAPTER_NOT_FOUND": NotFound,
    "VERSION_NOT_FOUND": NotFound,
    "ALIAS_NOT_FOUND": NotFound,
    "ADAPTER_EXISTS": AlreadyExists,
    "VERSION_CONFLICT": FailedPrecondition,
    "NO_PREVIOUS_VERSION": FailedPrecondition,
    "NOT_OLDER": FailedPrecondition,
    "ARTIFACT_DELETED": FailedPrecondition,
    "ALIAS_SERVING": FailedPrecondition,
    "ARTIFACT_NOT_FOUND": NotFound,
    "ARTIFACT_LEASE_EXPIRED": Unavailable,
    "STALE_EPOCH": FailedPrecondition,
    "PLACEMENT_NOT_FOUND": NotFound,
}


def adapter_key(name: str) -> str:
    return f"ot:adapter:{name}"


def placement_key(adapter: str) -> str:
    return f"ot:placement:{adapter}"


def placements_key(replica_id: str) -> str:
    return f"ot:placements:{replica_id}"


def version_prefix(name: str) -> str:
    return f"ot:version:{name}:"


def refs_key(sha256: str) -> str:
    return f"ot:artifact:{sha256}:refs"


def uploaders_key(sha256: str) -> str:
    return f"ot:artifact:{sha256}:uploaders"


def leases_key(sha256: str) -> str:
    return f"ot:artifact:{sha256}:leases"


TENANT_PREFIX = "ot:tenant:"


def tenant_uploads_key(tenant: str) -> str:
    return f"{TENANT_PREFIX}{tenant}:uploads"


def tenant_reserved_key(tenant: str) -> str:
    return f"{TENANT_PREFIX}{tenant}:reserved"


UPLOADS_KEY = "ot:uploads"
DELETING_KEY = "ot:artifacts:deleting"


def timestamp(ms: int) -> Timestamp:
    stamp = Timestamp()
    stamp.FromMilliseconds(ms)
    return stamp


def now_ms() -> int:
    return int(time.time() * 1000)


@contextlib.contextmanager
def redis_errors() -> Iterator[None]:
    """Script errors -> precise statuses; a lost connection -> UNAVAILABLE (the script did not run)."""
    try:
        yield
    except redis.ResponseError as exc:
        reason, _, message = str(exc).partition(" ")
        error = _ERRORS.get(reason)
        if error is None:
            raise
        raise error(message, reason=reason) from None
    except (redis.ConnectionError, redis.TimeoutError) as exc:
        raise Unavailable(
            "the registry's database is unavailable; retry shortly, and if it persists ask the operator to check "
            "the registry's Redis",
            reason="STORE_UNAVAILABLE",
        ).logged_with(f"Redis: {type(exc).__name__}: {exc}") from None


def encode_token(value: str) -> str:
    return base64.urlsafe_b64encode(value.encode()).decode()


def decode_token(token: str) -> str:
    try:
        return base64.urlsafe_b64decode(token.encode()).decode()
    except (binascii.Error, UnicodeDecodeError, ValueError):
        raise InvalidArgument(f"invalid page token {token!r}", reason="INVALID_PAGE_TOKEN") from None


def check_page_size(requested: int) -> int:
    if requested > 1000:
        raise InvalidArgument("page_size is at most 1000", reason="INVALID_PAGE_SIZE")
    return requested or 100


def text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class StoreBase:
    """The Redis client, its registered scripts, and the one way to run a script."""

    def __init__(self, client: aioredis.Redis, *, events_maxlen: int = 100_000) -> None:
        self.redis = client
        self.events_maxlen = events_maxlen
        self._scripts = {
            name: client.register_script(getattr(scripts, name))
            for name in (
                "CREATE_ADAPTER",
                "DELETE_ADAPTER",
                "PUBLISH_VERSION",
                "SET_ALIAS",
                "DELETE_ALIAS",
                "COLLECT_VERSION",
                "SET_SERVING_ALIAS",
                "CLAIM_UPLOAD",
                "CLAIM_ORPHAN",
                "LEASE_ARTIFACT",
                "RESERVE_QUOTA",
                "RECORD_UPLOAD",
            )
        }
        for name in ("PLACE_ADAPTER", "MOVE_PLACEMENT", "RECORD_PLACEMENT_STATE", "DROP_PLACEMENT"):
            self._scripts[name] = client.register_script(getattr(placement_scripts, name))

    async def _run(self, script: str, keys: Sequence[str], args: Sequence[object]) -> Any:
        with redis_errors():
            return await self._scripts[script](keys=list(keys), args=list(args))  # type: ignore[arg-type]

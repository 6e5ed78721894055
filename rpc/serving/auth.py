"""Bearer-token authentication and tenant authorization.

A tokens file (JSON) maps tokens to a tenant and a role:
    {"tokens": [{"token": "s3cret", "tenant": "team-a", "role": "user"},
                {"token_sha256": "<hex>", "tenant": "ops", "role": "admin"}]}
or the environment: OPENTINKER_TOKENS_FILE=<path>, or OPENTINKER_TOKENS="tok=team-a:user,tok2=ops:admin".
A user of tenant t sees only adapters named "t/..."; the admin role sees everything and alone may delete
other tenants' adapters, roll back other tenants' adapters and collect garbage (a tenant deletes its own).
"""

from __future__ import annotations

import contextvars
import enum
import hashlib
import hmac
import json
import os
from dataclasses import dataclass
from pathlib import Path

from opentinker.rpc.serving.errors import InvalidArgument, PermissionDenied


class Role(enum.StrEnum):
    USER = "user"
    ADMIN = "admin"


@dataclass(frozen=True, slots=True)
class Principal:
    """Who is calling. tenant None means auth is off (loopback only): full access."""

    tenant: str | None
    role: Role

    @property
    def is_admin(self) -> bool:
        return self.role is Role.ADMIN

    @property
    def actor(self) -> str:
        """Name recorded in events and lineage."""
        if self.tenant is None:
            return "local"
        return f"{self.tenant}:{self.role.value}"

    def can_access(self, adapter_name: str) -> bool:
        if self.tenant is None or self.is_admin:
            return True
        return adapter_name.startswith(self.tenant + "/")


LOCAL_PRINCIPAL = Principal(tenant=None, role=Role.ADMIN)

_current: contextvars.ContextVar[Principal] = contextvars.ContextVar("opentinker_principal")


def current_principal() -> Principal:
    """The caller of the RPC being handled (set by the interceptor)."""
    return _current.get(LOCAL_PRINCIPAL)


def set_principal(principal: Principal) -> contextvars.Token[Principal]:
    return _current.set(principal)


def reset_principal(token: contextvars.Token[Principal]) -> None:
    _current.reset(token)


def require_access(adapter_name: str) -> Principal:
    principal = current_principal()
    if not principal.can_access(adapter_name):
        raise PermissionDenied(
            f"tenant {principal.tenant!r} may not access adapter {adapter_name!r}",
            adapter=adapter_name,
        )
    return principal


def require_admin(action: str) -> Principal:
    principal = current_principal()
    if not principal.is_admin:
        raise PermissionDenied(f"{action} requires the admin role", action=action)
    return principal


def _digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


class TokenTable:
    """Token digests -> principals. Tokens are compared by digest in constant time."""

    def __init__(self, entries: dict[str, Principal]) -> None:
        self._by_digest = entries

    def __len__(self) -> int:
        return len(self._by_digest)

    def lookup(self, token: str) -> Principal | None:
        digest = _digest(token)
        found: Principal | None = None
        for known, principal in self._by_digest.items():
            if hmac.compare_digest(known, digest):
                found = principal
        return found

    @classmethod
    def from_file(cls, path: Path) -> TokenTable:
        try:
            document = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise InvalidArgument(f"cannot read tokens file {path}: {exc}") from exc
        entries: dict[str, Principal] = {}
        for item in document.get("tokens", []):
            digest = item.get("token_sha256") or _digest(str(item["token"]))
            entries[digest] = Principal(tenant=str(item["tenant"]), role=Role(item.get("role", "user")))
        return cls(entries)

    @classmethod
    def from_spec(cls, spec: str) -> TokenTable:
        """Parse "token=tenant:role,token2=tenant2" (role defaults to user)."""
        entries: dict[str, Principal] = {}
        for part in filter(None, (p.strip() for p in spec.split(","))):
            token, _, who = part.partition("=")
            tenant, _, role = who.partition(":")
            if not token or not tenant:
                raise InvalidArgument(f"bad token entry {part!r}: expected token=tenant[:role]")
            entries[_digest(token)] = Principal(tenant=tenant, role=Role(role or "user"))
        return cls(entries)

    @classmethod
    def load(cls, path: Path | None) -> TokenTable | None:
        """From the given file, else OPENTINKER_TOKENS_FILE, else OPENTINKER_TOKENS; None if none set."""
        env_file = os.environ.get("OPENTINKER_TOKENS_FILE")
        if path is not None:
            return cls.from_file(path)
        if env_file:
            return cls.from_file(Path(env_file))
        spec = os.environ.get("OPENTINKER_TOKENS")
        if spec:
            return cls.from_spec(spec)
        return None

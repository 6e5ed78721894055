"""Tinker API keys -> OpenTinker tenants and bearer tokens.

The tinker SDK sends its key in the ``X-API-Key`` header and insists it starts with ``tml-``. A keys file
(JSON, like the servers' tokens file) maps each key to the tenant whose adapters it trains and, when the
servers require authentication, the bearer token the gateway presents to them on the key's behalf:

    {"keys": [{"key": "tml-team-a-secret", "tenant": "team-a", "token": "s3cret"},
              {"key_sha256": "<sha256 hex of the key>", "tenant": "team-b"}]}

or the environment: OPENTINKER_GATEWAY_KEYS_FILE=<path>, or
OPENTINKER_GATEWAY_KEYS="tml-a=team-a:token-a,tml-b=team-b" (token optional).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

KEY_PREFIX = "tml-"
_TENANT_RE = re.compile(r"^[a-z0-9][a-z0-9._-]{0,62}$")


class KeysFileError(ValueError):
    """The keys file or variable is malformed; the gateway refuses to start."""


@dataclass(frozen=True, slots=True)
class Principal:
    """The owner of one API key: adapters live under ``tenant/``; ``token`` goes to the servers."""

    tenant: str
    token: str | None


@dataclass(frozen=True, slots=True)
class _Entry:
    key_sha256: str
    principal: Principal


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _entry(raw: object, where: str) -> _Entry:
    if not isinstance(raw, dict):
        raise KeysFileError(f"{where}: each entry must be an object")
    tenant = raw.get("tenant")
    if not isinstance(tenant, str) or not _TENANT_RE.match(tenant):
        raise KeysFileError(f"{where}: tenant must match [a-z0-9][a-z0-9._-]{{0,62}}, got {tenant!r}")
    token = raw.get("token")
    if token is not None and not isinstance(token, str):
        raise KeysFileError(f"{where}: token must be a string")
    key, digest = raw.get("key"), raw.get("key_sha256")
    if isinstance(key, str) and digest is None:
        if not key.startswith(KEY_PREFIX):
            raise KeysFileError(f"{where}: keys must start with {KEY_PREFIX!r} (the tinker SDK refuses others)")
        digest = _sha256(key)
    if not isinstance(digest, str) or not re.fullmatch(r"[0-9a-f]{64}", digest):
        raise KeysFileError(f"{where}: give exactly one of 'key' or 'key_sha256' (64 hex digits)")
    return _Entry(digest, Principal(tenant, token or None))


class KeyStore:
    """Looks keys up by digest in constant time per entry; never keeps plain keys."""

    def __init__(self, entries: list[_Entry]) -> None:
        self._entries = entries

    @classmethod
    def from_file(cls, path: Path) -> KeyStore:
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise KeysFileError(f"cannot read keys file {path}: {exc}") from exc
        keys = data.get("keys") if isinstance(data, dict) else None
        if not isinstance(keys, list):
            raise KeysFileError(f'{path}: expected {{"keys": [...]}}')
        return cls([_entry(raw, f"{path} entry {i}") for i, raw in enumerate(keys)])

    @classmethod
    def from_spec(cls, spec: str) -> KeyStore:
        """``key=tenant[:token],...``"""
        entries = []
        for i, item in enumerate(part.strip() for part in spec.split(",") if part.strip()):
            key, sep, rest = item.partition("=")
            if not sep:
                raise KeysFileError(f"OPENTINKER_GATEWAY_KEYS item {i}: expected key=tenant[:token]")
            tenant, _, token = rest.partition(":")
            entries.append(_entry({"key": key, "tenant": tenant, "token": token or None}, f"item {i}"))
        return cls(entries)

    @classmethod
    def load(cls, path: Path | None) -> KeyStore:
        """From ``path``, else OPENTINKER_GATEWAY_KEYS_FILE, else OPENTINKER_GATEWAY_KEYS; empty if none."""
        env_file = os.environ.get("OPENTINKER_GATEWAY_KEYS_FILE")
        if path is None and env_file:
            path = Path(env_file)
        if path is not None:
            return cls.from_file(path)
        return cls.from_spec(os.environ.get("OPENTINKER_GATEWAY_KEYS", ""))

    def __len__(self) -> int:
        return len(self._entries)

    def principal_of_tenant(self, tenant: str) -> Principal | None:
        """The first key's principal of ``tenant``: the checkpoint GC acts with its token, not the caller's."""
        return next((entry.principal for entry in self._entries if entry.principal.tenant == tenant), None)

    def lookup(self, key: str) -> Principal | None:
        if not key.startswith(KEY_PREFIX):
            return None
        digest = _sha256(key)
        found = None
        for entry in self._entries:
            if hmac.compare_digest(entry.key_sha256, digest):
                found = entry.principal
        return found

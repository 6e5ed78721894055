"""`opentinker up` with a tokens file: the servers' link to the registry needs a service token.

A registry with tokens refuses the trainer and the sampler unless they send an admin token (`registry_token`).
When the config names tokens but no `registry_token`, `up` provisions one: a random admin token for the tenant
`opentinker-up`, written (0600) to WORKDIR/service-token and added by its digest to a copy of the tokens file,
WORKDIR/tokens.json (0600), which the servers of the stack read instead. The token reaches the trainer and the
sampler through their environment, never their command line (which `ps` shows).
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from opentinker.rpc.process.config import ConfigError, env_name, resolve_value

SERVICE_TENANT = "opentinker-up"
TOKEN_FILE = "service-token"
TOKENS_FILE = "tokens.json"


@dataclass(frozen=True, slots=True)
class StackAuth:
    tokens_file: Path  # the copy with the service token, for every server that read the original
    original: Path
    token_file: Path  # WORKDIR/service-token, read by `opentinker status --workdir`
    token: str

    def args(self, service: str, config: dict[str, Any]) -> list[str]:
        own = resolve_value(config, service, "tokens_file")
        if service == "registry" or (own is not None and Path(str(own)).resolve() == self.original):
            return ["--tokens-file", str(self.tokens_file)]
        return []

    def env(self, service: str) -> dict[str, str]:
        return {} if service == "registry" else {env_name(service, "registry_token"): self.token}


def registry_tokens_file(config: dict[str, Any]) -> Path | None:
    value = resolve_value(config, "registry", "tokens_file") or os.environ.get("OPENTINKER_TOKENS_FILE")
    return Path(str(value)).resolve() if value else None


def needs_service_token(config: dict[str, Any], services: list[str]) -> bool:
    """Tokens on the registry of this stack, and a trainer or sampler of it without a registry_token."""
    if "registry" not in services or registry_tokens_file(config) is None:
        return False
    return any(resolve_value(config, s, "registry_token") is None for s in services if s != "registry")


def refuse_unprovisionable(config: dict[str, Any], services: list[str]) -> None:
    """Tokens from OPENTINKER_TOKENS (no file `up` could copy) and a server without a registry_token: every call
    would fail UNAUTHENTICATED, so refuse now, naming the fix."""
    if (
        "registry" not in services
        or registry_tokens_file(config) is not None
        or not os.environ.get("OPENTINKER_TOKENS")
    ):
        return
    missing = [s for s in services if s != "registry" and resolve_value(config, s, "registry_token") is None]
    if missing:
        raise ConfigError(
            f"the registry takes tokens from OPENTINKER_TOKENS but no registry_token is set for the "
            f"{' and the '.join(missing)}: set registry_token (an admin token), or use tokens_file and `up` "
            "provisions one"
        )


def _write_private(path: Path, text: str) -> None:
    # Created 0600 from the start: never readable by others, not even for a moment.
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(text)


def provision(config: dict[str, Any], workdir: Path) -> StackAuth:
    original = registry_tokens_file(config)
    assert original is not None
    try:
        document = json.loads(original.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"tokens file {original} (tokens_file) is not readable JSON: {exc}") from None
    if not isinstance(document, dict) or not isinstance(document.get("tokens"), list):
        raise ConfigError(f'tokens file {original} (tokens_file) must be {{"tokens": [...]}}')
    token = secrets.token_urlsafe(32)
    entry = {"token_sha256": hashlib.sha256(token.encode()).hexdigest(), "tenant": SERVICE_TENANT, "role": "admin"}
    workdir.mkdir(parents=True, exist_ok=True)
    tokens_file = workdir / TOKENS_FILE
    _write_private(tokens_file, json.dumps({**document, "tokens": [*document["tokens"], entry]}, indent=2))
    token_file = workdir / TOKEN_FILE
    _write_private(token_file, token + "\n")
    return StackAuth(tokens_file, original, token_file, token)

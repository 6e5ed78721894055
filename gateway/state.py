"""What both surfaces share, hung off the aiohttp app: API keys, the servers behind the gateway, the flags, the
captured episodes and the worker-thread slots; and the request helpers that read it."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from aiohttp import web

from opentinker.gateway.auth import KeyStore, Principal
from opentinker.gateway.backend import Backend, Backends
from opentinker.gateway.config import GatewayConfig
from opentinker.gateway.episodes import MemoryEpisodes


@dataclass(slots=True)
class Gateway:
    keys: KeyStore
    backends: Backends
    config: GatewayConfig = field(default_factory=GatewayConfig)
    episodes: MemoryEpisodes = field(default_factory=MemoryEpisodes)  # episodes.py: Redis with --redis-url
    decode_slots: asyncio.Semaphore = field(default_factory=lambda: asyncio.Semaphore(2))  # bodies decoded at once
    json_slots: asyncio.Semaphore = field(default_factory=lambda: asyncio.Semaphore(2))  # big JSON bodies parsed


GATEWAY = web.AppKey("gateway", Gateway)


def gateway_of(request: web.Request) -> Gateway:
    return request.app[GATEWAY]


def principal_of(request: web.Request) -> Principal:
    principal = request.get("principal")
    assert isinstance(principal, Principal), "the auth middleware sets the principal"
    return principal


def backend_of(request: web.Request) -> Backend:
    return gateway_of(request).backends.for_token(principal_of(request).token)

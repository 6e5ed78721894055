"""Shared fixtures: private Redis servers, tiny models, server processes (session-scoped where heavy)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from opentinker.registry.embedded_redis import EmbeddedRedis

# Nothing in the test suite may reach a model hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedRedis]:
    """A private Redis on a free port (never the machine's 6379)."""
    server = EmbeddedRedis(tmp_path_factory.mktemp("redis")).start()
    assert server.port != 6379
    yield server
    server.stop()

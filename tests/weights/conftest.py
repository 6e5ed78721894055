"""A fresh store on each backend for a test (the servers, moto and Azurite, are tests/conftest.py's)."""

from __future__ import annotations

from pathlib import Path

import pytest
from storeservers import StoreServer

from opentinker.weights.object_store import ObjectStore, parse_store_url

BACKENDS = ("file", "s3", "az")


@pytest.fixture(params=BACKENDS)
def store(
    request: pytest.FixtureRequest, servers: dict[str, StoreServer], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> ObjectStore:
    """A fresh prefix on one backend, reached through the environment only."""
    backend: str = request.param
    prefix = f"{request.node.module.__name__}/{request.node.name.replace('[', '-').rstrip(']')}"
    if backend == "file":
        return ObjectStore(parse_store_url(str(tmp_path / "store")))
    for name, value in servers[backend].env().items():
        monkeypatch.setenv(name, value)
    return ObjectStore(parse_store_url(servers[backend].url(prefix)), retries=1, retry_budget_s=5)

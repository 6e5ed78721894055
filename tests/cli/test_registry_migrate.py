"""`opentinker registry migrate-store`: every artifact a version uses, copied from the registry's folder store into
a bucket (S3 on moto, Azure on Azurite), verified; a second run copies 0; and a sampler started on the bucket
serves the versions trained before the move."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import grpc
import pytest
from registryutil import unique_name
from samplerutil import greedy, prompt, trained_adapter
from serverproc import ServerProcess, opentinker_command, registry_store, start_sampler
from storeservers import StoreServer
from trainerutil import Trainer

from opentinker.v1 import sampler_pb2_grpc
from opentinker.weights.artifact_remote import check_remote
from opentinker.weights.object_store import ObjectStore, parse_store_url


def migrate(registry: ServerProcess, env: dict[str, str], *args: str) -> dict[str, object]:
    result = subprocess.run(
        opentinker_command("registry", "migrate-store", "--registry", registry.address, "--json", *args),
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **env},
    )
    assert result.returncode == 0, result.stderr
    report: dict[str, object] = json.loads(result.stdout)
    return report


@pytest.mark.parametrize("backend", ["s3", "az"])
def test_migrate_then_serve_from_the_bucket(
    backend: str,
    servers: dict[str, StoreServer],
    registry_server: ServerProcess,
    trainer: Trainer,
    tiny_model: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    name, version = trained_adapter(trainer, seed=700)
    server = servers[backend]
    url = server.url(unique_name("migrated"))
    # --from on one backend (read straight from the folder), through the registry on the other.
    source = ("--from", str(registry_store(registry_server))) if backend == "az" else ()
    first = migrate(registry_server, server.env(), "--to", url, *source)
    assert isinstance(first["copied"], int) and first["copied"] >= 1 and first["restart_with"] == f"--store {url}"
    again = migrate(registry_server, server.env(), "--to", url, *source)
    assert again["copied"] == 0 and again["already_there"] == first["copied"] and again["bytes_sent"] == 0
    for key, value in server.env().items():
        monkeypatch.setenv(key, value)
    check_remote(ObjectStore(parse_store_url(url)), version.artifact_uri)  # whole, manifest and files

    sampler_server = start_sampler(
        tmp_path / "sampler",
        tiny_model,
        registry_server,
        "--store",
        url,
        "--cache-dir",
        str(tmp_path / "cache"),
        env=server.env(),
    )
    try:
        with grpc.insecure_channel(sampler_server.address) as channel:
            tokens = greedy(sampler_pb2_grpc.SamplerServiceStub(channel), f"{name}@1", prompt(700))
        assert len(tokens) == 12
        assert (tmp_path / "cache" / "sha256" / version.artifact_sha256).is_dir()  # pulled from the bucket
    finally:
        assert sampler_server.terminate() == 0, sampler_server.log()

"""`opentinker registry migrate-store`: every artifact a version uses, copied from the registry's folder store into
a bucket (S3 on moto, Azure on Azurite), verified; an artifact damaged in the source is named with its versions,
not copied, and the run exits 1 after copying the rest; a second run copies 0; and a sampler started on the
bucket serves the versions published before the move."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import grpc
import pytest
from registryutil import create_adapter, flip_bit, publish_lora, unique_name
from samplerutil import greedy, prompt
from serverproc import ServerProcess, opentinker_command, registry_store, start_registry, start_sampler
from storeservers import StoreServer

from opentinker.rpc.serving.errors import NotFound
from opentinker.v1 import registry_pb2_grpc, sampler_pb2_grpc
from opentinker.weights.artifact_remote import check_remote
from opentinker.weights.object_store import ObjectStore, parse_store_url

WEIGHTS = "adapter_model.safetensors"


def migrate_run(registry: ServerProcess, env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        opentinker_command("registry", "migrate-store", "--registry", registry.address, *args),
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **env},
    )


def migrate(registry: ServerProcess, env: dict[str, str], *args: str) -> dict[str, Any]:
    """The JSON report of a run that found one damaged artifact (so it exits 1, having copied the rest)."""
    result = migrate_run(registry, env, "--json", *args)
    assert result.returncode == 1 and result.stdout, result.stderr
    report: dict[str, Any] = json.loads(result.stdout)
    return report


@pytest.mark.parametrize("backend", ["s3", "az"])
def test_migrate_then_serve_from_the_bucket(
    backend: str,
    servers: dict[str, StoreServer],
    tiny_model: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A registry of the test's own: migrate-store copies all a registry references, and the shared one holds
    # what other tests damage on purpose.
    registry_server = start_registry(tmp_path / "registry")
    try:
        name, damaged_name = unique_name("migrated"), unique_name("damaged")
        with grpc.insecure_channel(registry_server.address) as channel:
            registry = registry_pb2_grpc.RegistryServiceStub(channel)
            for adapter in (name, damaged_name):
                create_adapter(registry, adapter)
            good = publish_lora(registry, tiny_model, name, seed=700)
            bad = publish_lora(registry, tiny_model, damaged_name, seed=701)
        flip_bit(registry_store(registry_server) / "sha256" / bad.artifact_sha256 / WEIGHTS)

        server = servers[backend]
        url = server.url(unique_name("migrated"))
        # --from on one backend (read straight from the folder), through the registry on the other.
        source = ("--from", str(registry_store(registry_server))) if backend == "az" else ()
        first = migrate(registry_server, server.env(), "--to", url, *source)
        assert first["copied"] == 1 and first["restart_with"] == f"--store {url}", first
        damaged = first["damaged"]
        assert isinstance(damaged, list) and len(damaged) == 1, first
        assert damaged[0]["artifact_uri"] == bad.artifact_uri and damaged[0]["versions"] == [f"{damaged_name}@1"]
        assert WEIGHTS in damaged[0]["error"], damaged

        again = migrate(registry_server, server.env(), "--to", url, *source)
        assert again["copied"] == 0 and again["already_there"] == 1 and again["bytes_sent"] == 0, again
        assert [d["artifact_uri"] for d in again["damaged"]] == [bad.artifact_uri], again
        text = migrate_run(registry_server, server.env(), "--to", url, *source)
        assert text.returncode == 1, text.stderr
        assert f"damaged, not copied: {bad.artifact_uri} (used by {damaged_name}@1)" in text.stdout, text.stdout
        assert f"restart the registry, trainers and samplers with --store {url}" in text.stdout

        for key, value in server.env().items():
            monkeypatch.setenv(key, value)
        bucket = ObjectStore(parse_store_url(url))
        check_remote(bucket, good.artifact_uri)  # whole, manifest and files
        with pytest.raises(NotFound):
            check_remote(bucket, bad.artifact_uri)  # nothing of the damaged one is visible there

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
            assert (tmp_path / "cache" / "sha256" / good.artifact_sha256).is_dir()  # pulled from the bucket
        finally:
            assert sampler_server.terminate() == 0, sampler_server.log()
    finally:
        assert registry_server.terminate() == 0, registry_server.log()

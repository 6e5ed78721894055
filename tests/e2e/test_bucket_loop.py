"""The whole loop with artifacts in a bucket, on S3 (moto) and Azure Blob (Azurite): a registry that keeps metadata
only, a trainer that pushes snapshots before it publishes, a sampler that pulls versions straight from the bucket.
Every process is a real server in its own process, reaching the store through the standard environment only."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from metricsutil import documented, exported, metric, scrape
from registryutil import artifact_files, upload
from samplerutil import Sampler, greedy, loaded, prompt, request, run, snapshot, train, trained_adapter
from serverproc import ServerProcess, start_registry, start_sampler, start_trainer
from storeservers import StoreServer
from trainerutil import Trainer, assert_status, rpc_error

from opentinker.v1 import registry_pb2, registry_pb2_grpc, sampler_pb2_grpc, trainer_pb2_grpc
from opentinker.weights.artifact_manifest import MANIFEST_NAME, parse_uri
from opentinker.weights.artifact_remote import object_key, push
from opentinker.weights.artifact_store import ArtifactStore
from opentinker.weights.object_store import ObjectStore, parse_store_url

BYTES = "opentinker_registry_artifact_bytes_total"


@dataclass
class Stack:
    url: str
    env: dict[str, str]
    registry_server: ServerProcess
    servers: dict[str, ServerProcess]  # "trainer", "sampler"
    registry: registry_pb2_grpc.RegistryServiceStub
    trainer: Trainer
    sampler: Sampler
    sampler_cache: Path

    def bucket(self) -> ObjectStore:
        return ObjectStore(parse_store_url(self.url), retries=1, retry_budget_s=5)


@pytest.fixture(scope="module", params=["s3", "az"])
def stack(
    request: pytest.FixtureRequest,
    servers: dict[str, StoreServer],
    tiny_model: Path,
    tmp_path_factory: pytest.TempPathFactory,
    monkeypatch_module: pytest.MonkeyPatch,
) -> Iterator[Stack]:
    server = servers[request.param]
    url, env = server.url(f"loop-{request.param}"), server.env()
    for name, value in env.items():
        monkeypatch_module.setenv(name, value)  # for this process's own look into the bucket
    root = tmp_path_factory.mktemp(f"bucket-{request.param}")
    registry_server = start_registry(root / "registry", "--store", url, env=env)
    processes = [registry_server]
    try:
        store = ("--store", url)
        trainer_server = start_trainer(
            root / "trainer", tiny_model, registry_server, *store, "--cache-dir", str(root / "tc"), env=env
        )
        processes.append(trainer_server)
        sampler_server = start_sampler(
            root / "sampler", tiny_model, registry_server, *store, "--cache-dir", str(root / "sc"), env=env
        )
        processes.append(sampler_server)
        with (
            grpc.insecure_channel(registry_server.address) as r,
            grpc.insecure_channel(trainer_server.address) as t,
            grpc.insecure_channel(sampler_server.address) as s,
        ):
            yield Stack(
                url,
                env,
                registry_server,
                {"trainer": trainer_server, "sampler": sampler_server},
                registry_pb2_grpc.RegistryServiceStub(r),
                trainer_pb2_grpc.TrainerServiceStub(t),
                sampler_pb2_grpc.SamplerServiceStub(s),
                root / "sc",
            )
    finally:
        for process in reversed(processes):
            assert process.terminate() == 0, process.log()


@pytest.fixture(scope="module")
def monkeypatch_module() -> Iterator[pytest.MonkeyPatch]:
    with pytest.MonkeyPatch.context() as patch:
        yield patch


def test_train_publish_and_serve_through_the_bucket(stack: Stack) -> None:
    name, v1 = trained_adapter(stack.trainer, seed=500)
    bucket = stack.bucket()
    manifest = bucket.head(object_key(v1.artifact_sha256, MANIFEST_NAME))
    assert manifest is not None  # the trainer pushed it before the publish
    registry_dir = stack.registry_server.ready_file.parent
    assert not list(registry_dir.rglob(v1.artifact_sha256))  # the registry holds no copy
    tokens = greedy(stack.sampler, f"{name}@1", prompt(500))
    assert len(tokens) == 12
    # What the sampler serves is what the trainer wrote: its verified cache holds that content address.
    assert ArtifactStore(stack.sampler_cache).ref(v1.artifact_uri).sha256 == v1.artifact_sha256

    # Hot reload: a new version of the same adapter is pulled and served under its name.
    train(stack.trainer, name, seed=501, steps=1)
    v2 = snapshot(stack.trainer, name)
    assert v2.version == 2 and v2.artifact_sha256 != v1.artifact_sha256
    greedy(stack.sampler, name, prompt(501))
    assert f"{name}@2" in loaded(stack.sampler)

    # Not one artifact byte went through the registry for all of that.
    metrics = scrape(stack.registry_server.metrics_address)
    assert metric(metrics, BYTES, direction="upload") == metric(metrics, BYTES, direction="download") == 0


def test_registry_proxies_uploads_and_downloads_for_clients_without_credentials(stack: Stack) -> None:
    files = artifact_files(seed=520, size=3 << 20)  # several download blocks
    uri = upload(stack.registry, files)
    digest = uri.split(":", 1)[1]
    assert stack.bucket().head(object_key(digest, "adapter_model.safetensors")) is not None
    assert not list((stack.registry_server.ready_file.parent / "upload-staging" / "sha256").iterdir())
    stream = stack.registry.DownloadArtifact(registry_pb2.DownloadArtifactRequest(artifact_uri=uri))
    body = b"".join(m.chunk for m in stream if m.WhichOneof("message") == "chunk")
    assert hashlib.sha256(body).digest() == hashlib.sha256(b"".join(files.values())).digest()
    metrics = scrape(stack.registry_server.metrics_address)
    sent = sum(len(b) for b in files.values())
    assert metric(metrics, BYTES, direction="upload") >= sent
    assert metric(metrics, BYTES, direction="download") >= sent


def test_changed_byte_in_the_bucket_is_data_loss_for_that_version_only(stack: Stack) -> None:
    name, _v1 = trained_adapter(stack.trainer, seed=530)
    train(stack.trainer, name, seed=531, steps=1)
    v2 = snapshot(stack.trainer, name)
    bucket = stack.bucket()
    key = object_key(v2.artifact_sha256, "adapter_model.safetensors")
    data = bytearray(bucket.get_bytes(key))
    data[len(data) // 2] ^= 0x01
    bucket.put_bytes(key, bytes(data))  # same size: only the sampler's sha256 check can tell
    error = rpc_error(run, stack.sampler, request(f"{name}@2", prompt(530)))
    assert_status(error, grpc.StatusCode.DATA_LOSS, "DIGEST_MISMATCH")
    assert f"{name}@2" in (error.details() or "")
    assert len(greedy(stack.sampler, f"{name}@1", prompt(530))) == 12  # the other version is unaffected


def test_gc_removes_unpublished_pushes_after_the_grace_and_never_a_referenced_artifact(
    stack: Stack, tmp_path: Path
) -> None:
    name, referenced = trained_adapter(stack.trainer, seed=540)
    bucket = stack.bucket()
    # What trainers leave that no version names: a push that finished but was never published, and one killed
    # after its payload and before its manifest.
    local = ArtifactStore(tmp_path / "local")
    finished = local.commit_files(artifact_files(seed=541)).uri
    push(local, bucket, finished)
    killed = local.commit_files(artifact_files(seed=542)).uri
    killed_key = object_key(parse_uri(killed), "adapter_model.safetensors")
    bucket.put_bytes(killed_key, b"payload of a push killed before its manifest")
    error = rpc_error(
        stack.registry.PublishVersion,
        registry_pb2.PublishVersionRequest(adapter=name, artifact_uri=killed, artifact_sha256=parse_uri(killed)),
    )
    assert_status(error, grpc.StatusCode.NOT_FOUND, "ARTIFACT_NOT_FOUND")  # no manifest: never publishable

    def collect(grace_s: float | None) -> None:
        stack.registry.GarbageCollect(registry_pb2.GarbageCollectRequest(grace_s=grace_s))

    def present(uri: str) -> bool:
        return bool(bucket.list(f"sha256/{parse_uri(uri)}/"))

    collect(None)  # the registry's --gc-grace: an hour
    assert present(finished) and present(killed)
    time.sleep(2.5)  # object timestamps have one-second resolution on some stores
    collect(2.0)
    assert not present(finished) and not present(killed)
    assert present(referenced.artifact_uri)  # older than the grace too, but a version uses it
    assert len(greedy(stack.sampler, f"{name}@1", prompt(540))) == 12


def test_bucket_metrics_are_what_docs_metrics_md_lists(stack: Stack) -> None:
    """The rows docs/metrics.md marks "(bucket store)", exactly, on a trainer and a sampler that use one."""
    trained_adapter(stack.trainer, seed=550)  # a push, and a pull when the sampler follows it
    for server, process in stack.servers.items():
        assert process.metrics_address is not None
        rows = {n: r for n, r in documented().items() if r.bucket and server in r.servers}
        always = {n for n, r in documented().items() if not r.bucket and server in r.servers}
        got = {n: v for n, v in exported(process.metrics_address).items() if n not in always}
        assert set(got) == set(rows), (server, sorted(got), sorted(rows))
        for name, (kind, labels) in got.items():
            assert kind == rows[name].kind and labels <= rows[name].labels, name

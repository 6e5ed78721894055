"""RegistryClient (the Python SDK) against a real registry process on a private Redis."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import pickle
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import grpc
import pytest
from registryutil import artifact_files, unique_name
from serverproc import ServerProcess

from opentinker.client import (
    Adapter,
    ArtifactInfo,
    BatchRecord,
    Event,
    Lineage,
    OpenTinkerError,
    Reconcile,
    RegistryClient,
    Version,
)
from opentinker.client import registry_client as registry_client_module
from opentinker.client import registry_transfer as registry_transfer_module
from opentinker.v1 import registry_pb2


@pytest.fixture(scope="module")
def client(registry_server: ServerProcess) -> Iterator[RegistryClient]:
    # The session registry runs without a tokens file: any token is accepted, so this also checks
    # that sending the authorization metadata does not disturb calls.
    with RegistryClient(registry_server.address, token="unused-token", timeout=10.0) as sdk:
        yield sdk


@pytest.fixture
def small_pages(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pages of 2 so that a handful of items already exercises page following."""
    monkeypatch.setattr(registry_client_module, "_PAGE_SIZE", 2)


def write_files(directory: Path, files: dict[str, bytes]) -> Path:
    for rel, data in files.items():
        path = directory / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    return directory


def read_tree(directory: Path) -> dict[str, bytes]:
    return {p.relative_to(directory).as_posix(): p.read_bytes() for p in directory.rglob("*") if p.is_file()}


_seed = iter(range(10_000, 1 << 30))


def publish(
    client: RegistryClient, name: str, tmp_path: Path, *, lineage: Lineage | None = None, **kw: object
) -> Version:
    """Uploads a fresh artifact (unique content) through the SDK and publishes it."""
    seed = next(_seed)
    source = write_files(tmp_path / f"src-{seed}", artifact_files(seed))
    info = client.upload_artifact(source)
    return client.publish_version(name, info, lineage=lineage, **kw)  # type: ignore[arg-type]


def expect_error(code: grpc.StatusCode, reason: str, fn: object, *args: object) -> OpenTinkerError:
    with pytest.raises(OpenTinkerError) as caught:
        fn(*args)  # type: ignore[operator]
    error = caught.value
    assert error.code == code and error.reason == reason, str(error)
    return error


def test_create_get_list_delete_adapters(client: RegistryClient, small_pages: None) -> None:
    tenant = unique_name("tenant")
    created = client.create_adapter(
        f"{tenant}/a0", rank=8, labels={"team": "rl"}, description="first", base_model_digest="abc"
    )
    assert isinstance(created, Adapter)
    assert (created.name, created.tenant, created.rank, created.alpha) == (f"{tenant}/a0", tenant, 8, 8.0)
    assert created.target_modules == ("all-linear",) and created.aliases == {}
    assert created.labels == {"team": "rl"} and created.description == "first"
    assert created.base_model_digest == "abc" and created.created_by == "local"
    assert created.created_at.tzinfo is not None
    assert abs((datetime.now(UTC) - created.created_at).total_seconds()) < 60
    with pytest.raises(dataclasses.FrozenInstanceError):
        created.rank = 4  # type: ignore[misc]
    assert not hasattr(created, "__dict__")  # slotted

    custom = client.create_adapter(f"{tenant}/a1", rank=4, alpha=16.0, target_modules=("q_proj", "v_proj"))
    assert (custom.alpha, custom.target_modules) == (16.0, ("q_proj", "v_proj"))
    for i in range(2, 5):
        client.create_adapter(f"{tenant}/a{i}")
    assert client.get_adapter(f"{tenant}/a1") == custom
    # Five adapters on pages of two: list_adapters must follow next_page_token.
    assert [a.name for a in client.list_adapters(prefix=tenant + "/")] == [f"{tenant}/a{i}" for i in range(5)]

    event_id = client.delete_adapter(f"{tenant}/a4")
    assert event_id.count("-") == 1 and event_id.split("-")[0].isdigit()
    error = expect_error(grpc.StatusCode.NOT_FOUND, "ADAPTER_NOT_FOUND", client.get_adapter, f"{tenant}/a4")
    assert str(error) == f"NOT_FOUND: {error.message} [ADAPTER_NOT_FOUND]"
    assert f"{tenant}/a4" in error.message
    assert len(client.list_adapters(prefix=tenant + "/")) == 4


def test_publish_with_lineage_and_get_lineage_chain(client: RegistryClient, tmp_path: Path) -> None:
    name = unique_name()
    client.create_adapter(name, rank=8)
    batch_time = datetime(2025, 1, 2, 3, 4, 5, tzinfo=UTC)
    parent = 0
    for step in range(3):
        lineage = Lineage(
            parent_version=parent,
            trainer_step=step + 1,
            tokens_trained=100 * (step + 1),
            datums_trained=4 * (step + 1),
            batches=(
                BatchRecord(
                    digest=f"d{step}",
                    trace_ids=(f"trace-{step}",),
                    step=step + 1,
                    num_datums=4,
                    num_tokens=100,
                    loss_fn="cross_entropy",
                    time=batch_time,
                ),
            ),
            metrics={"loss:mean": 1.0 / (step + 1)},
            base_model_digest="base-digest",
        )
        version = publish(client, name, tmp_path, lineage=lineage)
        assert version.number == step + 1 and version.lineage == lineage
        parent = version.number

    chain = client.get_lineage(name)
    assert [v.number for v in chain] == [3, 2, 1]
    assert [v.lineage.parent_version for v in chain] == [2, 1, 0]
    assert [v.lineage.batches[0].trace_ids for v in chain] == [("trace-2",), ("trace-1",), ("trace-0",)]
    assert chain[0].lineage.batches[0].time == batch_time
    assert chain[0].lineage.metrics["loss:mean"] == pytest.approx(1 / 3)
    assert chain[0].published_by == "local" and chain[0].size_bytes > 0 and chain[0].rank == 8
    assert chain[0].created_at.tzinfo is not None and chain[0].aliases == ("latest",)
    assert [v.number for v in client.get_lineage(f"{name}@3", max_depth=2)] == [3, 2]
    assert client.get_version(name, 2) == chain[1]


def test_resolve_list_versions_and_publish_options(client: RegistryClient, tmp_path: Path, small_pages: None) -> None:
    name = unique_name()
    client.create_adapter(name)
    first = publish(client, name, tmp_path, request_id="req-1")
    second = publish(client, name, tmp_path, aliases=("stable",), expected_latest_version=1)
    third = publish(client, name, tmp_path, aliases=("canary",), skip_latest=True)
    assert (first.number, second.number, third.number) == (1, 2, 3)
    assert third.aliases == ("canary",) and sorted(second.aliases) == ["latest", "stable"]

    assert client.resolve(name).number == 2  # latest stayed on 2 (skip_latest)
    assert client.resolve(f"{name}@stable") == client.get_version(name, 2)
    assert client.resolve(f"{name}@canary").number == 3
    assert client.resolve(f"{name}@1").sha256 == first.sha256
    assert client.resolve(f"{name}@1").reference == f"{name}@1"
    # Three versions on pages of two, newest first.
    assert [v.number for v in client.list_versions(name)] == [3, 2, 1]

    # Replaying a request id returns the first result and publishes nothing.
    replay = client.publish_version(name, first.artifact_uri, first.sha256, request_id="req-1")
    assert replay.number == 1 and client.get_adapter(name).version_count == 3
    expect_error(
        grpc.StatusCode.FAILED_PRECONDITION,
        "VERSION_CONFLICT",
        lambda: publish(client, name, tmp_path, expected_latest_version=1),
    )
    with pytest.raises(TypeError):
        client.publish_version(name, first.artifact_uri, aliases="stable")


def test_alias_moves_rollback_and_delete(client: RegistryClient, tmp_path: Path) -> None:
    name = unique_name()
    client.create_adapter(name)
    for _ in range(3):
        publish(client, name, tmp_path)

    created = client.set_alias(name, "stable", 1, expected_version=0)
    assert (created.adapter, created.alias, created.previous_version, created.version) == (
        name,
        "stable",
        0,
        1,
    )
    assert created.event_id
    stale = expect_error(
        grpc.StatusCode.FAILED_PRECONDITION, "VERSION_CONFLICT", client.set_alias, name, "stable", 2, 3
    )
    assert stale.code is grpc.StatusCode.FAILED_PRECONDITION
    moved = client.set_alias(name, "stable", 2, expected_version=1)
    assert (moved.previous_version, moved.version) == (1, 2)

    back = client.rollback(name)
    assert (back.alias, back.previous_version, back.version) == ("latest", 3, 2)
    explicit = client.rollback(name, "stable", to_version=1)
    assert (explicit.alias, explicit.previous_version, explicit.version) == ("stable", 2, 1)
    assert client.get_adapter(name).aliases == {"latest": 2, "stable": 1}

    assert client.delete_alias(name, "stable", expected_version=1) == 1
    expect_error(grpc.StatusCode.NOT_FOUND, "ALIAS_NOT_FOUND", client.delete_alias, name, "stable")
    expect_error(grpc.StatusCode.FAILED_PRECONDITION, "ALIAS_MANAGED", client.delete_alias, name, "latest")
    assert client.get_adapter(name).aliases == {"latest": 2}


def test_watch_events_from_an_id_in_order(client: RegistryClient, tmp_path: Path) -> None:
    name = unique_name()
    client.create_adapter(name)
    first = publish(client, name, tmp_path)
    start = client.set_alias(name, "stable", first.number)
    second = publish(client, name, tmp_path, aliases=("canary",))
    rollback = client.rollback(name)
    client.delete_alias(name, "canary")

    stream = client.watch_events(after_id=start.event_id, adapters=[name])
    events = [next(stream) for _ in range(3)]
    stream.close()  # cancels the server stream
    with pytest.raises(StopIteration):
        next(stream)
    assert all(isinstance(e, Event) for e in events)
    published, rolled, deleted = (e for e in events if isinstance(e, Event))
    assert [e.type for e in (published, rolled, deleted)] == [
        "VERSION_PUBLISHED",
        "ALIAS_SET",
        "ALIAS_DELETED",
    ]
    assert (published.adapter, published.version, published.artifact_sha256) == (name, 2, second.sha256)
    assert published.aliases == {"latest": 2, "stable": 1, "canary": 2}
    assert published.actor == "local" and published.time.tzinfo is not None
    assert rolled.event_id == rollback.event_id
    assert (rolled.alias, rolled.previous_version, rolled.version, rolled.cause) == (
        "latest",
        2,
        1,
        "rollback",
    )
    assert (deleted.alias, deleted.previous_version) == ("canary", 2)
    assert deleted.aliases == {"latest": 1, "stable": 1}
    assert len({start.event_id, published.event_id, rolled.event_id, deleted.event_id}) == 4


def test_watch_snapshot_then_resume(client: RegistryClient, tmp_path: Path) -> None:
    name = unique_name()
    client.create_adapter(name)
    publish(client, name, tmp_path)
    stream = client.watch_events(adapters=[name], send_snapshot=True)
    snapshot = next(stream)
    stream.close()
    assert isinstance(snapshot, Reconcile)
    assert snapshot.reason == "requested" and snapshot.aliases == {name: {"latest": 1}}

    # Resuming from the snapshot's id yields exactly what happened after it.
    publish(client, name, tmp_path)
    resumed = client.watch_events(after_id=snapshot.event_id, adapters=[name])
    try:
        event = next(resumed)
    finally:
        resumed.close()
    assert isinstance(event, Event)
    assert (event.type, event.version, event.aliases) == ("VERSION_PUBLISHED", 2, {"latest": 2})


def test_garbage_collect_dry_run(client: RegistryClient, tmp_path: Path) -> None:
    name = unique_name()
    client.create_adapter(name)
    versions = [publish(client, name, tmp_path) for _ in range(4)]
    dry = client.garbage_collect(keep_last=1, adapter=name, dry_run=True)
    assert sorted(dry.collected) == [(name, 1), (name, 2), (name, 3)]
    assert dry.bytes_freed == sum(v.size_bytes for v in versions[:3])
    assert not client.get_version(name, 1).artifact_deleted  # dry run: nothing deleted


def test_upload_publish_download_round_trip(client: RegistryClient, tmp_path: Path) -> None:
    import torch
    from safetensors.torch import save_file

    source = tmp_path / "checkpoint"
    (source / "extra").mkdir(parents=True)
    # 600x600 float32 = 1.44 MB: more than one 1 MiB chunk, so chunks span files both ways.
    generator = torch.Generator().manual_seed(0)
    tensors = {
        "base_model.model.layers.0.q_proj.lora_A.weight": torch.randn(600, 600, generator=generator),
        "base_model.model.layers.0.q_proj.lora_B.weight": torch.zeros(8, 600),
    }
    save_file(tensors, str(source / "adapter_model.safetensors"))
    (source / "adapter_config.json").write_text(json.dumps({"r": 8, "lora_alpha": 16, "seed": unique_name()}))
    (source / "extra" / "notes.txt").write_text("nested file")
    (source / "zz-empty").write_bytes(b"")  # a trailing empty file carries no bytes in the stream

    info = client.upload_artifact(source)
    assert isinstance(info, ArtifactInfo)
    assert info.uri == f"sha256:{info.sha256}" and info.size_bytes > sum(len(b) for b in read_tree(source).values())
    copy = write_files(tmp_path / "copy", read_tree(source))
    assert client.upload_artifact(copy).sha256 == info.sha256  # content addressed

    name = unique_name()
    client.create_adapter(name, rank=8)
    version = client.publish_version(name, info.uri, info.sha256, size_bytes=info.size_bytes)
    assert (version.sha256, version.artifact_uri, version.size_bytes) == (
        info.sha256,
        info.uri,
        info.size_bytes,
    )

    target = tmp_path / "downloaded"
    downloaded = client.download_artifact(version.artifact_uri, target)
    assert downloaded == info
    assert read_tree(target) == read_tree(source)
    assert sorted(read_tree(target)) == [
        "adapter_config.json",
        "adapter_model.safetensors",
        "extra/notes.txt",
        "zz-empty",
    ]


def test_download_verifies_each_file(tmp_path: Path) -> None:
    # The server verifies before streaming, so a mismatch can only come from the wire or a faulty server:
    # drive the download sink directly with a manifest that disagrees with the bytes.
    good, bad = b"good bytes", b"evil bytes"
    headers = [
        registry_pb2.ArtifactFileHeader(path="a.json", size_bytes=len(good), sha256=hashlib.sha256(good).hexdigest()),
        registry_pb2.ArtifactFileHeader(path="b.bin", size_bytes=len(bad), sha256=hashlib.sha256(good).hexdigest()),
    ]
    sink = registry_transfer_module._DownloadSink(tmp_path, headers)
    with pytest.raises(OpenTinkerError) as caught:
        sink.feed(good + bad)
    sink.abort()
    assert caught.value.code == grpc.StatusCode.DATA_LOSS and caught.value.reason == "DIGEST_MISMATCH"
    assert caught.value.metadata["path"] == "b.bin"
    assert read_tree(tmp_path) == {"a.json": good}  # the wrong file never lands under its name

    with pytest.raises(OpenTinkerError) as escape:
        registry_transfer_module._DownloadSink(tmp_path, [registry_pb2.ArtifactFileHeader(path="../x")])
    assert escape.value.code == grpc.StatusCode.DATA_LOSS


def test_errors_carry_code_reason_and_metadata(client: RegistryClient, tmp_path: Path) -> None:
    missing = unique_name()
    not_found = expect_error(grpc.StatusCode.NOT_FOUND, "ADAPTER_NOT_FOUND", client.get_adapter, missing)
    assert str(not_found).startswith("NOT_FOUND: ") and str(not_found).endswith(" [ADAPTER_NOT_FOUND]")
    expect_error(grpc.StatusCode.NOT_FOUND, "ADAPTER_NOT_FOUND", client.resolve, missing + "@3")
    bad_name = expect_error(grpc.StatusCode.INVALID_ARGUMENT, "INVALID_ADAPTER_NAME", client.create_adapter, "Bad Name")
    assert bad_name.metadata == {"name": "Bad Name"}
    expect_error(grpc.StatusCode.INVALID_ARGUMENT, "INVALID_REFERENCE", client.resolve, missing + "@0")
    expect_error(grpc.StatusCode.INVALID_ARGUMENT, "INVALID_ARTIFACT_URI", client.download_artifact, "md5:x", tmp_path)
    expect_error(
        grpc.StatusCode.NOT_FOUND,
        "ARTIFACT_NOT_FOUND",
        client.download_artifact,
        "sha256:" + "cd" * 32,
        tmp_path,
    )
    name = unique_name()
    client.create_adapter(name)
    expect_error(grpc.StatusCode.ALREADY_EXISTS, "ADAPTER_EXISTS", client.create_adapter, name)
    expect_error(grpc.StatusCode.NOT_FOUND, "VERSION_NOT_FOUND", client.get_version, name, 7)
    expect_error(grpc.StatusCode.NOT_FOUND, "ALIAS_NOT_FOUND", client.rollback, name)
    # A streaming call fails at its first next().
    stream = client.watch_events(after_id="yesterday")
    expect_error(grpc.StatusCode.INVALID_ARGUMENT, "INVALID_EVENT_ID", next, stream)
    # Local source problems use the same error type.
    expect_error(grpc.StatusCode.INVALID_ARGUMENT, "INVALID_ARTIFACT_SOURCE", client.upload_artifact, tmp_path / "nope")
    # Errors survive pickling (worker processes) with every field.
    again = pickle.loads(pickle.dumps(bad_name))
    fields = ("code", "message", "reason", "metadata", "request_id")
    assert bad_name.request_id and [getattr(again, f) for f in fields] == [getattr(bad_name, f) for f in fields]


def test_upload_reports_local_read_errors(
    client: RegistryClient, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # gRPC reads the request iterator on its own thread and would report only UNKNOWN; the SDK must
    # surface the real cause (here: a file that vanished between hashing and sending).
    source = write_files(tmp_path / "src", artifact_files(next(_seed)))
    real = registry_transfer_module._upload_requests

    def vanishing(
        files: list[registry_transfer_module._LocalFile],
    ) -> Iterator[registry_pb2.UploadArtifactRequest]:
        (source / "adapter_model.safetensors").unlink()
        yield from real(files)

    monkeypatch.setattr(registry_transfer_module, "_upload_requests", vanishing)
    with pytest.raises(FileNotFoundError):
        client.upload_artifact(source)

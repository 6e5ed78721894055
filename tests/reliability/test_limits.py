"""Limits that hold against hostile input: gRPC message size (RESOURCE_EXHAUSTED, as configured by default and
by --max-message-mb) and no way out of the artifact store, neither through the gRPC API nor the
ArtifactStore API (names and digests like '../x', absolute paths, symlinks)."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from registryutil import artifact_files, upload
from serverproc import ServerProcess, registry_store, start_registry

from opentinker.rpc.serving.errors import DataLoss, InvalidArgument, NotFound, error_info
from opentinker.rpc.serving.server import MAX_MESSAGE_BYTES
from opentinker.v1 import registry_pb2, registry_pb2_grpc
from opentinker.weights.artifact_store import ArtifactStore

MiB = 1 << 20
ESCAPES = ["../x", "../../x", "a/../../x", "/x", "/etc/passwd", "sha256/../../x", "..", "./x", "a/./../x", "a\\..\\x"]
Registry = registry_pb2_grpc.RegistryServiceStub


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, ServerProcess]]:
    """A registry with the default limit and one with --max-message-mb 8 (each its own embedded Redis)."""
    root = tmp_path_factory.mktemp("limits")
    started = {
        "default": start_registry(root / "default"),
        "small": start_registry(root / "small", "--max-message-mb", "8"),
    }
    yield started
    assert {name: server.terminate() for name, server in started.items()} == {"default": 0, "small": 0}


def stub_of(server: ServerProcess) -> Iterator[Registry]:
    with grpc.insecure_channel(server.address, options=[("grpc.max_send_message_length", -1)]) as channel:
        yield registry_pb2_grpc.RegistryServiceStub(channel)


@pytest.fixture(scope="module")
def registry(servers: dict[str, ServerProcess]) -> Iterator[Registry]:
    yield from stub_of(servers["default"])


def create_with_description(stub: Registry, size: int) -> grpc.StatusCode:
    request = registry_pb2.CreateAdapterRequest(name="Not A Name", description="d" * size)
    with pytest.raises(grpc.RpcError) as caught:
        stub.CreateAdapter(request, timeout=60)
    code: grpc.StatusCode = caught.value.code()
    return code


@pytest.mark.parametrize(("server", "limit"), [("default", MAX_MESSAGE_BYTES), ("small", 8 * MiB)])
def test_message_size_limit(servers: dict[str, ServerProcess], server: str, limit: int) -> None:
    for stub in stub_of(servers[server]):
        # Just under the limit: the message arrives and is judged on its content (the name is invalid).
        assert create_with_description(stub, limit - 64 * 1024) == grpc.StatusCode.INVALID_ARGUMENT
        assert create_with_description(stub, limit + 1) == grpc.StatusCode.RESOURCE_EXHAUSTED
        stub.ListAdapters(registry_pb2.ListAdaptersRequest(), timeout=30)  # still serving


def assert_invalid(call: object, reason: str) -> None:
    with pytest.raises(grpc.RpcError) as caught:
        call()  # type: ignore[operator]
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, caught.value
    info = error_info(caught.value)
    assert info is not None and info.reason == reason, info


PAYLOAD = b"escape-attempt-6a1f0c"


def leaked(root: Path) -> list[Path]:
    """Files under root holding the payload of a refused write (an escape, or a refusal that still wrote)."""
    return [p for p in root.rglob("*") if p.is_file() and not p.is_symlink() and PAYLOAD in p.read_bytes()]


def upload_requests(path: str, data: bytes) -> Iterator[registry_pb2.UploadArtifactRequest]:
    header = registry_pb2.ArtifactFileHeader(path=path, size_bytes=len(data), sha256=hashlib.sha256(data).hexdigest())
    yield registry_pb2.UploadArtifactRequest(manifest=registry_pb2.ArtifactManifest(files=[header]))
    yield registry_pb2.UploadArtifactRequest(chunk=data)


def test_no_escape_from_the_store_through_grpc(servers: dict[str, ServerProcess], registry: Registry) -> None:
    store = registry_store(servers["default"])
    objects = set((store / "sha256").iterdir())
    for path in ESCAPES:
        assert_invalid(lambda p=path: registry.UploadArtifact(upload_requests(p, PAYLOAD)), "INVALID_ARTIFACT_PATH")
        for uri in (path, f"sha256:{path}", f"sha256:{path}{'0' * 64}"):
            request = registry_pb2.DownloadArtifactRequest(artifact_uri=uri)
            assert_invalid(lambda r=request: list(registry.DownloadArtifact(r)), "INVALID_ARTIFACT_URI")
            publish = registry_pb2.PublishVersionRequest(adapter="limits", artifact_uri=uri)
            assert_invalid(lambda r=publish: registry.PublishVersion(r), "INVALID_ARTIFACT_URI")
        assert_invalid(
            lambda p=path: registry.CreateAdapter(registry_pb2.CreateAdapterRequest(name=p)), "INVALID_ADAPTER_NAME"
        )
    assert leaked(store.parent.parent) == []
    assert set((store / "sha256").iterdir()) == objects


def test_symlinks_in_the_store_are_never_followed(
    servers: dict[str, ServerProcess], registry: Registry, tmp_path: Path
) -> None:
    """A link planted in the store (same bytes, so every digest matches) is refused, never read through."""
    store = registry_store(servers["default"])
    files = artifact_files(seed=77)
    for planted in ("file", "directory"):
        uri = upload(registry, files)
        directory = store / "sha256" / uri.removeprefix("sha256:")
        decoy = tmp_path / planted
        if planted == "file":
            decoy.write_bytes(files["adapter_model.safetensors"])
            (directory / "adapter_model.safetensors").unlink()
            (directory / "adapter_model.safetensors").symlink_to(decoy)
        else:
            directory.rename(decoy)
            directory.symlink_to(decoy, target_is_directory=True)
        with pytest.raises(grpc.RpcError) as caught:
            list(registry.DownloadArtifact(registry_pb2.DownloadArtifactRequest(artifact_uri=uri)))
        assert caught.value.code() in (grpc.StatusCode.DATA_LOSS, grpc.StatusCode.NOT_FOUND), caught.value
        with pytest.raises((DataLoss, NotFound)):
            ArtifactStore(store).path(uri)
        # Cleanup for the next round: the same bytes upload again (the broken copy is replaced).
        if planted == "file":
            (directory / "adapter_model.safetensors").unlink()
        else:
            directory.unlink()


def test_no_escape_from_the_store_through_the_api(tmp_path: Path) -> None:
    root = tmp_path / "store"
    store = ArtifactStore(root)
    for path in ESCAPES:
        with pytest.raises(InvalidArgument):
            store.commit_files({"ok.json": b"{}", path: PAYLOAD})
        with store.begin() as writer, pytest.raises(InvalidArgument):
            writer.add_file(path, len(PAYLOAD), hashlib.sha256(PAYLOAD).hexdigest())
        for call in (store.path, store.manifest, store.exists, store.delete):
            with pytest.raises(InvalidArgument):
                call(f"sha256:{path}")
    secret = tmp_path / "secret.txt"
    secret.write_bytes(PAYLOAD)
    source = tmp_path / "source"
    source.mkdir()
    (source / "adapter_config.json").write_bytes(b"{}")
    for link, target in (("weights.bin", secret), ("sub", tmp_path)):
        (source / link).symlink_to(target)
        with pytest.raises(InvalidArgument) as caught:
            store.commit_dir(source)
        assert caught.value.reason == "INVALID_ARTIFACT_SOURCE"
        (source / link).unlink()
    assert leaked(tmp_path) == [secret]
    assert list((root / "sha256").iterdir()) == []
    assert list((root / "tmp").iterdir()) == []

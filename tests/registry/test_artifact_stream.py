"""The one artifact transfer stream (weights/artifact_stream.py) and the three receivers built on it: the
registry's upload, the trainer/sampler fetch from the registry and the SDK's download."""

from __future__ import annotations

import asyncio
import hashlib
import random
from collections.abc import AsyncIterator, Iterable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from opentinker.registry.service import RegistryServicer
from opentinker.rpc.serving.errors import DataLoss, InvalidArgument
from opentinker.v1 import registry_pb2
from opentinker.weights.artifact_manifest import ArtifactFile
from opentinker.weights.artifact_store import ArtifactStore
from opentinker.weights.artifact_stream import ArtifactReceiver, StreamViolation, chunked
from opentinker.weights.artifact_transfer import fetch_artifact

FILES = {"a.json": b"{}", "empty": b"", "m/weights.bin": b"w" * 10, "z-empty": b""}


def declared(files: dict[str, bytes]) -> list[ArtifactFile]:
    return [ArtifactFile(p, hashlib.sha256(b).hexdigest(), len(b)) for p, b in files.items()]


class Recorder:
    def __init__(self) -> None:
        self.events: list[tuple[str, str | bytes]] = []

    def start(self, file: ArtifactFile) -> None:
        self.events.append(("start", file.path))

    def write(self, data: memoryview) -> None:
        self.events.append(("write", bytes(data)))

    def end(self, file: ArtifactFile) -> None:
        self.events.append(("end", file.path))


def receive(files: list[ArtifactFile], chunks: Iterable[bytes]) -> Recorder:
    sink = Recorder()
    receiver = ArtifactReceiver(lambda _files: sink)
    receiver.header(files)
    for chunk in chunks:
        receiver.chunk(chunk)
    receiver.close()
    return sink


def test_chunks_split_into_files_in_order_with_empty_files_passed() -> None:
    data = b"".join(FILES.values())
    sink = receive(declared(FILES), [data[:1], b"", data[1:5], data[5:]])
    assert sink.events == [
        ("start", "a.json"),
        ("write", b"{"),
        ("write", b"}"),
        ("end", "a.json"),
        ("start", "empty"),
        ("end", "empty"),
        ("start", "m/weights.bin"),
        ("write", b"www"),
        ("write", b"w" * 7),
        ("end", "m/weights.bin"),
        ("start", "z-empty"),
        ("end", "z-empty"),
    ]


@pytest.mark.parametrize(
    ("chunks", "kind", "path"),
    [
        ([b"{}" + b"w" * 10 + b"!"], "extra_bytes", ""),
        ([b"{}www"], "ended_inside", "m/weights.bin"),
        ([b"{}"], "ended_before", "m/weights.bin"),
    ],
)
def test_refuses_extra_and_missing_bytes(chunks: list[bytes], kind: str, path: str) -> None:
    with pytest.raises(StreamViolation) as caught:
        receive(declared(FILES), chunks)
    assert (caught.value.kind, caught.value.path) == (kind, path)


def test_refuses_the_wrong_order() -> None:
    receiver = ArtifactReceiver(lambda _files: Recorder())
    with pytest.raises(StreamViolation) as first:
        receiver.chunk(b"x")
    assert first.value.kind == "chunk_first"
    with pytest.raises(StreamViolation) as none:
        receiver.close()
    assert none.value.kind == "no_header"
    receiver.header(declared(FILES))
    with pytest.raises(StreamViolation) as twice:
        receiver.header(declared(FILES))
    assert twice.value.kind == "header_twice"


def test_chunked_recuts_across_pieces() -> None:
    assert list(chunked([b"abc", b"", b"defgh", b"i"], 4)) == [b"abcd", b"efgh", b"i"]
    assert list(chunked([b"abcd", b"efgh"], 4)) == [b"abcd", b"efgh"]
    assert list(chunked([b"", b""], 4)) == []
    rng = random.Random(0)
    for _ in range(300):
        pieces = [rng.randbytes(rng.randrange(12)) for _ in range(rng.randrange(8))]
        size = rng.randrange(1, 6)
        chunks = list(chunked(pieces, size))
        assert b"".join(chunks) == b"".join(pieces)
        assert all(len(c) == size for c in chunks[:-1]) and all(0 < len(c) <= size for c in chunks)


def download_messages(files: dict[str, bytes], extra: bytes = b"") -> list[registry_pb2.DownloadArtifactResponse]:
    headers = [
        registry_pb2.ArtifactFileHeader(path=f.path, size_bytes=f.size, sha256=f.sha256) for f in declared(files)
    ]
    return [
        registry_pb2.DownloadArtifactResponse(manifest=registry_pb2.ArtifactManifest(files=headers)),
        registry_pb2.DownloadArtifactResponse(chunk=b"".join(files.values()) + extra),
    ]


class FakeRegistry:
    """Just DownloadArtifact, streaming canned messages."""

    def __init__(self, messages: list[registry_pb2.DownloadArtifactResponse]) -> None:
        self.messages = messages

    def DownloadArtifact(self, request: Any, metadata: Any = None) -> AsyncIterator[Any]:
        async def stream() -> AsyncIterator[Any]:
            for message in self.messages:
                yield message

        return stream()


def test_fetch_round_trip_and_extra_bytes_are_data_loss(tmp_path: Path) -> None:
    source = ArtifactStore(tmp_path / "source")
    ref = source.commit_files(FILES)
    target = ArtifactStore(tmp_path / "target")
    asyncio.run(fetch_artifact(FakeRegistry(download_messages(FILES)), target, ref.uri, None))  # type: ignore[arg-type]
    assert target.ref(ref.uri) == ref

    # Bytes past the declared files used to escape as IndexError; they are DATA_LOSS like any bad digest.
    again = ArtifactStore(tmp_path / "again")
    with pytest.raises(DataLoss) as caught:
        registry = FakeRegistry(download_messages(FILES, extra=b"!"))
        asyncio.run(fetch_artifact(registry, again, ref.uri, None))  # type: ignore[arg-type]
    assert caught.value.code == grpc.StatusCode.DATA_LOSS and caught.value.reason == "DIGEST_MISMATCH"
    assert "more bytes than the manifest declares" in caught.value.message
    assert not again.exists(ref.uri) and list((tmp_path / "again" / "tmp").iterdir()) == []


class UploadLedger:
    """The part of the RegistryStore an upload touches: the lease on its digest and the record of who uploaded
    what (the local principal reserves no quota)."""

    def __init__(self) -> None:
        self.uploads: dict[str, int] = {}
        self.leases: set[tuple[str, str]] = set()

    async def lease_artifact(self, sha256: str, lease_id: str, ttl_ms: int) -> bool:
        self.leases.add((sha256, lease_id))
        return True

    async def release_lease(self, sha256: str, lease_id: str) -> None:
        self.leases.discard((sha256, lease_id))

    async def record_upload(self, sha256: str, tenant: str, size_bytes: int, lease_id: str, upload_id: str) -> None:
        self.leases.remove((sha256, lease_id))
        self.uploads[sha256] = size_bytes


def upload(servicer: RegistryServicer, messages: list[registry_pb2.UploadArtifactRequest]) -> Any:
    async def requests() -> AsyncIterator[registry_pb2.UploadArtifactRequest]:
        for message in messages:
            yield message

    return asyncio.run(servicer.UploadArtifact(requests(), None))


def upload_messages(files: dict[str, bytes], extra: bytes = b"") -> list[registry_pb2.UploadArtifactRequest]:
    return [
        registry_pb2.UploadArtifactRequest(manifest=message.manifest)
        if message.HasField("manifest")
        else registry_pb2.UploadArtifactRequest(chunk=message.chunk)
        for message in download_messages(files, extra)
    ]


@pytest.mark.parametrize(
    ("messages", "message"),
    [
        (lambda m: [*m, m[1]], "more bytes than the manifest declares"),
        (lambda m: m[:1], "upload ended before every declared byte arrived"),
        (lambda m: m[1:], "chunk before manifest"),
        (lambda m: [m[0], m[0]], "the manifest must be sent once, first"),
        (lambda m: [], "empty upload: no manifest"),
    ],
)
def test_registry_upload_refuses_a_broken_stream(tmp_path: Path, messages: Any, message: str) -> None:
    store = ArtifactStore(tmp_path)
    ledger = UploadLedger()
    servicer = RegistryServicer(ledger, store)  # type: ignore[arg-type]  # uploads only lease and record
    with pytest.raises(InvalidArgument) as caught:
        upload(servicer, messages(upload_messages(FILES)))
    assert (caught.value.reason, caught.value.message) == ("INVALID_UPLOAD", message)
    assert list((tmp_path / "tmp").iterdir()) == []  # the writer was aborted
    assert ledger.leases == set()
    response = upload(servicer, upload_messages(FILES))
    assert store.ref(response.artifact_uri).size_bytes == response.artifact_size_bytes


def test_chunks_from_a_store_reassemble(tmp_path: Path) -> None:
    store = ArtifactStore(tmp_path)
    ref = store.commit_files(FILES)
    pieces: Iterator[bytes] = (chunk for _file, chunk in store.iter_chunks(ref.uri, 3))
    assert b"".join(chunked(pieces, 4)) == b"".join(FILES[p] for p in sorted(FILES))

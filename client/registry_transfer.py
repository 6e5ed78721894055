"""Artifact transfer for the SDK: a local directory up to the registry's store and an artifact down into a
directory, on the shared stream (opentinker.weights.artifact_stream) and the shared manifest rules, with
every failure as an OpenTinkerError."""

from __future__ import annotations

import hashlib
import os
import tempfile
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import BinaryIO, Final

import grpc

from opentinker.client.connection import translated
from opentinker.client.errors import OpenTinkerError, from_rpc_error
from opentinker.client.registry_types import ArtifactInfo
from opentinker.v1 import registry_pb2, registry_pb2_grpc
from opentinker.weights.artifact_fs import scan_tree
from opentinker.weights.artifact_manifest import URI_PREFIX, ArtifactFile, hash_file, manifest_bytes, path_problem
from opentinker.weights.artifact_stream import ArtifactReceiver, StreamViolation, chunked, declared_bytes

CHUNK_SIZE: Final = 1 << 20
"""Upload message size: the contract's limit per chunk, well under gRPC's 4 MiB default message cap."""

Metadata = tuple[tuple[str, str], ...]


def upload_artifact(stub: registry_pb2_grpc.RegistryServiceStub, directory: Path, metadata: Metadata) -> ArtifactInfo:
    """Uploads every regular file under ``directory`` as one artifact (see RegistryClient.upload_artifact)."""
    files = _scan_directory(Path(directory))
    # gRPC runs the request iterator on its own thread and turns an exception there into a bare
    # UNKNOWN status ("Exception iterating requests!"); keep the exception so the caller sees the
    # real cause (a file that vanished or shrank, a permission error).
    failure: list[BaseException] = []

    def requests() -> Iterator[registry_pb2.UploadArtifactRequest]:
        try:
            yield from _upload_requests(files)
        except Exception as exc:
            failure.append(exc)
            raise

    try:
        response = stub.UploadArtifact(requests(), metadata=metadata)
    except grpc.RpcError as err:
        if failure:
            raise failure[0] from err
        raise from_rpc_error(err) from err
    if not isinstance(response, registry_pb2.UploadArtifactResponse):
        raise TypeError(f"expected UploadArtifactResponse, got {type(response).__name__}")
    return ArtifactInfo(response.artifact_uri, response.artifact_sha256, response.artifact_size_bytes)


def download_artifact(
    stub: registry_pb2_grpc.RegistryServiceStub, artifact_uri: str, directory: Path, metadata: Metadata
) -> ArtifactInfo:
    """Writes the artifact's files under ``directory``, verified (see RegistryClient.download_artifact)."""
    directory = Path(directory)
    request = registry_pb2.DownloadArtifactRequest(artifact_uri=artifact_uri)
    with translated():
        call = stub.DownloadArtifact(request, metadata=metadata)
    sink: _DownloadSink | None = None
    try:
        with translated():
            messages = iter(call)
            first = next(messages, None)
            if first is None or first.WhichOneof("message") != "manifest":
                raise _data_loss(f"download of {artifact_uri} did not start with a manifest")
            headers = list(first.manifest.files)
            manifest = _manifest_bytes(headers)
            digest = hashlib.sha256(manifest).hexdigest()
            requested = artifact_uri.removeprefix(URI_PREFIX).lower()
            if digest != requested:
                raise _data_loss(
                    f"the streamed manifest hashes to {digest}, not the requested {requested}",
                    expected_sha256=requested,
                    actual_sha256=digest,
                )
            directory.mkdir(parents=True, exist_ok=True)
            sink = _DownloadSink(directory, headers)
            for message in messages:
                if message.WhichOneof("message") != "chunk":
                    raise _data_loss(f"download of {artifact_uri} sent a second manifest")
                sink.feed(message.chunk)
            sink.close()
        size = sum(h.size_bytes for h in headers) + len(manifest)
        return ArtifactInfo(URI_PREFIX + digest, digest, size)
    except BaseException:
        if sink is not None:
            sink.abort()
        raise
    finally:
        # Stops the server stream when we bail out early; a no-op once the stream has ended.
        call.cancel()


@dataclass(frozen=True, slots=True)
class _LocalFile:
    rel: str
    path: Path
    size: int
    sha256: str


def _source_error(message: str, **metadata: str) -> OpenTinkerError:
    return OpenTinkerError(grpc.StatusCode.INVALID_ARGUMENT, message, "INVALID_ARTIFACT_SOURCE", metadata)


def _scan_directory(directory: Path) -> list[_LocalFile]:
    """Every regular file under ``directory``, sorted by relative POSIX path, with its size and sha256.

    Symlinks and special files are refused rather than skipped or followed: following could upload data
    from outside the directory, skipping would silently publish an incomplete adapter (the registry's own
    commit_dir makes the same choice).
    """
    if not directory.is_dir():
        raise _source_error(f"{directory} is not a directory", source=str(directory))
    found, _dirs, odd = scan_tree(directory)
    if odd:
        raise _source_error(
            f"{directory / odd[0]} is a symlink or special file; only regular files can be uploaded", path=odd[0]
        )
    files = []
    for rel in sorted(found):
        sha, size = hash_file(directory / rel)
        files.append(_LocalFile(rel, directory / rel, size, sha))
    return files


def _upload_requests(files: list[_LocalFile]) -> Iterator[registry_pb2.UploadArtifactRequest]:
    """The manifest, then the files' bytes back to back in manifest order, in chunks of CHUNK_SIZE.

    Chunks may span file boundaries (the server splits by the declared sizes). Exactly the declared number
    of bytes is read from each file, so a file that grew after hashing cannot shift the next file's bytes;
    the server re-hashes everything it receives.
    """
    headers = [registry_pb2.ArtifactFileHeader(path=f.rel, size_bytes=f.size, sha256=f.sha256) for f in files]
    yield registry_pb2.UploadArtifactRequest(manifest=registry_pb2.ArtifactManifest(files=headers))
    by_rel = {f.rel: f for f in files}
    pieces = (
        block for f in files for block in declared_bytes(ArtifactFile(f.rel, f.sha256, f.size), f.path, CHUNK_SIZE)
    )
    try:
        for chunk in chunked(pieces, CHUNK_SIZE):
            yield registry_pb2.UploadArtifactRequest(chunk=chunk)
    except StreamViolation as violation:
        raise OpenTinkerError(
            grpc.StatusCode.DATA_LOSS,
            f"{by_rel[violation.path].path} shrank while uploading",
            "DIGEST_MISMATCH",
            {"path": violation.path},
        ) from None


def _manifest_bytes(headers: Iterable[registry_pb2.ArtifactFileHeader]) -> bytes:
    """The registry's canonical manifest.json: its sha256 is the artifact digest, so recomputing it proves the
    streamed manifest is the one the URI names."""
    return manifest_bytes(ArtifactFile(h.path, h.sha256, h.size_bytes) for h in headers)


def _data_loss(message: str, **metadata: str) -> OpenTinkerError:
    return OpenTinkerError(grpc.StatusCode.DATA_LOSS, message, "DIGEST_MISMATCH", metadata)


def _safe_target(directory: Path, rel: str) -> Path:
    """``directory / rel`` for a relative POSIX path that cannot escape ``directory``."""
    if path_problem(rel) is not None:
        raise _data_loss(f"artifact manifest names an unsafe path {rel!r}", path=rel)
    return directory.joinpath(*PurePosixPath(rel).parts)


class _DownloadSink:
    """Writes the streamed bytes into files in manifest order (split by the shared ArtifactReceiver),
    verifying each file's sha256.

    Each file is written to a temporary name next to its target and renamed into place only once its
    digest checks out, so a mismatch never leaves a wrong file under the real name.
    """

    def __init__(self, directory: Path, headers: list[registry_pb2.ArtifactFileHeader]) -> None:
        files = [ArtifactFile(h.path, h.sha256, h.size_bytes) for h in headers]
        self._targets = {f.path: _safe_target(directory, f.path) for f in files}
        self._handle: BinaryIO | None = None
        self._temp: Path | None = None
        self._hasher = hashlib.sha256()
        self._receiver = ArtifactReceiver(lambda _files: self)
        self._receiver.header(files)

    def feed(self, data: bytes) -> None:
        with _stream_errors():
            self._receiver.chunk(data)

    def close(self) -> None:
        """Completes trailing empty files; every declared byte must have arrived."""
        with _stream_errors():
            self._receiver.close()

    def abort(self) -> None:
        if self._handle is not None:
            self._handle.close()
            self._handle = None
        if self._temp is not None:
            self._temp.unlink(missing_ok=True)
            self._temp = None

    # FileSink, driven by the receiver

    def start(self, file: ArtifactFile) -> None:
        target = self._targets[file.path]
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, temp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".partial", dir=target.parent)
        self._handle = os.fdopen(fd, "wb")
        self._temp = Path(temp)
        self._hasher = hashlib.sha256()

    def write(self, data: memoryview) -> None:
        assert self._handle is not None
        self._handle.write(data)
        self._hasher.update(data)

    def end(self, file: ArtifactFile) -> None:
        assert self._handle is not None and self._temp is not None
        self._handle.close()
        self._handle = None
        actual = self._hasher.hexdigest()
        if actual != file.sha256:
            raise _data_loss(
                f"{file.path!r} hashes to {actual}, the manifest says {file.sha256}",
                path=file.path,
                expected_sha256=file.sha256,
                actual_sha256=actual,
            )
        os.replace(self._temp, self._targets[file.path])
        self._temp = None


@contextmanager
def _stream_errors() -> Iterator[None]:
    """The receiver's protocol violations as the SDK's DATA_LOSS errors."""
    try:
        yield
    except StreamViolation as violation:
        path = violation.path
        if violation.kind == "ended_inside":
            raise _data_loss(f"download ended inside {path!r}", path=path) from None
        if violation.kind == "ended_before":
            raise _data_loss(f"download ended before {path!r}", path=path) from None
        raise _data_loss("the server sent more bytes than its manifest declares") from None

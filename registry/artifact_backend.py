"""Where the registry's artifacts live: a local content-addressed folder (ArtifactStore) or a bucket.

With a bucket the registry keeps metadata only: trainers push snapshots and samplers pull them straight from the
store, and a publish checks the bucket with HEAD requests (the manifest's digest, every file's size) before the
version becomes visible. UploadArtifact and DownloadArtifact stay for clients without store credentials (an
import or export from a laptop): an upload is staged in a local folder, verified, pushed and then dropped; a
download streams the bucket's objects through in ranged reads. Both hold a bounded number of bytes in memory.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path
from typing import Protocol

from opentinker.weights.artifact_manifest import BLOCK_SIZE, ArtifactFile, ArtifactRef, corrupt, parse_uri
from opentinker.weights.artifact_remote import check_remote, delete_remote, object_key, push, remote_manifest
from opentinker.weights.artifact_store import ArtifactStore
from opentinker.weights.artifact_stream import FileWriter
from opentinker.weights.artifact_writer import ArtifactWriter
from opentinker.weights.object_store import ObjectStore, parse_store_url


class UploadWriter(FileWriter, Protocol):
    def commit(self) -> ArtifactRef: ...
    def abort(self) -> None: ...


class RegistryArtifacts(Protocol):
    """What the registry's handlers do with artifact bytes; ArtifactStore is the local implementation."""

    def begin(self) -> UploadWriter: ...
    def ref(self, uri: str) -> ArtifactRef: ...
    def manifest(self, uri: str) -> list[ArtifactFile]: ...
    def iter_chunks(self, uri: str, chunk_size: int = BLOCK_SIZE) -> Iterator[tuple[ArtifactFile, bytes]]: ...
    def delete(self, uri: str) -> int: ...
    def cleanup_temp(self) -> int: ...


class BucketArtifacts:
    """The registry's artifacts in a bucket; ``staging`` holds uploads while they arrive."""

    def __init__(self, remote: ObjectStore, staging: ArtifactStore) -> None:
        self.remote = remote
        self.staging = staging

    def describe(self) -> str:
        return self.remote.describe()

    def begin(self) -> UploadWriter:
        return _StagedUpload(self.staging.begin(), self.staging, self.remote)

    def ref(self, uri: str) -> ArtifactRef:
        return check_remote(self.remote, uri)  # HEAD only: the registry moves no artifact bytes to publish

    def manifest(self, uri: str) -> list[ArtifactFile]:
        return list(remote_manifest(self.remote, uri))

    def iter_chunks(self, uri: str, chunk_size: int = BLOCK_SIZE) -> Iterator[tuple[ArtifactFile, bytes]]:
        """Every file's bytes in manifest order, in the store stream's chunks (about 8 MiB: the handler cuts them
        into blocks; ``chunk_size`` is for the folder store), each file checked against its sha256 as it streams:
        a changed object ends the stream with DataLoss before its last chunk is sent (the receiver checks too)."""
        digest = parse_uri(uri)
        for entry in remote_manifest(self.remote, uri):
            hasher = hashlib.sha256()
            held = b""
            for chunk in self.remote.stream(object_key(digest, entry.path), entry.size):
                hasher.update(chunk)
                if held:
                    yield entry, held
                held = chunk
            if hasher.hexdigest() != entry.sha256:
                raise corrupt(digest, f"{entry.path} in {self.remote.describe()} does not match its sha256")
            if held:
                yield entry, held

    def delete(self, uri: str) -> int:
        return delete_remote(self.remote, uri)

    def written_before(self, cutoff_s: float) -> list[str]:
        """Digests under ``sha256/`` whose every object was last written before ``cutoff_s`` (epoch seconds):
        the candidates of the sweep (a push that finished, or was killed, that long ago). States live under
        ``states/`` and are never listed."""
        newest: dict[str, float] = {}
        for info in self.remote.list("sha256/"):
            digest = info.key.split("/", 2)[1] if info.key.count("/") >= 2 else ""
            if digest:
                newest[digest] = max(newest.get(digest, 0.0), info.modified)
        return sorted(d for d, modified in newest.items() if modified < cutoff_s)

    def cleanup_temp(self) -> int:
        return self.staging.cleanup_temp()


class _StagedUpload:
    """An upload written (and verified) into the staging folder, then pushed; the staged copy goes either way."""

    def __init__(self, writer: ArtifactWriter, staging: ArtifactStore, remote: ObjectStore) -> None:
        self._writer, self._staging, self._remote = writer, staging, remote

    def add_file(self, path: str, expected_size: int, expected_sha256: str) -> None:
        self._writer.add_file(path, expected_size, expected_sha256)

    def write(self, chunk: bytes | bytearray | memoryview) -> None:
        self._writer.write(chunk)

    def commit(self) -> ArtifactRef:
        ref = self._writer.commit()
        try:
            push(self._staging, self._remote, ref.uri)
        finally:
            self._staging.delete(ref.uri)
        return ref

    def abort(self) -> None:
        self._writer.abort()


def open_registry_artifacts(store: str | Path | None, data_dir: Path) -> RegistryArtifacts:
    """What ``--store`` names (default: ``<data dir>/artifacts``); with a bucket, uploads are staged in
    ``<data dir>/upload-staging``."""
    location = parse_store_url(str(store or data_dir / "artifacts"))
    if not location.remote:
        return ArtifactStore(Path(location.prefix))
    return BucketArtifacts(ObjectStore(location), ArtifactStore(data_dir / "upload-staging"))

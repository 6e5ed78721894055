"""Artifacts in an object store, in the local store's content-addressed layout under the store's prefix::

    sha256/<digest>/<path>          the payload files, uploaded first (multipart when large)
    sha256/<digest>/manifest.json   uploaded last: a manifest in the bucket means every file went up before it

A writer killed mid-upload leaves payload objects and no manifest: nothing names them, no reader looks for them,
and the registry's GC removes them after its grace period. Readers never trust the bucket: `pull` checks the
manifest against the digest in its key and every file's sha256 while it streams into the local store, so a
changed byte anywhere is DataLoss(DIGEST_MISMATCH) and nothing is cached.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from opentinker.rpc.serving.errors import DataLoss, NotFound, Unavailable
from opentinker.weights.artifact_manifest import (
    MANIFEST_NAME,
    ArtifactFile,
    ArtifactRef,
    corrupt,
    format_uri,
    manifest_bytes,
    parse_manifest,
    parse_uri,
)
from opentinker.weights.artifact_store import ArtifactStore
from opentinker.weights.object_store import PARALLEL, PART_BYTES, ObjectStore


@dataclass(frozen=True)
class Pushed:
    ref: ArtifactRef
    bytes_sent: int  # 0 when the bucket held every object already (a repeated push, a resumed migration)


def object_key(digest: str, path: str) -> str:
    return f"sha256/{digest}/{path}"


def push(local: ArtifactStore, remote: ObjectStore, uri: str) -> Pushed:
    """Uploads a (verified) local artifact: files whose object is missing or of another size, then the manifest.
    Idempotent and resumable: what is already in the bucket with the right size is not sent again."""
    digest = parse_uri(uri)
    files = local.manifest(uri)  # verifies every file before a byte leaves
    directory = local.path(uri)
    manifest = manifest_bytes(files)
    sent = 0
    for entry in files:
        key = object_key(digest, entry.path)
        present = remote.head(key)
        if present is not None and present.size == entry.size:
            continue
        with open(directory / entry.path, "rb") as source:
            remote.put_file(key, source)
        sent += entry.size
    manifest_key = object_key(digest, MANIFEST_NAME)
    present = remote.head(manifest_key)
    if present is None or present.size != len(manifest):
        remote.put_bytes(manifest_key, manifest)
        sent += len(manifest)
    size = sum(entry.size for entry in files) + len(manifest)
    return Pushed(ArtifactRef(uri=format_uri(digest), sha256=digest, size_bytes=size), sent)


def remote_manifest(remote: ObjectStore, uri: str) -> tuple[ArtifactFile, ...]:
    """The artifact's files as its manifest in the bucket lists them, after checking the manifest's own digest.
    NotFound(ARTIFACT_NOT_FOUND) when there is no manifest (never uploaded, or an upload that did not finish)."""
    digest = parse_uri(uri)
    try:
        data = remote.get_bytes(object_key(digest, MANIFEST_NAME))
    except NotFound:
        raise NotFound(f"artifact {uri} is not in {remote.describe()}", reason="ARTIFACT_NOT_FOUND", uri=uri) from None
    if hashlib.sha256(data).hexdigest() != digest:
        raise corrupt(digest, f"the manifest in {remote.describe()} does not hash to its digest")
    return parse_manifest(data, digest)


def check_remote(remote: ObjectStore, uri: str) -> ArtifactRef:
    """What the registry checks before a version naming ``uri`` becomes visible: the manifest is there and hashes
    to the digest, and every file it lists is there with the listed size (HEAD only: the registry moves no
    artifact bytes; readers check the files' sha256)."""
    digest = parse_uri(uri)
    files = remote_manifest(remote, uri)
    for entry in files:
        present = remote.head(object_key(digest, entry.path))
        if present is None:
            raise NotFound(
                f"artifact {uri} is incomplete in {remote.describe()}: {entry.path} is missing",
                reason="ARTIFACT_NOT_FOUND",
                uri=uri,
                path=entry.path,
            )
        if present.size != entry.size:
            raise _wrong_size(digest, entry, present.size)
    size = sum(entry.size for entry in files) + len(manifest_bytes(files))
    return ArtifactRef(uri=format_uri(digest), sha256=digest, size_bytes=size)


def pull(remote: ObjectStore, local: ArtifactStore, uri: str, *, guess: Sequence[str] = (), size_hint: int = 0) -> int:
    """Fetches ``uri`` into the local store unless it is there already; returns the bytes fetched. Files up to
    PART_BYTES (configs, small adapters) are fetched all at once, in parallel, as soon as the manifest is read;
    larger ones stream in (ObjectStore.stream). Every file is hashed on the way; a mismatch is DataLoss and
    leaves nothing.

    ``guess``: paths the caller expects the artifact to hold (a peft adapter's two files), fetched whole at the
    same time as the manifest when ``size_hint`` (the artifact's bytes, from the registry) is at most PART_BYTES:
    a small reload then waits on one round trip instead of two. Guesses are only bytes in hand: the manifest
    read after them decides what the artifact is, and each is written (and hashed) as the file it lists."""
    if local.exists(uri):
        return 0
    digest = parse_uri(uri)
    fetched = 0
    with ThreadPoolExecutor(PARALLEL, thread_name_prefix="store-pull") as pool, local.begin() as writer:
        guessed = (
            {path: pool.submit(remote.get_bytes, object_key(digest, path)) for path in guess}
            if 0 < size_hint <= PART_BYTES
            else {}
        )
        files = remote_manifest(remote, uri)
        # One round trip for all the small files instead of one each: what a reload of a small adapter waits on.
        small = {
            e.path: guessed.get(e.path) or pool.submit(remote.get_range, object_key(digest, e.path), 0, e.size)
            for e in files
            if 0 < e.size <= PART_BYTES
        }
        for entry in files:
            writer.add_file(entry.path, entry.size, entry.sha256)
            key = object_key(digest, entry.path)
            try:
                chunks = [_small_file(small[entry.path], digest, entry)] if entry.path in small else None
                for chunk in chunks or remote.stream(key, entry.size):
                    writer.write(chunk)
                    fetched += len(chunk)
            except NotFound:
                raise NotFound(
                    f"artifact {uri} is incomplete in {remote.describe()}: {entry.path} is missing",
                    reason="ARTIFACT_NOT_FOUND",
                    uri=uri,
                    path=entry.path,
                ) from None
            except Unavailable:
                # A range past the end of a truncated object fails like a network error: tell them apart.
                present = remote.head(key)
                if present is not None and present.size != entry.size:
                    raise _wrong_size(digest, entry, present.size) from None
                raise
        ref = writer.commit()
    if ref.sha256 != digest:  # cannot differ when the manifest parsed canonically; a guard, not a path
        raise DataLoss(f"artifact {uri} rebuilt as {ref.uri}", reason="DIGEST_MISMATCH", uri=uri)
    return fetched


def _small_file(fetch: Future[bytes], digest: str, entry: ArtifactFile) -> bytes:
    """A small file's bytes. A guessed GET reads the whole object, so its length is the stored size: another
    size than the manifest's is the same DataLoss as a ranged GET that came up short."""
    data = fetch.result()
    if len(data) != entry.size:
        raise _wrong_size(digest, entry, len(data))
    return data


def delete_remote(remote: ObjectStore, uri: str) -> int:
    """Removes the artifact's objects, its manifest first (from then on no reader sees the artifact); returns the
    bytes removed. Repeatable: what is already gone is skipped, so an interrupted delete is finished by the next."""
    digest = parse_uri(uri)
    manifest_key = object_key(digest, MANIFEST_NAME)
    objects = sorted(remote.list(f"sha256/{digest}/"), key=lambda info: info.key != manifest_key)
    for info in objects:
        remote.delete(info.key)
    return sum(info.size for info in objects)


def _wrong_size(digest: str, entry: ArtifactFile, stored: int) -> DataLoss:
    return corrupt(digest, f"{entry.path} is {stored} bytes in the store, not {entry.size}", path=entry.path)

"""Content-addressed artifact store: adapter snapshots written by the trainer, read by samplers.

Layout under ``root``::

    sha256/<digest>/manifest.json   canonical JSON naming every payload file with its sha256 and size
    sha256/<digest>/<path>          the payload (peft: adapter_config.json, adapter_model.safetensors, ...)
    tmp/<name>/                     an artifact being written, or one being deleted
    tmp/<name>.lock                 flock(2)-held by the live process that owns tmp/<name>/

The manifest format and URIs are described in ``artifact_manifest``.

Crash safety (the trainer may be SIGKILLed at any instant): a writer builds the whole artifact inside a fresh
``tmp/<name>/``, fsyncing every file, the manifest and every directory, and then renames it to
``sha256/<digest>`` in one atomic step and fsyncs ``sha256/``. Readers only look under ``sha256/``, so they
see an artifact completely or not at all. Whatever a crash leaves in ``tmp/`` is removed by
``cleanup_temp()``; the flock on ``tmp/<name>.lock`` (released by the kernel when its owner dies) tells a
crashed writer's leftovers from a live writer's work in progress, so cleanup is safe to run from any process
at any time. Deletion renames the artifact into ``tmp/`` before removing it, so no reader ever sees a
half-deleted directory. ``fault_hook`` is called with a point name between steps ("temp_created",
"file_written:<path>", "manifest_written", "before_rename", "after_rename" or "already_committed",
"delete_renamed") so tests can kill the process at each of them.

Content addressing makes commits idempotent: committing bytes that are already stored verifies the stored
copy and drops the new one (or, if the stored copy is corrupt, replaces it). Reads (``path``, ``manifest``,
``ref``, ``iter_chunks``) verify the whole artifact first, every time: the manifest against the directory
name, and every file's size and sha256 against the manifest; any difference, including a missing, truncated
or extra file, a symlink or a malformed manifest, is ``DataLoss(reason="DIGEST_MISMATCH")``.

All sizes in ``ArtifactRef.size_bytes`` (and the value ``delete`` returns) count the payload files plus
manifest.json, i.e. the bytes the artifact occupies on disk.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import stat
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from opentinker.rpc.serving.errors import DataLoss, InvalidArgument, NotFound, Unavailable
from opentinker.weights.artifact_fs import (
    LOCK_SUFFIX,
    TempSlot,
    fsync_dir,
    open_nofollow,
    reap_slot,
    scan_tree,
    tree_bytes,
)
from opentinker.weights.artifact_manifest import (
    BLOCK_SIZE,
    MANIFEST_NAME,
    ArtifactFile,
    ArtifactRef,
    check_paths,
    corrupt,
    format_uri,
    hash_file,
    not_found,
    parents,
    parse_manifest,
    parse_uri,
    printable,
)
from opentinker.weights.artifact_writer import ArtifactWriter

_MAX_MANIFEST_BYTES = 16 << 20
_PUBLISH_ATTEMPTS = 8
# rename(2) of a directory onto an existing one: ENOTEMPTY/EEXIST (a directory), ENOTDIR (something else).
_DEST_TAKEN = frozenset({errno.EEXIST, errno.ENOTEMPTY, errno.ENOTDIR})
# Errors that mean the stored bytes are gone or unreadable rather than that we are misconfigured.
_CORRUPT_ERRNOS = frozenset({errno.ENOENT, errno.ENOTDIR, errno.ELOOP, errno.EIO, errno.EISDIR})


class ArtifactStore:
    """The store rooted at ``root``. Thread-safe and multi-process safe; one root may be shared by many
    processes on one filesystem (rename and flock must behave as POSIX says: a local disk, not NFS)."""

    def __init__(self, root: Path, *, fault_hook: Callable[[str], None] | None = None, durable: bool = True) -> None:
        self.root = Path(root)
        # durable=False: no fsync at all, for a cache of what a bucket holds. Every read verifies the digests, so
        # what a power cut leaves torn is found, dropped and fetched again; the fsyncs cost a reload ~2.5 ms.
        self.durable = durable
        self._objects = self.root / "sha256"
        self._tmp = self.root / "tmp"
        self._fault_hook = fault_hook
        for directory in (self.root, self._objects, self._tmp):
            directory.mkdir(parents=True, exist_ok=True)
        # The two subdirectory entries must survive a power cut before anything is renamed into them.
        self._sync_dir(self.root)

    # -- writing ----------------------------------------------------------------------------------------

    def begin(self) -> ArtifactWriter:
        """An incremental writer (for chunked uploads). Use it as a context manager, or commit()/abort()."""
        slot = TempSlot(self._tmp)
        try:
            os.mkdir(slot.path)
            self._fault("temp_created")
        except BaseException:
            slot.release()
            raise
        return ArtifactWriter(slot, self._fault, self._publish, durable=self.durable)

    def commit_files(self, files: Mapping[str, bytes]) -> ArtifactRef:
        """Stores ``{relative path: content}``; InvalidArgument before any I/O if a path is bad."""
        items = sorted(files.items())
        check_paths(path for path, _ in items)
        with self.begin() as writer:
            for path, data in items:
                writer.add_bytes(path, data)
            return writer.commit()

    def commit_dir(self, src: Path) -> ArtifactRef:
        """Stores every regular file under ``src`` (recursively, by relative path). Symlinks and special
        files are rejected (InvalidArgument INVALID_ARTIFACT_SOURCE): following them could pull in data
        from outside ``src``. Empty subdirectories are not represented. A top-level manifest.json is
        rejected, so a directory returned by ``path()`` cannot be re-committed as is."""
        entries = _scan_source(Path(src))
        check_paths(rel for rel, _ in entries)
        with self.begin() as writer:
            for rel, full in entries:
                with open_nofollow(full) as source:
                    writer.copy_file(rel, source)
            return writer.commit()

    # -- reading ----------------------------------------------------------------------------------------

    def path(self, uri: str) -> Path:
        """The artifact's directory, after verifying all of it. Do not modify it. It may vanish if someone
        deletes the artifact; load from it right away."""
        return self._verify(parse_uri(uri)).directory

    def manifest(self, uri: str) -> list[ArtifactFile]:
        """The payload files, sorted by path, after verifying all of them."""
        return list(self._verify(parse_uri(uri)).files)

    def ref(self, uri: str) -> ArtifactRef:
        """The ArtifactRef of a stored artifact, after verifying all of it."""
        digest = parse_uri(uri)
        return self._verify(digest).ref(digest)

    def exists(self, uri: str) -> bool:
        """Whether the artifact's directory is present. Cheap: nothing is verified (``path()`` does that)."""
        try:
            return stat.S_ISDIR(os.lstat(self._objects / parse_uri(uri)).st_mode)
        except FileNotFoundError:
            return False

    def iter_chunks(self, uri: str, chunk_size: int = BLOCK_SIZE) -> Iterator[tuple[ArtifactFile, bytes]]:
        """The files' bytes in manifest order, in chunks of at most ``chunk_size``; every file yields at least
        one chunk (an empty file yields exactly one, empty). The artifact is verified before this returns
        (errors surface at the call, not at the first ``next``), and each file is hashed again while it
        streams: its last chunk is held back until the whole file checks out, so a consumer never receives
        a complete file with the wrong bytes without a DataLoss."""
        if chunk_size <= 0:
            raise InvalidArgument(f"chunk_size must be positive, got {chunk_size}", chunk_size=chunk_size)
        digest = parse_uri(uri)
        return self._stream(digest, self._verify(digest), chunk_size)

    # -- removal ----------------------------------------------------------------------------------------

    def delete(self, uri: str) -> int:
        """Removes the artifact; returns the bytes freed (0 if it was absent). Safe to repeat."""
        digest = parse_uri(uri)
        directory = self._objects / digest
        if not os.path.lexists(directory):
            return 0
        slot = TempSlot(self._tmp)
        try:
            try:
                # One atomic step takes the artifact out of sight; the slow rmtree happens inside tmp/.
                os.rename(directory, slot.path)
            except FileNotFoundError:
                return 0  # a concurrent delete won
            self._sync_dir(self._objects)
            self._fault("delete_renamed")
            return tree_bytes(slot.path)
        finally:
            slot.release()

    def cleanup_temp(self) -> int:
        """Removes what crashed writers and deleters left in tmp/; returns how many leftovers it removed.
        Work in progress of live writers (in any process) is left alone."""
        stems = {name.removesuffix(LOCK_SUFFIX) for name in os.listdir(self._tmp)}
        return sum(reap_slot(self._tmp, stem) for stem in sorted(stems))

    # -- internals --------------------------------------------------------------------------------------

    def _sync_dir(self, path: Path) -> None:
        if self.durable:
            fsync_dir(path)

    def _fault(self, point: str) -> None:
        if self._fault_hook is not None:
            self._fault_hook(point)

    def _publish(self, slot: TempSlot, digest: str, ref: ArtifactRef) -> ArtifactRef:
        """Renames the finished temp dir to sha256/<digest>, or keeps an identical copy already there."""
        destination = self._objects / digest
        for _ in range(_PUBLISH_ATTEMPTS):
            try:
                os.rename(slot.path, destination)
            except OSError as error:
                if error.errno not in _DEST_TAKEN:
                    raise
            else:
                self._fault("after_rename")
                self._sync_dir(self._objects)
                return ref
            # Someone stored the same digest, hence the same bytes (possibly a racing writer right now).
            try:
                self._verify(digest)
            except NotFound:
                continue  # deleted since our rename failed: try again
            except DataLoss:
                # The stored copy is corrupt and ours is good: move it aside and put ours in its place.
                self._evict(destination)
                continue
            self._fault("already_committed")
            return ref
        raise Unavailable(
            f"could not commit {format_uri(digest)}: it kept changing under concurrent writers and deleters",
            reason="ARTIFACT_COMMIT_CONFLICT",
            uri=format_uri(digest),
        )

    def _evict(self, destination: Path) -> None:
        slot = TempSlot(self._tmp)
        try:
            with contextlib.suppress(FileNotFoundError):
                os.rename(destination, slot.path)
            self._sync_dir(self._objects)
        finally:
            slot.release()

    def _verify(self, digest: str) -> _Verified:
        directory = self._objects / digest
        try:
            return _verify_dir(directory, digest)
        except DataLoss:
            # Files vanishing mid-check because a concurrent delete renamed the directory away is absence,
            # not corruption.
            if not os.path.lexists(directory):
                raise not_found(digest) from None
            raise

    def _stream(self, digest: str, verified: _Verified, chunk_size: int) -> Iterator[tuple[ArtifactFile, bytes]]:
        for entry in verified.files:
            try:
                source = open_nofollow(verified.directory / entry.path)
            except OSError as error:
                if not os.path.lexists(verified.directory):
                    raise not_found(digest) from error
                raise corrupt(digest, f"cannot open {entry.path!r}: {error.strerror}", path=entry.path) from error
            with source:
                hasher = hashlib.sha256()
                remaining = entry.size
                while True:
                    block = source.read(min(chunk_size, remaining)) if remaining else b""
                    if remaining and not block:
                        raise corrupt(digest, f"{entry.path!r} was truncated while streaming", path=entry.path)
                    hasher.update(block)
                    remaining -= len(block)
                    if remaining:
                        yield entry, block
                        continue
                    if source.read(1) or hasher.hexdigest() != entry.sha256:
                        raise corrupt(digest, f"{entry.path!r} changed while streaming", path=entry.path)
                    yield entry, block
                    break


@dataclass(frozen=True, slots=True)
class _Verified:
    directory: Path
    files: tuple[ArtifactFile, ...]
    manifest_size: int

    def ref(self, digest: str) -> ArtifactRef:
        size = sum(entry.size for entry in self.files) + self.manifest_size
        return ArtifactRef(uri=format_uri(digest), sha256=digest, size_bytes=size)


def _verify_dir(directory: Path, digest: str) -> _Verified:
    try:
        mode = os.lstat(directory).st_mode
    except FileNotFoundError:
        raise not_found(digest) from None
    if not stat.S_ISDIR(mode):
        raise corrupt(digest, "not a directory")
    try:
        manifest_path = directory / MANIFEST_NAME
        if not stat.S_ISREG(os.lstat(manifest_path).st_mode):
            raise corrupt(digest, f"{MANIFEST_NAME} is not a regular file")
        with open_nofollow(manifest_path) as handle:
            manifest = handle.read(_MAX_MANIFEST_BYTES + 1)
        if len(manifest) > _MAX_MANIFEST_BYTES:
            raise corrupt(digest, f"{MANIFEST_NAME} is larger than {_MAX_MANIFEST_BYTES} bytes")
        actual_digest = hashlib.sha256(manifest).hexdigest()
        if actual_digest != digest:
            raise corrupt(digest, f"{MANIFEST_NAME} hashes to {actual_digest}", actual_sha256=actual_digest)
        files = parse_manifest(manifest, digest)

        found, found_dirs, odd = scan_tree(directory)
        if odd:
            raise corrupt(digest, f"symlink or special file {odd[0]!a}", path=printable(odd[0]))
        expected = {entry.path: entry for entry in files}
        extra = sorted(set(found) - set(expected) - {MANIFEST_NAME})
        if extra:
            raise corrupt(digest, f"file {extra[0]!a} is not in the manifest", path=printable(extra[0]))
        missing = sorted(set(expected) - set(found))
        if missing:
            raise corrupt(digest, f"file {missing[0]!r} is missing", path=missing[0])
        extra_dirs = sorted(found_dirs - {parent for path in expected for parent in parents(path)})
        if extra_dirs:
            raise corrupt(digest, f"directory {extra_dirs[0]!a} is not in the manifest")
        # Sizes first: a truncated file is caught without reading anything.
        for entry in files:
            if found[entry.path] != entry.size:
                raise corrupt(
                    digest,
                    f"{entry.path!r} has {found[entry.path]} bytes, the manifest says {entry.size}",
                    path=entry.path,
                    expected_size=entry.size,
                    actual_size=found[entry.path],
                )
        for entry in files:
            actual_sha, actual_size = hash_file(directory / entry.path)
            if (actual_sha, actual_size) != (entry.sha256, entry.size):
                raise corrupt(
                    digest,
                    f"{entry.path!r} hashes to {actual_sha}, the manifest says {entry.sha256}",
                    path=entry.path,
                    expected_sha256=entry.sha256,
                    actual_sha256=actual_sha,
                )
    except OSError as error:
        if error.errno not in _CORRUPT_ERRNOS:
            raise
        raise corrupt(digest, f"unreadable: {error.strerror}") from error  # not the path: the client sees it
    return _Verified(directory, files, len(manifest))


def _scan_source(src: Path) -> list[tuple[str, Path]]:
    if not src.is_dir():
        raise InvalidArgument(f"{src} is not a directory", reason="INVALID_ARTIFACT_SOURCE", source=printable(str(src)))
    files, _, odd = scan_tree(src)
    if odd:
        raise InvalidArgument(
            f"{src}: {odd[0]!a} is a symlink or special file; only regular files can be stored",
            reason="INVALID_ARTIFACT_SOURCE",
            path=printable(odd[0]),
        )
    if not files:
        raise InvalidArgument(f"{src} contains no files", reason="EMPTY_ARTIFACT")
    return [(rel, src / rel) for rel in sorted(files)]

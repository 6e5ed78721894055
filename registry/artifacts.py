"""Content-addressed artifact store: adapter snapshots written by the trainer, read by samplers.

Layout under ``root``::

    sha256/<digest>/manifest.json   canonical JSON naming every payload file with its sha256 and size
    sha256/<digest>/<path>          the payload (peft: adapter_config.json, adapter_model.safetensors, ...)
    tmp/<name>/                     an artifact being written, or one being deleted
    tmp/<name>.lock                 flock(2)-held by the live process that owns tmp/<name>/

``manifest.json`` is ``{"files": [{"path", "sha256", "size"}, ...], "format": 1}`` with the files sorted by
path, serialized with sorted keys, no whitespace, ASCII only and a trailing newline, so equal content always
gives equal bytes. The artifact digest is the sha256 of those bytes (it covers every file's name, size and
content) and ``sha256:<digest>`` is the artifact's URI. Payload paths are relative POSIX paths ("/"
separated, subdirectories allowed); a top-level ``manifest.json`` is reserved.

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
import fcntl
import hashlib
import io
import json
import os
import re
import shutil
import stat
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Final

from opentinker.rpc.errors import (
    DataLoss,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    Unavailable,
)

URI_PREFIX: Final = "sha256:"
MANIFEST_NAME: Final = "manifest.json"
MANIFEST_FORMAT: Final = 1
BLOCK_SIZE: Final = 1 << 20

_HEX64 = re.compile(r"[0-9a-f]{64}")  # always used with fullmatch
_LOCK_SUFFIX = ".lock"
_MAX_PATH_CHARS = 1024
_MAX_COMPONENT_BYTES = 255  # NAME_MAX on every filesystem we care about
_MAX_MANIFEST_BYTES = 16 << 20
_PUBLISH_ATTEMPTS = 8
# rename(2) of a directory onto an existing one: ENOTEMPTY/EEXIST (a directory), ENOTDIR (something else).
_DEST_TAKEN = frozenset({errno.EEXIST, errno.ENOTEMPTY, errno.ENOTDIR})
# Errors that mean the stored bytes are gone or unreadable rather than that we are misconfigured.
_CORRUPT_ERRNOS = frozenset({errno.ENOENT, errno.ENOTDIR, errno.ELOOP, errno.EIO, errno.EISDIR})
_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})


@dataclass(frozen=True, slots=True)
class ArtifactFile:
    """One payload file as the manifest records it."""

    path: str
    sha256: str
    size: int


@dataclass(frozen=True, slots=True)
class ArtifactRef:
    """A committed artifact. ``size_bytes`` = payload file sizes + the manifest.json size (bytes on disk)."""

    uri: str
    sha256: str
    size_bytes: int


def parse_uri(uri: str) -> str:
    """The hex digest of ``sha256:<64 hex>`` or of a bare 64-hex digest (either case; returned lowercase)."""
    body = uri.removeprefix(URI_PREFIX).lower()
    if not _HEX64.fullmatch(body):
        raise InvalidArgument(
            f"invalid artifact uri {uri!r}: expected 'sha256:' followed by 64 hex digits",
            reason="INVALID_ARTIFACT_URI",
            uri=_printable(uri),
        )
    return body


def format_uri(digest: str) -> str:
    return URI_PREFIX + digest


def check_artifact_path(path: str) -> str:
    """Returns ``path`` if it may name a payload file, else raises InvalidArgument(INVALID_ARTIFACT_PATH)."""
    problem = _path_problem(path)
    if problem is not None:
        raise InvalidArgument(
            f"invalid artifact path {path!r}: {problem}",
            reason="INVALID_ARTIFACT_PATH",
            path=_printable(path),
        )
    return path


class ArtifactStore:
    """The store rooted at ``root``. Thread-safe and multi-process safe; one root may be shared by many
    processes on one filesystem (rename and flock must behave as POSIX says: a local disk, not NFS)."""

    def __init__(self, root: Path, *, fault_hook: Callable[[str], None] | None = None) -> None:
        self.root = Path(root)
        self._objects = self.root / "sha256"
        self._tmp = self.root / "tmp"
        self._fault_hook = fault_hook
        for directory in (self.root, self._objects, self._tmp):
            directory.mkdir(parents=True, exist_ok=True)
        # The two subdirectory entries must survive a power cut before anything is renamed into them.
        _fsync_dir(self.root)

    # -- writing ----------------------------------------------------------------------------------------

    def begin(self) -> ArtifactWriter:
        """An incremental writer (for chunked uploads). Use it as a context manager, or commit()/abort()."""
        slot = _TempSlot(self._tmp)
        try:
            os.mkdir(slot.path)
            self._fault("temp_created")
        except BaseException:
            slot.release()
            raise
        return ArtifactWriter(slot, self._fault, self._publish)

    def commit_files(self, files: Mapping[str, bytes]) -> ArtifactRef:
        """Stores ``{relative path: content}``; InvalidArgument before any I/O if a path is bad."""
        items = sorted(files.items())
        _check_paths(path for path, _ in items)
        with self.begin() as writer:
            for path, data in items:
                writer._start_file(path, len(data), None)
                writer.write(data)
            return writer.commit()

    def commit_dir(self, src: Path) -> ArtifactRef:
        """Stores every regular file under ``src`` (recursively, by relative path). Symlinks and special
        files are rejected (InvalidArgument INVALID_ARTIFACT_SOURCE): following them could pull in data
        from outside ``src``. Empty subdirectories are not represented. A top-level manifest.json is
        rejected, so a directory returned by ``path()`` cannot be re-committed as is."""
        entries = _scan_source(Path(src))
        _check_paths(rel for rel, _ in entries)
        with self.begin() as writer:
            for rel, full in entries:
                # Hash what we write, not what we listed: the manifest matches the temp copy even if the
                # source changes under us.
                writer._start_file(rel, None, None)
                with _open_nofollow(full) as source:
                    while block := source.read(BLOCK_SIZE):
                        writer.write(block)
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
        slot = _TempSlot(self._tmp)
        try:
            try:
                # One atomic step takes the artifact out of sight; the slow rmtree happens inside tmp/.
                os.rename(directory, slot.path)
            except FileNotFoundError:
                return 0  # a concurrent delete won
            _fsync_dir(self._objects)
            self._fault("delete_renamed")
            return _tree_bytes(slot.path)
        finally:
            slot.release()

    def cleanup_temp(self) -> int:
        """Removes what crashed writers and deleters left in tmp/; returns how many leftovers it removed.
        Work in progress of live writers (in any process) is left alone."""
        stems = {name.removesuffix(_LOCK_SUFFIX) for name in os.listdir(self._tmp)}
        return sum(self._reap(stem) for stem in sorted(stems))

    # -- internals --------------------------------------------------------------------------------------

    def _fault(self, point: str) -> None:
        if self._fault_hook is not None:
            self._fault_hook(point)

    def _publish(self, slot: _TempSlot, digest: str, ref: ArtifactRef) -> ArtifactRef:
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
                _fsync_dir(self._objects)
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
        slot = _TempSlot(self._tmp)
        try:
            with contextlib.suppress(FileNotFoundError):
                os.rename(destination, slot.path)
            _fsync_dir(self._objects)
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
                raise _not_found(digest) from None
            raise

    def _stream(self, digest: str, verified: _Verified, chunk_size: int) -> Iterator[tuple[ArtifactFile, bytes]]:
        for entry in verified.files:
            try:
                source = _open_nofollow(verified.directory / entry.path)
            except OSError as error:
                if not os.path.lexists(verified.directory):
                    raise _not_found(digest) from error
                raise _corrupt(digest, f"cannot open {entry.path!r}: {error}", path=entry.path) from error
            with source:
                hasher = hashlib.sha256()
                remaining = entry.size
                while True:
                    block = source.read(min(chunk_size, remaining)) if remaining else b""
                    if remaining and not block:
                        raise _corrupt(digest, f"{entry.path!r} was truncated while streaming", path=entry.path)
                    hasher.update(block)
                    remaining -= len(block)
                    if remaining:
                        yield entry, block
                        continue
                    if source.read(1) or hasher.hexdigest() != entry.sha256:
                        raise _corrupt(digest, f"{entry.path!r} changed while streaming", path=entry.path)
                    yield entry, block
                    break

    def _reap(self, stem: str) -> bool:
        path = self._tmp / stem
        lock_path = self._tmp / (stem + _LOCK_SUFFIX)
        try:
            fd = os.open(lock_path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            # Owners create the lock before the directory and remove it after, so an unlocked directory
            # belongs to nobody alive.
            return _remove(path)
        except OSError:
            # Not a lock file we made (a directory, a symlink): junk.
            return _remove(path) | _remove(lock_path)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return False  # its owner is alive
            if not _same_file(lock_path, fd):
                return False  # another cleanup got here first
            _remove(path)
            _remove(lock_path)
            return True
        finally:
            os.close(fd)


class ArtifactWriter:
    """Builds one artifact: ``add_file(path, size, sha256)``, then ``write`` its bytes in chunks (a chunk
    never spans two files), then the next file, then ``commit()``. A file is checked as soon as its
    expected size is reached (a later ``add_file``/``commit`` catches a short one). A mismatch raises
    DataLoss(DIGEST_MISMATCH) and aborts the writer (temp files removed); so does any other failure
    after the writer has started changing files. InvalidArgument for a bad path or header changes nothing:
    the writer stays usable. Not thread-safe."""

    def __init__(
        self,
        slot: _TempSlot,
        fault: Callable[[str], None],
        publish: Callable[[_TempSlot, str, ArtifactRef], ArtifactRef],
    ) -> None:
        self._slot = slot
        self._fault = fault
        self._publish = publish
        self._files: list[ArtifactFile] = []
        self._paths = _PathSet()
        self._dirs: list[Path] = []  # subdirectories we created; fsynced before the rename
        self._current: _PendingFile | None = None
        self._last_full: str | None = None  # a file completed by reaching its expected size
        self._state = "open"

    def __enter__(self) -> ArtifactWriter:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._state != "committed":
            self.abort()

    def add_file(self, path: str, expected_size: int, expected_sha256: str) -> None:
        """Starts the next file; its bytes must be exactly ``expected_size`` long and hash to
        ``expected_sha256`` (64 hex digits)."""
        self._check_open()
        if isinstance(expected_size, bool) or not isinstance(expected_size, int) or expected_size < 0:
            raise InvalidArgument(f"invalid size {expected_size!r} for {path!r}", reason="INVALID_ARTIFACT_FILE")
        sha = expected_sha256.lower()
        if not _HEX64.fullmatch(sha):
            raise InvalidArgument(
                f"invalid sha256 {expected_sha256!r} for {path!r}: expected 64 hex digits",
                reason="INVALID_ARTIFACT_FILE",
            )
        self._start_file(path, expected_size, sha)

    def write(self, chunk: bytes | bytearray | memoryview) -> None:
        """Appends bytes to the current file."""
        self._check_open()
        view = memoryview(chunk)
        current = self._current
        if current is None:
            if not view.nbytes:
                return
            if self._last_full is None:
                raise FailedPrecondition("write() before add_file()", reason="NO_OPEN_FILE")
            with self._aborting():
                raise DataLoss(
                    f"more bytes than declared for {self._last_full!r}",
                    reason="DIGEST_MISMATCH",
                    path=self._last_full,
                )
        with self._aborting():
            expected = current.expected_size
            if expected is not None and current.written + view.nbytes > expected:
                raise DataLoss(
                    f"more bytes than declared for {current.path!r}: over {expected}",
                    reason="DIGEST_MISMATCH",
                    path=current.path,
                    expected_size=expected,
                )
            current.file.write(view)
            current.hasher.update(view)
            current.written += view.nbytes
            if current.written == expected:
                self._finish_file()
                self._last_full = current.path

    def commit(self) -> ArtifactRef:
        """Verifies the last file, writes the manifest and publishes the artifact atomically."""
        self._check_open()
        if not self._files and self._current is None:
            raise InvalidArgument("an artifact needs at least one file", reason="EMPTY_ARTIFACT")
        with self._aborting():
            self._finish_file()
            manifest = _manifest_bytes(self._files)
            digest = hashlib.sha256(manifest).hexdigest()
            _write_synced(self._slot.path / MANIFEST_NAME, manifest)
            self._fault("manifest_written")
            # The new entries in each directory must be durable before the rename makes them visible.
            for directory in reversed(self._dirs):
                _fsync_dir(directory)
            _fsync_dir(self._slot.path)
            self._fault("before_rename")
            size = sum(entry.size for entry in self._files) + len(manifest)
            ref = ArtifactRef(uri=format_uri(digest), sha256=digest, size_bytes=size)
            ref = self._publish(self._slot, digest, ref)
            self._state = "committed"
        self._slot.release()
        return ref

    def abort(self) -> None:
        """Discards everything written. Safe to call more than once, and a no-op after commit()."""
        if self._state != "open":
            return
        self._state = "aborted"
        if self._current is not None:
            self._current.file.close()
            self._current = None
        self._slot.release()

    def _start_file(self, path: str, expected_size: int | None, expected_sha256: str | None) -> None:
        self._check_open()
        check_artifact_path(path)
        if self._paths.conflict(path):
            raise InvalidArgument(
                f"artifact path {path!r} repeats or overlaps an earlier file",
                reason="INVALID_ARTIFACT_PATH",
                path=path,
            )
        with self._aborting():
            self._finish_file()
            for parent in _parents(path):
                directory = self._slot.path / parent
                if directory not in self._dirs:
                    os.mkdir(directory)
                    self._dirs.append(directory)
            file = open(self._slot.path / path, "xb")  # noqa: SIM115 (closed by _finish_file or abort)
            self._paths.add(path)
            self._current = _PendingFile(path, file, hashlib.sha256(), 0, expected_size, expected_sha256)
            self._last_full = None
            if expected_size == 0:
                self._finish_file()
                self._last_full = path

    def _finish_file(self) -> None:
        current = self._current
        if current is None:
            return
        self._current = None
        try:
            current.file.flush()
            os.fsync(current.file.fileno())
        finally:
            current.file.close()
        actual = current.hasher.hexdigest()
        if current.expected_size is not None and current.written != current.expected_size:
            raise DataLoss(
                f"{current.path!r}: got {current.written} bytes, declared {current.expected_size}",
                reason="DIGEST_MISMATCH",
                path=current.path,
                expected_size=current.expected_size,
                actual_size=current.written,
            )
        if current.expected_sha256 is not None and actual != current.expected_sha256:
            raise DataLoss(
                f"{current.path!r}: sha256 {actual}, declared {current.expected_sha256}",
                reason="DIGEST_MISMATCH",
                path=current.path,
                expected_sha256=current.expected_sha256,
                actual_sha256=actual,
            )
        self._files.append(ArtifactFile(current.path, actual, current.written))
        self._fault(f"file_written:{current.path}")

    def _check_open(self) -> None:
        if self._state != "open":
            raise FailedPrecondition(f"the artifact writer is {self._state}", reason="WRITER_CLOSED")

    @contextlib.contextmanager
    def _aborting(self) -> Iterator[None]:
        """Any failure inside aborts the writer: a half-written temp dir is never useful."""
        try:
            yield
        except BaseException as error:
            self.abort()
            if isinstance(error, OSError) and error.errno in _FULL_ERRNOS:
                raise ResourceExhausted(f"artifact store is full: {error}", reason="STORAGE_FULL") from error
            raise


# -- helpers ------------------------------------------------------------------------------------------------


@dataclass(slots=True)
class _PendingFile:
    path: str
    file: io.BufferedWriter
    hasher: Any  # hashlib's hash object has no public type name
    written: int
    expected_size: int | None
    expected_sha256: str | None


@dataclass(frozen=True, slots=True)
class _Verified:
    directory: Path
    files: tuple[ArtifactFile, ...]
    manifest_size: int

    def ref(self, digest: str) -> ArtifactRef:
        size = sum(entry.size for entry in self.files) + self.manifest_size
        return ArtifactRef(uri=format_uri(digest), sha256=digest, size_bytes=size)


class _PathSet:
    """Payload paths seen so far, to reject duplicates and a file that is also another file's directory."""

    def __init__(self) -> None:
        self._files: set[str] = set()
        self._dirs: set[str] = set()

    def conflict(self, path: str) -> bool:
        return path in self._files or path in self._dirs or any(d in self._files for d in _parents(path))

    def add(self, path: str) -> None:
        self._files.add(path)
        self._dirs.update(_parents(path))


class _TempSlot:
    """``tmp/<name>`` (created by the caller) guarded by an flock on ``tmp/<name>.lock`` for as long as this
    object lives. The kernel drops the lock when the process dies, which is how cleanup tells leftovers of a
    crash from live work. Invariant: the lock file exists before the directory and outlives it."""

    def __init__(self, tmp: Path) -> None:
        while True:
            name = uuid.uuid4().hex
            lock_path = tmp / (name + _LOCK_SUFFIX)
            fd = os.open(lock_path, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_CLOEXEC, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                # A cleanup may have locked and unlinked the fresh file before we locked it: then our lock
                # guards nothing, so start over with another name.
                if _same_file(lock_path, fd):
                    break
            except BaseException:
                os.close(fd)
                raise
            os.close(fd)
        self.path = tmp / name
        self._lock_path = lock_path
        self._fd: int | None = fd

    def release(self) -> None:
        if self._fd is None:
            return
        _remove(self.path)
        _remove(self._lock_path)
        os.close(self._fd)
        self._fd = None


def _path_problem(path: str) -> str | None:
    if not path:
        return "empty"
    if len(path) > _MAX_PATH_CHARS:
        return f"longer than {_MAX_PATH_CHARS} characters"
    if path.startswith("/"):
        return "absolute"
    if "\\" in path:
        return "contains a backslash (the separator is '/')"
    if any(ord(char) < 0x20 or ord(char) == 0x7F for char in path):
        return "contains a control character"
    try:
        path.encode("utf-8")
    except UnicodeEncodeError:
        return "not valid UTF-8"
    for part in path.split("/"):
        if part in ("", ".", ".."):
            return "has an empty, '.' or '..' component"
        if len(part.encode("utf-8")) > _MAX_COMPONENT_BYTES:
            return f"has a component longer than {_MAX_COMPONENT_BYTES} bytes"
    if path == MANIFEST_NAME:
        return f"{MANIFEST_NAME} is reserved for the store"
    return None


def _check_paths(paths: Iterable[str]) -> None:
    seen = _PathSet()
    for path in paths:
        check_artifact_path(path)
        if seen.conflict(path):
            raise InvalidArgument(
                f"artifact path {path!r} overlaps another file (a file cannot also be a directory)",
                reason="INVALID_ARTIFACT_PATH",
                path=path,
            )
        seen.add(path)


def _parents(path: str) -> list[str]:
    """The ancestor directories of a payload path: "a/b/c" -> ["a", "a/b"]."""
    parts = path.split("/")
    return ["/".join(parts[:i]) for i in range(1, len(parts))]


def _printable(text: str) -> str:
    """Text safe for a gRPC status (valid UTF-8), for names that came from the disk or a client."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return ascii(text)
    return text


def _manifest_bytes(files: Iterable[ArtifactFile]) -> bytes:
    entries = [
        {"path": entry.path, "sha256": entry.sha256, "size": entry.size}
        for entry in sorted(files, key=lambda entry: entry.path)
    ]
    document = {"files": entries, "format": MANIFEST_FORMAT}
    text = json.dumps(document, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return (text + "\n").encode("ascii")


def _parse_manifest(data: bytes, digest: str) -> tuple[ArtifactFile, ...]:
    """Strict: anything but exactly what ``_manifest_bytes`` would write is DataLoss."""

    def malformed(why: str) -> DataLoss:
        return _corrupt(digest, f"malformed manifest: {why}")

    try:
        document = json.loads(data)
    except (ValueError, RecursionError) as error:
        raise malformed(f"not JSON ({error})") from None
    if not isinstance(document, dict) or set(document) != {"files", "format"}:
        raise malformed("expected exactly the keys 'files' and 'format'")
    if type(document["format"]) is not int or document["format"] != MANIFEST_FORMAT:
        raise malformed(f"unsupported format {document['format']!r}")
    entries = document["files"]
    if not isinstance(entries, list) or not entries:
        raise malformed("'files' must be a non-empty list")
    files: list[ArtifactFile] = []
    seen = _PathSet()
    for entry in entries:
        if not isinstance(entry, dict) or set(entry) != {"path", "sha256", "size"}:
            raise malformed("each file needs exactly 'path', 'sha256' and 'size'")
        path, sha, size = entry["path"], entry["sha256"], entry["size"]
        if not isinstance(path, str) or _path_problem(path) is not None or seen.conflict(path):
            raise malformed(f"bad or repeated path {path!r}")
        if not isinstance(sha, str) or not _HEX64.fullmatch(sha):
            raise malformed(f"bad sha256 for {path!r}")
        if type(size) is not int or size < 0:
            raise malformed(f"bad size for {path!r}")
        seen.add(path)
        files.append(ArtifactFile(path, sha, size))
    if _manifest_bytes(files) != data:
        raise malformed("not in canonical form (order, spacing or encoding)")
    return tuple(files)


def _verify_dir(directory: Path, digest: str) -> _Verified:
    try:
        mode = os.lstat(directory).st_mode
    except FileNotFoundError:
        raise _not_found(digest) from None
    if not stat.S_ISDIR(mode):
        raise _corrupt(digest, "not a directory")
    try:
        manifest_path = directory / MANIFEST_NAME
        if not stat.S_ISREG(os.lstat(manifest_path).st_mode):
            raise _corrupt(digest, f"{MANIFEST_NAME} is not a regular file")
        with _open_nofollow(manifest_path) as handle:
            manifest = handle.read(_MAX_MANIFEST_BYTES + 1)
        if len(manifest) > _MAX_MANIFEST_BYTES:
            raise _corrupt(digest, f"{MANIFEST_NAME} is larger than {_MAX_MANIFEST_BYTES} bytes")
        actual_digest = hashlib.sha256(manifest).hexdigest()
        if actual_digest != digest:
            raise _corrupt(digest, f"{MANIFEST_NAME} hashes to {actual_digest}", actual_sha256=actual_digest)
        files = _parse_manifest(manifest, digest)

        found, found_dirs, odd = _scan_tree(directory)
        if odd:
            raise _corrupt(digest, f"symlink or special file {odd[0]!a}", path=_printable(odd[0]))
        expected = {entry.path: entry for entry in files}
        extra = sorted(set(found) - set(expected) - {MANIFEST_NAME})
        if extra:
            raise _corrupt(digest, f"file {extra[0]!a} is not in the manifest", path=_printable(extra[0]))
        missing = sorted(set(expected) - set(found))
        if missing:
            raise _corrupt(digest, f"file {missing[0]!r} is missing", path=missing[0])
        extra_dirs = sorted(found_dirs - {parent for path in expected for parent in _parents(path)})
        if extra_dirs:
            raise _corrupt(digest, f"directory {extra_dirs[0]!a} is not in the manifest")
        # Sizes first: a truncated file is caught without reading anything.
        for entry in files:
            if found[entry.path] != entry.size:
                raise _corrupt(
                    digest,
                    f"{entry.path!r} has {found[entry.path]} bytes, the manifest says {entry.size}",
                    path=entry.path,
                    expected_size=entry.size,
                    actual_size=found[entry.path],
                )
        for entry in files:
            actual_sha, actual_size = _hash_file(directory / entry.path)
            if (actual_sha, actual_size) != (entry.sha256, entry.size):
                raise _corrupt(
                    digest,
                    f"{entry.path!r} hashes to {actual_sha}, the manifest says {entry.sha256}",
                    path=entry.path,
                    expected_sha256=entry.sha256,
                    actual_sha256=actual_sha,
                )
    except OSError as error:
        if error.errno not in _CORRUPT_ERRNOS:
            raise
        raise _corrupt(digest, f"unreadable: {error}") from error
    return _Verified(directory, files, len(manifest))


def _scan_tree(top: Path) -> tuple[dict[str, int], set[str], list[str]]:
    """Regular files (relative POSIX path -> size), directories, and anything else (symlinks, fifos...)."""
    files: dict[str, int] = {}
    dirs: set[str] = set()
    odd: list[str] = []

    def fail(error: OSError) -> None:
        raise error  # os.walk would otherwise skip unreadable directories silently

    for dirpath, dirnames, filenames in os.walk(top, onerror=fail):
        rel = os.path.relpath(dirpath, top)
        prefix = "" if rel == "." else rel.replace(os.sep, "/") + "/"
        for name in dirnames:
            # With followlinks=False a symlink to a directory is listed here but not entered.
            if os.path.islink(os.path.join(dirpath, name)):
                odd.append(prefix + name)
            else:
                dirs.add(prefix + name)
        for name in filenames:
            info = os.lstat(os.path.join(dirpath, name))
            if stat.S_ISREG(info.st_mode):
                files[prefix + name] = info.st_size
            else:
                odd.append(prefix + name)
    return files, dirs, sorted(odd)


def _scan_source(src: Path) -> list[tuple[str, Path]]:
    if not src.is_dir():
        raise InvalidArgument(
            f"{src} is not a directory", reason="INVALID_ARTIFACT_SOURCE", source=_printable(str(src))
        )
    files, _, odd = _scan_tree(src)
    if odd:
        raise InvalidArgument(
            f"{src}: {odd[0]!a} is a symlink or special file; only regular files can be stored",
            reason="INVALID_ARTIFACT_SOURCE",
            path=_printable(odd[0]),
        )
    if not files:
        raise InvalidArgument(f"{src} contains no files", reason="EMPTY_ARTIFACT")
    return [(rel, src / rel) for rel in sorted(files)]


def _hash_file(path: Path) -> tuple[str, int]:
    hasher = hashlib.sha256()
    size = 0
    with _open_nofollow(path) as handle:
        while block := handle.read(BLOCK_SIZE):
            hasher.update(block)
            size += len(block)
    return hasher.hexdigest(), size


def _open_nofollow(path: Path) -> io.BufferedReader:
    # O_NOFOLLOW: a file swapped for a symlink after we listed it must not be followed.
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    return open(fd, "rb")


def _write_synced(path: Path, data: bytes) -> None:
    with open(path, "xb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _same_file(path: Path, fd: int) -> bool:
    try:
        on_disk = os.stat(path)
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (on_disk.st_dev, on_disk.st_ino) == (held.st_dev, held.st_ino)


def _remove(path: Path) -> bool:
    """Removes a file or a tree; False if there was nothing. Tolerates a concurrent remover."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return False
    if stat.S_ISDIR(mode):

        def ignore_vanished(function: Any, name: str, exc_info: Any) -> None:
            if not isinstance(exc_info[1], FileNotFoundError):
                raise exc_info[1]

        shutil.rmtree(path, onerror=ignore_vanished)
    else:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
    return True


def _tree_bytes(path: Path) -> int:
    if not path.is_dir() or path.is_symlink():
        return 0
    total = 0
    for dirpath, _, filenames in os.walk(path):
        for name in filenames:
            info = os.lstat(os.path.join(dirpath, name))
            if stat.S_ISREG(info.st_mode):
                total += info.st_size
    return total


def _corrupt(digest: str, what: str, **metadata: str | int) -> DataLoss:
    return DataLoss(
        f"artifact {format_uri(digest)} is corrupt: {what}",
        reason="DIGEST_MISMATCH",
        uri=format_uri(digest),
        **metadata,
    )


def _not_found(digest: str) -> NotFound:
    return NotFound(f"artifact {format_uri(digest)} not found", reason="ARTIFACT_NOT_FOUND", uri=format_uri(digest))

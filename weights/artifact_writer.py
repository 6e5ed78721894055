"""ArtifactWriter: builds one artifact inside its temp slot, file by file, hashing what it writes, then
writes the canonical manifest, fsyncs everything and hands the slot to the store to publish atomically."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import io
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, BinaryIO

from opentinker.rpc.serving.errors import DataLoss, FailedPrecondition, InvalidArgument, ResourceExhausted
from opentinker.weights.artifact_fs import TempSlot, fsync_dir, write_synced
from opentinker.weights.artifact_manifest import (
    BLOCK_SIZE,
    HEX64,
    MANIFEST_NAME,
    ArtifactFile,
    ArtifactRef,
    PathSet,
    check_artifact_path,
    format_uri,
    manifest_bytes,
    parents,
)

Publish = Callable[[TempSlot, str, ArtifactRef], ArtifactRef]
_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})


class ArtifactWriter:
    """Builds one artifact: ``add_file(path, size, sha256)``, then ``write`` its bytes in chunks (a chunk
    never spans two files), then the next file, then ``commit()``. A file is checked as soon as its
    expected size is reached (a later ``add_file``/``commit`` catches a short one). A mismatch raises
    DataLoss(DIGEST_MISMATCH) and aborts the writer (temp files removed); so does any other failure
    after the writer has started changing files. InvalidArgument for a bad path or header changes nothing:
    the writer stays usable. ``add_bytes`` and ``copy_file`` add a whole file whose digest is whatever was
    written. Not thread-safe."""

    def __init__(self, slot: TempSlot, fault: Callable[[str], None], publish: Publish, *, durable: bool = True) -> None:
        self._slot = slot
        self._durable = durable  # False: no fsyncs (a verified cache; see ArtifactStore)
        self._fault = fault
        self._publish = publish
        self._files: list[ArtifactFile] = []
        self._paths = PathSet()
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
        if not HEX64.fullmatch(sha):
            raise InvalidArgument(
                f"invalid sha256 {expected_sha256!r} for {path!r}: expected 64 hex digits",
                reason="INVALID_ARTIFACT_FILE",
            )
        self._start_file(path, expected_size, sha)

    def add_bytes(self, path: str, data: bytes) -> None:
        """Adds a whole file held in memory (its digest is that of ``data``)."""
        self._start_file(path, len(data), None)
        self.write(data)

    def copy_file(self, path: str, source: BinaryIO) -> None:
        """Adds a file with everything ``source`` yields until EOF. The manifest records what was written,
        not what was listed, so it matches the stored copy even if the source changes under us."""
        self._start_file(path, None, None)
        while block := source.read(BLOCK_SIZE):
            self.write(block)

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
            manifest = manifest_bytes(self._files)
            digest = hashlib.sha256(manifest).hexdigest()
            write_synced(self._slot.path / MANIFEST_NAME, manifest, sync=self._durable)
            self._fault("manifest_written")
            # The new entries in each directory must be durable before the rename makes them visible.
            for directory in (*reversed(self._dirs), self._slot.path) if self._durable else ():
                fsync_dir(directory)
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
            for parent in parents(path):
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
            if self._durable:
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


@dataclass(slots=True)
class _PendingFile:
    path: str
    file: io.BufferedWriter
    hasher: Any  # hashlib's hash object has no public type name
    written: int
    expected_size: int | None
    expected_sha256: str | None

"""The artifact transfer stream, both ends, once: a header listing every file (path, size, sha256) in
manifest order, then the files' bytes back to back in chunks that may span file boundaries (many small
files then cost few messages). Empty files carry no bytes.

The receiver is sans-IO: it splits the chunks into files by the declared sizes and tells a `FileSink`
where each file starts, its bytes and where it ends; the sink does the writing and the hashing. It refuses
a stream in the wrong order (chunks before the header, a second header), bytes past the declared files and
a stream that ends short, with a `StreamViolation` that each end turns into its own status. The sender
re-cuts the files' bytes into chunks of a fixed size.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Literal, Protocol

from opentinker.weights.artifact_fs import open_nofollow
from opentinker.weights.artifact_manifest import ArtifactFile

Violation = Literal["chunk_first", "header_twice", "no_header", "extra_bytes", "ended_inside", "ended_before"]


class StreamViolation(Exception):
    """The stream broke its protocol. ``path``: the file concerned, "" when none is."""

    def __init__(self, kind: Violation, path: str = "") -> None:
        super().__init__(kind, path)
        self.kind: Violation = kind
        self.path = path


class FileSink(Protocol):
    """Where a receiver puts the files: ``start``, then the file's bytes by ``write``, then ``end``."""

    def start(self, file: ArtifactFile) -> None: ...

    def write(self, data: memoryview) -> None: ...

    def end(self, file: ArtifactFile) -> None: ...


class ArtifactReceiver:
    """Feed it ``header(files)`` once, then ``chunk(data)`` as they arrive, then ``close()``. A file is
    started when its first byte arrives (an empty one as the stream passes it) and ended as soon as its
    declared size is reached; ``close`` completes trailing empty files."""

    def __init__(self, open_sink: Callable[[Sequence[ArtifactFile]], FileSink]) -> None:
        self._open_sink = open_sink
        self._sink: FileSink | None = None
        self._files: tuple[ArtifactFile, ...] = ()
        self._index = -1  # the file being received (-1: none yet)
        self._remaining = 0  # its bytes still due

    @property
    def files(self) -> tuple[ArtifactFile, ...]:
        return self._files

    def header(self, files: Sequence[ArtifactFile]) -> None:
        """The declared files; ``open_sink`` is asked for the sink now (it may refuse them by raising)."""
        if self._sink is not None:
            raise StreamViolation("header_twice")
        self._files = tuple(files)
        self._sink = self._open_sink(self._files)

    def chunk(self, data: bytes | memoryview) -> None:
        sink = self._sink
        if sink is None:
            raise StreamViolation("chunk_first")
        view = memoryview(data)
        while view.nbytes:
            while self._remaining == 0:
                self._next_file(sink)
            take = min(self._remaining, view.nbytes)
            self._remaining -= take
            sink.write(view[:take])
            view = view[take:]
            if self._remaining == 0:
                sink.end(self._files[self._index])

    def close(self) -> None:
        """The stream ended: every declared byte must have arrived."""
        sink = self._sink
        if sink is None:
            raise StreamViolation("no_header")
        if self._remaining:
            raise StreamViolation("ended_inside", self._files[self._index].path)
        for file in self._files[self._index + 1 :]:
            if file.size:
                raise StreamViolation("ended_before", file.path)
            self._index += 1
            sink.start(file)
            sink.end(file)

    def _next_file(self, sink: FileSink) -> None:
        self._index += 1
        if self._index >= len(self._files):
            raise StreamViolation("extra_bytes")
        file = self._files[self._index]
        sink.start(file)
        self._remaining = file.size
        if not file.size:
            sink.end(file)  # empty files carry no bytes: complete them as the stream passes them


class FileWriter(Protocol):
    """What WriterSink writes into: an ArtifactWriter, or the registry's upload into a bucket."""

    def add_file(self, path: str, expected_size: int, expected_sha256: str) -> None: ...
    def write(self, chunk: bytes | bytearray | memoryview) -> None: ...


class WriterSink:
    """A FileSink into an ArtifactWriter, which checks each file's size and sha256 as it completes."""

    def __init__(self, writer: FileWriter) -> None:
        self.writer = writer

    def start(self, file: ArtifactFile) -> None:
        self.writer.add_file(file.path, file.size, file.sha256)

    def write(self, data: memoryview) -> None:
        self.writer.write(data)

    def end(self, file: ArtifactFile) -> None:
        pass  # the writer verified the file when its declared size was reached


def declared_bytes(file: ArtifactFile, path: Path, block_size: int) -> Iterator[bytes]:
    """Exactly ``file.size`` bytes of ``path`` in blocks, so a file that grew after hashing cannot shift the
    next file's bytes; StreamViolation("ended_inside") if it shrank."""
    remaining = file.size
    with open_nofollow(path) as handle:
        while remaining:
            block = handle.read(min(block_size, remaining))
            if not block:
                raise StreamViolation("ended_inside", file.path)
            remaining -= len(block)
            yield block


def chunked(pieces: Iterable[bytes], chunk_size: int) -> Iterator[bytes]:
    """The bytes of ``pieces`` back to back, cut into chunks of ``chunk_size`` (the last one shorter; no
    empty chunk). Each byte is copied at most twice (once when it waits for the rest of its chunk)."""
    buffer = bytearray()
    for piece in pieces:
        if not buffer and len(piece) == chunk_size:
            yield piece  # already a whole chunk: no copy
            continue
        view = memoryview(piece)
        if buffer:
            take = min(chunk_size - len(buffer), view.nbytes)
            buffer += view[:take]
            view = view[take:]
            if len(buffer) < chunk_size:
                continue
            yield bytes(buffer)
            buffer.clear()
        while view.nbytes >= chunk_size:
            yield bytes(view[:chunk_size])
            view = view[chunk_size:]
        buffer += view
    if buffer:
        yield bytes(buffer)

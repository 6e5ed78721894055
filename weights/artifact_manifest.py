"""The artifact format every process agrees on: URIs, payload path rules, the canonical manifest bytes
(whose sha256 is the artifact's digest) and their strict parser, and file hashing.

``manifest.json`` is ``{"files": [{"path", "sha256", "size"}, ...], "format": 1}`` with the files sorted by
path, serialized with sorted keys, no whitespace, ASCII only and a trailing newline, so equal content always
gives equal bytes. The artifact digest is the sha256 of those bytes (it covers every file's name, size and
content) and ``sha256:<digest>`` is the artifact's URI. Payload paths are relative POSIX paths ("/"
separated, subdirectories allowed); a top-level ``manifest.json`` is reserved.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from opentinker.rpc.serving.errors import DataLoss, InvalidArgument, NotFound
from opentinker.weights.artifact_fs import open_nofollow

URI_PREFIX: Final = "sha256:"
MANIFEST_NAME: Final = "manifest.json"
MANIFEST_FORMAT: Final = 1
BLOCK_SIZE: Final = 1 << 20

HEX64: Final = re.compile(r"[0-9a-f]{64}")  # always used with fullmatch
_MAX_PATH_CHARS = 1024
_MAX_COMPONENT_BYTES = 255  # NAME_MAX on every filesystem we care about


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
    if not HEX64.fullmatch(body):
        raise InvalidArgument(
            f"invalid artifact uri {uri!r}: expected 'sha256:' followed by 64 hex digits",
            reason="INVALID_ARTIFACT_URI",
            uri=printable(uri),
        )
    return body


def format_uri(digest: str) -> str:
    return URI_PREFIX + digest


def check_artifact_path(path: str) -> str:
    """Returns ``path`` if it may name a payload file, else raises InvalidArgument(INVALID_ARTIFACT_PATH)."""
    problem = path_problem(path)
    if problem is not None:
        raise InvalidArgument(
            f"invalid artifact path {path!r}: {problem}",
            reason="INVALID_ARTIFACT_PATH",
            path=printable(path),
        )
    return path


def path_problem(path: str) -> str | None:
    """Why ``path`` cannot name a payload file, or None if it can."""
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


class PathSet:
    """Payload paths seen so far, to reject duplicates and a file that is also another file's directory."""

    def __init__(self) -> None:
        self._files: set[str] = set()
        self._dirs: set[str] = set()

    def conflict(self, path: str) -> bool:
        return path in self._files or path in self._dirs or any(d in self._files for d in parents(path))

    def add(self, path: str) -> None:
        self._files.add(path)
        self._dirs.update(parents(path))


def check_paths(paths: Iterable[str]) -> None:
    seen = PathSet()
    for path in paths:
        check_artifact_path(path)
        if seen.conflict(path):
            raise InvalidArgument(
                f"artifact path {path!r} overlaps another file (a file cannot also be a directory)",
                reason="INVALID_ARTIFACT_PATH",
                path=path,
            )
        seen.add(path)


def parents(path: str) -> list[str]:
    """The ancestor directories of a payload path: "a/b/c" -> ["a", "a/b"]."""
    parts = path.split("/")
    return ["/".join(parts[:i]) for i in range(1, len(parts))]


def printable(text: str) -> str:
    """Text safe for a gRPC status (valid UTF-8), for names that came from the disk or a client."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return ascii(text)
    return text


def manifest_bytes(files: Iterable[ArtifactFile]) -> bytes:
    """The canonical manifest.json of these files; its sha256 is the artifact digest."""
    entries = [
        {"path": entry.path, "sha256": entry.sha256, "size": entry.size}
        for entry in sorted(files, key=lambda entry: entry.path)
    ]
    document = {"files": entries, "format": MANIFEST_FORMAT}
    text = json.dumps(document, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return (text + "\n").encode("ascii")


def parse_manifest(data: bytes, digest: str) -> tuple[ArtifactFile, ...]:
    """Strict: anything but exactly what ``manifest_bytes`` would write is DataLoss."""

    def malformed(why: str) -> DataLoss:
        return corrupt(digest, f"malformed manifest: {why}")

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
    seen = PathSet()
    for entry in entries:
        if not isinstance(entry, dict) or set(entry) != {"path", "sha256", "size"}:
            raise malformed("each file needs exactly 'path', 'sha256' and 'size'")
        path, sha, size = entry["path"], entry["sha256"], entry["size"]
        if not isinstance(path, str) or path_problem(path) is not None or seen.conflict(path):
            raise malformed(f"bad or repeated path {path!r}")
        if not isinstance(sha, str) or not HEX64.fullmatch(sha):
            raise malformed(f"bad sha256 for {path!r}")
        if type(size) is not int or size < 0:
            raise malformed(f"bad size for {path!r}")
        seen.add(path)
        files.append(ArtifactFile(path, sha, size))
    if manifest_bytes(files) != data:
        raise malformed("not in canonical form (order, spacing or encoding)")
    return tuple(files)


def hash_file(path: Path) -> tuple[str, int]:
    """(sha256 hex, size) of a regular file, read without following a symlink."""
    hasher = hashlib.sha256()
    size = 0
    with open_nofollow(path) as handle:
        while block := handle.read(BLOCK_SIZE):
            hasher.update(block)
            size += len(block)
    return hasher.hexdigest(), size


def corrupt(digest: str, what: str, **metadata: str | int) -> DataLoss:
    return DataLoss(
        f"artifact {format_uri(digest)} is corrupt: {what}",
        reason="DIGEST_MISMATCH",
        uri=format_uri(digest),
        **metadata,
    )


def not_found(digest: str) -> NotFound:
    return NotFound(f"artifact {format_uri(digest)} not found", reason="ARTIFACT_NOT_FOUND", uri=format_uri(digest))

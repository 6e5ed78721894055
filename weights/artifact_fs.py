"""Filesystem primitives the artifact store is built on: durable writes and directory fsyncs, opens that
never follow a symlink, removal that tolerates a concurrent remover, tree scans and sizes, and the
flock-guarded temp slot that tells a crashed writer's leftovers from a live writer's work."""

from __future__ import annotations

import contextlib
import fcntl
import io
import os
import shutil
import stat
import uuid
from pathlib import Path
from typing import Any, Final

LOCK_SUFFIX: Final = ".lock"


def open_nofollow(path: Path) -> io.BufferedReader:
    # O_NOFOLLOW: a file swapped for a symlink after we listed it must not be followed.
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    return open(fd, "rb")


def write_synced(path: Path, data: bytes, *, sync: bool = True) -> None:
    with open(path, "xb") as handle:
        handle.write(data)
        handle.flush()
        if sync:
            os.fsync(handle.fileno())


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def same_file(path: Path, fd: int) -> bool:
    try:
        on_disk = os.stat(path)
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (on_disk.st_dev, on_disk.st_ino) == (held.st_dev, held.st_ino)


def remove(path: Path) -> bool:
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


def tree_bytes(path: Path) -> int:
    if not path.is_dir() or path.is_symlink():
        return 0
    total = 0
    for dirpath, _, filenames in os.walk(path):
        for name in filenames:
            info = os.lstat(os.path.join(dirpath, name))
            if stat.S_ISREG(info.st_mode):
                total += info.st_size
    return total


def scan_tree(top: Path) -> tuple[dict[str, int], set[str], list[str]]:
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


class TempSlot:
    """``tmp/<name>`` (created by the caller) guarded by an flock on ``tmp/<name>.lock`` for as long as this
    object lives. The kernel drops the lock when the process dies, which is how cleanup tells leftovers of a
    crash from live work. Invariant: the lock file exists before the directory and outlives it."""

    def __init__(self, tmp: Path) -> None:
        while True:
            name = uuid.uuid4().hex
            lock_path = tmp / (name + LOCK_SUFFIX)
            fd = os.open(lock_path, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_CLOEXEC, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                # A cleanup may have locked and unlinked the fresh file before we locked it: then our lock
                # guards nothing, so start over with another name.
                if same_file(lock_path, fd):
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
        remove(self.path)
        remove(self._lock_path)
        os.close(self._fd)
        self._fd = None


def reap_slot(tmp: Path, stem: str) -> bool:
    """Removes ``tmp/<stem>`` and its lock if no live process holds the lock; True if it removed anything."""
    path = tmp / stem
    lock_path = tmp / (stem + LOCK_SUFFIX)
    try:
        fd = os.open(lock_path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        # Owners create the lock before the directory and remove it after, so an unlocked directory
        # belongs to nobody alive.
        return remove(path)
    except OSError:
        # Not a lock file we made (a directory, a symlink): junk.
        return remove(path) | remove(lock_path)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False  # its owner is alive
        if not same_file(lock_path, fd):
            return False  # another cleanup got here first
        remove(path)
        remove(lock_path)
        return True
    finally:
        os.close(fd)

"""One owner per directory: an exclusive flock on `<dir>/<name>.lock`, which holds the owner's PID.

The registry takes it on its data dir before its embedded Redis starts (two Redis servers appending to one AOF
file corrupt it), `opentinker up` on its workdir. The kernel drops the lock when every descriptor of the file is
closed, so a SIGKILLed owner never leaves a stale lock. A child that inherits the descriptor (the embedded
Redis) keeps holding it until it exits too: a new owner cannot start while the old one's Redis still writes.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
from pathlib import Path


class DirLocked(Exception):
    """The directory has a live owner; `pid` is the one written in the lock file (0 when unreadable)."""

    def __init__(self, directory: Path, pid: int) -> None:
        super().__init__(f"{directory} is in use by process {pid or 'unknown'}")
        self.directory = directory
        self.pid = pid


def _pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class DirLock:
    """Held from `acquire` until `release` (or the process exits)."""

    def __init__(self, directory: Path, fd: int) -> None:
        self.directory = directory
        self.fd = fd

    @classmethod
    def acquire(cls, directory: Path, name: str, *, orphan_wait_s: float = 15.0) -> DirLock:
        """Locks `directory` (created if missing) or raises DirLocked. When the recorded owner is dead but the lock
        is still held, a child of that owner is finishing (its Redis flushing on SIGTERM): wait for it, bounded."""
        directory = directory.resolve()
        directory.mkdir(parents=True, exist_ok=True)
        fd = os.open(directory / f"{name}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        deadline = time.monotonic() + orphan_wait_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                pid = _read_pid(fd)
                if _pid_alive(pid) or time.monotonic() > deadline:
                    os.close(fd)
                    raise DirLocked(directory, pid) from None
                time.sleep(0.1)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        return cls(directory, fd)

    def release(self) -> None:
        if self.fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self.fd)
            self.fd = -1


def _read_pid(fd: int) -> int:
    try:
        return int(os.pread(fd, 32, 0).decode().strip() or 0)
    except (OSError, ValueError):
        return 0

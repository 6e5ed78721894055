"""Where a registry keeps its embedded Redis and its artifacts, and the lock that gives that place one owner.

The default is per user and stable ($XDG_DATA_HOME/opentinker/registry, else ~/.local/share/opentinker/registry),
never the current directory: a registry started from another directory must not come up empty over the same
artifact store. `opentinker up` passes WORKDIR/registry explicitly.
"""

from __future__ import annotations

import os
from pathlib import Path

from opentinker.rpc.process.dir_lock import DirLock, DirLocked
from opentinker.rpc.process.startup import StartupError

LOCK_NAME = "registry"


def default_data_dir() -> Path:
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "opentinker" / "registry"


def lock_data_dir(data_dir: Path) -> DirLock:
    """The data dir's lock for this process's lifetime, or StartupError naming the registry that holds it."""
    try:
        return DirLock.acquire(data_dir, LOCK_NAME)
    except DirLocked as exc:
        raise StartupError(
            f"data dir {exc.directory} is in use by another registry (pid {exc.pid or 'unknown'}); stop it or "
            "pass another --data-dir"
        ) from None

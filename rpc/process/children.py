"""Child processes that must not outlive the process that started them."""

from __future__ import annotations

import ctypes
import shutil
import signal

PR_SET_PDEATHSIG = 1


def die_with_parent(sig: signal.Signals = signal.SIGTERM) -> None:
    """The kernel sends `sig` to the calling process when its parent thread exits, even on the parent's SIGKILL
    (Linux). Safe to call between fork and exec: only prctl."""
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, int(sig))


def parent_death_command(sig: signal.Signals = signal.SIGTERM) -> list[str]:
    """A prefix that gives the command the same death signal through util-linux's setpriv, which sets it and execs
    the command, so that no Python runs between fork and exec (a preexec_fn does: with other threads running, a
    library's at-fork hook in the child can crash it, as fsspec's once did). [] where setpriv is missing: use
    `die_with_parent` as the preexec_fn then."""
    setpriv = shutil.which("setpriv")
    return [setpriv, "--pdeathsig", sig.name.removeprefix("SIG"), "--"] if setpriv else []

"""Child processes that must not outlive the process that started them."""

from __future__ import annotations

import ctypes
import signal

PR_SET_PDEATHSIG = 1


def die_with_parent(sig: signal.Signals = signal.SIGTERM) -> None:
    """The kernel sends `sig` to the calling process when its parent thread exits, even on the parent's SIGKILL
    (Linux). Safe to call between fork and exec: only prctl."""
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, int(sig))

"""Fault injection for the reliability tests: die by SIGKILL at a named point.

``OPENTINKER_FAULT_POINT=name[:nth]`` arms one point: the process SIGKILLs itself the nth time (default: the
first) it reaches ``name``. Names are ``<scope>/<point>``: the scope says which operation runs (set with
``scope()`` around it, e.g. ``save_state``), the point where in it (e.g. ``file_written:state.json``, the
artifact store's hook names). ``configure()`` reads the variable once at startup; unarmed, ``fault_point`` is
one attribute check and ``scope`` does nothing, so production pays nothing.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Callable, Iterator, Mapping

ENV_VAR = "OPENTINKER_FAULT_POINT"


class _Armed:
    def __init__(self) -> None:
        self.target: tuple[str, int] | None = None
        self.count = 0
        self.lock = threading.Lock()
        self.local = threading.local()


_ARMED = _Armed()


def parse(spec: str) -> tuple[str, int]:
    """``name[:nth]`` -> (name, nth). Names may contain ':' themselves; only a numeric last part is nth."""
    name, _, last = spec.rpartition(":")
    if name and last.isdigit():
        if int(last) < 1:
            raise ValueError(f"{ENV_VAR}: nth must be >= 1 in {spec!r}")
        return name, int(last)
    return spec, 1


def configure(environ: Mapping[str, str] = os.environ) -> Callable[[str], None] | None:
    """Arms the point named in the environment (if any); returns the hook for ArtifactStore(fault_hook=...)."""
    spec = environ.get(ENV_VAR, "")
    with _ARMED.lock:
        _ARMED.target = parse(spec) if spec else None
        _ARMED.count = 0
    return fault_point if _ARMED.target is not None else None


def fault_point(point: str) -> None:
    """Called between steps that must survive a crash; SIGKILLs the process if this is the armed point."""
    target = _ARMED.target
    if target is None:
        return
    scope_name = getattr(_ARMED.local, "scope", "")
    name = f"{scope_name}/{point}" if scope_name else point
    if name != target[0]:
        return
    with _ARMED.lock:
        _ARMED.count += 1
        hit = _ARMED.count == target[1]
    if hit:
        os.kill(os.getpid(), signal.SIGKILL)


@contextlib.contextmanager
def scope(name: str) -> Iterator[None]:
    """Points reached on this thread inside the block are named ``<name>/<point>``."""
    if _ARMED.target is None:
        yield
        return
    previous = getattr(_ARMED.local, "scope", "")
    _ARMED.local.scope = name
    try:
        yield
    finally:
        _ARMED.local.scope = previous

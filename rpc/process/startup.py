"""How every server fails to start: one line on stderr (which server, what, what to do), exit 2 for a
configuration error, the traceback only at `--log-level debug`. And the check that runs first, before anything
slow or stateful starts: the ports are free (the model's is weights/model_check.py)."""

from __future__ import annotations

import contextlib
import errno
import logging
import socket
import sys
from collections.abc import Iterator

import typer

from opentinker.rpc.serving.errors import ServiceError

log = logging.getLogger("opentinker.startup")

CONFIG_ERROR_EXIT = 2
DEBUG_HINT = "run with --log-level debug for the traceback"


class StartupError(Exception):
    """A configuration the server cannot start with; the message says what to change."""


def check_port(host: str, port: int, flag: str) -> None:
    """Binds `port` for a moment (as gRPC will, with SO_REUSEADDR): a port in use is found now, not after the
    model loaded. Port 0 (a free one) and disabled ports (< 0) pass."""
    if port <= 0:
        return
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host.strip("[]"), port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise StartupError(
                    f"port {port} on {host} is in use; stop what holds it or pass another {flag} (0 picks a free one)"
                ) from None
            raise StartupError(f"cannot bind {host}:{port} ({exc.strerror}); check --host and {flag}") from None


def check_ports(host: str, port: int, metrics_port: int) -> None:
    check_port(host, port, "--port")
    check_port(host, metrics_port, "--metrics-port")


def fail(component: str, message: str, code: int = CONFIG_ERROR_EXIT) -> None:
    """One line, whatever the message held (a library's multi-line error)."""
    print(f"opentinker {component}: {' '.join(message.split())}", file=sys.stderr, flush=True)
    raise SystemExit(code)


@contextlib.contextmanager
def startup_errors(component: str, log_level: str) -> Iterator[None]:
    """Around a server's start: configuration errors become one line and exit 2; anything else one line and exit
    1 (its traceback with --log-level debug, where it is raised as is)."""
    debug = log_level.upper() == "DEBUG"
    try:
        yield
    except (typer.Exit, typer.Abort):  # click's own exits (Exit is a RuntimeError)
        raise
    except StartupError as exc:
        if debug:
            log.exception("startup failed")
        fail(component, str(exc))
    except typer.BadParameter as exc:
        hint = exc.param_hint if isinstance(exc.param_hint, str) else None
        fail(component, f"invalid value{f' for {hint}' if hint else ''}: {exc.message}")
    except ServiceError as exc:  # raised while loading (a model that is not there, a file that is not readable)
        if debug:
            log.exception("startup failed")
        fail(component, exc.message)
    except (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError) as exc:
        if debug:
            log.exception("startup failed")
        fail(component, f"{exc.strerror}: {exc.filename}; check the flag that names it")
    except Exception as exc:
        if debug:
            raise
        fail(component, f"failed: {type(exc).__name__}: {exc} ({DEBUG_HINT})", code=1)

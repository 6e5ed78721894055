"""WORKDIR/stack.json: where the stack `opentinker up` runs can be reached, for `opentinker status --workdir`.

Written once every server serves, removed when `up` stops. It holds addresses, PIDs and log paths, and the path
of the service token file (0600), never a token itself.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

STACK_FILE = "stack.json"


@dataclass(frozen=True, slots=True)
class StackInfo:
    addresses: dict[str, str]  # service -> host:port
    token_file: Path | None

    def token(self) -> str | None:
        if self.token_file is None:
            return None
        try:
            return self.token_file.read_text().strip() or None
        except OSError:
            return None


def write_stack_file(workdir: Path, servers: dict[str, dict[str, object]], token_file: Path | None) -> Path:
    path = workdir / STACK_FILE
    document = {"pid": os.getpid(), "servers": servers, "token_file": str(token_file) if token_file else None}
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(document, indent=2, sort_keys=True))
    partial.replace(path)
    return path


def remove_stack_file(workdir: Path) -> None:
    (workdir / STACK_FILE).unlink(missing_ok=True)


class NoStack(Exception):
    """No stack of `up` in that workdir (none started, or it stopped)."""


def read_stack_file(workdir: Path) -> StackInfo:
    path = workdir / STACK_FILE
    try:
        document: dict[str, Any] = json.loads(path.read_text())
    except FileNotFoundError:
        raise NoStack(f"no {STACK_FILE} in {workdir}: no `opentinker up` runs there") from None
    except (OSError, json.JSONDecodeError) as exc:
        raise NoStack(f"cannot read {path}: {exc}") from None
    servers = document.get("servers") or {}
    addresses = {name: str(info["address"]) for name, info in servers.items() if info.get("address")}
    token_file = document.get("token_file")
    return StackInfo(addresses, Path(token_file) if token_file else None)

"""`opentinker fleet haproxy`: HAProxy's `backend samplers` section written from ListReplicas, for the config in
deploy/haproxy/ (consistent hashing on the x-opentinker-adapter header, hash-balance-factor 125). Only serving
samplers of one base are listed, so a draining replica gets no new request once HAProxy has reloaded. With
`--watch` the file is rewritten on every membership change and the HAProxy master (its `-p` pid file) is told
to reload by SIGUSR2.

Each server's `id` is derived from its address: HAProxy's consistent-hash ring places a server by its id, so
a replica keeps its place on the ring, and its adapters, while others join and leave."""

from __future__ import annotations

import hashlib
import os
import signal
import sys
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Annotated

import grpc
import typer

from opentinker.cli.options import DEFAULT_REGISTRY, CaCert, RegistryAddr, Token
from opentinker.cli.registry_connect import connect
from opentinker.client import OpenTinkerError, Replica
from opentinker.client.fleet_router import candidates

BACKEND = "samplers"


def server_id(address: str, taken: set[int]) -> int:
    """A positive 31-bit id from SHA-256 of the address; the next free one on the (2^-31 likely) collision."""
    value = int.from_bytes(hashlib.sha256(address.encode()).digest()[:4], "big") & 0x7FFFFFFF
    value = value or 1
    while value in taken:
        value = value % 0x7FFFFFFF + 1
    taken.add(value)
    return value


def fleet_base(replicas: Sequence[Replica], base: str) -> str:
    """The base whose samplers are listed: ``base`` if given, else the one base every serving sampler shares."""
    if base:
        return base
    bases = sorted({r.base_fingerprint for r in candidates(replicas, "")})
    if len(bases) > 1:
        raise typer.BadParameter(
            f"the fleet serves {len(bases)} bases ({', '.join(b[:12] for b in bases)}): pick one", param_hint="--base"
        )
    return bases[0] if bases else ""


def backend_section(replicas: Iterable[Replica], base: str) -> str:
    """The `backend samplers` section: one h2 server per serving sampler of ``base``, by address."""
    lines = [
        "# Written by `opentinker fleet haproxy` from the registry's ListReplicas; do not edit.",
        f"backend {BACKEND}",
    ]
    taken: set[int] = set()
    for replica in sorted(candidates(list(replicas), base), key=lambda r: r.address):
        ident = server_id(replica.address, taken)
        # `check`: a TCP connect every second, so a killed replica leaves the ring before its lease runs out.
        lines.append(f"    server r{ident} {replica.address} proto h2 id {ident} check inter 1s fall 2 rise 1")
    return "\n".join(lines) + "\n"


def write_if_changed(path: Path, text: str) -> bool:
    """Replaces ``path`` atomically (HAProxy never reads half a file); False when it already says ``text``."""
    if path.exists() and path.read_text() == text:
        return False
    partial = path.with_name(path.name + ".partial")
    partial.write_text(text)
    os.replace(partial, path)
    return True


def reload_haproxy(pid_file: Path) -> None:
    """SIGUSR2 to the master-worker master: it starts a worker on the new files, the old one finishes its
    streams. A missing or stale pid file is reported and skipped: the next change tries again."""
    try:
        os.kill(int(pid_file.read_text().split()[0]), signal.SIGUSR2)
    except (OSError, ValueError, IndexError) as error:
        print(f"fleet haproxy: cannot reload HAProxy from {pid_file}: {error}", file=sys.stderr)


def haproxy_command(
    out: Annotated[Path, typer.Option("--out", help="The file to write (HAProxy's second -f).")],
    registry: RegistryAddr = DEFAULT_REGISTRY,
    token: Token = None,
    ca_cert: CaCert = None,
    base: Annotated[str, typer.Option(help="Base fingerprint to list (default: the fleet's only base).")] = "",
    watch: Annotated[bool, typer.Option(help="Keep the file current as replicas join, drain and leave.")] = False,
    pid_file: Annotated[
        Path | None, typer.Option(help="HAProxy's -p pid file (master-worker, -W): reloaded on every change.")
    ] = None,
) -> None:
    """Writes HAProxy's server list for the sampler fleet (deploy/haproxy/haproxy.cfg says how to run it)."""
    with connect(registry, token, ca_cert) as client:
        if not watch:
            replicas = client.list_replicas("sampler")
            publish(out, backend_section(replicas, fleet_base(replicas, base)), pid_file)
            return
        fleet: dict[str, Replica] = {}
        while True:
            try:
                for change in client.watch_replicas("sampler"):
                    if change.snapshot:
                        fleet.clear()
                    fleet.update({r.replica_id: r for r in change.replicas})
                    for gone in change.left:
                        fleet.pop(gone, None)
                    # Fixed once known: a sampler of another base joining later is left out, not an error.
                    base = base or fleet_base(list(fleet.values()), base)
                    publish(out, backend_section(fleet.values(), base), pid_file)
            except OpenTinkerError as error:
                if error.code != grpc.StatusCode.UNAVAILABLE:
                    raise
                # The registry is restarting: HAProxy keeps the last list (and its health checks) meanwhile.
                print(f"fleet haproxy: registry unavailable ({error.message}); retrying in 1 s", file=sys.stderr)
                time.sleep(1)


def publish(out: Path, section: str, pid_file: Path | None) -> None:
    if write_if_changed(out, section):
        print(f"{out}: {section.count('    server ')} servers", flush=True)
        if pid_file is not None:
            reload_haproxy(pid_file)

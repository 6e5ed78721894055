"""`opentinker registry migrate-store --to URL`: copies every artifact a version references into another store.

The registry names what to copy (every version of every adapter that still has its artifact, and the saved
state its lineage names, if any); the bytes come from ``--from`` when given (read straight from that store, the
registry moves none) or else through the registry's DownloadArtifact (it reads its own store). Each artifact is
verified against its digest in a local temporary folder before it is pushed, and pushed with its manifest
last, so the target never holds a visible artifact that is not whole. What the target already has complete is
skipped: a second run copies 0, and an interrupted run resumes where it stopped. The registry keeps serving
from its store throughout; the command ends by printing the flag to restart the servers with.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Literal

import typer

from opentinker.cli import registry_json as out
from opentinker.cli.failure import fail
from opentinker.cli.options import DEFAULT_REGISTRY, AsJson, CaCert, RegistryAddr, Token
from opentinker.cli.registry_connect import connect, console
from opentinker.client import RegistryClient
from opentinker.rpc.serving.errors import NotFound, ServiceError
from opentinker.weights.artifact_remote import check_remote, pull, push
from opentinker.weights.artifact_store import ArtifactStore
from opentinker.weights.object_store import ObjectStore, open_store

Kind = Literal["snapshot", "state"]


@dataclass
class Migration:
    copied: int = 0
    already_there: int = 0
    bytes_sent: int = 0
    states_not_found: int = 0  # states the source does not hold (a trainer kept them in its own folder)


def referenced(client: RegistryClient) -> list[tuple[str, Kind]]:
    """Every artifact a live version uses, and every state a version's lineage names, each once, in order."""
    found: dict[str, Kind] = {}
    for adapter in client.list_adapters():
        for version in client.list_versions(adapter.name):
            if version.artifact_deleted:
                continue
            found.setdefault(version.artifact_uri, "snapshot")
            if version.lineage.state_id:
                found.setdefault(version.lineage.state_id, "state")
    return sorted(found.items())


def _space(store: ObjectStore, kind: Kind) -> ObjectStore:
    return store.child("states") if kind == "state" and store.location.remote else store


def _complete(target: ObjectStore, uri: str) -> bool:
    try:
        check_remote(target, uri)
    except NotFound:
        return False
    return True


def migrate(client: RegistryClient, target: ObjectStore, source: ObjectStore | None) -> Migration:
    result = Migration()
    for uri, kind in referenced(client):
        destination = _space(target, kind)
        if _complete(destination, uri):
            result.already_there += 1
            continue
        with tempfile.TemporaryDirectory(prefix="opentinker-migrate-") as tmp:
            local = ArtifactStore(Path(tmp))
            try:
                if source is not None:
                    pull(_space(source, kind), local, uri)
                elif kind == "state":
                    result.states_not_found += 1  # the registry serves versions' artifacts only
                    continue
                else:
                    client.download_artifact(uri, Path(tmp) / "download")
                    local.commit_dir(Path(tmp) / "download")
            except NotFound:
                if kind == "state":
                    result.states_not_found += 1
                    continue
                raise
            result.bytes_sent += push(local, destination, uri).bytes_sent
            result.copied += 1
    return result


def migrate_store(
    to: Annotated[str, typer.Option("--to", help="The new store: a folder or s3://, az://, gs:// URL.")],
    source: Annotated[
        str | None,
        typer.Option(
            "--from",
            help="The registry's current store, read directly (then no byte goes through the registry, and "
            "saved states are copied too); default: read through the registry.",
        ),
    ] = None,
    registry: RegistryAddr = DEFAULT_REGISTRY,
    token: Token = None,
    ca_cert: CaCert = None,
    as_json: AsJson = False,
) -> None:
    """Copy every referenced artifact to another store, verified; resumable and idempotent (admin)."""
    try:
        target = open_store(to)
        origin = open_store(source) if source else None
    except ServiceError as exc:
        fail(exc.message)
    with connect(registry, token, ca_cert) as client:
        try:
            result = migrate(client, target, origin)
        except ServiceError as exc:
            fail(exc.message)
    flag = f"--store {target.describe()}"
    if as_json:
        out.print_json(
            {
                "copied": result.copied,
                "already_there": result.already_there,
                "bytes_sent": result.bytes_sent,
                "states_not_found": result.states_not_found,
                "restart_with": flag,
            }
        )
        return
    console.print(
        f"copied {result.copied} artifacts ({result.bytes_sent} bytes); {result.already_there} were there already"
    )
    if result.states_not_found:
        console.print(f"{result.states_not_found} saved states were not copied: pass --from to copy them")
    console.print(f"restart the registry, trainers and samplers with {flag}")

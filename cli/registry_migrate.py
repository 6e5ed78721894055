"""`opentinker registry migrate-store --to URL`: copies every artifact a version references into another store.

The registry names what to copy (every version of every adapter that still has its artifact, and the saved
state its lineage names, if any); the bytes come from ``--from`` when given (read straight from that store, the
registry moves none) or else through the registry's DownloadArtifact (it reads its own store). Each artifact is
verified against its digest in a local temporary folder before it is pushed, and pushed with its manifest
last, so the target never holds a visible artifact that is not whole. What the target already has complete is
skipped: a second run copies 0, and an interrupted run resumes where it stopped. An artifact whose bytes are
damaged in the source is not copied (nothing could repair it there): the run goes on with the others, names it
and the versions that use them, and exits 1. The registry keeps serving from its store throughout; the command
ends by printing the flag to restart the servers with.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Literal

import grpc
import typer

from opentinker.cli import registry_json as out
from opentinker.cli.failure import fail
from opentinker.cli.options import DEFAULT_REGISTRY, AsJson, CaCert, RegistryAddr, Token
from opentinker.cli.registry_connect import connect, console
from opentinker.client import OpenTinkerError, RegistryClient
from opentinker.rpc.serving.errors import DataLoss, NotFound, ServiceError
from opentinker.weights.artifact_remote import check_remote, pull, push
from opentinker.weights.artifact_store import ArtifactStore
from opentinker.weights.object_store import ObjectStore, open_store

Kind = Literal["snapshot", "state"]


@dataclass(frozen=True)
class Damaged:
    """An artifact the source holds but whose bytes do not match its digest, and the versions that use it."""

    uri: str
    versions: list[str]  # "adapter@version"
    error: str


@dataclass
class Migration:
    copied: int = 0
    already_there: int = 0
    bytes_sent: int = 0
    states_not_found: int = 0  # states the source does not hold (a trainer kept them in its own folder)
    damaged: list[Damaged] = field(default_factory=list)


@dataclass
class Reference:
    kind: Kind
    versions: list[str] = field(default_factory=list)


def referenced(client: RegistryClient) -> list[tuple[str, Reference]]:
    """Every artifact a live version uses, and every state a version's lineage names, each once, in order, with
    the versions that name it."""
    found: dict[str, Reference] = {}
    for adapter in client.list_adapters():
        for version in client.list_versions(adapter.name):
            if version.artifact_deleted:
                continue
            name = f"{version.adapter}@{version.number}"
            found.setdefault(version.artifact_uri, Reference("snapshot")).versions.append(name)
            if version.lineage.state_id:
                found.setdefault(version.lineage.state_id, Reference("state")).versions.append(name)
    return sorted(found.items())


def _space(store: ObjectStore, kind: Kind) -> ObjectStore:
    return store.child("states") if kind == "state" and store.location.remote else store


def _complete(target: ObjectStore, uri: str) -> bool:
    try:
        check_remote(target, uri)
    except NotFound:
        return False
    return True


def _fetch(client: RegistryClient, source: ObjectStore | None, kind: Kind, uri: str, tmp: Path) -> ArtifactStore | None:
    """The artifact, verified, in a local store under `tmp`; None where the source does not hold it (a saved
    state); DataLoss where its bytes do not match its digest."""
    local = ArtifactStore(tmp)
    try:
        if source is not None:
            pull(_space(source, kind), local, uri)
        elif kind == "state":
            return None  # the registry serves versions' artifacts only
        else:
            client.download_artifact(uri, tmp / "download")
            local.commit_dir(tmp / "download")
    except NotFound:
        if kind == "state":
            return None
        raise
    except OpenTinkerError as exc:
        if exc.code != grpc.StatusCode.DATA_LOSS:
            raise
        raise DataLoss(exc.message) from exc
    return local


def migrate(client: RegistryClient, target: ObjectStore, source: ObjectStore | None) -> Migration:
    result = Migration()
    for uri, reference in referenced(client):
        destination = _space(target, reference.kind)
        if _complete(destination, uri):
            result.already_there += 1
            continue
        with tempfile.TemporaryDirectory(prefix="opentinker-migrate-") as tmp:
            try:
                local = _fetch(client, source, reference.kind, uri, Path(tmp))
            except DataLoss as exc:
                result.damaged.append(Damaged(uri, reference.versions, exc.message))
                continue
            if local is None:
                result.states_not_found += 1
                continue
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
                "damaged": [{"artifact_uri": d.uri, "versions": d.versions, "error": d.error} for d in result.damaged],
                "restart_with": flag,
            }
        )
    else:
        console.print(
            f"copied {result.copied} artifacts ({result.bytes_sent} bytes); {result.already_there} were there already"
        )
        if result.states_not_found:
            console.print(f"{result.states_not_found} saved states were not copied: pass --from to copy them")
        for damaged in result.damaged:
            used_by = ", ".join(damaged.versions)
            console.print(f"damaged, not copied: {damaged.uri} (used by {used_by}): {damaged.error}", markup=False)
        console.print(f"restart the registry, trainers and samplers with {flag}")
    if result.damaged:
        # The versions named above cannot load from the new store; the operator decides (roll an alias back,
        # delete the version, restore the bytes from a backup) before restarting on it.
        raise typer.Exit(1)

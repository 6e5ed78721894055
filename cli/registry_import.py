"""`opentinker registry import|export`: peft LoRA folders in and out of a running registry, through the SDK.

The folder is checked (`opentinker.weights.peft_io`) before anything is sent, so a refused import changes
nothing in the registry.
"""

from __future__ import annotations

import tempfile
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated

import grpc
import typer

from opentinker.cli import registry_json as out
from opentinker.cli.failure import fail
from opentinker.cli.options import DEFAULT_REGISTRY, AsJson, CaCert, RegistryAddr, Token
from opentinker.cli.registry_connect import connect, console
from opentinker.client import BatchRecord, Lineage, LoraConfig, OpenTinkerError, RegistryClient, Version
from opentinker.rpc.process.progress import spinner
from opentinker.weights.peft_io import (
    PeftAdapter,
    PeftFolderError,
    check_export_target,
    inspect_peft_folder,
    write_import_files,
    write_peft_folder,
)


def import_adapter(
    directory: Annotated[
        Path, typer.Argument(help="A peft LoRA folder (adapter_config.json, adapter_model.safetensors).")
    ],
    name: Annotated[str, typer.Argument(help="Adapter to publish it to (created if missing).")],
    base_model: Annotated[
        Path | None, typer.Option(help="Local base model folder to check shapes against and record (its digest).")
    ] = None,
    alias: Annotated[list[str] | None, typer.Option(help="Also point these aliases at the new version.")] = None,
    registry: RegistryAddr = DEFAULT_REGISTRY,
    token: Token = None,
    ca_cert: CaCert = None,
    as_json: AsJson = False,
) -> None:
    """Publish a peft LoRA adapter trained elsewhere as a new version (validated first; lineage says where from)."""
    try:
        with spinner(f"checking {directory}", quiet=as_json):
            adapter = inspect_peft_folder(directory, base_model)
    except PeftFolderError as exc:
        fail(str(exc))
    with connect(registry, token, ca_cert) as client:
        version = _publish_import(client, adapter, name, alias or [], quiet=as_json)
    if as_json:
        out.print_json(out.version_json(version))
        return
    console.print(
        f"imported {directory} as {version.reference} (rank {adapter.rank}, "
        f"{len(adapter.modules)} modules: {', '.join(adapter.target_modules)})"
    )
    for note in adapter.notes:
        console.print(f"  note: {note}")


def _publish_import(
    client: RegistryClient, adapter: PeftAdapter, name: str, aliases: list[str], *, quiet: bool
) -> Version:
    source = str(adapter.directory.resolve())
    lora = LoraConfig(
        rank=adapter.rank, alpha=adapter.alpha, dropout=adapter.dropout, target_modules=tuple(adapter.target_modules)
    )
    try:
        existing = client.get_adapter(name)
    except OpenTinkerError as exc:
        if exc.code != grpc.StatusCode.NOT_FOUND:
            raise
        existing = None
    if existing is not None:
        theirs, ours = existing.base_model_digest, adapter.base_model_digest
        if theirs and ours and theirs != ours:
            fail(
                f"{name} belongs to base model {theirs[:12]}..., but {source} was checked against "
                f"{adapter.base_model_checked} ({ours[:12]}...)"
            )
        base_digest = ours or theirs
    else:
        base_digest = adapter.base_model_digest
        client.create_adapter(
            name,
            rank=lora.rank,
            alpha=lora.alpha,
            dropout=lora.dropout,
            target_modules=lora.target_modules,
            base_model_digest=base_digest,
            labels={"origin": "peft-import"},
            description=f"imported from {source}"[:1000],
        )
    with tempfile.TemporaryDirectory(prefix="opentinker-import-") as tmp:
        write_import_files(adapter, Path(tmp))  # only the peft files, without what the inspection left out
        with spinner(f"uploading {name}", quiet=quiet):
            uploaded = client.upload_artifact(Path(tmp))
    # Imported weights were not trained from any earlier version: no parent, one record naming the source.
    record = BatchRecord(
        digest=adapter.weights_sha256, trace_ids=(f"import:{source}",), loss_fn="peft-import", time=datetime.now(UTC)
    )
    lineage = Lineage(base_model_digest=base_digest, batches=(record,))
    return client.publish_version(
        name, uploaded, lineage=lineage, aliases=aliases, lora=lora, request_id=f"import-{uuid.uuid4().hex}"
    )


def export_adapter(
    reference: Annotated[str, typer.Argument(help="name, name@alias or name@N.")],
    directory: Annotated[Path, typer.Argument(help="New or empty folder to write the peft adapter into.")],
    base_model_name: Annotated[
        str | None,
        typer.Option("--base-model-name", help="Write this as base_model_name_or_path in adapter_config.json."),
    ] = None,
    registry: RegistryAddr = DEFAULT_REGISTRY,
    token: Token = None,
    ca_cert: CaCert = None,
    as_json: AsJson = False,
) -> None:
    """Write a version as a plain peft folder (PeftModel.from_pretrained loads it)."""
    try:
        check_export_target(directory)  # before anything is downloaded or written
    except PeftFolderError as exc:
        fail(str(exc))
    with connect(registry, token, ca_cert) as client:
        version = client.resolve(reference)
        if version.artifact_deleted:
            fail(f"{version.reference} was garbage-collected; its weights are gone")
        with tempfile.TemporaryDirectory(prefix="opentinker-export-") as tmp:
            artifact = Path(tmp) / "artifact"
            with spinner(f"downloading {version.reference}", quiet=as_json):
                client.download_artifact(version.artifact_uri, artifact)  # a failure: connect() reports it
            try:
                written = write_peft_folder(artifact, directory, base_model_name_or_path=base_model_name)
            except PeftFolderError as exc:
                fail(str(exc))
    if as_json:
        out.print_json(
            {
                "adapter": version.adapter,
                "version": str(version.number),
                "directory": str(directory),
                "files": [p.name for p in written],
                "artifact_sha256": version.sha256,
            }
        )
    else:
        console.print(f"wrote {version.reference} to {directory} ({', '.join(p.name for p in written)})")

"""`opentinker registry create|adapters|versions|show|alias|rollback|lineage|watch|gc|delete|migrate-store`:
administer a running registry through the SDK's RegistryClient (plaintext, or TLS with --ca-cert; --token as
the bearer)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from contextlib import closing
from datetime import UTC, datetime
from typing import Annotated

import typer
from rich.table import Table

from opentinker.cli import registry_json as out
from opentinker.cli.options import DEFAULT_REGISTRY, AsJson, CaCert, RegistryAddr, Token
from opentinker.cli.registry_connect import connect, console
from opentinker.cli.registry_import import export_adapter, import_adapter
from opentinker.cli.registry_migrate import migrate_store
from opentinker.cli.rollback_notice import rollback_notice
from opentinker.client import Reconcile, Version
from opentinker.weights.names import LATEST

TRACES_SHOWN = 4  # trace ids per version in the lineage table
alias_app = typer.Typer(no_args_is_help=True, help="Move, remove or serve aliases.")


def when(moment: datetime) -> str:
    return "" if int(moment.timestamp()) == 0 else moment.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S")


def create(
    name: str,
    rank: Annotated[int, typer.Option(help="LoRA rank.")] = 32,
    alpha: Annotated[float, typer.Option(help="LoRA alpha (default: rank).")] = 0.0,
    target: Annotated[list[str] | None, typer.Option(help="Target modules (attn, mlp, all-linear, names).")] = None,
    description: Annotated[str, typer.Option(help="Free text.")] = "",
    registry: RegistryAddr = DEFAULT_REGISTRY,
    token: Token = None,
    ca_cert: CaCert = None,
    as_json: AsJson = False,
) -> None:
    """Register an adapter name."""
    with connect(registry, token, ca_cert) as client:
        # No --target: the empty list, which the registry reads as its default (all linear modules).
        created = client.create_adapter(
            name, rank=rank, alpha=alpha, target_modules=target or [], description=description
        )
    if as_json:
        out.print_json(out.created_json(created))
    else:
        console.print(f"created {created.name} (event {created.event_id})")


def adapters(
    prefix: Annotated[str, typer.Option(help="Only names with this prefix.")] = "",
    registry: RegistryAddr = DEFAULT_REGISTRY,
    token: Token = None,
    ca_cert: CaCert = None,
    as_json: AsJson = False,
) -> None:
    """List adapters with their aliases."""
    with connect(registry, token, ca_cert) as client:
        found = client.list_adapters(prefix)
    if as_json:
        out.print_json([out.adapter_json(a) for a in found])
        return
    table = Table("adapter", "versions", "newest", "aliases", "rank", "created")
    for a in found:
        aliases = ", ".join(
            f"{k}->{v}{' (serving)' if k == a.serving_alias != LATEST else ''}" for k, v in sorted(a.aliases.items())
        )
        table.add_row(a.name, str(a.version_count), str(a.latest_version), aliases, str(a.rank), when(a.created_at))
    console.print(table)


def versions(
    name: str,
    limit: Annotated[int, typer.Option(min=0, help="Newest N versions.")] = 20,
    registry: RegistryAddr = DEFAULT_REGISTRY,
    token: Token = None,
    ca_cert: CaCert = None,
    as_json: AsJson = False,
) -> None:
    """Versions of an adapter, newest first."""
    with connect(registry, token, ca_cert) as client:
        newest = client.list_versions(name, limit or 100)  # 0: the registry's page size
        total = client.get_adapter(name).version_count if not as_json else len(newest)
    if as_json:
        out.print_json([out.version_json(v) for v in newest])
        return
    table = Table("version", "aliases", "parent", "step", "tokens", "metrics", "artifact", "published", "by")
    for v in newest:
        artifact = "(collected)" if v.artifact_deleted else v.sha256[:12]
        table.add_row(
            str(v.number),
            ", ".join(v.aliases),
            parent_text(v),
            str(v.lineage.trainer_step),
            str(v.lineage.tokens_trained),
            metrics_text(v.lineage.metrics),
            artifact,
            when(v.created_at),
            v.published_by,
        )
    console.print(table)
    if total > len(newest):
        console.print(
            f"{len(newest)} of {total} versions shown (--limit N, 0 for a page of 100; --json for all fields)"
        )


def parent_text(v: Version) -> str:
    """The parent version; a fork's names its adapter ("team-a/base@5")."""
    if not v.lineage.parent_version:
        return "-"
    if v.lineage.parent_adapter and v.lineage.parent_adapter != v.adapter:
        return f"{v.lineage.parent_adapter}@{v.lineage.parent_version}"
    return str(v.lineage.parent_version)


def metrics_text(metrics: dict[str, float]) -> str:
    return ", ".join(f"{k}={val:.4g}" for k, val in sorted(metrics.items()))


def show(
    reference: str,
    registry: RegistryAddr = DEFAULT_REGISTRY,
    token: Token = None,
    ca_cert: CaCert = None,
    as_json: AsJson = False,
) -> None:
    """Resolve a reference (name, name@alias, name@N) to its exact version."""
    with connect(registry, token, ca_cert) as client:
        v = client.resolve(reference)
        # A version without a LoRA shape of its own has its adapter's (empty there too: all linear modules).
        adapter = None if as_json else client.get_adapter(v.adapter)
    if adapter is None:
        out.print_json(out.version_json(v))
        return
    targets = v.target_modules or adapter.target_modules
    via = f" (bare name: serving alias {adapter.serving_alias})" if "@" not in reference else ""
    console.print(f"{reference} -> {v.adapter}@{v.number}{via}")
    console.print(f"  aliases    {', '.join(v.aliases) or '-'}")
    console.print(f"  artifact   {v.artifact_uri}{' (collected)' if v.artifact_deleted else ''} ({v.size_bytes} B)")
    console.print(f"  lora       rank {v.rank} alpha {v.alpha:g} targets {', '.join(targets) or 'all-linear'}")
    console.print(f"  parent     {parent_text(v)}  step {v.lineage.trainer_step}")
    console.print(f"  trained    {v.lineage.tokens_trained} tokens, {v.lineage.datums_trained} datums since the parent")
    if v.lineage.metrics:
        console.print(f"  metrics    {metrics_text(v.lineage.metrics)}")
    if v.lineage.state_id:
        console.print(f"  state      {v.lineage.state_id} (the trainer's full state at this version)")
    console.print(f"  published  {when(v.created_at)} by {v.published_by}")


@alias_app.command("set")
def alias_set(
    name: str,
    alias: str,
    version: int,
    expect: Annotated[int | None, typer.Option(help="Only if the alias points to this version now.")] = None,
    registry: RegistryAddr = DEFAULT_REGISTRY,
    token: Token = None,
    ca_cert: CaCert = None,
    as_json: AsJson = False,
) -> None:
    """Point ALIAS of NAME at VERSION."""
    with connect(registry, token, ca_cert) as client:
        move = client.set_alias(name, alias, version, expected_version=expect)
    if as_json:
        out.print_json(out.alias_set_json(move))
    else:
        console.print(f"{name}@{alias}: {move.previous_version or '-'} -> {move.version}")


@alias_app.command("serve")
def alias_serve(
    name: str,
    alias: str,
    registry: RegistryAddr = DEFAULT_REGISTRY,
    token: Token = None,
    ca_cert: CaCert = None,
    as_json: AsJson = False,
) -> None:
    """Make bare NAME (no @) resolve to ALIAS for every client and sampler; `latest` restores the default."""
    with connect(registry, token, ca_cert) as client:
        move = client.set_serving_alias(name, alias)
    if as_json:
        out.print_json(out.serving_alias_json(move))
    else:
        at = f"v{move.version}" if move.version else "no version yet"
        console.print(f"{name} serves @{move.alias} ({at}) to bare names (was @{move.previous_alias})")


@alias_app.command("rm")
def alias_rm(
    name: str,
    alias: str,
    expect: Annotated[int | None, typer.Option(help="Only if the alias points to this version now.")] = None,
    registry: RegistryAddr = DEFAULT_REGISTRY,
    token: Token = None,
    ca_cert: CaCert = None,
    as_json: AsJson = False,
) -> None:
    """Remove ALIAS of NAME."""
    with connect(registry, token, ca_cert) as client:
        move = client.delete_alias_move(name, alias, expected_version=expect)
    if as_json:
        out.print_json(out.alias_rm_json(move))
    else:
        console.print(f"removed {name}@{alias} (was {move.previous_version})")


def rollback(
    name: str,
    alias: Annotated[str, typer.Option(help="Alias to move back.")] = "latest",
    to: Annotated[int | None, typer.Option(help="Target version (default: the previous one).")] = None,
    registry: RegistryAddr = DEFAULT_REGISTRY,
    token: Token = None,
    ca_cert: CaCert = None,
    as_json: AsJson = False,
) -> None:
    """Move an alias back to an older version."""
    with connect(registry, token, ca_cert) as client:
        move = client.rollback(name, alias, to)
        left = client.get_version(name, move.previous_version) if alias == LATEST and move.previous_version else None
        serving = client.get_adapter(name).serving_alias if left is not None else LATEST
    if as_json:
        out.print_json(out.rollback_json(move))
    else:
        console.print(f"{name}@{move.alias}: {move.previous_version} -> {move.version}")
    notice = rollback_notice(name, alias, left, move.version, serving)
    if notice:
        print(notice, file=sys.stderr)


def lineage(
    reference: str,
    depth: Annotated[int, typer.Option(help="At most N versions (0: all).")] = 0,
    registry: RegistryAddr = DEFAULT_REGISTRY,
    token: Token = None,
    ca_cert: CaCert = None,
    as_json: AsJson = False,
) -> None:
    """The chain of versions back to the first, with their batches."""
    with connect(registry, token, ca_cert) as client:
        chain = client.get_lineage(reference, max_depth=depth)
    if as_json:
        out.print_json([out.version_json(v) for v in chain])
        return
    table = Table("version", "parent", "step", "tokens", "batches", "trace ids", "metrics")
    for v in chain:
        traces = sorted({t for b in v.lineage.batches for t in b.trace_ids})
        shown = ", ".join(traces[:TRACES_SHOWN])
        if len(traces) > TRACES_SHOWN:
            shown += f" (+{len(traces) - TRACES_SHOWN} more: --json lists all)"
        table.add_row(
            v.reference,
            parent_text(v),
            str(v.lineage.trainer_step),
            str(v.lineage.tokens_trained),
            str(len(v.lineage.batches)),
            shown,
            metrics_text(v.lineage.metrics),
        )
    console.print(table)


def watch(
    from_id: Annotated[str, typer.Option("--from", help="Resume after this event id ('0': from the oldest).")] = "",
    adapter: Annotated[list[str] | None, typer.Option(help="Only these adapters ('tenant/*' patterns).")] = None,
    count: Annotated[int, typer.Option(help="Stop after N messages (0: never).")] = 0,
    registry: RegistryAddr = DEFAULT_REGISTRY,
    token: Token = None,
    ca_cert: CaCert = None,
    as_json: AsJson = False,
) -> None:
    """Stream registry events (one per line)."""
    seen = 0
    # closing(): leaving early (--count) cancels the server stream.
    with connect(registry, token, ca_cert) as client, closing(client.watch_events(from_id, adapter or [])) as stream:
        for message in stream:
            if as_json:
                print(out.line(out.watch_json(message)), flush=True)
            elif isinstance(message, Reconcile):
                print(f"{message.event_id} RECONCILE ({message.reason}) {len(message.aliases)} adapters", flush=True)
                for name, aliases in message.aliases.items():
                    print(f"    {name} {dict(sorted(aliases.items()))}", flush=True)
            else:
                e = message
                detail = f"{e.alias} {e.previous_version or '-'} -> {e.version}" if e.alias else f"v{e.version}"
                print(f"{e.event_id} {e.type} {e.adapter} {detail} by {e.actor}", flush=True)
            seen += 1
            if count and seen >= count:
                return


def gc(
    keep: Annotated[int, typer.Option(help="Keep the newest K versions of each adapter (plus aliased ones).")] = 5,
    adapter: Annotated[str, typer.Option(help="Only this adapter.")] = "",
    dry_run: Annotated[bool, typer.Option(help="Only report.")] = False,
    gc_grace: Annotated[
        float | None,
        typer.Option(
            min=0,
            help="Seconds an unpublished artifact (an upload, or objects pushed to a bucket store and never "
            "published) must be old to be deleted (default: the registry's --gc-grace, 1 h unless set).",
        ),
    ] = None,
    registry: RegistryAddr = DEFAULT_REGISTRY,
    token: Token = None,
    ca_cert: CaCert = None,
    as_json: AsJson = False,
) -> None:
    """Delete artifacts outside the retention policy (admin)."""
    with connect(registry, token, ca_cert) as client:
        result = client.garbage_collect(keep, adapter, dry_run, gc_grace)
    if as_json:
        out.print_json(out.gc_json(result))
        return
    verb = "would collect" if dry_run else "collected"
    for (name, number), artifact in zip(result.collected, result.artifacts, strict=True):
        console.print(f"{verb} {name}@{number} ({artifact.size_bytes} B)")
    console.print(f"{len(result.collected)} versions, {result.bytes_freed} bytes freed")


def delete(name: str, registry: RegistryAddr = DEFAULT_REGISTRY, token: Token = None, ca_cert: CaCert = None) -> None:
    """Delete an adapter and its aliases (its tenant or an admin); versions remain until gc."""
    with connect(registry, token, ca_cert) as client:
        event_id = client.delete_adapter(name)
    console.print(f"deleted {name} (event {event_id})")


def add_admin_commands(registry_app: typer.Typer) -> None:
    """Adds the admin commands to the `registry` group (next to `serve`), in the order `--help` lists them."""
    commands: list[tuple[str, Callable[..., None]]] = [
        ("create", create),
        ("adapters", adapters),
        ("versions", versions),
        ("show", show),
        ("rollback", rollback),
        ("lineage", lineage),
        ("watch", watch),
        ("gc", gc),
        ("delete", delete),
        ("import", import_adapter),
        ("export", export_adapter),
        ("migrate-store", migrate_store),
    ]
    for name, command in commands:
        registry_app.command(name)(command)
    registry_app.add_typer(alias_app, name="alias")

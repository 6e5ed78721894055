"""`opentinker fleet status`: the registry's live replicas (samplers, and trainers once they register), one row
each with state, base, load and resident versions; `--json` gives every field of every record."""

from __future__ import annotations

import dataclasses
import json
from datetime import datetime
from typing import Annotated, Any

import typer
from rich.table import Table

from opentinker.cli.options import DEFAULT_REGISTRY, AsJson, CaCert, RegistryAddr, Token
from opentinker.cli.registry_connect import connect, console
from opentinker.client import Replica

fleet_app = typer.Typer(no_args_is_help=True)


def replica_json(replica: Replica) -> dict[str, Any]:
    record = dataclasses.asdict(replica)
    for key, value in record.items():
        if isinstance(value, datetime):
            record[key] = value.isoformat()
        elif isinstance(value, tuple):
            record[key] = list(value)
    return record


@fleet_app.command("status")
def status(
    registry: RegistryAddr = DEFAULT_REGISTRY,
    token: Token = None,
    ca_cert: CaCert = None,
    as_json: AsJson = False,
    role: Annotated[str | None, typer.Option(help="Only samplers or only trainers.")] = None,
) -> None:
    """The fleet as the registry sees it: every replica whose lease is alive."""
    if role not in (None, "sampler", "trainer"):
        raise typer.BadParameter("sampler or trainer", param_hint="--role")
    with connect(registry, token, ca_cert) as client:
        replicas = client.list_replicas(role)  # type: ignore[arg-type]
    if as_json:
        print(json.dumps([replica_json(r) for r in replicas], indent=2, sort_keys=True))
        return
    table = Table(
        "replica",
        "role",
        "address",
        "state",
        "zone",
        "base",
        "slots",
        "waiting",
        "kv blocks",
        "tok/s",
        "resident",
        title=f"fleet: {len(replicas)} replicas",
    )
    for r in replicas:
        load = r.load
        table.add_row(
            r.replica_id,
            r.role,
            r.address,
            r.state,
            r.zone or "-",
            r.base_fingerprint[:12],
            f"{load.slots_used}/{load.slots_total or 'no limit'}",  # a trainer's --max-resident-adapters 0
            str(load.waiting_sequences),  # a trainer's: compute jobs queued
            f"{load.kv_blocks_used}/{load.kv_blocks_total}" if r.role == "sampler" else "-",  # a trainer has none
            f"{load.tokens_per_second:.1f}" if r.role == "sampler" else "-",
            ", ".join(r.resident) or "-",
        )
    console.print(table)

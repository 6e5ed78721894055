"""`opentinker trainer adapters|show|delete|reset|save-state|move`: operate a running trainer through the SDK's
ServiceClient. Tenant-scoped by the token: a tenant sees and touches only its own adapters (others answer
PERMISSION_DENIED). A failed call prints one line, `error: CODE: message [REASON]`, and exits 1."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from opentinker.cli import registry_json as out
from opentinker.cli.console import table_console
from opentinker.cli.failure import reported
from opentinker.cli.options import DEFAULT_REGISTRY, AsJson, CaCert, RegistryAddr, Token
from opentinker.client import ServiceClient, TrainingAdapterInfo

TRAINER_PORT = 7071
DEFAULT_TRAINER = f"127.0.0.1:{TRAINER_PORT}"
TrainerAddr = Annotated[str, typer.Option("--trainer", envvar="OPENTINKER_TRAINER", help="Trainer address host:port.")]

console = table_console()  # piped: wide enough that no column is cut


@contextmanager
def connect(address: str, token: str | None, ca_cert: Path | None) -> Iterator[ServiceClient]:
    # No deadline: loading a version or saving a state of a big adapter takes as long as it takes.
    with ServiceClient(trainer=address, token=token, timeout=None, ca_cert=ca_cert) as client, reported(ca_cert):
        yield client


def _plain(value: Any) -> Any:
    """JSON form of an SDK record: every field, zeros and empties included; times as ISO 8601 UTC."""
    if isinstance(value, datetime):
        return value.astimezone(UTC).isoformat()
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, tuple | list):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def print_json(value: object) -> None:
    out.print_json(_plain(value))


def _parent(info: TrainingAdapterInfo) -> str:
    if not info.last_snapshot_version:
        return "-"
    return f"{info.parent_adapter or info.name}@{info.last_snapshot_version}"


def adapters(
    prefix: Annotated[str, typer.Option(help="Only names starting with this (e.g. team-a/).")] = "",
    trainer: TrainerAddr = DEFAULT_TRAINER,
    token: Token = None,
    ca_cert: CaCert = None,
    as_json: AsJson = False,
) -> None:
    """Adapters this trainer holds (those the token may access)."""
    with connect(trainer, token, ca_cert) as client:
        held = client.list_training_adapters(prefix)
    if as_json:
        print_json(held)
        return
    table = Table("name", "rank", "step", "tokens", "pending", "next parent", "resident")
    for info in held:
        table.add_row(
            info.name,
            str(info.rank),
            str(info.step),
            str(info.tokens_trained),
            str(info.pending_batches),
            _parent(info),
            "yes" if info.resident else "no",
        )
    console.print(table)


def show(
    name: str,
    trainer: TrainerAddr = DEFAULT_TRAINER,
    token: Token = None,
    ca_cert: CaCert = None,
    as_json: AsJson = False,
) -> None:
    """One adapter's training state: step, totals, pending batches, the version its next snapshot follows."""
    with connect(trainer, token, ca_cert) as client:
        info = client.get_training_adapter(name)
    if as_json:
        print_json(info)
        return
    rows = [
        ("name", info.name),
        ("lora", f"rank {info.rank}, alpha {info.alpha:g}, dropout {info.dropout:g}"),
        ("target modules", ", ".join(info.target_modules)),
        ("step", str(info.step)),
        ("tokens trained", str(info.tokens_trained)),
        ("datums trained", str(info.datums_trained)),
        ("pending batches", str(info.pending_batches)),
        ("next snapshot's parent", _parent(info)),
        ("parameters", str(info.num_parameters)),
        ("resident", "yes" if info.resident else "no"),
    ]
    for key, value in rows:
        console.print(f"{key:>24}  {value}", highlight=False)


def delete(
    name: str,
    trainer: TrainerAddr = DEFAULT_TRAINER,
    token: Token = None,
    ca_cert: CaCert = None,
    as_json: AsJson = False,
) -> None:
    """Drop an adapter's training state from the trainer (its registry versions stay)."""
    with connect(trainer, token, ca_cert) as client:
        client.delete_training_adapter(name)
    if as_json:
        print_json({"deleted": name})
    else:
        console.print(f"deleted {name} from the trainer (registry versions kept)", highlight=False)


def reset(
    name: str,
    to: Annotated[str, typer.Option("--to", help="Version to load: N, an alias (stable), or another NAME@N.")],
    keep_optimizer: Annotated[
        bool, typer.Option("--keep-optimizer", help="Keep the AdamW moments (default: fresh ones).")
    ] = False,
    trainer: TrainerAddr = DEFAULT_TRAINER,
    token: Token = None,
    ca_cert: CaCert = None,
    as_json: AsJson = False,
) -> None:
    """Load a version's weights into the live adapter, so its next snapshot's parent is that version."""
    with connect(trainer, token, ca_cert) as client:
        result = client.reset_training_adapter(name, to, keep_optimizer=keep_optimizer)
    if as_json:
        print_json(result)
        return
    optimizer = "optimizer kept" if result.optimizer_kept else "optimizer fresh"
    console.print(
        f"{name}: weights of {result.adapter}@{result.version} loaded, {optimizer}, step "
        f"{result.info.step}; the next snapshot's parent is {result.adapter}@{result.version}",
        highlight=False,
    )


def save_state(
    name: str,
    label: Annotated[str, typer.Option(help="Human label of the state.")] = "",
    trainer: TrainerAddr = DEFAULT_TRAINER,
    token: Token = None,
    ca_cert: CaCert = None,
    as_json: AsJson = False,
) -> None:
    """Save the adapter's full state (weights, optimizer, step, RNG, ledger) for an exact resume."""
    with connect(trainer, token, ca_cert) as client:
        saved = client.save_training_state(name, label)
    if as_json:
        print_json(saved)
    else:
        console.print(f"{name}: state {saved.state_id} (step {saved.step}, {saved.size_bytes} bytes)", highlight=False)


def move(
    name: str,
    to: Annotated[
        str, typer.Option("--to", help="The trainer to move it to: host:port or replica id (default: least loaded).")
    ] = "",
    registry: RegistryAddr = DEFAULT_REGISTRY,
    token: Token = None,
    ca_cert: CaCert = None,
    as_json: AsJson = False,
) -> None:
    """Trainer pool: hand an adapter to another trainer with no step lost (save, fence, load); its training
    clients follow on their next call."""
    with (
        ServiceClient(registry=registry, token=token, timeout=None, ca_cert=ca_cert) as client,
        reported(ca_cert),
    ):
        moved = client.move_training_adapter(name, to)
    if as_json:
        print_json(moved)
    else:
        console.print(
            f"{name}: moved from {moved.from_address} to {moved.to_address} (epoch {moved.epoch}, state at step "
            f"{moved.state_step})",
            highlight=False,
        )


def add_trainer_commands(trainer_app: typer.Typer) -> None:
    """Adds the operations to the `trainer` group (next to `serve`)."""
    commands: list[tuple[str, Callable[..., None]]] = [
        ("adapters", adapters),
        ("show", show),
        ("delete", delete),
        ("reset", reset),
        ("save-state", save_state),
        ("move", move),
    ]
    for name, command in commands:
        trainer_app.command(name)(command)

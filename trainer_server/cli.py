"""`opentinker trainer serve`: one frozen base model, many LoRA adapters, over gRPC."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from opentinker.rpc.process import cli_options as opt
from opentinker.rpc.process.config import serve_command
from opentinker.rpc.process.model_server_setup import ModelServerSetup
from opentinker.weights.artifact_bucket import store_environment

DEFAULT_PORT = 7071
trainer_app = typer.Typer(no_args_is_help=True)


@trainer_app.command("serve", cls=serve_command("trainer", lambda params: store_environment(params.get("store"))))
@opt.serve_flags(DEFAULT_PORT)
@opt.model_server_flags("trainer")
def serve(
    max_resident_adapters: Annotated[
        int, typer.Option(help="Adapters kept on the device; idle ones move off LRU (0: no limit).")
    ] = 0,
    spill_dir: Annotated[
        Path | None, typer.Option(help="Where offloaded adapters go when the device is the CPU.")
    ] = None,
    max_batch_tokens: Annotated[int, typer.Option(help="Largest ForwardBackward batch, in tokens.")] = 1 << 20,
    max_batch_positions: Annotated[
        int,
        typer.Option(help="Largest Forward/ForwardBackward batch in padded positions (datums x longest datum)."),
    ] = 1 << 17,
    max_adapters_per_tenant: Annotated[
        int, typer.Option(help="Adapters one tenant may hold in this trainer (admins are not counted; 0: no limit).")
    ] = 64,
    micro_batch_positions: Annotated[
        int,
        typer.Option(
            help="Padded positions per micro-batch: a bigger Forward/ForwardBackward runs in parts with "
            "gradient accumulation, other tenants' and adapters' jobs between them."
        ),
    ] = 1 << 12,
    max_tenant_memory_mb: Annotated[
        int,
        typer.Option(
            help="LoRA memory one tenant's adapters may hold in this trainer, MiB: weights + gradients + AdamW "
            "moments, weighed at CreateAdapter before anything is allocated (admins are not counted; 0: no limit)."
        ),
    ] = 16384,
    max_queued_per_tenant: Annotated[
        int,
        typer.Option(
            help="Forward/ForwardBackward/OptimStep/Save* requests one tenant may have queued or running on the "
            "compute thread; more are refused before their payload is converted (admins are not counted; 0: no limit)."
        ),
    ] = 64,
    max_serving_rank: Annotated[
        int,
        typer.Option(
            help="Largest LoRA rank CreateAdapter accepts: set it to the samplers' --max-rank, which could not serve "
            "a larger one (0: no check)."
        ),
    ] = 64,
    persist_state: Annotated[
        bool,
        typer.Option(
            help="Save each adapter's full state (weights, optimizer, step, RNG, ledger) with every snapshot, so "
            "attaching after a trainer restart resumes it exactly."
        ),
    ] = False,
    autosave_every: Annotated[
        int,
        typer.Option(
            help="A pool adapter (placed by the registry) saves its full state every N optimizer steps, recorded "
            "in the registry: a failover resumes there and the SDK replays the calls since (0: only at creation)."
        ),
    ] = 50,
    *,
    setup: ModelServerSetup,
    serving: opt.Serving,
) -> None:
    """Run the trainer gRPC server."""
    from opentinker.rpc.process.memory import limit_malloc_arenas

    limit_malloc_arenas()  # first, before torch and gRPC start their threads: freed adapters can be trimmed
    from opentinker.rpc.serving.server import configure_logging
    from opentinker.trainer_server.build import TrainerConfig, serve_trainer
    from opentinker.weights.model_check import check_model

    configure_logging(serving.log_level)
    serving.refuse_unsafe_exposure("trainer")
    serving.check_ports()  # a busy port or a missing model: found before the model loads
    check_model(setup.model, setup.revision, setup.served_model_name)
    if max_adapters_per_tenant < 0:
        raise typer.BadParameter("must be at least 0 (0: no limit)", param_hint="--max-adapters-per-tenant")
    if max_tenant_memory_mb < 0:
        raise typer.BadParameter("must be at least 0 (0: no limit)", param_hint="--max-tenant-memory-mb")
    if max_queued_per_tenant < 0:
        raise typer.BadParameter("must be at least 0 (0: no limit)", param_hint="--max-queued-per-tenant")
    if micro_batch_positions < 1:
        raise typer.BadParameter("must be at least 1", param_hint="--micro-batch-positions")
    if max_batch_positions < 1:
        raise typer.BadParameter("must be at least 1", param_hint="--max-batch-positions")
    if autosave_every < 0:
        raise typer.BadParameter("must be at least 0 (0: only at creation)", param_hint="--autosave-every")
    if max_serving_rank < 0:
        raise typer.BadParameter("must be at least 0 (0: no check)", param_hint="--max-serving-rank")
    config = TrainerConfig(
        setup=setup,
        server=serving.server,
        max_resident_adapters=max_resident_adapters,
        spill_dir=spill_dir,
        max_batch_tokens=max_batch_tokens,
        max_batch_positions=max_batch_positions,
        max_adapters_per_tenant=max_adapters_per_tenant,
        micro_batch_positions=micro_batch_positions,
        max_tenant_memory_mb=max_tenant_memory_mb,
        max_queued_per_tenant=max_queued_per_tenant,
        max_serving_rank=max_serving_rank,
        persist_state=persist_state,
        autosave_every=autosave_every,
    )
    serve_trainer(config)

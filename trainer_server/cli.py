"""`opentinker trainer serve`: one frozen base model, many LoRA adapters, over gRPC."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from opentinker.rpc import cli_options as opt
from opentinker.rpc.config import serve_command

DEFAULT_PORT = 7071
trainer_app = typer.Typer(no_args_is_help=True)


@trainer_app.command("serve", cls=serve_command("trainer"))
def serve(
    model: Annotated[str, typer.Option(help="Base model: a local HF directory (or a cached HF id).")],
    registry: Annotated[str, typer.Option(envvar="OPENTINKER_REGISTRY", help="Registry address host:port.")],
    store: Annotated[Path, typer.Option(help="Artifact store root (share it with the registry when possible).")],
    registry_token: Annotated[
        str | None,
        typer.Option(envvar="OPENTINKER_REGISTRY_TOKEN", help="Token the trainer uses with the registry."),
    ] = None,
    device: Annotated[str, typer.Option(help="auto (CUDA when present), cpu or cuda.")] = "auto",
    dtype: Annotated[str, typer.Option(help="Base weights dtype: float32 or bfloat16.")] = "float32",
    max_resident_adapters: Annotated[
        int, typer.Option(help="Adapters kept on the device; idle ones move off LRU (0: no limit).")
    ] = 0,
    spill_dir: Annotated[
        Path | None, typer.Option(help="Where offloaded adapters go when the device is the CPU.")
    ] = None,
    max_batch_tokens: Annotated[int, typer.Option(help="Largest ForwardBackward batch, in tokens.")] = 1 << 20,
    registry_ca: opt.RegistryCa = None,
    host: opt.Host = "127.0.0.1",
    port: opt.Port = DEFAULT_PORT,
    metrics_port: opt.MetricsPort = 0,
    tokens_file: opt.TokensFile = None,
    insecure_public: opt.InsecurePublic = False,
    tls_cert: opt.TlsCert = None,
    tls_key: opt.TlsKey = None,
    ready_file: opt.ReadyFile = None,
    log_level: opt.LogLevel = "INFO",
    max_message_mb: opt.MaxMessageMb = 64,
    config_file: opt.Config = None,
    print_config: opt.PrintConfig = False,
) -> None:
    """Run the trainer gRPC server."""
    import grpc
    from prometheus_client import REGISTRY

    from opentinker.rpc import faults
    from opentinker.rpc.channel import bearer_metadata
    from opentinker.rpc.progress import spinner
    from opentinker.rpc.registry_link import registry_channel
    from opentinker.rpc.server import ServiceBinding, configure_logging, exit_if_unsafe, serve_forever
    from opentinker.trainer_server.base_model import BaseModel
    from opentinker.trainer_server.metrics import TrainerCollector
    from opentinker.trainer_server.scheduler import AdapterScheduler
    from opentinker.trainer_server.service import TrainerServicer
    from opentinker.trainer_server.trainer import Trainer
    from opentinker.v1 import registry_pb2_grpc, trainer_pb2, trainer_pb2_grpc
    from opentinker.weights.artifact_store import ArtifactStore
    from opentinker.weights.base_model import pick_device

    configure_logging(log_level)
    # Refuse an unsafe exposure before loading the model, not after.
    exposure = opt.server_options(host, port, metrics_port, tokens_file, insecure_public, tls_cert, tls_key, ready_file)
    exit_if_unsafe("trainer", exposure)
    if dtype not in ("float32", "bfloat16"):
        raise typer.BadParameter("dtype must be float32 or bfloat16", param_hint="--dtype")
    artifacts = ArtifactStore(store, fault_hook=faults.configure())  # no hook unless a test arms one
    artifacts.cleanup_temp()
    with spinner(f"loading {model}"):
        base = BaseModel(model, device=pick_device(device), dtype=dtype)
    trainer = Trainer(base, artifacts, max_resident=max_resident_adapters,
                      spill_dir=spill_dir or store.parent / "trainer-spill")  # fmt: skip
    scheduler = AdapterScheduler()
    REGISTRY.register(TrainerCollector(trainer, scheduler))
    metadata = bearer_metadata(registry_token) or None
    state: dict[str, object] = {}

    def add(server: grpc.aio.Server) -> None:
        # The aio channel must be created inside the server's event loop.
        channel = registry_channel(registry, registry_ca)
        state["channel"] = channel
        scheduler.start()
        servicer = TrainerServicer(trainer, scheduler, registry_pb2_grpc.RegistryServiceStub(channel),
                                   registry_metadata=metadata, max_batch_tokens=max_batch_tokens)  # fmt: skip
        trainer_pb2_grpc.add_TrainerServiceServicer_to_server(servicer, server)

    async def on_stop() -> None:
        await scheduler.stop()
        channel = state.get("channel")
        if isinstance(channel, grpc.aio.Channel):
            await channel.close()

    binding = ServiceBinding(trainer_pb2.DESCRIPTOR.services_by_name["TrainerService"].full_name, add)
    options = opt.server_options(host, port, metrics_port, tokens_file, insecure_public, tls_cert, tls_key, ready_file,
                                 max_message_mb)  # fmt: skip
    serve_forever("trainer", [binding], options, on_stop=on_stop)

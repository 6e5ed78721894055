"""The trainer server's wiring, apart from its flags: `TrainerConfig` (what `opentinker trainer serve` parsed) ->
`build_trainer` (base model, trainer, scheduler, the gRPC service and its shutdown) -> `serve_trainer` (runs it
until a signal).

Heavy modules (torch, grpc) are imported inside the functions, so importing this (and the CLI) stays fast.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

MAX_REPORTED_ADAPTERS = 4096  # the registry's bound on a replica's resident list (replica_handlers.py)

if TYPE_CHECKING:
    from opentinker.rpc.process.model_server_setup import ModelServerSetup
    from opentinker.rpc.serving.server import ServerOptions, ServiceBinding
    from opentinker.trainer_server.trainer import Trainer


@dataclass(frozen=True, slots=True)
class TrainerConfig:
    setup: ModelServerSetup  # the base model, the registry, the store (shared with the sampler)
    server: ServerOptions
    max_resident_adapters: int = 0  # 0: no limit
    spill_dir: Path | None = None  # None: <store>/../trainer-spill
    max_batch_tokens: int = 1 << 20
    max_batch_positions: int = 1 << 17  # datums x longest datum per request (batch.py)
    max_adapters_per_tenant: int = 64  # 0: no limit (quota.py)
    micro_batch_positions: int = 1 << 12  # a bigger request runs in parts (micro_batch.py)
    max_tenant_memory_mb: int = 16384  # LoRA weights + gradients + moments per tenant; 0: no limit (quota.py)
    max_queued_per_tenant: int = 64  # compute jobs per tenant queued or running; 0: no limit (admission.py)
    max_serving_rank: int = 64  # the samplers' --max-rank (start_point.py); 0: no check
    persist_state: bool = False  # a full state with every snapshot, for an exact resume after a restart
    autosave_every: int = 50  # a pool adapter's full state every N steps (pool_handlers.py); 0: at creation only


@dataclass(frozen=True, slots=True)
class BuiltTrainer:
    bindings: list[ServiceBinding]
    on_stop: Callable[[], Coroutine[Any, Any, None]]
    trainer: Trainer
    health_checks: dict[str, Callable[[], Awaitable[bool]]] = field(default_factory=dict)  # store_health_checks
    on_start: Callable[[str], Awaitable[None]] | None = None  # registers with the fleet (membership.py)
    on_drain: Callable[[], Awaitable[None]] | None = None  # DRAINING in the registry before health flips


def build_trainer(config: TrainerConfig) -> BuiltTrainer:
    """Loads the base model and returns the service to serve."""
    import grpc
    from prometheus_client import REGISTRY

    from opentinker.rpc.process import faults
    from opentinker.rpc.process.progress import spinner
    from opentinker.rpc.serving.channel import bearer_metadata
    from opentinker.rpc.serving.membership import Beat, FleetMember
    from opentinker.rpc.serving.registry_link import registry_channel
    from opentinker.rpc.serving.server import ServiceBinding
    from opentinker.trainer_server.base_model import BaseModel
    from opentinker.trainer_server.metrics import TrainerCollector
    from opentinker.trainer_server.scheduler import AdapterScheduler
    from opentinker.trainer_server.service import TrainerServicer
    from opentinker.trainer_server.trainer import Trainer
    from opentinker.v1 import registry_pb2, registry_pb2_grpc, trainer_pb2, trainer_pb2_grpc
    from opentinker.weights.artifact_bucket import open_artifacts, store_health_checks
    from opentinker.weights.base_model import pick_device, pick_dtype

    c, setup = config, config.setup
    # No fault hook unless a test arms one.
    artifacts, bucket = open_artifacts(
        str(setup.store), setup.cache_dir, setup.cache_max_bytes, fault_hook=faults.configure()
    )
    artifacts.cleanup_temp()
    with spinner(f"loading {setup.model}"):
        device = pick_device(setup.device)
        base = BaseModel(
            setup.model,
            device=device,
            dtype=pick_dtype(setup.dtype, device),
            revision=setup.revision,
            served_name=setup.served_model_name,
        )
    spill_dir = c.spill_dir or artifacts.root.parent / "trainer-spill"
    trainer = Trainer(base, artifacts, max_resident=c.max_resident_adapters, spill_dir=spill_dir, bucket=bucket)
    scheduler = AdapterScheduler()
    REGISTRY.register(TrainerCollector(trainer, scheduler))
    metadata = bearer_metadata(setup.registry_token) or None
    state: dict[str, object] = {}

    def beat() -> Beat:
        # slots: the adapters this trainer holds (on the device or spilled), of --max-resident-adapters.
        # list() copies the keys in one step under the GIL, while the compute thread may add an adapter.
        held = sorted(list(trainer.adapters))
        load = registry_pb2.ReplicaLoad(
            slots_used=len(held),
            slots_total=c.max_resident_adapters,
            waiting_sequences=scheduler.queued,
        )
        return Beat(load, held[:MAX_REPORTED_ADAPTERS])

    def on_beat(response: registry_pb2.HeartbeatResponse, sent_at: float) -> None:
        servicer = state.get("servicer")
        if isinstance(servicer, TrainerServicer):
            servicer.on_beat(response, sent_at)  # renews the pool adapters' leases

    member = FleetMember(
        registry_pb2.REPLICA_ROLE_TRAINER, base.digest, c.max_resident_adapters, beat, setup, on_beat=on_beat
    )

    def add(server: grpc.aio.Server) -> None:
        # The aio channel must be created inside the server's event loop.
        channel = registry_channel(setup.registry, setup.registry_ca)
        state["channel"] = channel
        scheduler.start()
        servicer = TrainerServicer(
            trainer,
            scheduler,
            registry_pb2_grpc.RegistryServiceStub(channel),
            registry_metadata=metadata,
            max_batch_tokens=c.max_batch_tokens,
            max_batch_positions=c.max_batch_positions,
            max_adapters_per_tenant=c.max_adapters_per_tenant,
            micro_batch_positions=c.micro_batch_positions,
            max_tenant_memory_mb=c.max_tenant_memory_mb,
            max_queued_per_tenant=c.max_queued_per_tenant,
            max_serving_rank=c.max_serving_rank,
            persist_state=c.persist_state,
            member=member,
            autosave_every=c.autosave_every,
        )
        state["servicer"] = servicer
        trainer_pb2_grpc.add_TrainerServiceServicer_to_server(servicer, server)

    async def on_start(address: str) -> None:
        channel = state["channel"]
        assert isinstance(channel, grpc.aio.Channel)
        member.join(registry_pb2_grpc.RegistryServiceStub(channel), metadata, address)

    async def on_stop() -> None:
        await member.leave()
        await scheduler.stop()
        channel = state.get("channel")
        if isinstance(channel, grpc.aio.Channel):
            await channel.close()

    async def on_drain() -> None:
        await member.drain()  # DRAINING first: the registry places nothing new here
        servicer = state.get("servicer")
        if isinstance(servicer, TrainerServicer):
            await servicer.move_all_away()  # then the pool adapters go to other trainers

    binding = ServiceBinding(trainer_pb2.DESCRIPTOR.services_by_name["TrainerService"].full_name, add)
    return BuiltTrainer([binding], on_stop, trainer, store_health_checks(bucket), on_start, on_drain)


def serve_trainer(config: TrainerConfig) -> None:
    """Builds the trainer and serves it until SIGINT/SIGTERM."""
    from opentinker.rpc.serving.server import ServerHooks, serve_forever

    built = build_trainer(config)
    hooks = ServerHooks(
        on_start=built.on_start, on_drain=built.on_drain, on_stop=built.on_stop, health_checks=built.health_checks
    )
    serve_forever("trainer", built.bindings, config.server, hooks)

"""The sampler server's wiring, apart from its flags: `SamplerConfig` (what `opentinker sampler serve` parsed) ->
`build_sampler` (model, slot pool, engine in or out of process, the gRPC service and its shutdown) ->
`serve_sampler` (runs it until a signal).

Heavy modules (torch, grpc) are imported inside the functions, so importing this (and the CLI) stays fast.
"""

from __future__ import annotations

import functools
import logging
import os
import signal
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from opentinker.rpc.process.model_server_setup import ModelServerSetup
    from opentinker.rpc.serving.server import ServerOptions, ServiceBinding
    from opentinker.sampler_server.engine import Engine
    from opentinker.sampler_server.engine_api import EngineAPI
    from opentinker.sampler_server.kernels import Backend

log = logging.getLogger("opentinker.sampler")
CpuGemm = Literal["onednn", "torch"]  # float32 CPU base matmuls: oneDNN packed weights or torch's dense GEMM
# The default bound of a text prompt: a prompt_text of more bytes than this per token of the context would hardly
# fit it anyway (English runs ~4 bytes a token, CJK ~3), and tokenizing it costs CPU and memory per byte.
PROMPT_BYTES_PER_TOKEN = 16


class BadOption(ValueError):
    """Options that do not fit together (found once the device is known); `option` names the flag."""

    def __init__(self, message: str, option: str) -> None:
        super().__init__(message)
        self.option = option


@dataclass(frozen=True, slots=True)
class SamplerConfig:
    setup: ModelServerSetup  # the base model, the registry, the store (shared with the trainer)
    server: ServerOptions
    max_slots: int = 32
    max_rank: int = 64
    max_seqs: int = 64
    max_batch_tokens: int = 4096
    prefill_chunk_tokens: int = 512  # prompt tokens per mixed step; 0: whole prompts, a step prefills or decodes
    mixed_prefill_tokens: int | None = None  # None: default_mixed_prefill_tokens(the device); 0: no bound
    max_len: int = 0  # 0: the model's, capped at 4096
    max_waiting: int = 256
    num_blocks: int = 0  # KV-cache blocks; 0: kv_cache_mb, or what max_seqs x max_len took in slots
    kv_cache_mb: float = 0.0
    prefix_cache: bool = True  # reuse cached prompt blocks (--no-prefix-cache: off)
    share_base_prefix_cache: bool = False  # base-model blocks shared across tenants (single-tenant deployments)
    max_seqs_per_tenant: int | None = None  # None: default_tenant_slots(max_seqs); 0: no limit
    max_kv_blocks_per_tenant: int | None = None  # None: default_tenant_blocks(the pool); 0: no bound
    max_queued_per_tenant: int | None = None  # None: default_tenant_queue(max_waiting); 0: no limit
    max_compiles_per_tenant: int = 16  # grammars one tenant may have waiting to compile; 0: no limit
    max_pinned_per_tenant: int | None = None  # None: default_tenant_pins(max_slots); 0: no limit
    max_prompt_bytes: int = 0  # 0: PROMPT_BYTES_PER_TOKEN per token of the context
    burst_wait_ms: float = 2.0
    kernel: Backend = "auto"
    cpu_gemm: CpuGemm = "onednn"
    engine_process: bool | None = None  # None: on for the CPU, off for CUDA
    follow: tuple[str, ...] = ()
    follow_window: float = 300.0


@dataclass(frozen=True, slots=True)
class BuiltSampler:
    bindings: list[ServiceBinding]
    on_stop: Callable[[], Coroutine[Any, Any, None]]
    engine: EngineAPI
    health_checks: dict[str, Callable[[], Awaitable[bool]]] = field(default_factory=dict)  # store_health_checks
    on_start: Callable[[str], Awaitable[None]] | None = None  # registers with the fleet (membership.py)
    on_drain: Callable[[], Awaitable[None]] | None = None  # tells the fleet it drains, before health flips


def load_tokenizer(model_dir: Path) -> Any | None:
    """The model's tokenizer, or None when it has none (token-only serving)."""
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(model_dir)
    except (OSError, ValueError):
        return None


def build_sampler(config: SamplerConfig) -> BuiltSampler:
    """Loads the model (in the engine process when there is one) and returns the service to serve; raises
    BadOption for options that do not fit the device."""
    import grpc
    import torch
    from prometheus_client import REGISTRY

    from opentinker.rpc.process.progress import spinner
    from opentinker.rpc.serving.channel import bearer_metadata
    from opentinker.rpc.serving.membership import Beat, FleetMember
    from opentinker.rpc.serving.registry_link import registry_channel
    from opentinker.rpc.serving.server import ServiceBinding
    from opentinker.sampler_server.adapters import AdapterLoader
    from opentinker.sampler_server.block_manager import BLOCK_SIZE
    from opentinker.sampler_server.constraint import Grammars
    from opentinker.sampler_server.engine import Engine
    from opentinker.sampler_server.engine_process import EngineProcess
    from opentinker.sampler_server.follower import AliasFollower
    from opentinker.sampler_server.kernels import resolve_kernel
    from opentinker.sampler_server.metrics import SamplerCollector
    from opentinker.sampler_server.model.kv_cache import KVCache
    from opentinker.sampler_server.model.llama import LlamaForCausalLM
    from opentinker.sampler_server.model.weights import linear_shapes
    from opentinker.sampler_server.scheduler import Scheduler
    from opentinker.sampler_server.service import SamplerServicer
    from opentinker.sampler_server.slot_pool import SlotPool, SlotTensors, default_tenant_pins
    from opentinker.sampler_server.tenant_bounds import (
        default_mixed_prefill_tokens,
        default_tenant_blocks,
        default_tenant_queue,
        default_tenant_slots,
    )
    from opentinker.v1 import common_pb2, registry_pb2, registry_pb2_grpc, sampler_pb2, sampler_pb2_grpc
    from opentinker.weights.artifact_bucket import open_artifacts, store_health_checks
    from opentinker.weights.base_model import model_digest, pick_device, pick_dtype, resolve_model_dir
    from opentinker.weights.model_config import load_config
    from opentinker.weights.served_name import served_model_name

    c, setup = config, config.setup
    model, registry, registry_token, registry_ca = setup.model, setup.registry, setup.registry_token, setup.registry_ca
    max_seqs, max_batch_tokens = c.max_seqs, c.max_batch_tokens
    per_tenant = default_tenant_slots(max_seqs) if c.max_seqs_per_tenant is None else c.max_seqs_per_tenant
    queued = default_tenant_queue(c.max_waiting) if c.max_queued_per_tenant is None else c.max_queued_per_tenant
    pins = default_tenant_pins(c.max_slots) if c.max_pinned_per_tenant is None else c.max_pinned_per_tenant
    torch_device = torch.device(pick_device(setup.device))
    mixed = c.mixed_prefill_tokens
    mixed = default_mixed_prefill_tokens(torch_device.type) if mixed is None else mixed
    dtype = pick_dtype(setup.dtype, torch_device.type)
    torch_dtype = torch.float32 if dtype == "float32" else torch.bfloat16
    lora_kernel = resolve_kernel(c.kernel, torch_device.type)  # the engine runs it, GetSamplerInfo reports it
    model_dir = resolve_model_dir(model, setup.revision)
    served_name = served_model_name(model, setup.served_model_name, model_dir)  # refused before the load
    model_config = load_config(model_dir)
    context = c.max_len or min(model_config.context_length, 4096)
    shapes = linear_shapes(model_config)
    num_blocks = kv_blocks(c, model_config, context, torch_dtype)
    tenant_blocks = c.max_kv_blocks_per_tenant
    tenant_blocks = default_tenant_blocks(num_blocks) if tenant_blocks is None else tenant_blocks
    # Dynamic NTK rotates a prompt's keys by frequencies of that sequence's length past the context: a block
    # cached in one sequence would not equal the same block computed in a longer one, so no reuse there.
    prefix_cache = c.prefix_cache and model_config.rope.rope_type != "dynamic"
    # On CUDA the engine process is opt-in until it has been measured on a GPU (docs/performance.md).
    in_process = not (c.engine_process if c.engine_process is not None else torch_device.type == "cpu")
    tokenizer = load_tokenizer(model_dir)  # loading starts no thread; a forked engine process inherits it
    # Each process compiles its own grammars (a matcher cannot cross the pipe): the edge to check a request, the
    # engine for its samples, each on tenant-fair threads of its own (never the engine process's reader thread,
    # grammar_lane.py); the llguidance tokenizer is made on first use, after the fork.
    grammars = Grammars(tokenizer, model_config.vocab_size, tuple(model_config.eos_token_ids))
    # Nothing in this process runs a torch op before the engine process is forked (see SlotPool's `shared`), nor
    # touches CUDA: its pool is in CPU shared memory and the engine process keeps a device copy (SlotMirror).
    pool_device = torch_device if in_process else torch.device("cpu")
    pool = SlotPool(shapes, max_slots=c.max_slots, max_rank=c.max_rank, device=pool_device, shared=not in_process)

    def build_engine(
        release: Callable[[int], None], on_iteration: Callable[[], None] | None, slots: SlotTensors
    ) -> Engine:
        runner = LlamaForCausalLM.from_pretrained(model_dir, device=torch_device, dtype=torch_dtype)
        packed = c.cpu_gemm == "onednn" and runner.pack_for_cpu()
        if torch_device.type == "cpu" and torch_dtype == torch.float32:
            log.info("base matmuls: %s", "oneDNN packed weights" if packed else "torch dense weights")
        kept_out = -(-context // BLOCK_SIZE)  # blocks besides the pool (see Engine.__init__)
        cache = KVCache(model_config, num_blocks + kept_out, BLOCK_SIZE, torch_device, torch_dtype)
        scheduler = Scheduler(
            max_seqs=max_seqs,
            max_batch_tokens=max_batch_tokens,
            max_seqs_per_tenant=per_tenant,
            prefill_chunk_tokens=c.prefill_chunk_tokens,
            max_blocks_per_tenant=tenant_blocks,
            mixed_prefill_tokens=mixed,
        )
        return Engine(
            runner,
            cache,
            slots,
            scheduler,
            release=release,
            max_len=context,
            eos_token_ids=model_config.eos_token_ids,
            kernel=lora_kernel,
            burst_wait=c.burst_wait_ms / 1000,
            prefix_cache=prefix_cache,
            on_iteration=on_iteration,
            grammars=grammars,
        )

    engine: EngineAPI
    if not in_process:
        # Forked first, while this process has no other thread (the spinner below starts one).
        engine = EngineProcess(
            build_engine,
            pool,
            max_len=context,
            max_seqs=max_seqs,
            max_batch_tokens=max_batch_tokens,
            device=torch_device,
        )
        with spinner(f"loading {model} on {torch_device} in the engine process"):
            engine.wait_ready()
    else:
        with spinner(f"loading {model} on {torch_device}"):
            engine = build_engine(pool.release, None, pool.tensors)
    artifacts, bucket = open_artifacts(str(setup.store), setup.cache_dir, setup.cache_max_bytes)
    artifacts.cleanup_temp()
    digest = model_digest(model_dir)
    info = common_pb2.BaseModelInfo(
        model=model,
        model_digest=digest,
        architecture=model_config.arch,
        vocab_size=model_config.vocab_size,
        hidden_size=model_config.hidden_size,
        num_layers=model_config.num_layers,
        max_position_embeddings=context,
        dtype=dtype,
        device=str(torch_device),
        lora_target_modules=sorted({m.rsplit(".", 1)[-1] for m in shapes}),
        served_name=served_name,
    )
    metadata = bearer_metadata(registry_token) or None
    state: dict[str, object] = {}

    def add(server: grpc.aio.Server) -> None:
        channel = registry_channel(registry, registry_ca)  # inside the server's event loop
        state["channel"] = channel
        loader = AdapterLoader(
            pool,
            artifacts,
            registry_pb2_grpc.RegistryServiceStub(channel),
            metadata=metadata,
            model_digest=digest,
            max_pinned_per_tenant=pins,
            bucket=bucket,
        )
        follower = AliasFollower(
            registry_pb2_grpc.RegistryServiceStub(channel),
            loader,
            follow=c.follow,
            follow_window=c.follow_window,
            metadata=metadata,
        )
        loader.follower = follower
        state["follower"] = follower
        follower.start()
        servicer = SamplerServicer(
            engine,
            loader,
            info=info,
            tokenizer=tokenizer,
            max_waiting=c.max_waiting,
            follower=follower,
            max_queued_per_tenant=queued,
            share_base_prefix_cache=c.share_base_prefix_cache,
            max_prompt_bytes=c.max_prompt_bytes or PROMPT_BYTES_PER_TOKEN * context,
            grammars=grammars,
            max_compiles_per_tenant=c.max_compiles_per_tenant,
        )
        sampler_pb2_grpc.add_SamplerServiceServicer_to_server(servicer, server)
        state["servicer"] = servicer
        if isinstance(engine, EngineProcess):
            engine.on_exit = functools.partial(os.kill, os.getpid(), signal.SIGTERM)  # see engine_process.py
        engine.start()
        REGISTRY.register(SamplerCollector(engine, loader))

    def beat() -> Beat:
        load = registry_pb2.ReplicaLoad(
            slots_used=pool.used(),
            slots_total=pool.capacity,
            waiting_sequences=engine.num_waiting,
            running_sequences=engine.num_running,
            kv_blocks_used=engine.stats.blocks_used,
            kv_blocks_total=engine.stats.blocks_total,
            tokens_per_second=engine.stats.tokens_per_second(),
        )
        resident = [f"{s.key[0]}@{s.key[1]}" for s in pool.slots[1:] if s.key is not None and not s.loading]
        return Beat(load, resident)

    member = FleetMember(registry_pb2.REPLICA_ROLE_SAMPLER, digest, c.max_slots, beat, setup)

    async def on_start(address: str) -> None:
        channel, servicer = state["channel"], state["servicer"]
        assert isinstance(channel, grpc.aio.Channel) and isinstance(servicer, SamplerServicer)
        servicer.replica = member.join(registry_pb2_grpc.RegistryServiceStub(channel), metadata, address)

    async def on_stop() -> None:
        await member.leave()
        follower = state.get("follower")
        if isinstance(follower, AliasFollower):
            await follower.stop()
        engine.stop()
        channel = state.get("channel")
        if isinstance(channel, grpc.aio.Channel):
            await channel.close()

    binding = ServiceBinding(sampler_pb2.DESCRIPTOR.services_by_name["SamplerService"].full_name, add)
    return BuiltSampler([binding], on_stop, engine, store_health_checks(bucket), on_start, member.drain)


def kv_blocks(c: SamplerConfig, model_config: Any, context: int, dtype: Any) -> int:
    """The KV-cache pool's blocks from the flags; the default takes the memory today's max_seqs fixed slots of
    max_len took, so memory never grows by default. Raises BadOption when one max_len sequence would not fit."""
    from opentinker.sampler_server.block_manager import BLOCK_SIZE
    from opentinker.sampler_server.model.kv_cache import KVCache

    per_sequence = -(-context // BLOCK_SIZE)
    if c.num_blocks:
        blocks, option = c.num_blocks, "--num-blocks"
    elif c.kv_cache_mb:
        blocks, option = KVCache.blocks_for(model_config, c.kv_cache_mb, BLOCK_SIZE, dtype), "--kv-cache-mb"
    else:  # at most the bytes of the max_seqs + 1 slots of max_len the slot cache took, less the blocks the
        # engine keeps out of the pool (and always room for one max_len sequence: the rounding could leave less)
        blocks, option = max(per_sequence, (c.max_seqs + 1) * context // BLOCK_SIZE - per_sequence), "--max-seqs"
    if blocks < per_sequence:
        raise BadOption(
            f"{blocks} KV-cache blocks of {BLOCK_SIZE} tokens cannot hold one {context}-token sequence "
            f"(--max-len); it needs {per_sequence}",
            option,
        )
    return blocks


def serve_sampler(config: SamplerConfig) -> None:
    """Builds the sampler and serves it until SIGINT/SIGTERM; exits 1 when it stopped because its engine process
    died (a supervisor should restart it)."""
    from opentinker.rpc.serving.server import ServerHooks, serve_forever
    from opentinker.sampler_server.engine_process import EngineProcess

    built = build_sampler(config)
    hooks = ServerHooks(built.on_start, built.on_drain, built.on_stop, built.health_checks)
    serve_forever("sampler", built.bindings, config.server, hooks)
    if isinstance(built.engine, EngineProcess) and built.engine.died:
        raise SystemExit(1)  # stopped because the engine process died: a supervisor should restart this server

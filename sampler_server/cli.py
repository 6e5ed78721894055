"""`opentinker sampler serve` (the server) and `opentinker sample` (stream from it to the terminal)."""

from __future__ import annotations

import functools
import logging
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer

from opentinker.rpc import cli_options as opt
from opentinker.rpc.config import serve_command

DEFAULT_PORT = 7072
log = logging.getLogger("opentinker.sampler")
sampler_app = typer.Typer(no_args_is_help=True)


def load_tokenizer(model_dir: Path) -> Any | None:
    """The model's tokenizer, or None when it has none (token-only serving)."""
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(model_dir)
    except (OSError, ValueError):
        return None


@sampler_app.command("serve", cls=serve_command("sampler"))
def serve(
    model: Annotated[str, typer.Option(help="Base model: a local HF directory (or a cached HF id).")],
    registry: Annotated[str, typer.Option(envvar="OPENTINKER_REGISTRY", help="Registry address host:port.")],
    store: Annotated[Path, typer.Option(help="Artifact store root (share it with the registry when possible).")],
    registry_token: Annotated[
        str | None, typer.Option(envvar="OPENTINKER_REGISTRY_TOKEN", help="Token the sampler uses with the registry.")
    ] = None,
    device: Annotated[str, typer.Option(help="auto (CUDA when present), cpu or cuda.")] = "auto",
    dtype: Annotated[str, typer.Option(help="float32 or bfloat16.")] = "float32",
    max_slots: Annotated[int, typer.Option(help="Adapter versions resident at once.")] = 32,
    max_rank: Annotated[int, typer.Option(help="Largest LoRA rank served (smaller ranks are zero-padded).")] = 64,
    max_seqs: Annotated[int, typer.Option(help="Sequences in a batch (KV-cache slots).")] = 64,
    max_batch_tokens: Annotated[int, typer.Option(help="Prompt tokens per prefill step.")] = 4096,
    max_len: Annotated[int, typer.Option(help="Context per sequence (0: the model's, capped at 4096).")] = 0,
    max_waiting: Annotated[int, typer.Option(help="Queued sequences before RESOURCE_EXHAUSTED.")] = 256,
    burst_wait_ms: Annotated[
        float,
        typer.Option(
            min=0.0,
            max=1000.0,
            help="An idle sampler's first prefill waits until no request came for this long (at most 10x).",
        ),
    ] = 2.0,
    kernel: Annotated[str, typer.Option(help="LoRA kernel: auto, segments, reference or triton.")] = "auto",
    cpu_gemm: Annotated[
        str,
        typer.Option(
            help="Base matmuls on a float32 CPU: onednn (weights packed once: faster, some more memory; see "
            "README), or torch (dense weights, torch's own GEMM)."
        ),
    ] = "onednn",
    engine_process: Annotated[
        bool | None,
        typer.Option(
            "--engine-process/--no-engine-process",
            help="Run the engine (model, KV cache, step loop) in a process of its own, apart from gRPC's Python. "
            "Default: on for the CPU, off for CUDA.",
        ),
    ] = None,
    follow: Annotated[
        list[str] | None, typer.Option(help="Adapters (fnmatch patterns) whose alias moves are always preloaded.")
    ] = None,
    follow_window: Annotated[
        float, typer.Option(help="Also preload adapters that had requests in the last N seconds.")
    ] = 300.0,
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
    """Run the sampler gRPC server."""
    from opentinker.rpc.memory import limit_malloc_arenas

    limit_malloc_arenas()  # first, before torch and gRPC start their threads
    # The engine thread and the event loop hand the GIL back and forth every few ops; at Python's default 5 ms
    # interval a burst of arriving RPCs holds back the first prefill (bench/streaming.py: time-to-first-token
    # overhead +30 -> +16 ms at 0.5 ms, wall unchanged).
    sys.setswitchinterval(0.0005)
    import grpc
    import torch
    from prometheus_client import REGISTRY

    from opentinker.registry.artifacts import ArtifactStore
    from opentinker.registry.remote import registry_channel
    from opentinker.rpc.progress import spinner
    from opentinker.rpc.server import ServiceBinding, configure_logging, exit_if_unsafe, serve_forever
    from opentinker.sampler_server.adapters import AdapterLoader
    from opentinker.sampler_server.engine import Engine
    from opentinker.sampler_server.engine_process import EngineProcess
    from opentinker.sampler_server.follower import AliasFollower
    from opentinker.sampler_server.kernels import TRITON_AVAILABLE, Backend
    from opentinker.sampler_server.metrics import SamplerCollector
    from opentinker.sampler_server.model.kv_cache import KVCache
    from opentinker.sampler_server.model.llama import LlamaForCausalLM, linear_shapes
    from opentinker.sampler_server.scheduler import Scheduler
    from opentinker.sampler_server.service import SamplerServicer
    from opentinker.sampler_server.slot_pool import SlotPool
    from opentinker.v1 import common_pb2, registry_pb2_grpc, sampler_pb2, sampler_pb2_grpc
    from opentinker.weights.base_model import model_digest, pick_device, resolve_model_dir
    from opentinker.weights.model_config import load_config

    configure_logging(log_level)
    # Refuse an unsafe exposure before loading the model, not after.
    exposure = opt.server_options(host, port, metrics_port, tokens_file, insecure_public, tls_cert, tls_key, ready_file)
    exit_if_unsafe("sampler", exposure)
    if dtype not in ("float32", "bfloat16"):
        raise typer.BadParameter("dtype must be float32 or bfloat16", param_hint="--dtype")
    backends: dict[str, Backend] = {
        "auto": "auto",
        "segments": "segments",
        "reference": "reference",
        "triton": "triton",
    }
    if cpu_gemm not in ("onednn", "torch"):
        raise typer.BadParameter("cpu-gemm must be onednn or torch", param_hint="--cpu-gemm")
    if kernel not in backends:
        raise typer.BadParameter("kernel must be auto, segments, reference or triton", param_hint="--kernel")
    torch_device = torch.device(pick_device(device))
    torch_dtype = torch.float32 if dtype == "float32" else torch.bfloat16
    model_dir = resolve_model_dir(model)
    config = load_config(model_dir)
    context = max_len or min(config.max_position_embeddings, 4096)
    shapes = linear_shapes(config)
    if engine_process and torch_device.type != "cpu":
        raise typer.BadParameter("the engine process shares its adapter slots in CPU memory; on CUDA the engine "
                                 "runs in the server process", param_hint="--engine-process")  # fmt: skip
    in_process = not (engine_process if engine_process is not None else torch_device.type == "cpu")
    tokenizer = load_tokenizer(model_dir)  # loading starts no thread; a forked engine process inherits it
    # Nothing in this process runs a torch op before the engine process is forked (see SlotPool's `shared`).
    pool = SlotPool(shapes, max_slots=max_slots, max_rank=max_rank, device=torch_device, shared=not in_process)

    def build_engine(release: Callable[[int], None], on_iteration: Callable[[], None] | None) -> Engine:
        runner = LlamaForCausalLM.from_pretrained(model_dir, device=torch_device, dtype=torch_dtype)
        packed = cpu_gemm == "onednn" and runner.pack_for_cpu()
        if torch_device.type == "cpu" and torch_dtype == torch.float32:
            log.info("base matmuls: %s", "oneDNN packed weights" if packed else "torch dense weights")
        cache = KVCache(config, max_seqs + 1, context, torch_device, torch_dtype)  # + one slot for ComputeLogprobs
        return Engine(runner, cache, pool.tensors, Scheduler(max_seqs=max_seqs, max_batch_tokens=max_batch_tokens),
                      release=release, max_len=context, eos_token_ids=config.eos_token_ids,
                      tokenizer=tokenizer, kernel=backends[kernel], score_slot=max_seqs,
                      burst_wait=burst_wait_ms / 1000, on_iteration=on_iteration)  # fmt: skip

    engine: Engine | EngineProcess
    if not in_process:
        # Forked first, while this process has no other thread (the spinner below starts one).
        engine = EngineProcess(build_engine, pool, max_len=context, max_seqs=max_seqs,
                               max_batch_tokens=max_batch_tokens, device=torch_device)  # fmt: skip
        with spinner(f"loading {model} on {torch_device} in the engine process"):
            engine.wait_ready()
    else:
        with spinner(f"loading {model} on {torch_device}"):
            engine = build_engine(pool.release, None)
    artifacts = ArtifactStore(store)
    artifacts.cleanup_temp()
    digest = model_digest(model_dir)
    info = common_pb2.BaseModelInfo(
        model=model, model_digest=digest, architecture=config.arch, vocab_size=config.vocab_size,
        hidden_size=config.hidden_size, num_layers=config.num_layers, max_position_embeddings=context, dtype=dtype,
        device=str(torch_device), lora_target_modules=sorted({m.rsplit(".", 1)[-1] for m in shapes}),
    )  # fmt: skip
    metadata = [("authorization", f"Bearer {registry_token}")] if registry_token else None
    used_kernel = (
        kernel if kernel != "auto" else ("triton" if torch_device.type == "cuda" and TRITON_AVAILABLE else "segments")
    )
    state: dict[str, object] = {}

    def add(server: grpc.aio.Server) -> None:
        channel = registry_channel(registry, registry_ca)  # inside the server's event loop
        state["channel"] = channel
        loader = AdapterLoader(pool, artifacts, registry_pb2_grpc.RegistryServiceStub(channel), metadata=metadata,
                               model_digest=digest)  # fmt: skip
        follower = AliasFollower(registry_pb2_grpc.RegistryServiceStub(channel), loader, follow=follow or [],
                                 follow_window=follow_window, metadata=metadata)  # fmt: skip
        loader.follower = follower
        state["follower"] = follower
        follower.start()
        servicer = SamplerServicer(engine, loader, info=info, tokenizer=tokenizer, max_waiting=max_waiting,
                                   lora_kernel=used_kernel, follower=follower)  # fmt: skip
        sampler_pb2_grpc.add_SamplerServiceServicer_to_server(servicer, server)
        if isinstance(engine, EngineProcess):
            engine.on_exit = functools.partial(os.kill, os.getpid(), signal.SIGTERM)  # stop serving; see module doc
        engine.start()
        REGISTRY.register(SamplerCollector(engine, loader))

    async def on_stop() -> None:
        follower = state.get("follower")
        if isinstance(follower, AliasFollower):
            await follower.stop()
        engine.stop()
        channel = state.get("channel")
        if isinstance(channel, grpc.aio.Channel):
            await channel.close()

    binding = ServiceBinding(sampler_pb2.DESCRIPTOR.services_by_name["SamplerService"].full_name, add)
    options = opt.server_options(host, port, metrics_port, tokens_file, insecure_public, tls_cert, tls_key, ready_file,
                                 max_message_mb)  # fmt: skip
    serve_forever("sampler", [binding], options, on_stop=on_stop)
    if isinstance(engine, EngineProcess) and engine.died:
        raise SystemExit(1)  # stopped because the engine process died: a supervisor should restart this server

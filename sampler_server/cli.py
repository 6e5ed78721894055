"""`opentinker sampler serve`: the sampler's flags, checked, then handed to its builder (`build.py`)."""

from __future__ import annotations

import sys
from typing import Annotated, cast

import typer

from opentinker.rpc.process import cli_options as opt
from opentinker.rpc.process.config import serve_command
from opentinker.rpc.process.model_server_setup import ModelServerSetup
from opentinker.weights.artifact_bucket import store_environment

DEFAULT_PORT = 7072
sampler_app = typer.Typer(no_args_is_help=True)


@sampler_app.command("serve", cls=serve_command("sampler", lambda params: store_environment(params.get("store"))))
@opt.serve_flags(DEFAULT_PORT)
@opt.model_server_flags("sampler")
def serve(
    max_slots: Annotated[int, typer.Option(help="Adapter versions resident at once.")] = 32,
    max_rank: Annotated[int, typer.Option(help="Largest LoRA rank served (smaller ranks are zero-padded).")] = 64,
    max_seqs: Annotated[int, typer.Option(help="Sequences in a batch.")] = 64,
    max_batch_tokens: Annotated[
        int, typer.Option(help="Tokens per step: decodes and prompt chunks, or a whole-prompt prefill.")
    ] = 4096,
    prefill_chunk_tokens: Annotated[
        int,
        typer.Option(
            min=0,
            help="Prompt tokens per step, in chunks beside every running sequence's decode token, so that a long "
            "prompt never stalls running streams. 0: whole prompts, a step prefills or decodes.",
        ),
    ] = 512,
    mixed_prefill_tokens: Annotated[
        int | None,
        typer.Option(
            min=0,
            help="Prompt tokens one tenant computes in a step where another tenant's streams decode, so that long "
            "prompts (a flood of ComputeLogprobs) cannot slow every other tenant's tokens to one per 512-token "
            "chunk. Default: 16 on the CPU (where a prompt token costs what a decode row does), no bound but "
            "--prefill-chunk-tokens on CUDA; 0: no bound.",
        ),
    ] = None,
    max_len: Annotated[int, typer.Option(help="Context per sequence (0: the model's, capped at 4096).")] = 0,
    max_waiting: Annotated[int, typer.Option(help="Queued sequences before RESOURCE_EXHAUSTED.")] = 256,
    num_blocks: Annotated[
        int,
        typer.Option(
            min=0,
            help="KV-cache blocks of 16 tokens shared by every sequence. 0: what --max-seqs x --max-len positions "
            "took in fixed slots (or --kv-cache-mb).",
        ),
    ] = 0,
    kv_cache_mb: Annotated[
        float, typer.Option(min=0, help="KV-cache size in MiB, instead of --num-blocks (0: --num-blocks).")
    ] = 0,
    prefix_cache: Annotated[
        bool, typer.Option("--prefix-cache/--no-prefix-cache", help="Reuse cached K/V of earlier prompts' blocks.")
    ] = True,
    share_base_prefix_cache: Annotated[
        bool,
        typer.Option(
            help="Share the base model's cached blocks across tenants (single-tenant deployments); by default "
            "they are shared within a tenant only, so no tenant can time another's prompts."
        ),
    ] = False,
    max_seqs_per_tenant: Annotated[
        int | None,
        typer.Option(
            min=0,
            help="Seats (sequences in the batch) one tenant may hold at once, so that others always find one "
            "soon. Default: 3/4 of --max-seqs (at least 1); 0: no limit.",
        ),
    ] = None,
    max_kv_blocks_per_tenant: Annotated[
        int | None,
        typer.Option(
            min=0,
            help="KV-cache blocks one tenant may hold at once (never less than one --max-len sequence's); when "
            "the pool runs out, the tenant most over its fair share is preempted first. Default: 3/4 of the "
            "pool; 0: no bound.",
        ),
    ] = None,
    max_queued_per_tenant: Annotated[
        int | None,
        typer.Option(
            min=0,
            help="Samples one user tenant may have waiting (not started) before RESOURCE_EXHAUSTED "
            "TENANT_QUEUE_FULL, so that one tenant's flood cannot fill the whole waiting queue; admins are "
            "bounded by --max-waiting only. Default: 3/4 of --max-waiting (at least 1); 0: no limit.",
        ),
    ] = None,
    max_compiles_per_tenant: Annotated[
        int,
        typer.Option(
            min=0,
            help="Grammars (constraints not cached) one tenant may have waiting to compile before RESOURCE_EXHAUSTED "
            "TENANT_COMPILES_FULL; a tenant compiles one at a time, on two threads the tenants take in turns. "
            "0: no limit.",
        ),
    ] = 16,
    max_pinned_per_tenant: Annotated[
        int | None,
        typer.Option(
            min=0,
            help="Adapter versions one user tenant may pin at once (LoadAdapter pin), so that one tenant's pins "
            "cannot take every slot; a pin beyond it is refused RESOURCE_EXHAUSTED TOO_MANY_PINS and loads nothing. "
            "Admins' pins are not counted. Default: 1/8 of --max-slots (at least 1); 0: no limit.",
        ),
    ] = None,
    max_prompt_bytes: Annotated[
        int,
        typer.Option(
            min=0,
            help="Largest prompt_text in UTF-8 bytes, refused (PROMPT_TOO_LONG) before it is tokenized. "
            "0: 16 bytes per token of the context (--max-len), 64 KiB at 4,096 tokens.",
        ),
    ] = 0,
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
            "Default: on for the CPU, off for CUDA (where the engine process keeps its own device copy of the adapter "
            "slots; opt in until it is measured on a GPU).",
        ),
    ] = None,
    follow: Annotated[
        list[str] | None, typer.Option(help="Adapters (fnmatch patterns) whose alias moves are always preloaded.")
    ] = None,
    follow_window: Annotated[
        float, typer.Option(help="Also preload adapters that had requests in the last N seconds.")
    ] = 300.0,
    *,
    setup: ModelServerSetup,
    serving: opt.Serving,
) -> None:
    """Run the sampler gRPC server."""
    from opentinker.rpc.process.memory import limit_malloc_arenas

    limit_malloc_arenas()  # first, before torch and gRPC start their threads
    # The engine thread and the event loop hand the GIL back and forth every few ops; at Python's default 5 ms
    # interval a burst of arriving RPCs holds back the first prefill (bench/streaming.py: time-to-first-token
    # overhead +30 -> +16 ms at 0.5 ms, wall unchanged).
    sys.setswitchinterval(0.0005)
    from opentinker.rpc.serving.server import configure_logging
    from opentinker.sampler_server.build import BadOption, CpuGemm, SamplerConfig, serve_sampler
    from opentinker.sampler_server.kernels import Backend
    from opentinker.weights.model_check import check_model

    configure_logging(serving.log_level)
    serving.refuse_unsafe_exposure("sampler")
    serving.check_ports()  # a busy port or a missing model: found before the model loads
    check_model(setup.model, setup.revision, setup.served_model_name)
    if cpu_gemm not in ("onednn", "torch"):
        raise typer.BadParameter("cpu-gemm must be onednn or torch", param_hint="--cpu-gemm")
    if kernel not in ("auto", "segments", "reference", "triton"):
        raise typer.BadParameter("kernel must be auto, segments, reference or triton", param_hint="--kernel")
    if num_blocks and kv_cache_mb:
        raise typer.BadParameter("give --num-blocks or --kv-cache-mb, not both", param_hint="--kv-cache-mb")
    if max_seqs_per_tenant is not None and max_seqs_per_tenant > max_seqs:
        raise typer.BadParameter(
            f"{max_seqs_per_tenant} is more than --max-seqs ({max_seqs}); 0 means no limit",
            param_hint="--max-seqs-per-tenant",
        )
    if max_queued_per_tenant is not None and max_queued_per_tenant > max_waiting:
        raise typer.BadParameter(
            f"{max_queued_per_tenant} is more than --max-waiting ({max_waiting}); 0 means no limit",
            param_hint="--max-queued-per-tenant",
        )
    if max_pinned_per_tenant is not None and max_pinned_per_tenant > max_slots:
        raise typer.BadParameter(
            f"{max_pinned_per_tenant} is more than --max-slots ({max_slots}); 0 means no limit",
            param_hint="--max-pinned-per-tenant",
        )
    config = SamplerConfig(
        setup=setup,
        server=serving.server,
        max_slots=max_slots,
        max_rank=max_rank,
        max_seqs=max_seqs,
        max_batch_tokens=max_batch_tokens,
        max_len=max_len,
        prefill_chunk_tokens=prefill_chunk_tokens,
        mixed_prefill_tokens=mixed_prefill_tokens,
        max_kv_blocks_per_tenant=max_kv_blocks_per_tenant,
        max_waiting=max_waiting,
        num_blocks=num_blocks,
        kv_cache_mb=kv_cache_mb,
        prefix_cache=prefix_cache,
        share_base_prefix_cache=share_base_prefix_cache,
        max_seqs_per_tenant=max_seqs_per_tenant,
        max_queued_per_tenant=max_queued_per_tenant,
        max_compiles_per_tenant=max_compiles_per_tenant,
        max_prompt_bytes=max_prompt_bytes,
        burst_wait_ms=burst_wait_ms,
        max_pinned_per_tenant=max_pinned_per_tenant,
        kernel=cast("Backend", kernel),
        cpu_gemm=cast("CpuGemm", cpu_gemm),
        engine_process=engine_process,
        follow=tuple(follow or ()),
        follow_window=follow_window,
    )
    try:
        serve_sampler(config)
    except BadOption as exc:
        raise typer.BadParameter(str(exc), param_hint=exc.option) from None

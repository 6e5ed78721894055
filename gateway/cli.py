"""`opentinker gateway serve`: the tinker SDK's HTTP API in front of a trainer, a sampler and a registry."""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from opentinker.rpc.process import cli_options as opt
from opentinker.rpc.process.config import GATEWAY_SECTION, serve_command

if TYPE_CHECKING:
    from opentinker.gateway.auth import KeyStore
    from opentinker.gateway.config import GatewayConfig
    from opentinker.gateway.episodes import EpisodeLimits

DEFAULT_PORT = 7073
SWITCH_INTERVAL_S = 0.001
app = typer.Typer(no_args_is_help=True)
log = logging.getLogger("opentinker.gateway")


@app.command("serve", cls=serve_command(GATEWAY_SECTION))
def serve(
    trainer: Annotated[str, typer.Option(envvar="OPENTINKER_TRAINER", help="Trainer address host:port.")],
    sampler: Annotated[
        str,
        typer.Option(
            envvar="OPENTINKER_SAMPLER",
            help="Sampler address host:port, or 'fleet': every sampler of the registry's fleet, routed by adapter.",
        ),
    ],
    registry: Annotated[str, typer.Option(envvar="OPENTINKER_REGISTRY", help="Registry address host:port.")],
    keys_file: Annotated[
        Path | None,
        typer.Option(exists=True, help="JSON file mapping tml- API keys to tenants and server tokens."),
    ] = None,
    host: Annotated[str, typer.Option(help="Address to bind (loopback unless --insecure-public).")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="HTTP port; 0 picks a free port (printed on start).")] = DEFAULT_PORT,
    insecure_public: Annotated[
        bool, typer.Option(help="Allow a non-loopback address (plain HTTP: put TLS in front of it).")
    ] = False,
    fwdbwd_max_chunk_len: Annotated[int, typer.Option(help="Datums per forward_backward request.")] = 1024,
    compress_fwdbwd: Annotated[bool, typer.Option(help="Ask the SDK to zstd-compress forward_backward.")] = True,
    default_max_tokens: Annotated[int, typer.Option(help="max_tokens when a request leaves it unset.")] = 16,
    poll_seconds: Annotated[float, typer.Option(help="Longest retrieve_future long-poll, in seconds.")] = 20.0,
    max_num_samples: Annotated[int, typer.Option(help="num_samples per asample (the sampler's limit).")] = 64,
    max_body_bytes: Annotated[
        int, typer.Option(help="A forward_backward body, as sent and decompressed (the SDK sends <= 5 MB).")
    ] = 64 << 20,
    max_json_bytes: Annotated[int, typer.Option(help="A JSON request body.")] = 8 << 20,
    max_string_length: Annotated[int, typer.Option(help="Characters of any string in a request.")] = 4096,
    seq_window: Annotated[int, typer.Option(help="How far ahead of a model's next seq_id a request may be.")] = 256,
    max_pending_bytes: Annotated[
        int, typer.Option(help="forward_backward bytes one model may have waiting for their turn.")
    ] = 256 << 20,
    max_tenant_pending_bytes: Annotated[
        int, typer.Option(help="forward_backward bytes all models of one tenant may have waiting.")
    ] = 1 << 30,
    max_sessions_per_tenant: Annotated[
        int, typer.Option(help="Sessions one tenant holds at once (finished ones count until they expire).")
    ] = 1024,
    max_inflight_per_tenant: Annotated[
        int, typer.Option(help="Unfinished requests of one tenant; beyond, 429 (the SDK backs off and retries).")
    ] = 4096,
    pending_ttl_seconds: Annotated[
        float, typer.Option(help="How long a request waits for an earlier seq_id before it fails.")
    ] = 300.0,
    session_ttl_seconds: Annotated[
        float, typer.Option(help="A session without heartbeats expires (its models' waiting requests fail).")
    ] = 900.0,
    max_tenant_result_bytes: Annotated[
        int,
        typer.Option(
            min=0,
            help="Bytes of finished results one tenant holds for retrieve_future (kept an hour); beyond, its oldest "
            "are dropped (retrieving one answers 404 RESULT_DROPPED). 0: no limit.",
        ),
    ] = 1 << 30,
    redis_url: Annotated[
        str | None,
        typer.Option(
            envvar="OPENTINKER_GATEWAY_REDIS_URL",
            help="Redis for the gateway's state (sessions, model ids, tinker:// paths, checkpoint TTLs), so that "
            "tinker clients go on after a gateway restart; without it that state is in memory only.",
        ),
    ] = None,
    checkpoint_gc_seconds: Annotated[
        float, typer.Option(help="How often expired and deleted checkpoints are deleted from the trainer/registry.")
    ] = 60.0,
    stability_ttl_seconds: Annotated[
        float,
        typer.Option(
            help="A stable_reinforce stability record (record_stability_info) is kept this long after its last use."
        ),
    ] = 86400.0,
    max_tenant_stability_tokens: Annotated[
        int,
        typer.Option(
            help="Prompt + sampled tokens one tenant's stability records hold; beyond, its least recently "
            "used are dropped."
        ),
    ] = 1 << 22,
    tokenizer: Annotated[
        str | None,
        typer.Option(
            help="Tokenizer (directory or hub id in the local HF cache) for /v1 chat templates and text prompts; "
            "default: the model the trainer was started with."
        ),
    ] = None,
    tool_call_parser: Annotated[
        str,
        typer.Option(
            help="/v1 tool calls in the model's output: auto (the format its chat template teaches), hermes "
            "(<tool_call>{json}</tool_call>), llama3 (JSON, <|python_tag|>) or none (always text)."
        ),
    ] = "auto",
    max_tokenizer_jobs_per_tenant: Annotated[
        int,
        typer.Option(
            help="/v1 chat renders, encodes and logprob decodes one tenant may have waiting for the gateway's "
            "tokenizer thread, which tenants take in turns (429 beyond)."
        ),
    ] = 64,
    episode_ttl_seconds: Annotated[
        float, typer.Option(help="A captured episode (/v1/episodes) is kept this long after its last write.")
    ] = 7 * 86400.0,
    episode_max_turns: Annotated[int, typer.Option(help="Turns one captured episode may hold (429 beyond).")] = 256,
    episode_max_tokens: Annotated[
        int, typer.Option(help="Prompt + completion tokens one captured episode may hold (429 beyond).")
    ] = 1 << 20,
    episode_max_per_tenant: Annotated[
        int, typer.Option(help="Live captured episodes one tenant may hold (429 beyond).")
    ] = 10_000,
    ready_file: Annotated[Path | None, typer.Option(help="Write {address, metrics_address} JSON once serving.")] = None,
    log_level: Annotated[str, typer.Option(help="Logging level.")] = "INFO",
    config_file: opt.Config = None,
    print_config: opt.PrintConfig = False,
) -> None:
    """Run the Tinker-compatible HTTP gateway (tinker SDK 0.38.0)."""
    from opentinker.gateway.auth import KeysFileError, KeyStore
    from opentinker.gateway.config import GatewayConfig
    from opentinker.gateway.logsafe import configure
    from opentinker.gateway.openai.tool_calls import PARSER_CHOICES
    from opentinker.rpc.process.startup import check_port, startup_errors
    from opentinker.rpc.serving.server import is_loopback

    configure(log_level)
    with startup_errors("gateway", log_level):
        check_port(host, port, "--port")  # one line and exit 2, as every server's startup errors
    if not is_loopback(host) and not insecure_public:
        typer.echo(f"refusing to bind {host}: plain HTTP carries API keys; pass --insecure-public", err=True)
        raise typer.Exit(2)
    try:
        keys = KeyStore.load(keys_file)
    except KeysFileError as exc:
        typer.echo(f"gateway keys: {exc}", err=True)
        raise typer.Exit(2) from None
    if not len(keys):
        typer.echo("no API keys: pass --keys-file or set OPENTINKER_GATEWAY_KEYS(_FILE)", err=True)
        raise typer.Exit(2)
    config = GatewayConfig(
        fwdbwd_max_chunk_len=fwdbwd_max_chunk_len,
        compress_fwdbwd=compress_fwdbwd,
        default_max_tokens=default_max_tokens,
        poll_seconds=poll_seconds,
        max_num_samples=max_num_samples,
        max_body_bytes=max_body_bytes,
        max_json_bytes=max_json_bytes,
        max_string_length=max_string_length,
        seq_window=seq_window,
        max_pending_bytes=max_pending_bytes,
        pending_ttl_seconds=pending_ttl_seconds,
        session_ttl_seconds=session_ttl_seconds,
        max_tenant_pending_bytes=max_tenant_pending_bytes,
        max_sessions_per_tenant=max_sessions_per_tenant,
        max_inflight_per_tenant=max_inflight_per_tenant,
        max_tenant_result_bytes=max_tenant_result_bytes,
        checkpoint_gc_seconds=checkpoint_gc_seconds,
        stability_ttl_seconds=stability_ttl_seconds,
        max_tenant_stability_tokens=max_tenant_stability_tokens,
        tool_call_parser=tool_call_parser,
        max_tokenizer_jobs_per_tenant=max_tokenizer_jobs_per_tenant,
    )
    if tool_call_parser not in PARSER_CHOICES:
        typer.echo(f"--tool-call-parser must be one of {', '.join(PARSER_CHOICES)}", err=True)
        raise typer.Exit(2)
    positive = {name: value for name, value in config.limits().items() if not value > 0}
    if positive:
        typer.echo(f"these must be positive: {', '.join('--' + n.replace('_', '-') for n in positive)}", err=True)
        raise typer.Exit(2)

    from opentinker.gateway.episodes import EpisodeLimits

    episodes = EpisodeLimits(episode_ttl_seconds, episode_max_turns, episode_max_tokens, episode_max_per_tenant)
    if min(episodes.ttl_seconds, episodes.max_turns, episodes.max_tokens, episodes.max_episodes) <= 0:
        typer.echo("the --episode-* limits must be positive", err=True)
        raise typer.Exit(2)
    addresses = (trainer, sampler, registry)
    asyncio.run(_run(keys, addresses, config, host, port, ready_file, redis_url, tokenizer, episodes))


async def _run(
    keys: KeyStore,
    addresses: tuple[str, str, str],
    config: GatewayConfig,
    host: str,
    port: int,
    ready_file: Path | None,
    redis_url: str | None,
    tokenizer: str | None = None,
    episode_limits: EpisodeLimits | None = None,
) -> None:
    import redis
    from aiohttp import web

    from opentinker.gateway.app import create_app
    from opentinker.gateway.backend import Backends
    from opentinker.gateway.episodes import MemoryEpisodes, RedisEpisodes
    from opentinker.gateway.openai.chat_template import TokenizerHandle
    from opentinker.gateway.openai.state import OpenAIState
    from opentinker.gateway.state import Gateway
    from opentinker.gateway.tinker.durable import MemoryState, RedisState
    from opentinker.gateway.tinker.state import TinkerState
    from opentinker.rpc.serving.server import write_ready_file

    # Big bodies are decoded and parsed on worker threads; when one runs Python code, the event loop waits for the
    # GIL up to the switch interval at each wake-up: 1 ms instead of 5 keeps other tenants' requests moving.
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    durable = MemoryState() if redis_url is None else RedisState(redis_url)
    try:
        saved = await durable.load()
    except (redis.RedisError, ValueError, KeyError) as exc:  # unreachable, or not this gateway's records
        typer.echo(f"gateway state store {durable.where}: {exc}", err=True)
        raise typer.Exit(2) from None
    episodes = (
        RedisEpisodes(durable.client, episode_limits)
        if isinstance(durable, RedisState)
        else MemoryEpisodes(episode_limits)
    )
    gateway = Gateway(keys=keys, backends=Backends(*addresses), config=config, episodes=episodes)
    tinker = TinkerState(config, durable=durable)
    tinker.restore(saved)
    openai = OpenAIState(TokenizerHandle(tokenizer, config.max_tokenizer_jobs_per_tenant))
    if durable.durable:
        log.info(
            "gateway state in %s: %d sessions, %d training runs, %d checkpoint paths restored",
            durable.where,
            len(tinker.sessions),
            len(tinker.runs),
            len(tinker.checkpoints),
        )
    else:
        log.warning(
            "gateway state is in memory only: a restart forgets every session, model id, tinker:// path and "
            "captured episode "
            "(pass --redis-url to keep them)"
        )
    # forward_backward bodies are decompressed by the gateway itself (zstd, size-capped).
    runner = web.AppRunner(create_app(gateway, tinker, openai), access_log=None, auto_decompress=False)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound = runner.addresses[0]
    address = f"{host}:{bound[1]}"
    typer.echo(f"opentinker gateway serving on {address}")
    if ready_file is not None:
        write_ready_file(ready_file, address, None)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("stopping")
    await runner.cleanup()

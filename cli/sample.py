"""`opentinker sample`: stream a completion from a sampler to the terminal, through the SDK's SamplingClient
(plaintext, or TLS with --ca-cert; --token as the bearer). With --chat the prompt is a user message rendered by
the model's chat template (the SDK's Renderer, as SFT and RL loops render it), so a chat-trained adapter sees
the format it was trained on."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from opentinker.cli.failure import describe
from opentinker.cli.options import CaCert, Token
from opentinker.client import OpenTinkerError, Renderer, SamplingClient, SamplingParams, ServiceClient
from opentinker.client.sampling_client import Prompt

DEFAULT_SAMPLER = "127.0.0.1:7072"


def sample_command(
    reference: Annotated[str, typer.Argument(help="base, name, name@alias or name@N.")],
    prompt: Annotated[str, typer.Argument(help="Prompt text (tokenized by the sampler; with --chat: the user turn).")],
    max_tokens: Annotated[int, typer.Option(min=1, max=(1 << 32) - 1, help="Tokens to generate.")] = 32,
    temperature: Annotated[float, typer.Option(help="0: greedy.")] = 1.0,
    top_p: Annotated[float, typer.Option(help="Nucleus sampling mass.")] = 1.0,
    top_k: Annotated[int, typer.Option(min=0, max=(1 << 32) - 1, help="0: off.")] = 0,
    seed: Annotated[int | None, typer.Option(min=0, max=(1 << 64) - 1, help="Same seed, same output.")] = None,
    frequency_penalty: Annotated[
        float, typer.Option(help="-2..2: a token's logit loses count * this for each time it was sampled.")
    ] = 0.0,
    presence_penalty: Annotated[
        float, typer.Option(help="-2..2: a token's logit loses this once it has been sampled.")
    ] = 0.0,
    cache_salt: Annotated[
        str, typer.Option(help="Requests with different salts share no prefix-cache blocks (at most 256 bytes).")
    ] = "",
    stop: Annotated[list[str] | None, typer.Option(help="Stop strings.")] = None,
    chat: Annotated[
        bool, typer.Option(help="Render PROMPT as a user message with the model's chat template; stop at end of turn.")
    ] = False,
    system: Annotated[str | None, typer.Option(help="With --chat: a system message before the user's.")] = None,
    tokenizer: Annotated[
        Path | None,
        typer.Option(help="With --chat: the model directory whose tokenizer renders (default: the sampler's model)."),
    ] = None,
    sampler: Annotated[
        str | None,
        typer.Option(
            envvar="OPENTINKER_SAMPLER", help=f"Sampler address (default {DEFAULT_SAMPLER} without --registry)."
        ),
    ] = None,
    registry: Annotated[
        str | None,
        typer.Option(help="Sample through this registry's fleet (routed by adapter, failing over) when no --sampler."),
    ] = None,
    token: Token = None,
    ca_cert: CaCert = None,
) -> None:
    """Stream a completion from a sampler to the terminal."""
    if (system is not None or tokenizer is not None) and not chat:
        raise typer.BadParameter("--system and --tokenizer need --chat", param_hint="--chat")
    stop_reason = "?"
    version = ""
    if sampler is None and registry is None:
        sampler = DEFAULT_SAMPLER
    with ServiceClient(sampler=sampler, registry=registry, token=token, ca_cert=ca_cert) as service:
        client = service.create_sampling_client(reference)
        try:
            request: Prompt = prompt
            stop_token_ids: tuple[int, ...] = ()
            if chat:
                request, stop_token_ids = _chat_prompt(client, prompt, system, tokenizer)
            params = SamplingParams(
                max_tokens=max_tokens,
                temperature=temperature,
                top_k=top_k,
                top_p=top_p,
                seed=seed,
                stop=stop or [],
                stop_token_ids=stop_token_ids,
                logprobs=False,
                frequency_penalty=frequency_penalty,
                presence_penalty=presence_penalty,
            )
            for chunk in client.stream(request, params, cache_salt=cache_salt):
                version = chunk.version.exact
                sys.stdout.write(chunk.text)
                sys.stdout.flush()
                if chunk.stop_reason is not None:
                    stop_reason = chunk.stop_reason
        except OpenTinkerError as exc:
            print(f"error: {describe(exc, ca_cert)}", file=sys.stderr)
            raise typer.Exit(1) from None
    print(f"\n[{version}, stop: {stop_reason}]", file=sys.stderr)


def _chat_prompt(
    client: SamplingClient, text: str, system: str | None, tokenizer: Path | None
) -> tuple[list[int], tuple[int, ...]]:
    """The rendered prompt's tokens (ending with the assistant header) and the template's end-of-turn tokens."""
    model_dir = tokenizer if tokenizer is not None else Path(client.base_model())
    if not (model_dir / "tokenizer_config.json").is_file():
        print(
            f"error: --chat needs the model's tokenizer: {str(model_dir)!r} is not a local model directory; "
            "pass --tokenizer DIR",
            file=sys.stderr,
        )
        raise typer.Exit(2)
    messages = ([{"role": "system", "content": system}] if system is not None else []) + [
        {"role": "user", "content": text}
    ]
    try:
        renderer = Renderer.from_pretrained(model_dir)  # transformers is imported here, for --chat only
    except ValueError as exc:  # no chat template, no stop token
        print(f"error: --chat: {model_dir}: {exc}", file=sys.stderr)
        raise typer.Exit(2) from None
    return renderer.prompt_tokens(messages), renderer.stop_token_ids

"""`opentinker sample`: stream a completion from a sampler to the terminal, through the SDK's SamplingClient
(plaintext, or TLS with --ca-cert; --token as the bearer)."""

from __future__ import annotations

import sys
from typing import Annotated

import typer

from opentinker.cli.failure import describe
from opentinker.cli.options import CaCert, Token
from opentinker.client import OpenTinkerError, SamplingClient, SamplingParams

DEFAULT_SAMPLER = "127.0.0.1:7072"


def sample_command(
    reference: Annotated[str, typer.Argument(help="base, name, name@alias or name@N.")],
    prompt: Annotated[str, typer.Argument(help="Prompt text (tokenized by the sampler, no chat template).")],
    max_tokens: Annotated[int, typer.Option(min=1, max=(1 << 32) - 1, help="Tokens to generate.")] = 32,
    temperature: Annotated[float, typer.Option(help="0: greedy.")] = 1.0,
    top_p: Annotated[float, typer.Option(help="Nucleus sampling mass.")] = 1.0,
    top_k: Annotated[int, typer.Option(min=0, max=(1 << 32) - 1, help="0: off.")] = 0,
    seed: Annotated[int | None, typer.Option(min=0, max=(1 << 64) - 1, help="Same seed, same output.")] = None,
    stop: Annotated[list[str] | None, typer.Option(help="Stop strings.")] = None,
    sampler: Annotated[str, typer.Option(envvar="OPENTINKER_SAMPLER", help="Sampler address.")] = DEFAULT_SAMPLER,
    token: Token = None,
    ca_cert: CaCert = None,
) -> None:
    """Stream a completion from a sampler to the terminal."""
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                            stop=stop or [], logprobs=False)  # fmt: skip
    stop_reason = "?"
    version = ""
    with SamplingClient(sampler, reference, token, ca_cert=ca_cert) as client:
        try:
            for chunk in client.stream(prompt, params):
                version = chunk.version.exact
                sys.stdout.write(chunk.text)
                sys.stdout.flush()
                if chunk.stop_reason is not None:
                    stop_reason = chunk.stop_reason
        except OpenTinkerError as exc:
            print(f"error: {describe(exc, ca_cert)}", file=sys.stderr)
            raise typer.Exit(1) from None
    print(f"\n[{version}, stop: {stop_reason}]", file=sys.stderr)

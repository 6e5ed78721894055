"""Where /v1 completions meet the episode store: the check before sampling (one choice per recorded request) and the
append of the finished choice's exact record (records.CompletedChoice) as the episode's next turn."""

from __future__ import annotations

from collections.abc import Sequence

from opentinker.gateway.episodes import Turn, check_single_choice
from opentinker.gateway.errors import GatewayError
from opentinker.gateway.openai.errors import OpenAIError
from opentinker.gateway.openai.records import CompletedChoice
from opentinker.gateway.state import Gateway


def check_capturable(episode: str | None, num_choices: int) -> None:
    """Before sampling: a request that records an episode asks for exactly one choice (400 otherwise)."""
    if episode is not None:
        _one_choice(num_choices)


async def capture(gw: Gateway, tenant: str, episode: str | None, records: Sequence[CompletedChoice]) -> None:
    """After the last token: the choice as the episode's next turn (429 beyond a bound, nothing written)."""
    if episode is None:
        return
    _one_choice(len(records))
    (record,) = records
    turn = Turn(
        list(record.prompt_token_ids),
        list(record.token_ids),
        list(record.logprobs),
        record.model,
        record.finish_reason,
        record.request_id,
        record.started_at,
        record.finished_at,
        record.constraint,
    )
    try:
        await gw.episodes.append(tenant, episode, turn)
    except GatewayError as exc:
        raise _openai(exc) from None


def _openai(exc: GatewayError) -> OpenAIError:
    # The streamed path answers OpenAIErrors as the stream's error event (anything else is a 500 there).
    return exc if isinstance(exc, OpenAIError) else OpenAIError(exc.status, exc.code, exc.message)


def _one_choice(n: int) -> None:
    try:
        check_single_choice(n)
    except GatewayError as exc:
        raise _openai(exc) from None

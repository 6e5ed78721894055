"""What each finished /v1 choice leaves behind, token for token: the record episode capture stores, and the
episode id a request names (``X-OpenTinker-Episode`` header or ``metadata.episode_id``)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from opentinker.gateway.openai.errors import invalid

EPISODE_HEADER = "X-OpenTinker-Episode"
_EPISODE_RE = re.compile(r"[A-Za-z0-9._:-]{1,128}")


@dataclass(frozen=True, slots=True)
class CompletedChoice:
    """One finished choice: exactly the tokens the sampler saw and produced."""

    request_id: str  # the response's id (chatcmpl-... / cmpl-...)
    index: int  # the choice's index in the response
    endpoint: str  # "chat.completions" or "completions"
    prompt_token_ids: tuple[int, ...]  # what the sampler was given (the rendered chat template)
    token_ids: tuple[int, ...]  # every sampled token, a stop token included
    logprobs: tuple[float, ...]  # the sampler's logprob of each token in token_ids
    model: str  # the exact version, "tenant/name@N", or the base model's id
    finish_reason: str  # "stop" | "length" | "tool_calls"
    text: str  # the choice's text as answered (stop string cut)
    started_at: float  # unix seconds: request admitted by the gateway
    finished_at: float  # unix seconds: this choice's last token received
    # The grammar the tokens were drawn under (structured.OutputConstraint.to_record): their logprobs are of the
    # masked distribution. None: sampled free.
    constraint: dict[str, str] | None = None


def episode_id(header: str | None, metadata_value: str | None) -> str | None:
    """The request's episode id, checked ([A-Za-z0-9._:-]{1,128}); header and metadata must agree when both."""
    if header is not None and metadata_value is not None and header != metadata_value:
        raise invalid(f"the {EPISODE_HEADER} header and metadata.episode_id differ", "metadata.episode_id")
    value = header if header is not None else metadata_value
    if value is not None and not _EPISODE_RE.fullmatch(value):
        raise invalid("an episode id is 1-128 characters of [A-Za-z0-9._:-]", "metadata.episode_id")
    return value

"""JSON of /v1 answers: chat.completion(.chunk), text_completion, usage, logprobs, SSE framing.

Extra fields as vLLM returns them: ``prompt_token_ids`` on the response (on the first chunk when streamed) and
``token_ids`` on each choice (each chunk's new ones when streamed), when the request asks ``return_token_ids``."""

from __future__ import annotations

import json
from collections.abc import Sequence

from opentinker.gateway.openai.tool_calls import ToolCall
from opentinker.v1 import sampler_pb2

Json = dict[str, object]
DONE = b"data: [DONE]\n\n"


def finish_reason(stop_reason: int) -> str:
    if stop_reason in (sampler_pb2.STOP_REASON_LENGTH, sampler_pb2.STOP_REASON_CONTEXT_LENGTH):
        return "length"
    return "stop"  # an end-of-sequence or stop token, or a stop string


def sse(payload: Json) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


def usage(prompt_tokens: int, completion_tokens: int) -> Json:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


Alternatives = Sequence[tuple[str, float]]  # one position's most likely tokens (text, logprob), most likely first


def chat_logprobs(pieces: Sequence[str], logprobs: Sequence[float], top: Sequence[Alternatives]) -> Json:
    """OpenAI's chat logprobs: each token's, and its position's ``top_logprobs`` most likely tokens as the sampler
    ranked them (``top``: one per token; empty when none were asked for)."""
    content = []
    for piece, logprob, alternatives in zip(pieces, logprobs, top, strict=True):
        entry: Json = {"token": piece, "logprob": logprob, "bytes": list(piece.encode())}
        entry["top_logprobs"] = [{"token": t, "logprob": lp, "bytes": list(t.encode())} for t, lp in alternatives]
        content.append(entry)
    return {"content": content, "refusal": None}


def completion_logprobs(
    pieces: Sequence[str], logprobs: Sequence[float], top: Sequence[Alternatives] | None, offset: int
) -> Json:
    """The legacy completions' logprobs (``text_offset`` from ``offset``, the characters already answered). As
    OpenAI's, each ``top_logprobs`` dict holds the k most likely tokens and the sampled one (k + 1 entries when it
    is not among them); None when ``logprobs`` was 0."""
    offsets = []
    for piece in pieces:
        offsets.append(offset)
        offset += len(piece)
    tops: list[dict[str, float]] | None = None
    if top is not None:
        tops = []
        for piece, logprob, alternatives in zip(pieces, logprobs, top, strict=True):
            ranked: dict[str, float] = {}
            for text, lp in [*alternatives, (piece, logprob)]:
                ranked.setdefault(text, lp)  # two ids of one text (a partial character): the likelier one's
            tops.append(ranked)
    return {"tokens": list(pieces), "token_logprobs": list(logprobs), "top_logprobs": tops, "text_offset": offsets}


def tool_calls_json(calls: Sequence[ToolCall]) -> list[Json]:
    return [
        {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
        for call in calls
    ]


def chat_message(content: str | None, calls: Sequence[ToolCall]) -> Json:
    message: Json = {"role": "assistant", "content": content, "refusal": None}
    if calls:
        message["tool_calls"] = tool_calls_json(calls)
    return message


def envelope(kind: str, response_id: str, created: int, model: str, choices: list[Json]) -> Json:
    return {"id": response_id, "object": kind, "created": created, "model": model, "choices": choices}

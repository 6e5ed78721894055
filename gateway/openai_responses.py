"""JSON of /v1 answers: chat.completion(.chunk), text_completion, usage, logprobs, SSE framing.

Extra fields as vLLM returns them: ``prompt_token_ids`` on the response (on the first chunk when streamed) and
``token_ids`` on each choice (each chunk's new ones when streamed), when the request asks ``return_token_ids``."""

from __future__ import annotations

import json
from collections.abc import Sequence

from opentinker.gateway.tool_calls import ToolCall
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


def chat_logprobs(pieces: Sequence[str], logprobs: Sequence[float], top: int) -> Json:
    """OpenAI's chat logprobs. The sampler gives the chosen token's logprob only, so ``top_logprobs`` holds
    that token alone when alternatives are asked for (docs/interop.md)."""
    content = []
    for piece, logprob in zip(pieces, logprobs, strict=True):
        entry: Json = {"token": piece, "logprob": logprob, "bytes": list(piece.encode())}
        entry["top_logprobs"] = [{"token": piece, "logprob": logprob, "bytes": list(piece.encode())}] if top else []
        content.append(entry)
    return {"content": content, "refusal": None}


def completion_logprobs(pieces: Sequence[str], logprobs: Sequence[float], top: int, offset: int) -> Json:
    """The legacy completions' logprobs (``text_offset`` from ``offset``, the characters already answered)."""
    offsets = []
    for piece in pieces:
        offsets.append(offset)
        offset += len(piece)
    return {
        "tokens": list(pieces),
        "token_logprobs": list(logprobs),
        "top_logprobs": [{piece: lp} for piece, lp in zip(pieces, logprobs, strict=True)] if top else None,
        "text_offset": offsets,
    }


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

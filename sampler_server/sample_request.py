"""The service edge's conversions: a request's sampling parameters and cache salt, checked, into the engine's
typed records (`SamplingParams`, the salt's digest), and the engine's `StopReason` back into the proto's. The
only place that knows both sides, so a field renamed in sampler.proto touches this file and the handlers alone;
each conversion runs once per request (or once per streamed message), never per step."""

from __future__ import annotations

import hashlib
import math

from opentinker.rpc.serving.errors import InvalidArgument
from opentinker.sampler_server.constraint import Constraint, invalid, json_schema
from opentinker.sampler_server.sequence import SamplingParams, StopReason
from opentinker.v1 import sampler_pb2

MAX_STOP_STRINGS = 16
MAX_TOP_LOGPROBS = 20  # most likely tokens reported per sampled position (OpenAI's bound)
MAX_PENALTY = 2.0  # OpenAI's bound on frequency and presence penalties (either sign)
MAX_CACHE_SALT_BYTES = 256  # UTF-8 bytes of a request's cache_salt (only its SHA-256 enters the cache key)

STOP_REASONS: dict[StopReason, sampler_pb2.StopReason] = {
    StopReason.UNSPECIFIED: sampler_pb2.STOP_REASON_UNSPECIFIED,
    StopReason.STOP_TOKEN: sampler_pb2.STOP_REASON_STOP_TOKEN,
    StopReason.LENGTH: sampler_pb2.STOP_REASON_LENGTH,
    StopReason.CONTEXT_LENGTH: sampler_pb2.STOP_REASON_CONTEXT_LENGTH,
    StopReason.STOP_STRING: sampler_pb2.STOP_REASON_STOP_STRING,
}


def cache_salt(salt: str) -> str:
    """The SHA-256 (hex) of a request's cache_salt, the part of its prefix-cache key that keeps requests of one
    tenant with different salts from sharing blocks; "" for no salt. Longer than MAX_CACHE_SALT_BYTES:
    INVALID_ARGUMENT INVALID_CACHE_SALT."""
    if not salt:
        return ""
    data = salt.encode()
    if len(data) > MAX_CACHE_SALT_BYTES:
        raise InvalidArgument(
            f"cache_salt is {len(data):,} bytes; at most {MAX_CACHE_SALT_BYTES}",
            reason="INVALID_CACHE_SALT",
            field="cache_salt",
        )
    return hashlib.sha256(data).hexdigest()


def sampling_params(message: sampler_pb2.SamplingParams, *, vocab_size: int) -> SamplingParams:
    temperature = message.temperature if message.HasField("temperature") else 1.0
    if not math.isfinite(temperature) or temperature < 0:
        raise InvalidArgument(
            "sampling_params.temperature must be >= 0",
            reason="INVALID_SAMPLING_PARAMS",
            field="sampling_params.temperature",
        )
    top_p = message.top_p or 1.0
    if not 0.0 < top_p <= 1.0:
        raise InvalidArgument(
            "sampling_params.top_p must be in (0, 1]", reason="INVALID_SAMPLING_PARAMS", field="sampling_params.top_p"
        )
    max_tokens = message.max_tokens or 16
    stop_ids = tuple(int(t) for t in message.stop_token_ids)
    if any(not 0 <= t < vocab_size for t in stop_ids):
        raise InvalidArgument(
            "sampling_params.stop_token_ids has ids outside the vocabulary",
            reason="INVALID_SAMPLING_PARAMS",
            field="sampling_params.stop_token_ids",
        )
    if len(message.stop_strings) > MAX_STOP_STRINGS or any(not s for s in message.stop_strings):
        raise InvalidArgument(
            f"at most {MAX_STOP_STRINGS} non-empty stop strings",
            reason="INVALID_SAMPLING_PARAMS",
            field="sampling_params.stop_strings",
        )
    if message.top_logprobs > MAX_TOP_LOGPROBS:
        raise InvalidArgument(
            f"sampling_params.top_logprobs is {message.top_logprobs}; at most {MAX_TOP_LOGPROBS} "
            "most likely tokens per position are reported (0: none)",
            reason="INVALID_SAMPLING_PARAMS",
            field="sampling_params.top_logprobs",
        )
    for name in ("frequency_penalty", "presence_penalty"):
        value = getattr(message, name)
        if not -MAX_PENALTY <= value <= MAX_PENALTY:  # NaN fails this too
            raise InvalidArgument(
                f"sampling_params.{name} is {value}; it must be in {-MAX_PENALTY:g}..{MAX_PENALTY:g}",
                reason="INVALID_SAMPLING_PARAMS",
                field=f"sampling_params.{name}",
            )
    return SamplingParams(
        temperature=temperature,
        top_k=message.top_k,
        top_p=top_p,
        seed=message.seed if message.HasField("seed") else None,
        max_tokens=max_tokens,
        stop_token_ids=stop_ids,
        stop_strings=tuple(message.stop_strings),
        logprobs=message.logprobs,
        top_logprobs=message.top_logprobs,
        frequency_penalty=message.frequency_penalty,
        presence_penalty=message.presence_penalty,
    )


def constraint_of(message: sampler_pb2.SampleRequest) -> Constraint | None:
    """A request's constraint as the engine's record (its grammar is compiled later, off the event loop); with stop
    strings or stop token ids: INVALID_CONSTRAINT (a stop could end the output where the grammar may not)."""
    kind = message.constraint.WhichOneof("kind")
    if kind is None:
        return None
    if message.sampling_params.stop_strings or message.sampling_params.stop_token_ids:
        raise invalid(
            "a constraint cannot be combined with stop strings or stop token ids: a stop could cut the output where "
            "the grammar may not end (the grammar itself says where the output ends)"
        )
    if kind == "json_schema":
        return json_schema(message.constraint.json_schema)
    if kind == "json_object":
        if not message.constraint.json_object:
            raise invalid("constraint.json_object must be true when set")
        return Constraint("json_object")
    source: str = getattr(message.constraint, kind)
    if not source:
        raise invalid(f"constraint.{kind} is empty")
    return Constraint(kind, source)

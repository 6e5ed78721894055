"""Sampling routes: create_sampling_session, samplers/{id}, asample (sample and compute_logprobs)."""

from __future__ import annotations

from contextlib import aclosing

from aiohttp import web

from opentinker.gateway.backend import Backend, Backends
from opentinker.gateway.bodies import Json, field_of, json_body, required
from opentinker.gateway.errors import RequestFailed, bad_request, not_found
from opentinker.gateway.state import backend_of, gateway_of, principal_of
from opentinker.gateway.tinker import convert, fields
from opentinker.gateway.tinker.futures import Outcome
from opentinker.gateway.tinker.sessions import SamplingSession, new_id
from opentinker.gateway.tinker.state import TinkerState, tinker_of
from opentinker.v1 import common_pb2, sampler_pb2

# SampleRequest fields this gateway cannot honour; asking for them fails the request instead of silently
# returning less than was asked.
_UNSUPPORTED = ("topk_prompt_logprobs", "prompt_alt_tokens_k")
MAX_TOPK_SAMPLE_LOGPROBS = 20  # the sampler's bound on SamplingParams.top_logprobs


async def _reference(
    gw: TinkerState, backends: Backends, tenant: str, token: str | None, model_path: str | None, base_model: str | None
) -> str:
    """What a sampling session samples: an exact registry version for a sampler_weights path, else "base"."""
    base = await backends.base_model(token)
    if model_path is not None:
        try:
            checkpoint = gw.checkpoints.get(model_path, tenant)
        except RequestFailed as exc:
            raise not_found(exc.message, "UNKNOWN_CHECKPOINT") from exc
        if checkpoint.kind != "sampler":
            raise bad_request(
                f"{model_path} is a training state; sample from weights saved with save_weights_for_sampler",
                "NOT_SAMPLER_WEIGHTS",
            )
        return checkpoint.target
    if base_model is None or not base.matches(base_model):
        raise bad_request(f"base_model {base_model!r} is not served here; this server serves {base.model!r}")
    return "base"


async def create_sampling_session(request: web.Request) -> web.Response:
    gw, principal = tinker_of(request), principal_of(request)
    body = await json_body(request)
    session_id = required(body, "session_id", str)
    seq = fields.required_integer(body, "sampling_session_seq_id", 0, fields.INT32_MAX)
    gw.sessions.active(session_id, principal.tenant)
    model_path = field_of(body, "model_path", str, required=False)
    base_model = field_of(body, "base_model", str, required=False)
    backends = gateway_of(request).backends
    reference = await _reference(gw, backends, principal.tenant, principal.token, model_path, base_model)
    base = await backends.base_model(principal.token)
    sampler_id = f"{session_id}:sample:{seq}"
    sampler = SamplingSession(sampler_id, principal.tenant, session_id, reference, base.model, model_path)
    await gw.durable.put_sampler(sampler)
    gw.sessions.add_sampler(sampler)
    return web.json_response({"type": "create_sampling_session", "sampling_session_id": sampler_id})


async def get_sampler(request: web.Request) -> web.Response:
    gw, principal = tinker_of(request), principal_of(request)
    sampler = gw.sessions.sampler(request.match_info["sampler_id"], principal.tenant)
    return web.json_response(
        {"sampler_id": sampler.sampling_session_id, "base_model": sampler.base_model, "model_path": sampler.model_path}
    )


# per sample: tokens, their logprobs, our stop reason, each token's most likely tokens (when asked)
Sampled = list[tuple[list[int], list[float], int, list[sampler_pb2.TopLogprobs]]]


async def _sample(
    backend: Backend, request: sampler_pb2.SampleRequest, num_samples: int, want_prompt_logprobs: bool
) -> tuple[Sampled, list[float] | None]:
    tokens: list[list[int]] = [[] for _ in range(num_samples)]
    logprobs: list[list[float]] = [[] for _ in range(num_samples)]
    tops: list[list[sampler_pb2.TopLogprobs]] = [[] for _ in range(num_samples)]
    stops = [sampler_pb2.STOP_REASON_UNSPECIFIED] * num_samples
    prompt_logprobs: list[float] | None = None
    async with aclosing(backend.sampler.sample_async(request)) as messages:
        async for message in messages:
            i = message.sample_index
            if not 0 <= i < num_samples:
                raise RequestFailed(f"sampler answered an unexpected sample_index {i}", "server")
            tokens[i].extend(message.tokens)
            logprobs[i].extend(message.logprobs)
            tops[i].extend(message.top_logprobs)
            if message.stop_reason != sampler_pb2.STOP_REASON_UNSPECIFIED:
                stops[i] = message.stop_reason
            if want_prompt_logprobs and prompt_logprobs is None and message.prompt_tokens:
                prompt_logprobs = list(message.prompt_logprobs)
    if any(stop == sampler_pb2.STOP_REASON_UNSPECIFIED for stop in stops):
        raise RequestFailed("the sampler's stream ended before every sample finished", "server")
    return list(zip(tokens, logprobs, stops, tops, strict=True)), prompt_logprobs if want_prompt_logprobs else None


def _sample_request(
    gw: TinkerState, body: Json, reference: str, request_id: str
) -> tuple[sampler_pb2.SampleRequest, int]:
    """The sampler's request and the number of samples, every field checked first (400 INVALID_FIELD): nothing
    is sized from ``num_samples`` before it is known to be within ``--max-num-samples``."""
    num_samples = fields.integer(body, "num_samples", 1, gw.config.max_num_samples, default=1)
    assert num_samples is not None
    want_prompt_logprobs = fields.boolean(body, "prompt_logprobs")
    for name in _UNSUPPORTED:
        fields.integer(body, name, 0, fields.INT32_MAX)
    fields.integer(body, "prompt_logprobs_last_n", 0, fields.INT32_MAX)
    top_k = fields.integer(body, "topk_sample_logprobs", 0, MAX_TOPK_SAMPLE_LOGPROBS, default=0)
    params = fields.mapping(body, "sampling_params")
    sample = sampler_pb2.SampleRequest(
        model=reference,
        prompt=common_pb2.ModelInput(
            chunks=[
                common_pb2.ModelInputChunk(
                    encoded_text=common_pb2.EncodedTextChunk(tokens=convert.prompt_tokens(body.get("prompt")))
                )
            ]
        ),
        sampling_params=convert.sampling_params(params, gw.config.default_max_tokens),
        num_samples=num_samples,
        prompt_logprobs=want_prompt_logprobs,
        request_id=request_id,
    )
    sample.sampling_params.top_logprobs = top_k or 0
    return sample, num_samples


async def asample(request: web.Request) -> web.Response:
    gw, principal, backend = tinker_of(request), principal_of(request), backend_of(request)
    body = await json_body(request)
    sampler_id = field_of(body, "sampling_session_id", str, required=False)
    record_stability = fields.boolean(body, "record_stability_info")
    session_id: str | None = None
    if sampler_id is not None:
        sampling_session = gw.sessions.sampler(sampler_id, principal.tenant)
        reference, session_id = sampling_session.reference, sampling_session.session_id
        seq = fields.required_integer(body, "seq_id", 0, fields.INT64_MAX)
        prefix = f"{sampler_id}:{seq}"
    else:
        model_path = field_of(body, "model_path", str, required=False)
        base_model = field_of(body, "base_model", str, required=False)
        reference = await _reference(
            gw, gateway_of(request).backends, principal.tenant, principal.token, model_path, base_model
        )
        prefix = new_id()
    sample, num_samples = _sample_request(gw, body, reference, prefix)

    async def job() -> Outcome:
        for name in _UNSUPPORTED:
            if body.get(name):
                raise RequestFailed(f"{name} is not supported by this server")
        if body.get("target_prompt_logprobs") is not None or body.get("prompt_logprobs_last_n") is not None:
            raise RequestFailed("target_prompt_logprobs and prompt_logprobs_last_n are not supported by this server")
        if record_stability and session_id is None:
            raise RequestFailed("record_stability_info needs a sampling session (create the SamplingClient first)")
        sequences, prompt_logprobs = await _sample(backend, sample, num_samples, sample.prompt_logprobs)
        if record_stability and session_id is not None:
            # what stable_reinforce will form its ratio against (tinker/stability.py)
            gw.stability.record(
                principal.tenant,
                session_id,
                sample.prompt.chunks[0].encoded_text.tokens,
                {f"{prefix}:{i}": (tokens, logprobs) for i, (tokens, logprobs, _, _) in enumerate(sequences)},
            )
        top_k = sample.sampling_params.top_logprobs
        return Outcome(proto=convert.sample_response(sequences, prompt_logprobs, top_k))

    future = gw.futures.create(principal.tenant)
    gw.futures.start(future, job)
    return web.json_response(
        {"request_id": future.request_id, "sample_sequence_ids": [f"{prefix}:{i}" for i in range(num_samples)]}
    )


def add_routes(app: web.Application) -> None:
    app.router.add_post("/api/v1/create_sampling_session", create_sampling_session)
    app.router.add_get("/api/v1/samplers/{sampler_id}", get_sampler)
    app.router.add_post("/api/v1/asample", asample)

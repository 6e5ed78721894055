"""The gateway's state, shared by every handler, and the request helpers they use."""

from __future__ import annotations

import asyncio
import functools
import logging
from dataclasses import dataclass, field
from typing import TypeVar

from aiohttp import web

from opentinker.gateway.auth import KeyStore, Principal
from opentinker.gateway.backend import Backend, Backends
from opentinker.gateway.bodies import parse_json
from opentinker.gateway.chat_template import TokenizerHandle
from opentinker.gateway.checkpoints import CheckpointTable
from opentinker.gateway.durable import MemoryState, Saved
from opentinker.gateway.episodes import MemoryEpisodes
from opentinker.gateway.errors import bad_request
from opentinker.gateway.futures import FutureStore
from opentinker.gateway.models import Lane, ModelTable, TrainingModel
from opentinker.gateway.runs import RunTable
from opentinker.gateway.sessions import SessionTable
from opentinker.gateway.stability import DEFAULT_MAX_TENANT_TOKENS, DEFAULT_TTL_SECONDS, StabilityRecords

log = logging.getLogger(__name__)

SUPPORTED_SDK_VERSION = "0.38.0"
"""The tinker SDK version whose protocol this gateway speaks; others are served with a warning."""


MAX_SDK_VERSION = 64  # characters of a create_session's sdk_version


@dataclass(frozen=True, slots=True)
class GatewayConfig:
    """The gateway's flags (``opentinker gateway serve --help``); the bounds keep one key from holding the
    event loop or the memory every other key shares."""

    fwdbwd_max_chunk_len: int = 1024  # datums per forward_backward request the SDK sends
    compress_fwdbwd: bool = True  # ask the SDK to zstd-compress forward_backward bodies
    default_max_tokens: int = 16  # when SamplingParams.max_tokens is None
    poll_seconds: float = 20.0  # longest retrieve_future long-poll
    max_num_samples: int = 64  # samples per asample (the sampler's own limit)
    max_body_bytes: int = 64 << 20  # a forward_backward body, sent and decompressed
    max_json_bytes: int = 8 << 20  # a JSON body
    max_string_length: int = 4096  # characters of any string (or key) in a JSON body
    seq_window: int = 256  # how far ahead of a model's next expected seq_id a request may be
    max_pending_bytes: int = 256 << 20  # forward_backward bytes one model may have waiting for their turn
    max_tenant_pending_bytes: int = 1 << 30  # ... and all models of one tenant together
    max_sessions_per_tenant: int = 1024  # sessions one tenant holds at once (finished ones count until they expire)
    max_inflight_per_tenant: int = 4096  # unfinished requests of one tenant (429, retried by the SDK, beyond)
    pending_ttl_seconds: float = 300.0  # how long a request may wait for an earlier seq_id that never comes
    session_ttl_seconds: float = 900.0  # a session without heartbeats expires (the SDK sends one every 10 s)
    max_tenant_result_bytes: int = 1 << 30  # finished results one tenant holds (its oldest dropped beyond); 0: none
    checkpoint_gc_seconds: float = 60.0  # how often expired and deleted checkpoints are deleted for real
    stability_ttl_seconds: float = DEFAULT_TTL_SECONDS  # a stability record is kept this long after its last use
    max_tenant_stability_tokens: int = DEFAULT_MAX_TENANT_TOKENS  # tokens one tenant's stability records hold
    tool_call_parser: str = "auto"  # /v1 tool calls: auto (from the chat template), hermes, llama3, none
    max_tokenizer_jobs_per_tenant: int = 64  # /v1 renders one tenant may have waiting for the tokenizer (429 beyond)

    def limits(self) -> dict[str, float]:
        """The numeric flags that must be positive (those where 0 means "no limit" are left out)."""
        return {
            name: getattr(self, name)
            for name in self.__dataclass_fields__
            if isinstance(getattr(self, name), int | float)
            and not isinstance(getattr(self, name), bool)
            and name not in ZERO_MEANS_NO_LIMIT
        }


ZERO_MEANS_NO_LIMIT = frozenset({"max_tenant_result_bytes"})


@dataclass(slots=True)
class Gateway:
    keys: KeyStore
    backends: Backends
    config: GatewayConfig = field(default_factory=GatewayConfig)
    futures: FutureStore = field(default_factory=FutureStore)
    sessions: SessionTable = field(default_factory=SessionTable)
    models: ModelTable = field(default_factory=ModelTable)
    checkpoints: CheckpointTable = field(default_factory=CheckpointTable)
    runs: RunTable = field(default_factory=RunTable)
    durable: MemoryState = field(default_factory=MemoryState)  # durable.py: Redis with --redis-url
    stability: StabilityRecords = field(default_factory=StabilityRecords)
    tokenizer: TokenizerHandle = field(default_factory=TokenizerHandle)  # /v1 chat templates (--tokenizer)
    episodes: MemoryEpisodes = field(default_factory=MemoryEpisodes)  # episodes.py: Redis with --redis-url
    decode_slots: asyncio.Semaphore = field(default_factory=lambda: asyncio.Semaphore(2))  # bodies decoded at once
    json_slots: asyncio.Semaphore = field(default_factory=lambda: asyncio.Semaphore(2))  # big JSON bodies parsed

    def __post_init__(self) -> None:
        self.futures.poll_seconds = self.config.poll_seconds
        self.futures.max_inflight = self.config.max_inflight_per_tenant
        self.futures.results.max_bytes = self.config.max_tenant_result_bytes or None
        self.stability.ttl_seconds = self.config.stability_ttl_seconds
        self.stability.max_tenant_tokens = self.config.max_tenant_stability_tokens

    def restore(self, saved: Saved) -> None:
        """The tables as the state store kept them: the models of sessions that have not expired get their lanes
        back, expecting the seq_id after the last one accepted."""
        self.sessions.restore(saved.sessions, saved.samplers)
        for run in saved.runs:
            self.runs.add(run)
            session = self.sessions.find(run.session_id)
            if session is None or session.finished == "expired":
                continue
            lane = self.lane(run.model_id)
            lane.next_seq = saved.seq.get(run.model_id, 0) + 1
            self.models.add(
                TrainingModel(run.model_id, run.tenant, run.session_id, run.adapter, run.lora, run.base_model, lane)
            )
        for checkpoint in saved.checkpoints:
            self.checkpoints.add(checkpoint)

    def lane(self, model_id: str) -> Lane:
        """A new model's request lane, within the configured window and pending bytes."""
        return Lane(model_id, window=self.config.seq_window, max_pending_bytes=self.config.max_pending_bytes)


GATEWAY = web.AppKey("gateway", Gateway)


def gateway_of(request: web.Request) -> Gateway:
    return request.app[GATEWAY]


def principal_of(request: web.Request) -> Principal:
    principal = request.get("principal")
    assert isinstance(principal, Principal), "the auth middleware sets the principal"
    return principal


def backend_of(request: web.Request) -> Backend:
    return gateway_of(request).backends.for_token(principal_of(request).token)


def check_sdk_version(version: object) -> str | None:
    """A warning for an SDK version this gateway was not built against (it is still served); 400 for a version
    that is not a short string."""
    if version is None:
        version = ""
    if not isinstance(version, str) or len(version) > MAX_SDK_VERSION:
        raise bad_request(f"sdk_version must be a string of at most {MAX_SDK_VERSION} characters", "INVALID_FIELD")
    if version == SUPPORTED_SDK_VERSION:
        return None
    message = (
        f"tinker SDK {version!r} is not the version this OpenTinker gateway supports ({SUPPORTED_SDK_VERSION}); "
        "requests are served, but some may not work"
    )
    log.warning("%s", message)
    return message


# Reading JSON bodies

Json = dict[str, object]
_T = TypeVar("_T")
JSON_INLINE_BYTES = 64 << 10  # smaller JSON bodies (all the SDK's but long prompts) are parsed on the event loop


async def json_body(request: web.Request) -> Json:
    """The body as a JSON object within the configured size, depth and string bounds (see bodies.py). A body
    above ``JSON_INLINE_BYTES`` is parsed on a worker thread, two at a time, so that one tenant's big bodies
    leave the event loop to every other request (the answers are the same either way; see bodies.py for what
    still holds the GIL)."""
    gw = gateway_of(request)
    raw = await request.read()
    parse = functools.partial(
        parse_json, raw, max_bytes=gw.config.max_json_bytes, max_string=gw.config.max_string_length
    )
    if len(raw) <= JSON_INLINE_BYTES or len(raw) > gw.config.max_json_bytes:
        return parse()
    async with gw.json_slots:
        return await asyncio.to_thread(parse, yielding=True)


def field_of(body: Json, name: str, kind: type[_T], *, required: bool = True) -> _T | None:
    value = body.get(name)
    if value is None:
        if required:
            raise bad_request(f"{name} is required", "MISSING_FIELD")
        return None
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise bad_request(f"{name} must be {kind.__name__}, got {type(value).__name__}", "INVALID_FIELD")
    return value


def required(body: Json, name: str, kind: type[_T]) -> _T:
    value = field_of(body, name, kind)
    assert value is not None
    return value

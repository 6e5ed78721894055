"""The sampling SDK's typed records (Tinker-style): how a sampler generates and what it returns (sequences,
stream chunks, the exact version that produced them, residency and load).

Every type is a frozen, slotted dataclass holding tuples; their conversion to and from the wire protos
lives in `opentinker.client.wire`.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from typing import Literal, TypeAlias

from opentinker.client.constraints import Constraint
from opentinker.client.datum import int64, int64s

__all__ = [
    "LoadedAdapter",
    "SampleChunk",
    "SampleResult",
    "SampledSequence",
    "SampledVersion",
    "SamplerStats",
    "SamplingParams",
    "StopReason",
]

StopReason: TypeAlias = Literal["length", "stop_token", "stop_string", "context_length"]
"""Why a sample ended: max_tokens reached, an end-of-sequence / stop token sampled (and included), a stop
string appeared in the text, or the model's context was full."""


@dataclass(frozen=True, slots=True, init=False)
class SamplingParams:
    """How a sampler generates. temperature 0: greedy; top_k 0 and top_p 1: off; top_p 0: greedy too.

    ``SamplingParams(max_tokens=16, temperature=1.0, top_k=0, top_p=1.0, seed=None, stop=(), stop_token_ids=(),
    logprobs=True, top_logprobs=0, frequency_penalty=0.0, presence_penalty=0.0)``. ``seed``: same seed, prompt and
    version, same output (sample i of a request uses seed + i); None draws a fresh one. ``stop``: stop strings (a
    single string is one stop string); ``stop_token_ids``: tokens that end a sample (besides the model's
    end-of-sequence tokens), included in its output. ``logprobs``: return the logprob of every sampled token.
    ``top_logprobs`` (0..20): also return, per sampled token, the k most likely tokens at its position
    (SampledSequence.top_logprobs), from the same distribution as ``logprobs`` (temperature 1, before top_k /
    top_p). ``top_p`` 0 is the limit of a shrinking nucleus, the most likely token alone: it is sent as temperature
    0 (the wire reads top_p 0 as "off"). ``frequency_penalty`` / ``presence_penalty`` (-2..2, 0: off): OpenAI's,
    over the tokens the sample generated so far; a token's logit loses count * frequency_penalty + (count > 0) *
    presence_penalty before the temperature (reported logprobs stay the model's own). The sampler checks the values
    (INVALID_ARGUMENT), except those checked here: max_tokens at least 1 (the wire reads 0 as "default") and
    top_logprobs not negative (the wire cannot carry it).
    """

    max_tokens: int
    temperature: float
    top_k: int
    top_p: float
    seed: int | None
    stop: tuple[str, ...]
    stop_token_ids: tuple[int, ...]
    logprobs: bool
    top_logprobs: int
    frequency_penalty: float
    presence_penalty: float
    constraint: Constraint | None

    def __init__(
        self,
        max_tokens: int = 16,
        temperature: float = 1.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int | None = None,
        stop: str | Iterable[str] = (),
        stop_token_ids: Iterable[int] = (),
        logprobs: bool = True,
        top_logprobs: int = 0,
        frequency_penalty: float = 0.0,
        presence_penalty: float = 0.0,
        constraint: Constraint | None = None,
    ) -> None:
        max_tokens = int64(max_tokens)
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {max_tokens}")
        object.__setattr__(self, "max_tokens", max_tokens)
        object.__setattr__(self, "temperature", float(temperature))
        object.__setattr__(self, "top_k", int64(top_k))
        object.__setattr__(self, "top_p", float(top_p))
        object.__setattr__(self, "seed", None if seed is None else int64(seed))
        object.__setattr__(self, "stop", (stop,) if isinstance(stop, str) else tuple(stop))
        object.__setattr__(self, "stop_token_ids", int64s(stop_token_ids))
        object.__setattr__(self, "logprobs", bool(logprobs))
        top_logprobs = int64(top_logprobs)
        if top_logprobs < 0:
            raise ValueError(f"top_logprobs must not be negative, got {top_logprobs}")
        object.__setattr__(self, "top_logprobs", top_logprobs)
        object.__setattr__(self, "frequency_penalty", float(frequency_penalty))
        object.__setattr__(self, "presence_penalty", float(presence_penalty))
        object.__setattr__(self, "constraint", constraint)


@dataclass(frozen=True, slots=True)
class SampledVersion:
    """The exact adapter version that produced a sample: ``adapter`` "" and ``version`` 0 for the base model.

    ``reference`` is the reference the request named ("name@stable"); ``sha256`` the artifact's manifest
    digest ("" for the base model).
    """

    adapter: str
    version: int
    reference: str
    sha256: str

    @property
    def exact(self) -> str:
        """ "name@N", or "base" for the base model."""
        return f"{self.adapter}@{self.version}" if self.adapter else "base"


TopLogprobs = tuple[tuple[int, float], ...]
"""The k most likely (token id, logprob) pairs at one sampled position, most likely first."""


@dataclass(frozen=True, slots=True)
class SampledSequence:
    """One completed sample: its tokens (a stop token included), their logprobs (empty unless
    SamplingParams.logprobs), its text and why it ended. ``top_logprobs``: one entry per token when
    SamplingParams.top_logprobs > 0, else empty."""

    tokens: tuple[int, ...]
    logprobs: tuple[float, ...]
    text: str
    stop_reason: StopReason
    version: SampledVersion
    top_logprobs: tuple[TopLogprobs, ...] = ()
    # The replicas that produced it, in order: one, or more when a stream moved on a failure (fleet_sampling).
    replicas: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class SampleChunk:
    """A streamed piece of sample ``sample_index``: the tokens produced since its previous chunk.

    ``stop_reason`` is set on the sample's last chunk only. ``text`` may lag behind ``tokens`` while a
    multi-byte character is incomplete; the concatenated texts are the sample's text.
    """

    sample_index: int
    tokens: tuple[int, ...]
    logprobs: tuple[float, ...]
    text: str
    stop_reason: StopReason | None
    version: SampledVersion
    top_logprobs: tuple[TopLogprobs, ...] = ()
    replica: str = ""  # the replica's address that produced these tokens


@dataclass(frozen=True, slots=True)
class SampleResult:
    """The samples of one request, in sample order. ``prompt_logprobs``: logprobs of prompt tokens 1..n-1
    (None unless requested); ``prompt_tokens``: the prompt's length in tokens."""

    sequences: tuple[SampledSequence, ...]
    prompt_logprobs: tuple[float, ...] | None
    prompt_tokens: int


@dataclass(frozen=True, slots=True)
class LoadedAdapter:
    """A version resident in one of the sampler's slots. ``active_requests``: requests holding it now."""

    version: SampledVersion
    slot: int
    rank: int
    pinned: bool
    active_requests: int
    serving_aliases: tuple[str, ...]
    load_time: datetime | None


@dataclass(frozen=True, slots=True)
class SamplerStats:
    """A sampler's load: requests, adapter slots, throughput (decode tokens/s over the last seconds) and
    adapter loads. ``reloads_total``: hot reloads of followed aliases; ``adapter_loads_total``: every version
    loaded into a slot (on demand or by hot reload); ``reload_failures_total``: every failed load.

    The paged KV cache: ``kv_blocks_*`` and ``preemptions_total`` are engine-wide (0 for a tenant's caller);
    ``own_prompt_tokens_*`` are the caller's own Sample prompts by where their K/V came from (an admin's: every
    caller's), and ``prefix_cache_hit_rate`` is cached / (cached + computed) of those."""

    running_requests: int
    waiting_requests: int
    max_waiting: int
    slots_used: int
    slots_total: int
    tokens_generated: int
    decode_tokens_per_second: float
    kv_cache_usage: float
    reloads_total: int
    reload_failures_total: int
    last_event_id: str
    adapter_loads_total: int = 0
    kv_block_size: int = 0
    kv_blocks_total: int = 0
    kv_blocks_used: int = 0
    kv_blocks_cached: int = 0
    kv_blocks_evicted: int = 0
    preemptions_total: int = 0
    own_prompt_tokens_cached: int = 0
    own_prompt_tokens_computed: int = 0
    own_prompt_tokens_shared: int = 0

    @property
    def kv_blocks_free(self) -> int:
        return self.kv_blocks_total - self.kv_blocks_used

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Of the caller's prompt tokens that needed K/V (cached or computed), the fraction found cached."""
        looked_up = self.own_prompt_tokens_cached + self.own_prompt_tokens_computed
        return self.own_prompt_tokens_cached / looked_up if looked_up else 0.0

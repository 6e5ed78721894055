"""The training SDK's public typed records (Tinker-style): what users build and what the clients return.

    from opentinker.client import Datum, ModelInput

    datum = Datum(
        model_input=ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [0.0] * 3 + [1.0] * (len(tokens) - 4)},
    )

Every type is a frozen, slotted dataclass holding tuples (and plain dicts for mappings, so that values
pickle); helpers that "modify" one return a new object. The training example and its parts (ModelInput,
TensorData, Datum) are defined in `opentinker.client.datum` and re-exported here. Their conversion to and
from the wire protos lives in `opentinker.client.wire` (internal: no protobuf message appears in a public
signature).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from typing import Literal, TypeAlias

from opentinker.client.datum import Datum, DType, EncodedTextChunk, LossFnInput, ModelInput, TensorData, int64, int64s

__all__ = [
    "AdamParams",
    "DType",
    "Datum",
    "EncodedTextChunk",
    "ForwardBackwardOutput",
    "LoadedAdapter",
    "LoraConfig",
    "LossFnInput",
    "ModelInput",
    "OptimStepResult",
    "ResetResult",
    "SampleChunk",
    "SampleResult",
    "SampledSequence",
    "SampledVersion",
    "SamplerStats",
    "SamplingParams",
    "SavedState",
    "StartedFrom",
    "StopReason",
    "TensorData",
    "TrainerInfo",
    "TrainingAdapterInfo",
]

StopReason: TypeAlias = Literal["length", "stop_token", "stop_string", "context_length"]
"""Why a sample ended: max_tokens reached, an end-of-sequence / stop token sampled (and included), a stop
string appeared in the text, or the model's context was full."""
ALL_LINEAR = "all-linear"
"""LoraConfig.target_modules for every linear layer (the wire spells it as an empty list)."""


def _strings(values: Iterable[str], what: str) -> tuple[str, ...]:
    # A bare string is iterable too; ("stable") instead of ("stable",) would otherwise become 6 items.
    if isinstance(values, str):
        raise TypeError(f"{what} must be a sequence of strings, not a single string")
    return tuple(values)


# Configuration


@dataclass(frozen=True, slots=True)
class LoraConfig:
    """LoRA hyper-parameters. alpha None means alpha = rank (scaling 1).

    target_modules: "attn", "mlp", "all-linear" (attn + mlp), "lm_head" (the unembedding) or explicit module names
    ("q_proj", "down_proj", ...), in any combination.
    """

    rank: int = 32
    alpha: float | None = None
    dropout: float = 0.0
    target_modules: tuple[str, ...] = (ALL_LINEAR,)

    def __post_init__(self) -> None:
        # Lists are accepted (and stored as a tuple, keeping the config hashable); a bare string is refused.
        object.__setattr__(self, "target_modules", _strings(self.target_modules, "target_modules"))


@dataclass(frozen=True, slots=True)
class AdamParams:
    """AdamW parameters of an optimizer step (Tinker defaults). grad_clip_norm 0 disables clipping.

    The trainer reads a zero field as "use the default", so beta1 = 0 or beta2 = 0 cannot be requested.
    """

    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0


# Results


@dataclass(frozen=True, slots=True)
class ForwardBackwardOutput:
    """The result of forward_backward (or forward).

    ``logprobs[i]`` holds datum i's target-token logprobs, one per model_input position;
    ``loss_fn_outputs[i]`` every per-datum output tensor ("logprobs" always). ``metrics`` are named
    "name:reduction" ("loss:sum", "tokens:sum", ...). ``batch_digest`` is the batch's id in the adapter's
    data ledger and ``step`` the optimizer step these gradients go into; forward sets neither ("" and 0).
    """

    logprobs: tuple[tuple[float, ...], ...]
    loss_fn_outputs: tuple[dict[str, TensorData], ...]
    metrics: dict[str, float]
    batch_digest: str = ""
    step: int = 0

    @property
    def loss(self) -> float:
        """The summed loss of the batch (metrics["loss:sum"])."""
        return self.metrics["loss:sum"]


@dataclass(frozen=True, slots=True)
class OptimStepResult:
    """step: the adapter's step count after this step. metrics: "grad_norm:value", "learning_rate:value"."""

    step: int
    metrics: dict[str, float]


@dataclass(frozen=True, slots=True)
class TrainingAdapterInfo:
    """An adapter's training state as the trainer holds it.

    ``pending_batches``: forward_backward calls whose gradients await the next optim_step;
    ``last_snapshot_version``: the last version save_snapshot published (0: none); ``resident``: False
    while its state is offloaded from the training device; ``adam``: the defaults optim_step uses.
    """

    name: str
    rank: int
    alpha: float
    target_modules: tuple[str, ...]
    step: int
    tokens_trained: int
    datums_trained: int
    pending_batches: int
    last_snapshot_version: int
    num_parameters: int
    resident: bool
    dropout: float
    seed: int
    adam: AdamParams
    created_at: datetime | None
    parent_adapter: str = ""  # last_snapshot_version's adapter when another one (a fork); "": this adapter

    @property
    def lora(self) -> LoraConfig:
        return LoraConfig(rank=self.rank, alpha=self.alpha, dropout=self.dropout, target_modules=self.target_modules)


@dataclass(frozen=True, slots=True)
class StartedFrom:
    """What create_training_client's adapter started from. kind: "fresh" (weights from the seed), "version"
    (``adapter``@``version``'s weights, fresh optimizer) or "state" (``state_id``: weights, optimizer, step, RNG;
    ``version`` the one it was saved with, when --persist-state saved it). ``description``: one line for people."""

    kind: Literal["fresh", "version", "state"]
    adapter: str
    version: int
    state_id: str
    description: str


@dataclass(frozen=True, slots=True)
class ResetResult:
    """A reset: the adapter now holds ``adapter``@``version``'s weights (the next snapshot's parent);
    ``optimizer_kept``: whether the AdamW moments were kept (else fresh)."""

    adapter: str
    version: int
    optimizer_kept: bool
    info: TrainingAdapterInfo


@dataclass(frozen=True, slots=True)
class SavedState:
    """A saved training state: pass ``state_id`` to load_state or create_training_client(resume_state=...)."""

    state_id: str
    step: int
    size_bytes: int


@dataclass(frozen=True, slots=True)
class TrainerInfo:
    """The base model a trainer holds and what it can train."""

    model: str
    model_digest: str
    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    max_position_embeddings: int
    dtype: str
    device: str
    loss_fns: tuple[str, ...]
    lora_target_modules: tuple[str, ...] = ()
    max_resident_adapters: int = 0
    served_name: str = ""  # the model's public name (a hub id or --served-model-name), which clients send


# Sampling


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

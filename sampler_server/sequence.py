"""One generated sequence: its prompt, sampling parameters, pinned adapter slot, KV-cache blocks and output."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import torch

from opentinker.sampler_server.constraint import Constraint

GREEDY_BELOW_TEMPERATURE = 1e-5


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class StopReason(enum.Enum):
    """Why a sample ended; the service edge names it in the proto's terms (sample_request.py)."""

    UNSPECIFIED = "unspecified"  # still running
    STOP_TOKEN = "stop_token"  # it sampled one of its stop tokens or an end-of-sequence token
    LENGTH = "length"  # max_tokens reached (a score: its input computed)
    CONTEXT_LENGTH = "context_length"  # the context is full
    STOP_STRING = "stop_string"  # its text met a stop string (the server's detokenizer saw it)


@dataclass(frozen=True, slots=True)
class SamplingParams:
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    max_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()
    logprobs: bool = False
    top_logprobs: int = 0  # the most likely tokens to report at each sampled position (0: none)
    frequency_penalty: float = 0.0  # subtracted from a token's score once per time the sample generated it
    presence_penalty: float = 0.0  # subtracted from a token's score once the sample generated it at all
    constraint: Constraint | None = None  # the grammar every sample follows (constraint.py); None: free

    @property
    def penalized(self) -> bool:
        return self.frequency_penalty != 0.0 or self.presence_penalty != 0.0

    @property
    def greedy(self) -> bool:
        # Below this, logits / temperature can overflow float32 (inf -> NaN probabilities, a failed step for the
        # whole batch); the distribution is the argmax to within float precision anyway.
        return self.temperature < GREEDY_BELOW_TEMPERATURE


# A ComputeLogprobs input's: it computes its whole input, samples no token (max_tokens 0) and reports the
# logprobs of its input tokens, the model's own (temperature 1).
SCORE_PARAMS = SamplingParams(temperature=0.0, max_tokens=0)


@dataclass(frozen=True, slots=True)
class TopLogprobs:
    """The most likely tokens at one sampled position, most likely first, with their logprobs (the same
    log_softmax of the raw logits as the sampled token's)."""

    token_ids: list[int]
    logprobs: list[float]


@dataclass(slots=True)
class Sequence:
    seq_id: int
    request_id: str
    sample_index: int
    prompt: list[int]
    params: SamplingParams
    lora_slot: int  # 0 = base model
    tenant: str = ""  # whose batch share it uses (the scheduler's fairness key; see tenant_stats.batch_tenant)
    want_prompt_logprobs: bool = False
    status: Status = Status.WAITING
    kv_slot: int = -1  # its seat in the batch (one of max_seqs) while running
    block_table: list[int] = field(default_factory=list)  # KV-cache blocks holding its positions, in order
    block_keys: list[bytes] = field(default_factory=list)  # prefix-cache chain keys of its full blocks, in order
    cache_key: str = ""  # the weights identity its cached blocks are keyed by (block_manager.py); "": none
    leader: Sequence | None = None  # in its first prefill: the sample of its request that computes its prompt
    num_cached: int = 0  # tokens whose K/V are in the cache
    output: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_top: list[TopLogprobs] = field(default_factory=list)  # one per output token when params.top_logprobs
    prompt_logprobs: list[float] | None = None
    prompt_logprobs_so_far: list[float] = field(default_factory=list)  # of the prompt chunks computed so far
    stop_reason: StopReason = StopReason.UNSPECIFIED
    seed: int | None = None  # sampling seed of this sample (None: greedy); the engine makes its generator
    generator: torch.Generator | None = None
    matcher: Any = None  # a constrained sample's llguidance matcher, made on the engine's side (grammar_masks.py)
    emitted_tokens: int = 0  # tokens already sent to the client
    # Tokens by where their K/V came from, summed over its admissions (a preempted one's recompute included)
    tokens_cached: int = 0  # found in the prefix cache
    tokens_computed: int = 0  # run through a prefill forward
    tokens_shared: int = 0  # held by reference from another sample of its request

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    def token_slice(self, start: int, end: int) -> list[int]:
        """tokens[start:end] without building the whole prompt + output list (a step asks each sequence for its
        newest token or chunk; copying a long sequence whole for it was O(length) per step)."""
        n = len(self.prompt)
        if end <= n:
            return self.prompt[start:end]
        if start >= n:
            return self.output[start - n : end - n]
        return self.prompt[start:] + self.output[: end - n]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.output)

    @property
    def scores_only(self) -> bool:
        """A ComputeLogprobs input (Engine.score): its prompt logprobs are the answer; it samples nothing."""
        return self.params.max_tokens == 0

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

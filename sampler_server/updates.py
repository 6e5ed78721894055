"""What a step hands back for one sample (`SequenceUpdate`): its new token ids and logprobs, and whether and why
it ended; `append_token` adds a sampled token to its sequence, checks its stops and makes that update."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from opentinker.sampler_server.sequence import Sequence, StopReason, TopLogprobs

NON_FINITE_OUTPUT = "NON_FINITE_OUTPUT"  # SequenceUpdate.error_reason: the request's adapter, not the engine, failed
NON_FINITE_MESSAGE = "the adapter made the model's logits non-finite (inf or NaN)"


@dataclass(frozen=True, slots=True)
class SequenceUpdate:
    """What one sample gained in one step: plain values, so that it can cross a process boundary."""

    request_id: str
    sample_index: int
    tokens: list[int]
    logprobs: list[float]
    finished: bool
    stop_reason: StopReason = StopReason.UNSPECIFIED  # set when finished
    prompt_logprobs: list[float] | None = None  # on a sample's first update, when they were asked for
    error: str = ""  # set when the engine failed this sequence (the request ends with an error status)
    error_reason: str = ""  # NON_FINITE_OUTPUT: the request's adapter made its logits non-finite; "": the engine
    prompt_sources: tuple[int, int, int] = (0, 0, 0)  # the sample's tokens cached, computed, shared so far
    top_logprobs: list[TopLogprobs] = field(default_factory=list)  # one per token, when its params ask for them


UpdateCallback = Callable[[SequenceUpdate], None]


def append_token(
    seq: Sequence,
    token: int,
    logprob: float,
    top: TopLogprobs | None,
    eos_token_ids: set[int],
    max_len: int,
    grammar_ended: bool = False,
) -> SequenceUpdate:
    """Appends one sampled token to seq, ends it on a stop token, its max_tokens or the context (stop checks on
    token ids only: stop strings are the server's, detokenizer.py) or where its grammar ended (grammar_masks.py)
    -> the tokens it has not emitted yet."""
    seq.output.append(token)
    seq.output_logprobs.append(logprob)
    if top is not None:
        seq.output_top.append(top)
    params = seq.params
    if token in params.stop_token_ids or token in eos_token_ids or grammar_ended:
        seq.stop_reason = StopReason.STOP_TOKEN
    elif len(seq.output) >= params.max_tokens:
        seq.stop_reason = StopReason.LENGTH
    elif seq.num_tokens >= max_len:
        seq.stop_reason = StopReason.CONTEXT_LENGTH
    first = seq.emitted_tokens == 0
    new_tokens = seq.output[seq.emitted_tokens :]
    new_logprobs = seq.output_logprobs[seq.emitted_tokens :]
    new_top = seq.output_top[seq.emitted_tokens :] if seq.output_top else []
    seq.emitted_tokens = len(seq.output)
    return SequenceUpdate(
        seq.request_id,
        seq.sample_index,
        new_tokens,
        new_logprobs,
        seq.stop_reason is not StopReason.UNSPECIFIED,
        seq.stop_reason,
        seq.prompt_logprobs if first else None,
        prompt_sources=(seq.tokens_cached, seq.tokens_computed, seq.tokens_shared),
        top_logprobs=new_top,
    )


def failed_update(seq: Sequence, error: str, reason: str = "") -> SequenceUpdate:
    """The last update of a sample the engine failed (`reason`: NON_FINITE_OUTPUT, or "" for the engine's own)."""
    return SequenceUpdate(seq.request_id, seq.sample_index, [], [], finished=True, error=error, error_reason=reason)

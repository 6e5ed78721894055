"""Prompt scoring: a ComputeLogprobs input as a sequence that samples nothing, and the prompt logprobs every
sequence that asks for them (a score, or a Sample with prompt_logprobs) gathers chunk by chunk.

A score computes its whole input and samples nothing (max_tokens 0), so it takes its tenant's fair share of the
batch, goes through chunked prefill with everyone else's prompts and leaves its blocks in the prefix cache for
the next turn, instead of one unbounded forward inline on the engine thread between two steps. A prompt
prefilled in chunks gives the same logprobs as in one piece: each chunk attends to the K/V its earlier chunks
wrote, and its logprobs are appended to `prompt_logprobs_so_far`.
"""

from __future__ import annotations

import concurrent.futures

import torch

from opentinker.sampler_server.sequence import SCORE_PARAMS, Sequence, StopReason
from opentinker.sampler_server.updates import SequenceUpdate, UpdateCallback


def score_sequence(request_id: str, tokens: list[int], lora_slot: int, cache_key: str, tenant: str) -> Sequence:
    """The sequence that scores `tokens` under the slot's version: its prompt logprobs are the answer."""
    return Sequence(
        seq_id=-1,
        request_id=request_id,
        sample_index=0,
        prompt=list(tokens),
        params=SCORE_PARAMS,
        lora_slot=lora_slot,
        tenant=tenant,
        want_prompt_logprobs=True,
        cache_key=cache_key,
    )


def score_callback(future: concurrent.futures.Future[list[float]]) -> UpdateCallback:
    """Settles a score's future with its one update's prompt logprobs, or the engine's error."""

    def on_update(update: SequenceUpdate) -> None:  # engine thread
        if update.error:
            settle_score(future, RuntimeError(update.error))
        elif update.finished:
            settle_score(future, update.prompt_logprobs or [])

    return on_update


def settle_score(future: concurrent.futures.Future[list[float]], outcome: list[float] | Exception) -> None:
    """Completes a score's future unless its caller cancelled it meanwhile."""
    try:
        if isinstance(outcome, Exception):
            future.set_exception(outcome)
        else:
            future.set_result(outcome)
    except concurrent.futures.InvalidStateError:
        pass  # cancelled: nobody waits for it (the cancel aborted the score)


def score_update(seq: Sequence) -> SequenceUpdate:
    """A score's input is computed: its one update, its prompt logprobs (the answer), and it ends."""
    seq.stop_reason = StopReason.LENGTH
    sources = (seq.tokens_cached, seq.tokens_computed, seq.tokens_shared)
    return SequenceUpdate(
        seq.request_id, seq.sample_index, [], [], True, seq.stop_reason, seq.prompt_logprobs, prompt_sources=sources
    )


def wants_prompt_logprobs(seq: Sequence) -> bool:
    """Prompt logprobs are computed in a sequence's first prefill only (not when it recomputes after preemption,
    unless it was preempted before its last prompt chunk)."""
    return seq.want_prompt_logprobs and seq.prompt_logprobs is None


def gather_prompt_logprobs(seq: Sequence, chunk: int, logits: torch.Tensor) -> None:
    """logits: [chunk, V], the rows of seq's prompt chunk from num_cached on -> the logprob of each prompt token
    they predict (position p predicts token p+1) appended to what the earlier chunks gathered; whole, in
    `prompt_logprobs`, once the last chunk is in."""
    begin = seq.num_cached  # 0 at a first (or, after a preemption, again first) chunk
    count = min(begin + chunk, len(seq.prompt) - 1) - begin  # positions predicting a prompt token
    targets = torch.tensor(seq.prompt[begin + 1 : begin + 1 + count], dtype=torch.long, device=logits.device)
    picked = logits[:count].log_softmax(-1).gather(1, targets[:, None]).squeeze(1)  # [count]
    so_far = [] if begin == 0 else seq.prompt_logprobs_so_far
    seq.prompt_logprobs_so_far = [*so_far, *picked.tolist()]
    if begin + chunk == seq.num_tokens:
        seq.prompt_logprobs, seq.prompt_logprobs_so_far = seq.prompt_logprobs_so_far, []

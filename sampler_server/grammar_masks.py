"""Each step's token masks for the constrained samples of the batch (constraint.py's matchers), computed while the
step's forward pass runs, and applied to their logit rows before sampling.

    step t:  masks.start(sampling) --thread--> bitmask [R, ceil(V/32)] int32 from each matcher -> allowed [R, V]
             model.forward(...)                (meanwhile; llguidance drops the GIL, torch does too)
             sample(last, sampling, masks.result())   -> constrained rows' disallowed logits at -inf
             consume(sampling, tokens)                 -> each matcher advances by its sampled token

A matcher's mask for step t depends only on the tokens sampled up to step t-1, so it can be computed as soon as
step t-1 ended. Free rows are not touched: their logits, draws and logprobs are those of a batch without
constrained neighbours, bit for bit.
"""

from __future__ import annotations

import concurrent.futures
from dataclasses import dataclass

import torch

from opentinker.sampler_server.sequence import Sequence


@dataclass(frozen=True, slots=True)
class StepMasks:
    rows: list[int]  # the constrained rows of the step's sampling batch
    allowed: torch.Tensor  # [R, V] bool on the CPU: which tokens each of them may sample


class MaskWorker:
    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self._thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="sampler-grammar-masks")
        self._bits = torch.arange(32, dtype=torch.int32)

    def start(self, sampling: list[Sequence]) -> concurrent.futures.Future[StepMasks] | None:
        """The masks of the rows of `sampling` that are constrained, computing on the mask thread; None if none."""
        rows = [row for row, seq in enumerate(sampling) if seq.matcher is not None]
        if not rows:
            return None
        return self._thread.submit(self._compute, rows, [sampling[row].matcher for row in rows])

    def _compute(self, rows: list[int], matchers: list[object]) -> StepMasks:
        words = (self.vocab_size + 31) // 32
        bitmask = torch.zeros(len(rows), words, dtype=torch.int32)  # [R, W]: bit j of word w allows token 32w + j
        for i, matcher in enumerate(matchers):
            matcher.unsafe_compute_mask_ptr(bitmask[i].data_ptr(), words * 4)  # type: ignore[attr-defined]
        allowed = ((bitmask[:, :, None] >> self._bits) & 1).flatten(1)[:, : self.vocab_size].bool()  # [R, V]
        return StepMasks(rows, allowed)

    def stop(self) -> None:
        self._thread.shutdown(wait=False, cancel_futures=True)


def apply_masks(logits: torch.Tensor, masks: StepMasks | None) -> torch.Tensor:
    """logits: [B, V] -> the same with each constrained row's disallowed tokens at -inf (a copy; free rows equal)."""
    if masks is None:
        return logits
    index = torch.tensor(masks.rows, dtype=torch.long, device=logits.device)
    allowed = masks.allowed.to(logits.device, non_blocking=True)
    vocab = logits.shape[-1]
    if allowed.shape[-1] < vocab:  # a model vocabulary padded past the tokenizer's: the padding is never allowed
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[-1]), value=False)
    out = logits.clone()
    out[index] = logits.index_select(0, index).masked_fill(~allowed, float("-inf"))
    return out


def consume(seq: Sequence, token: int) -> tuple[bool, bool]:
    """Advances a constrained sample's matcher by its sampled token -> (accepted, the grammar has ended). A matcher
    already in error (a parser limit reached while its mask was computed: llguidance then allows only the end of
    sequence, which it would accept) accepts nothing, so the sample fails instead of ending as if complete."""
    matcher = seq.matcher
    if matcher is None:
        return True, False
    if matcher.is_error() or not matcher.consume_token(token):
        return False, True
    return True, bool(matcher.is_stopped())


def failure(seq: Sequence, token: int) -> tuple[str, str]:
    """Why `consume` refused: (message, reason). A parser limit reached mid-sample (llguidance's "too complex"
    stops: the lexer's fuel or states per step) is the request's constraint asking more than the sampler's bounds,
    GRAMMAR_LIMIT; a token the mask allowed but the grammar refused is a library fault, GRAMMAR_REFUSED."""
    matcher = seq.matcher
    error = matcher.get_error() if matcher is not None and matcher.is_error() else ""
    first = error.splitlines()[0][:500] if error else ""
    if first and "satisfy the grammar" not in first:
        return f"the constraint's grammar hit a parser limit after {len(seq.output)} tokens: {first}", GRAMMAR_LIMIT
    return f"the constraint's grammar refused token {token} ({first or 'no reason given'})", GRAMMAR_REFUSED


GRAMMAR_LIMIT = "GRAMMAR_LIMIT"
GRAMMAR_REFUSED = "GRAMMAR_REFUSED"

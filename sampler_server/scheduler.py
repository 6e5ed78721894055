"""Continuous batching: sequences join between steps, leave when finished.

Each step is either a prefill of newly admitted sequences (prompts, within a token budget) or one decode
token for every running sequence. Prefill goes first so new requests start quickly (nano-vllm's policy), but
never twice in a row while sequences are decoding: a steady stream of new requests (one tenant's flood of short
or failing requests) would otherwise starve every running generation of every tenant. So running sequences wait
for at most one prefill between two of their tokens.
A sequence owns one KV-cache slot from admission to finish. The samples of one request share their prompt
(the engine computes it once), so only a request's first sample in a prefill counts against its token budget.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass

from opentinker.sampler_server.sequence import Sequence, Status


@dataclass(frozen=True, slots=True)
class ScheduledBatch:
    sequences: list[Sequence]
    is_prefill: bool


class Scheduler:
    def __init__(self, *, max_seqs: int, max_batch_tokens: int) -> None:
        self.max_seqs = max_seqs
        self.max_batch_tokens = max_batch_tokens
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.running: list[Sequence] = []
        self.free_kv_slots = list(range(max_seqs - 1, -1, -1))
        self._prefilled_last = False  # the previous step was a prefill

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch | None:
        admitted: list[Sequence] = []
        requests: set[str] = set()
        budget = self.max_batch_tokens
        decode_due = self._prefilled_last and bool(self.running)
        while self.waiting and self.free_kv_slots and not decode_due:
            seq = self.waiting[0]
            cost = 0 if seq.request_id in requests else len(seq.prompt)
            if admitted and cost > budget:
                break  # the next prefill gets it; a single prompt may exceed the budget on its own
            self.waiting.popleft()
            seq.kv_slot = self.free_kv_slots.pop()
            seq.status = Status.RUNNING
            admitted.append(seq)
            requests.add(seq.request_id)
            budget -= cost
        self._prefilled_last = bool(admitted)
        if admitted:
            self.running.extend(admitted)
            return ScheduledBatch(admitted, is_prefill=True)
        if self.running:
            return ScheduledBatch(list(self.running), is_prefill=False)
        return None

    def finish(self, seq: Sequence) -> None:
        """Removes a finished or aborted sequence and frees its KV slot."""
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
            self.free_kv_slots.append(seq.kv_slot)
        elif seq.status is Status.WAITING:
            self.waiting.remove(seq)
        seq.status = Status.FINISHED
        seq.kv_slot = -1

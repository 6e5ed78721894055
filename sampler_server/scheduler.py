"""Continuous batching: sequences join between steps, leave when finished.

Each step is either a prefill of newly admitted sequences (prompts, within a token budget) or one decode
token for every running sequence. Prefill goes first so new requests start quickly (nano-vllm's policy), but
never twice in a row while sequences are decoding: a steady stream of new requests (one tenant's flood of short
or failing requests) would otherwise starve every running generation of every tenant. So running sequences wait
for at most one prefill between two of their tokens.
A sequence owns one KV-cache slot from admission to finish. The samples of one request share their prompt
(the engine computes it once), so only a request's first sample in a prefill counts against its token budget.

The batch is shared fairly between tenants: each tenant's waiting requests form a FIFO queue of their own, and a
free KV slot goes to the head request of the waiting tenant that holds the fewest slots (ties: the one admitted
least recently, i.e. round-robin). One turn admits the head request's samples together, as many as there are
free slots; the rest of them go first at that tenant's next turn. A tenant never holds more than
`max_seqs_per_tenant` slots at once, so one tenant's flood of long requests leaves room for the others: another
tenant's request finds a free slot at once or at the next sequence that finishes.
"""

from __future__ import annotations

import collections
import itertools
from dataclasses import dataclass

from opentinker.sampler_server.sequence import Sequence, Status


@dataclass(frozen=True, slots=True)
class ScheduledBatch:
    sequences: list[Sequence]
    is_prefill: bool


def default_tenant_slots(max_seqs: int) -> int:
    """--max-seqs-per-tenant's default: 3/4 of the batch (at least 1), so a quarter is always left to others."""
    return max(1, max_seqs * 3 // 4)


class Scheduler:
    def __init__(self, *, max_seqs: int, max_batch_tokens: int, max_seqs_per_tenant: int = 0) -> None:
        """max_seqs_per_tenant: the KV slots one tenant may hold at once (0: no limit, every slot)."""
        self.max_seqs = max_seqs
        self.max_batch_tokens = max_batch_tokens
        self.max_seqs_per_tenant = min(max_seqs_per_tenant or max_seqs, max_seqs)
        self._queues: dict[str, collections.deque[Sequence]] = {}  # tenants with waiting sequences, FIFO each
        self.running: list[Sequence] = []
        self.held: collections.Counter[str] = collections.Counter()  # KV slots each tenant holds
        self.num_waiting = 0
        self.free_kv_slots = list(range(max_seqs - 1, -1, -1))
        self._prefilled_last = False  # the previous step was a prefill
        self._turns = itertools.count(1)
        self._last_turn: dict[str, int] = {}  # tenant -> its latest admission; kept while it has sequences

    @property
    def waiting(self) -> list[Sequence]:
        """Every waiting sequence (tenant by tenant, each in arrival order)."""
        return [seq for queue in self._queues.values() for seq in queue]

    def waiting_of(self, tenant: str) -> int:
        queue = self._queues.get(tenant)
        return 0 if queue is None else len(queue)

    def add(self, seq: Sequence) -> None:
        queue = self._queues.get(seq.tenant)
        if queue is None:
            queue = self._queues[seq.tenant] = collections.deque()
        queue.append(seq)
        self.num_waiting += 1

    def has_work(self) -> bool:
        return bool(self.num_waiting or self.running)

    def schedule(self) -> ScheduledBatch | None:
        admitted: list[Sequence] = []
        decode_due = self._prefilled_last and bool(self.running)
        if not decode_due:
            self._admit(admitted)
        self._prefilled_last = bool(admitted)
        if admitted:
            self.running.extend(admitted)
            return ScheduledBatch(admitted, is_prefill=True)
        if self.running:
            return ScheduledBatch(list(self.running), is_prefill=False)
        return None

    def _admit(self, admitted: list[Sequence]) -> None:
        """Fills free slots turn by turn; a tenant is out of this prefill once it cannot take its next sequence
        (its slot cap, or a prompt beyond the token budget left: it goes first in the next prefill)."""
        requests: set[str] = set()
        budget = self.max_batch_tokens
        done: set[str] = set()
        while self.free_kv_slots:
            tenant = self._next_tenant(done)
            if tenant is None:
                return
            queue = self._queues[tenant]
            head = queue[0].request_id
            taken = 0
            while queue and queue[0].request_id == head and self.free_kv_slots:
                if self.held[tenant] >= self.max_seqs_per_tenant:
                    break
                seq = queue[0]
                cost = 0 if seq.request_id in requests else len(seq.prompt)
                if admitted and cost > budget:
                    break  # a single prompt may exceed the budget on its own, in a prefill of its own
                queue.popleft()
                self.num_waiting -= 1
                seq.kv_slot = self.free_kv_slots.pop()
                seq.status = Status.RUNNING
                self.held[tenant] += 1
                admitted.append(seq)
                requests.add(seq.request_id)
                budget -= cost
                taken += 1
            if taken:
                self._last_turn[tenant] = next(self._turns)
            else:
                done.add(tenant)
            if not queue:
                del self._queues[tenant]

    def _next_tenant(self, done: set[str]) -> str | None:
        """The waiting tenant whose turn it is: of those that may still take a slot, the one holding the fewest
        slots, then the one admitted least recently (then the one that started waiting first)."""
        candidates = [t for t in self._queues if t not in done]
        if not candidates:
            return None
        return min(candidates, key=lambda t: (self.held[t], self._last_turn.get(t, 0)))

    def finish(self, seq: Sequence) -> None:
        """Removes a finished or aborted sequence and frees its KV slot."""
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
            self.free_kv_slots.append(seq.kv_slot)
            self.held[seq.tenant] -= 1
            if not self.held[seq.tenant]:
                del self.held[seq.tenant]
        elif seq.status is Status.WAITING:
            queue = self._queues.get(seq.tenant)
            if queue is not None and seq in queue:
                queue.remove(seq)
                self.num_waiting -= 1
                if not queue:
                    del self._queues[seq.tenant]
        if seq.tenant not in self.held and seq.tenant not in self._queues:
            self._last_turn.pop(seq.tenant, None)  # gone from the batch: nothing to remember
        seq.status = Status.FINISHED
        seq.kv_slot = -1

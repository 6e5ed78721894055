"""Continuous batching: sequences join between steps, leave when finished.

Each step is either a prefill of newly admitted sequences (prompts, within a token budget) or one decode
token for every running sequence. Prefill goes first so new requests start quickly (nano-vllm's policy), but
never twice in a row while sequences are decoding: a steady stream of new requests (one tenant's flood of short
or failing requests) would otherwise starve every running generation of every tenant. So running sequences wait
for at most one prefill between two of their tokens.
A running sequence holds one of `max_seqs` seats in the batch and the KV-cache blocks of its tokens
(block_manager.py): a sequence is admitted when its blocks are free, and a decode step gives each sequence the
block its next token starts. When the blocks run out, the newest running sequence is preempted: its blocks are
freed and it goes back to the head of its tenant's queue, to recompute its prompt and output so far when it is
admitted again (its generator is untouched, so it goes on drawing the tokens it would have drawn). The samples of
one request admitted in one prefill share their prompt: the first computes it, the others hold its blocks by
reference (`leader`), so only the first counts against the prefill's token budget.

The batch is shared fairly between tenants: each tenant's waiting requests form a FIFO queue of their own, and a
free seat goes to the head request of the waiting tenant that holds the fewest seats (ties: the one admitted
least recently, i.e. round-robin). One turn admits the head request's samples together, as many as there are
free seats; the rest of them go first at that tenant's next turn. A tenant never holds more than
`max_seqs_per_tenant` seats at once, so one tenant's flood of long requests leaves room for the others: another
tenant's request finds a free seat at once or at the next sequence that finishes.
"""

from __future__ import annotations

import collections
import itertools
from dataclasses import dataclass

from opentinker.sampler_server.block_manager import BlockManager
from opentinker.sampler_server.sequence import Sequence, Status


@dataclass(frozen=True, slots=True)
class ScheduledBatch:
    sequences: list[Sequence]
    is_prefill: bool


def default_tenant_slots(max_seqs: int) -> int:
    """--max-seqs-per-tenant's default: 3/4 of the batch (at least 1), so a quarter is always left to others."""
    return max(1, max_seqs * 3 // 4)


class Scheduler:
    def __init__(
        self,
        *,
        max_seqs: int,
        max_batch_tokens: int,
        max_seqs_per_tenant: int = 0,
        blocks: BlockManager | None = None,
    ) -> None:
        """max_seqs_per_tenant: the seats one tenant may hold at once (0: no limit, every seat). blocks: the KV
        cache's books (the engine hands its own in with `use_blocks`); None: seats are the only limit."""
        self.max_seqs = max_seqs
        self.max_batch_tokens = max_batch_tokens
        self.max_seqs_per_tenant = min(max_seqs_per_tenant or max_seqs, max_seqs)
        self._queues: dict[str, collections.deque[Sequence]] = {}  # tenants with waiting sequences, FIFO each
        self.running: list[Sequence] = []
        self.held: collections.Counter[str] = collections.Counter()  # seats each tenant holds
        self.num_waiting = 0
        self.free_kv_slots = list(range(max_seqs - 1, -1, -1))  # free seats in the batch
        self.blocks = blocks
        self.preemptions = 0
        self.prompt_tokens_cached = 0  # tokens admitted sequences found in the prefix cache
        self._prefilled_last = False  # the previous step was a prefill
        self._turns = itertools.count(1)
        self._last_turn: dict[str, int] = {}  # tenant -> its latest admission; kept while it has sequences

    def use_blocks(self, blocks: BlockManager) -> None:
        self.blocks = blocks

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
        decoding = self._grow_running() if self.running else []
        return ScheduledBatch(decoding, is_prefill=False) if decoding else None  # none: the next step admits

    def _grow_running(self) -> list[Sequence]:
        """Every running sequence gets the block its next token needs, oldest first; when none is free the
        newest running sequence is preempted (nano-vllm's policy: the one that has cost the least so far)."""
        if self.blocks is None:
            return list(self.running)
        blocks, queue, decoding = self.blocks, list(self.running), []
        while queue:
            seq = queue.pop(0)
            while not blocks.can_grow(seq):
                if queue:
                    self.preempt(queue.pop())
                else:
                    self.preempt(seq)
                    break
            else:
                blocks.grow(seq)
                decoding.append(seq)
        return decoding

    def preempt(self, seq: Sequence) -> None:
        """Frees a running sequence's seat and blocks and puts it back at the head of its tenant's queue."""
        self.running.remove(seq)
        self._leave_seat(seq)
        seq.status = Status.WAITING
        queue = self._queues.get(seq.tenant)
        if queue is None:
            queue = self._queues[seq.tenant] = collections.deque()
        queue.appendleft(seq)
        self.num_waiting += 1
        self.preemptions += 1

    def _admit(self, admitted: list[Sequence]) -> None:
        """Fills free seats turn by turn; a tenant is out of this prefill once it cannot take its next sequence
        (its seat cap, or a prompt beyond the token budget left: it goes first in the next prefill). The prefill
        ends when the next sequence's blocks are not free: nobody jumps it (it would starve behind short ones)."""
        leaders: dict[str, Sequence] = {}  # request -> its sample computing the prompt in this prefill
        budget = self.max_batch_tokens
        done: set[str] = set()
        out_of_blocks = False
        while self.free_kv_slots and not out_of_blocks:
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
                leader = leaders.get(seq.request_id)
                if leader is not None and not _same_prompt(leader, seq):
                    leader = None
                cost = 0 if leader is not None else seq.num_tokens - seq.num_cached
                if admitted and cost > budget:
                    break  # a single prompt may exceed the budget on its own, in a prefill of its own
                if leader is not None:
                    seq.leader = leader
                    if self.blocks is not None:
                        self.blocks.fork(leader, seq)
                elif self.blocks is not None:
                    # Prompt logprobs need every prompt position's logits: such a first prefill reuses nothing.
                    first_logprobs = seq.want_prompt_logprobs and seq.prompt_logprobs is None
                    cached = self.blocks.admit(seq, reuse=not first_logprobs)
                    if cached < 0:
                        out_of_blocks = True
                        break
                    self.prompt_tokens_cached += cached
                    cost -= cached
                queue.popleft()
                self.num_waiting -= 1
                seq.kv_slot = self.free_kv_slots.pop()
                seq.status = Status.RUNNING
                self.held[tenant] += 1
                admitted.append(seq)
                if leader is None and not seq.output:
                    leaders.setdefault(seq.request_id, seq)
                budget -= cost
                taken += 1
            if taken:
                self._last_turn[tenant] = next(self._turns)
            elif not out_of_blocks:
                done.add(tenant)
            if not queue:
                del self._queues[tenant]

    def _next_tenant(self, done: set[str]) -> str | None:
        """The waiting tenant whose turn it is: of those that may still take a seat, the one holding the fewest
        seats, then the one admitted least recently (then the one that started waiting first)."""
        candidates = [t for t in self._queues if t not in done]
        if not candidates:
            return None
        return min(candidates, key=lambda t: (self.held[t], self._last_turn.get(t, 0)))

    def finish(self, seq: Sequence) -> None:
        """Removes a finished or aborted sequence and frees its seat and blocks."""
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
            self._leave_seat(seq)
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

    def _leave_seat(self, seq: Sequence) -> None:
        self.free_kv_slots.append(seq.kv_slot)
        seq.kv_slot = -1
        self.held[seq.tenant] -= 1
        if not self.held[seq.tenant]:
            del self.held[seq.tenant]
        if self.blocks is not None:
            self.blocks.release(seq)


def _same_prompt(leader: Sequence, seq: Sequence) -> bool:
    """Whether seq may hold leader's prompt blocks: another sample of one request (same prompt, weights and
    prompt-logprobs wish, nothing generated yet), which the n samples of a Sample call always are."""
    return (not seq.output and seq.prompt == leader.prompt and seq.lora_slot == leader.lora_slot
            and seq.cache_key == leader.cache_key
            and seq.want_prompt_logprobs == leader.want_prompt_logprobs)  # fmt: skip

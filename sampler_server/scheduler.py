"""Continuous batching: sequences join between steps, leave when finished.

A step gives each of its sequences a number of tokens to compute (`ScheduledBatch.chunks`): 1 for a decode (the
token sampled last step), a run of prompt tokens for a prefill, 0 for a sample that takes its leader's logits
row. A sequence samples in the step that computes its last token; one whose prompt is only partly computed
samples nothing that step and its `num_cached` advances by its chunk. Two ways to fill a step:

- Chunked (`prefill_chunk_tokens` > 0, the server's default): every step holds the decode token of every
  running sequence whose prompt is computed, and then prompt tokens up to `prefill_chunk_tokens` (and up to
  `max_batch_tokens` in all), shared out between the tenants that want prompt tokens: evenly, what one cannot use
  going to the others, and at most `mixed_prefill_tokens` to a tenant while another tenant's sequences decode in
  the step (the step's time is what every one of their tokens waits). Within a tenant's share, first the next
  chunks of its partly computed prompts (oldest first), then its new sequences, the last possibly with only a
  first chunk. A long prompt enters over several steps and running streams keep their pace: none waits for more
  than one step between two of its tokens, whatever arrives (a "mixed" step), and one tenant's long prompts do
  not keep another tenant's new request out until they are done. A step with no decode due is a plain prefill.
- Whole prompts (`prefill_chunk_tokens` 0): a step is either a prefill of newly admitted sequences (whole
  prompts within `max_batch_tokens`; a single prompt may exceed it, in a prefill of its own) or one decode token
  for every running sequence. Prefill goes first so new requests start quickly (nano-vllm's policy), but never
  twice in a row while sequences are decoding: a steady stream of new requests (one tenant's flood of short or
  failing requests) would otherwise starve every running generation of every tenant. So running sequences wait
  for at most one prefill between two of their tokens.

A running sequence holds one of `max_seqs` seats in the batch and the KV-cache blocks of its tokens
(block_manager.py): a sequence is admitted when the blocks of all its tokens are free (a chunked prompt takes
them all at admission, so it never runs out halfway), and a decode step gives each sequence the block its next
token starts. The samples of one request admitted together share their prompt: the first computes it (chunk by
chunk), the others hold its blocks by reference (`leader`) and wait, out of the steps, until the step that
computes its last prompt token, where they take its logits row; only the first counts against the token budget.

The batch is shared fairly between tenants: each tenant's waiting requests form a FIFO queue of their own, and a
free seat goes to the head request of the waiting tenant that holds the fewest seats (ties: the one admitted
least recently, i.e. round-robin). One turn admits the head request's samples together, as many as there are
free seats; the rest of them go first at that tenant's next turn. A tenant never holds more than
`max_seqs_per_tenant` seats at once, so one tenant's flood of long requests leaves room for the others: another
tenant's request finds a free seat at once or at the next sequence that finishes.

Seats bound sequences, not memory: a tenant also holds at most `max_blocks_per_tenant` KV blocks (0: no bound;
never less than one max_len sequence's), counted as the distinct blocks its sequences reference; a block shared
by several tenants (a prefix cached on purpose for all, --share-base-prefix-cache) counts against every one of
them. Admission and growth respect it: a tenant at its bound is out of the admission turn (the others go on),
and a sequence whose growth would pass it preempts the newest sequence of its own tenant (itself, last). When
the pool itself runs out, the victim is the newest running sequence of the tenant holding the most blocks over
its fair share (the pool / the tenants running or waiting); when none holds more than its share, the newest of
the growing sequence's own tenant. So a tenant within its share is never preempted for another's growth, and
with a single tenant this is nano-vllm's newest-first (the one that has cost the least so far). A preempted
sequence frees its seat and blocks and goes back to the head of its tenant's queue, to recompute its prompt
and output so far when it is admitted again (its generator is untouched, so it goes on drawing the tokens it
would have drawn); a leader preempted before its prompt is computed takes its waiting samples with it.
"""

from __future__ import annotations

import collections
import itertools
from dataclasses import dataclass

from opentinker.sampler_server.block_manager import NO_BLOCKS, TENANT_FULL, BlockManager
from opentinker.sampler_server.sequence import Sequence, Status


@dataclass(frozen=True, slots=True)
class ScheduledBatch:
    sequences: list[Sequence]
    is_prefill: bool  # some sequence computes prompt tokens (whole-prompt mode: the step is a prefill, no decodes)
    chunks: list[int]  # [B] tokens each computes from its num_cached on: 1 decode, n a prompt chunk, 0 a follower
    prefill_tokens: int = 0  # tokens of the chunks that are not decodes


class Scheduler:
    def __init__(
        self,
        *,
        max_seqs: int,
        max_batch_tokens: int,
        max_seqs_per_tenant: int = 0,
        blocks: BlockManager | None = None,
        prefill_chunk_tokens: int = 0,
        max_blocks_per_tenant: int = 0,
        mixed_prefill_tokens: int = 0,
    ) -> None:
        """max_seqs_per_tenant: the seats one tenant may hold at once (0: no limit, every seat). blocks: the KV
        cache's books (the engine hands its own in with `use_blocks`); None: seats are the only limit.
        prefill_chunk_tokens: prompt tokens per step in chunked mode (0: whole prompts, a step prefills or
        decodes). max_blocks_per_tenant: the KV blocks one tenant may hold (0: no bound). mixed_prefill_tokens: the
        prompt tokens a tenant computes in a chunked step where another tenant's sequences decode (0: no bound
        but the step's)."""
        self.max_seqs = max_seqs
        self.max_batch_tokens = max_batch_tokens
        self.max_seqs_per_tenant = min(max_seqs_per_tenant or max_seqs, max_seqs)
        self.prefill_chunk_tokens = prefill_chunk_tokens
        self.max_blocks_per_tenant = max_blocks_per_tenant
        self.mixed_prefill_tokens = mixed_prefill_tokens
        self.tenant_blocks = 0  # the bound in force (use_blocks); 0: none
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

    def use_blocks(self, blocks: BlockManager, *, sequence_blocks: int = 0) -> None:
        """The engine's books; `sequence_blocks`: the blocks of one max_len sequence, the least a tenant's bound
        may be (else such a sequence could never be admitted)."""
        self.blocks = blocks
        bound = self.max_blocks_per_tenant
        self.tenant_blocks = min(max(bound, sequence_blocks), blocks.num_blocks) if bound else 0

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
        return self._schedule_chunked() if self.prefill_chunk_tokens else self._schedule_whole()

    def _schedule_whole(self) -> ScheduledBatch | None:
        """A prefill of whole prompts, or a decode of every running sequence (never two prefills in a row while
        sequences decode)."""
        admitted: list[Sequence] = []
        decode_due = self._prefilled_last and bool(self.running)
        if not decode_due:
            self._admit(admitted, self.max_batch_tokens, whole=True)
        self._prefilled_last = bool(admitted)
        if admitted:
            self.running.extend(admitted)
            chunks = [0 if seq.leader is not None else seq.num_tokens - seq.num_cached for seq in admitted]
            return ScheduledBatch(admitted, is_prefill=True, chunks=chunks, prefill_tokens=sum(chunks))
        decoding = self._grow_running(list(self.running)) if self.running else []
        return ScheduledBatch(decoding, False, [1] * len(decoding)) if decoding else None  # none: the next admits

    def _schedule_chunked(self) -> ScheduledBatch | None:
        """Every due decode, then prompt chunks within prefill_chunk_tokens (and max_batch_tokens in all), shared
        between the tenants that want prompt tokens (`_prompt_allowances`): each tenant's partly computed prompts
        first (oldest first), then new sequences."""
        decoding = self._grow_running([seq for seq in self.running if _decoding(seq)])
        budget = min(self.prefill_chunk_tokens, self.max_batch_tokens - len(decoding))
        work = [(seq, 1) for seq in decoding]
        partial = [seq for seq in self.running if seq.leader is None and not _decoding(seq)]
        allowed = self._prompt_allowances(partial, {seq.tenant for seq in decoding}, budget)
        for seq in partial:
            chunk = min(allowed[seq.tenant], seq.num_tokens - seq.num_cached)
            if chunk > 0:
                work.append((seq, chunk))
                allowed[seq.tenant] -= chunk
                budget -= chunk
        admitted: list[Sequence] = []
        if budget > 0:
            self._admit(admitted, budget, whole=False, allowed=dict(allowed))
        self.running.extend(admitted)
        for seq in admitted:
            if seq.leader is None:  # the last one admitted may get only its first chunk
                chunk = min(budget, allowed[seq.tenant], seq.num_tokens - seq.num_cached)
                work.append((seq, chunk))
                allowed[seq.tenant] -= chunk
                budget -= chunk
        # The waiting samples of each prompt computed to its end this step take its row.
        ending = {id(seq) for seq, chunk in work if seq.num_cached + chunk == seq.num_tokens}
        work += [(seq, 0) for seq in self.running if seq.leader is not None and id(seq.leader) in ending]
        if not work:
            return None
        prefill = sum(chunk for seq, chunk in work if not (chunk == 1 and _decoding(seq)))
        return ScheduledBatch([seq for seq, _ in work], prefill > 0, [chunk for _, chunk in work], prefill)

    def _prompt_allowances(self, partial: list[Sequence], decoders: set[str], budget: int) -> dict[str, int]:
        """The prompt tokens each tenant may compute this step. The budget is shared out evenly between the tenants
        that want prompt tokens (partly computed prompts, waiting sequences), what one of them cannot use going to
        the others, so one tenant's long prompts do not keep another's new request out until they are done. A
        tenant gets at most `mixed_prefill_tokens` while another tenant's sequences decode in the step: on a
        compute-bound device each prompt token costs about what a decode row does, and a 512-token chunk would
        make every one of the other tenant's tokens wait as long as 15 decode steps."""
        demand: collections.Counter[str] = collections.Counter()
        for seq in partial:
            demand[seq.tenant] += seq.num_tokens - seq.num_cached
        for tenant, queue in self._queues.items():
            for seq in queue:  # the head requests are what is admitted; enough of them to want the budget
                if demand[tenant] >= budget:
                    break
                demand[tenant] += seq.num_tokens - seq.num_cached
        mixed = self.mixed_prefill_tokens
        limit = {t: mixed if mixed and decoders - {t} else budget for t in demand}
        allowed = dict.fromkeys(demand, 0)
        wanting = sorted((t for t in demand if demand[t]), key=lambda t: (self.held[t], self._last_turn.get(t, 0)))
        while budget > 0 and wanting:
            share = max(1, budget // len(wanting))
            for tenant in list(wanting):
                give = min(share, budget, demand[tenant] - allowed[tenant], limit[tenant] - allowed[tenant])
                allowed[tenant] += give
                budget -= give
                if allowed[tenant] >= min(demand[tenant], limit[tenant]):
                    wanting.remove(tenant)
                if not budget:
                    break
        return allowed

    def _grow_running(self, sequences: list[Sequence]) -> list[Sequence]:
        """Every sequence given (running, oldest first) gets the block its next token needs; when its tenant's
        bound or the pool is out of blocks, a victim is preempted (`_victim`), possibly the sequence itself."""
        blocks = self.blocks
        if blocks is None:
            return sequences
        for seq in sequences:
            while seq.status is Status.RUNNING and not self._can_grow(seq):
                self.preempt(self._victim(seq))
            if seq.status is Status.RUNNING:
                blocks.grow(seq)
        return [seq for seq in sequences if seq.status is Status.RUNNING]

    def _can_grow(self, seq: Sequence) -> bool:
        assert self.blocks is not None
        return self.blocks.can_grow(seq) and self.blocks.within(seq, self.tenant_blocks)

    def _victim(self, seq: Sequence) -> Sequence:
        """Whom seq's growth preempts: the newest sequence of seq's tenant when it is at its bound; when the pool
        is out, of the tenant most over its fair share (none over: seq's own tenant)."""
        assert self.blocks is not None
        blocks, tenant = self.blocks, seq.tenant
        if blocks.within(seq, self.tenant_blocks):
            share = blocks.num_blocks / len(self.held.keys() | self._queues.keys())
            most = max(self.held, key=lambda t: (blocks.held_by(t) - share, t == tenant))
            if blocks.held_by(most) > share:
                tenant = most
        return next(s for s in reversed(self.running) if s.tenant == tenant)

    def preempt(self, seq: Sequence) -> None:
        """Frees a running sequence's seat and blocks and puts it back at the head of its tenant's queue; its
        samples waiting for its prompt (whose blocks it has not computed) go back with it, behind it."""
        followers = [s for s in self.running if s.leader is seq]
        for victim in [*reversed(followers), seq]:
            victim.leader = None
            self.running.remove(victim)
            self._leave_seat(victim)
            victim.status = Status.WAITING
            queue = self._queues.get(victim.tenant)
            if queue is None:
                queue = self._queues[victim.tenant] = collections.deque()
            queue.appendleft(victim)
            self.num_waiting += 1
            self.preemptions += 1

    def _admit(
        self, admitted: list[Sequence], budget: int, *, whole: bool, allowed: dict[str, int] | None = None
    ) -> None:
        """Fills free seats turn by turn within `budget` prompt tokens (`whole`: prompts must fit it whole;
        else sequences are admitted while some budget is left, the last possibly for a first chunk; `allowed`: and
        while their tenant's allowance of this step's prompt tokens is, each charged what its first chunk computes,
        from both; see `_prompt_allowances`). A tenant is out of
        this prefill once it cannot take its next sequence (its seat cap, its block bound, or a whole prompt
        beyond the budget left: it goes first in the next prefill). Admission ends when the next sequence's
        blocks are not free: nobody jumps it (it would starve behind short ones)."""
        leaders: dict[str, Sequence] = {}  # request -> its sample computing the prompt in this prefill
        done: set[str] = set()
        out_of_blocks = False
        while self.free_kv_slots and not out_of_blocks:
            tenant = self._next_tenant(done)
            if tenant is None:
                break
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
                if cost and (admitted and cost > budget if whole else min(budget, _allowed(allowed, tenant)) <= 0):
                    break  # whole: a single prompt may exceed the budget on its own, in a prefill of its own
                if leader is not None:
                    seq.leader = leader
                    if self.blocks is not None:
                        self.blocks.fork(leader, seq)
                elif self.blocks is not None:
                    # Prompt logprobs need every prompt position's logits: such a first prefill reuses nothing.
                    first_logprobs = seq.want_prompt_logprobs and seq.prompt_logprobs is None
                    cached = self.blocks.admit(seq, reuse=not first_logprobs, limit=self.tenant_blocks)
                    if cached == TENANT_FULL:
                        break  # out of this turn: its tenant holds its share of the blocks
                    if cached == NO_BLOCKS:
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
                if allowed is not None:  # chunked: this step computes what the tenant's allowance holds of it
                    cost = min(cost, allowed[tenant])
                    allowed[tenant] -= cost
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


def _allowed(allowed: dict[str, int] | None, tenant: str) -> int:
    """A tenant's prompt tokens left in this step (None: no allowances, only the step's budget)."""
    return 1 << 30 if allowed is None else allowed.get(tenant, 0)


def _decoding(seq: Sequence) -> bool:
    """Whether seq's next forward is a decode: its last token is one it sampled, nothing else is uncomputed."""
    return seq.leader is None and bool(seq.output) and seq.num_tokens - seq.num_cached == 1


def _same_prompt(leader: Sequence, seq: Sequence) -> bool:
    """Whether seq may hold leader's prompt blocks: another sample of one request (same prompt, weights and
    prompt-logprobs wish, nothing generated yet), which the n samples of a Sample call always are."""
    return (
        not seq.output
        and seq.prompt == leader.prompt
        and seq.lora_slot == leader.lora_slot
        and seq.cache_key == leader.cache_key
        and seq.want_prompt_logprobs == leader.want_prompt_logprobs
    )

"""The paged KV cache's books: which blocks are free, how many sequences reference each, every sequence's block
table (`Sequence.block_table`, the blocks holding its positions in order), and the prefix cache.

A sequence holds `ceil(num_tokens / block_size)` blocks: admission takes the blocks of its prompt (or, after a
preemption, of its prompt and output so far), and a decode step takes one more block whenever the token it
writes starts a new block. Memory is then proportional to the tokens held, not to max_seqs x max_len. The
tensors are `model.kv_cache.KVCache`; this file never touches them: the block copies it decides on are queued
in `copies` for the engine to run before its next forward.

The n samples of one request share their prompt's blocks by reference (`fork`). A block is written only by a
sequence that holds it alone: a sample about to append to a partly filled block others hold too takes a copy
of it first (copy-on-write), so a group of 8 holds one copy of its prompt plus one partial block each.

Prefix cache: every full block is keyed by a hash chain, sha256(parent block's key, the block's token ids), whose
first link is seeded with the sequence's `cache_key`: the exact weights identity (an adapter version's artifact
sha256, or the base model's digest salted with the tenant), never a name or an alias. A new sequence takes the
longest run of its leading blocks found under its own chain by reference and computes only the rest, so a hot
reload, a rollback or a re-created adapter can never meet another version's K/V: different weights, different
chain. A block nobody references stays cached until a fresh block is needed; then the least recently used of
them is evicted. A referenced block is never evicted.

Per tenant (`Sequence.tenant`), the books count the distinct blocks its sequences reference (`held_by`), for the
scheduler's per-tenant bound. A block several tenants reference (a prefix shared on purpose) counts against every
one of them, so riding another tenant's cached prefix never lets a tenant past its bound; within a tenant a
block counts once, however many of its samples hold it.

ComputeLogprobs populates the cache but reuses nothing from it. Its answer is a logprob for EVERY position, and
a position's logits need its hidden state through every layer, which the cache does not hold (it holds K/V
only): a cached prefix would save its K/V projections and nothing else, as every layer's hidden state must be
recomputed anyway. A score is a sequence asking its prompt logprobs and sampling nothing (Engine.score), and
a Sample asking prompt logprobs is the same case: its first prefill reuses nothing (scheduler.py), computes its
whole input into fresh pool blocks and registers its full blocks under the same chain as any Sample's (the
served version's weights identity, the caller's tenant for the base model): the next Sample that extends the
scored text (an RL loop sampling turn t+1 after scoring prompt + completion of turn t) finds them. A block whose
key is already cached keeps the cached copy (register skips it) and the score's copy goes back to the free list;
the score's blocks are released when it ends, so they are idle cached blocks (evictable) and no reference
outlives the call.
"""

from __future__ import annotations

import array
import collections
import hashlib

from opentinker.sampler_server.sequence import Sequence

BLOCK_SIZE = 16  # tokens per block (vLLM's and nano-vllm's default order of size: small waste, short tables)
NO_BLOCKS = -1  # `admit`: the pool has not the blocks free
TENANT_FULL = -2  # `admit`: the sequence's tenant would hold more than its bound


def block_key(parent: bytes, tokens: list[int]) -> bytes:
    """One link of the chain: the key of a full block whose predecessor's key (or the cache key) is `parent`."""
    return hashlib.sha256(parent + array.array("q", tokens).tobytes()).digest()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int = BLOCK_SIZE, *, prefix_cache: bool = True) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need >= 1 block of >= 1 token, got {num_blocks} blocks of {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_cache = prefix_cache
        self.refs = [0] * num_blocks  # sequences whose table holds each block
        self._free: collections.deque[int] = collections.deque(range(num_blocks))  # holding nothing cached
        self.keys: list[bytes | None] = [None] * num_blocks  # the chain key of a cached block
        self.cached: dict[bytes, int] = {}  # chain key -> block
        self._idle: collections.OrderedDict[int, None] = collections.OrderedDict()  # cached, unreferenced; LRU first
        self.evicted = 0
        self.copies: list[tuple[int, int, int]] = []  # (source, destination, rows) the engine copies next
        self._tenant_refs: dict[str, collections.Counter[int]] = {}  # tenant -> its sequences' references per block

    @property
    def num_free(self) -> int:
        """Blocks a sequence may take: never used, or cached and unreferenced (evicted on demand)."""
        return len(self._free) + len(self._idle)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    @property
    def num_cached(self) -> int:
        return len(self.cached)

    def held_by(self, tenant: str) -> int:
        """Distinct blocks the tenant's sequences reference."""
        refs = self._tenant_refs.get(tenant)
        return 0 if refs is None else len(refs)

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def needed(self, seq: Sequence) -> int:
        """Blocks seq must take before its next forward: enough to hold positions 0..num_tokens-1, plus a copy
        of a shared block it is about to write to."""
        return max(0, self.blocks_for(seq.num_tokens) - len(seq.block_table)) + self._shared_target(seq)

    def _shared_target(self, seq: Sequence) -> int:
        """1 when the block seq writes next (its token at num_tokens - 1) is in its table and held by others."""
        index = (seq.num_tokens - 1) // self.block_size
        return int(
            seq.num_cached < seq.num_tokens and index < len(seq.block_table) and self.refs[seq.block_table[index]] > 1
        )

    def can_grow(self, seq: Sequence) -> bool:
        return self.needed(seq) <= self.num_free

    def within(self, seq: Sequence, limit: int) -> bool:
        """Whether seq's tenant stays within `limit` blocks (0: no bound) once seq took what it needs next."""
        return not limit or self.held_by(seq.tenant) + self.needed(seq) <= limit

    def grow(self, seq: Sequence) -> None:
        """Gives seq the blocks its next forward writes to (the caller checked `can_grow`)."""
        if self._shared_target(seq):
            index = (seq.num_tokens - 1) // self.block_size
            shared, own = seq.block_table[index], self._take()
            self._unref(seq.tenant, shared)  # others still hold it
            self._ref(seq.tenant, own)
            seq.block_table[index] = own
            self.copies.append((shared, own, (seq.num_tokens - 1) % self.block_size))
        for _ in range(self.needed(seq)):
            block = self._take()
            self._ref(seq.tenant, block)
            seq.block_table.append(block)

    def admit(self, seq: Sequence, *, reuse: bool = True, limit: int = 0) -> int:
        """Gives a waiting sequence the blocks of all its tokens: its longest cached prefix by reference (when
        `reuse`), fresh blocks for the rest. Returns the tokens found cached, or (taking nothing) NO_BLOCKS when
        the blocks are not free, TENANT_FULL when its tenant would hold more than `limit` blocks (0: no bound)."""
        cached = self._match(seq) if reuse else 0
        if not self.can_grow(seq) or not self.within(seq, limit):
            full = self.can_grow(seq)
            self.release(seq)
            return TENANT_FULL if full else NO_BLOCKS
        self.grow(seq)
        seq.tokens_cached += cached  # the sequence's own books, for its tenant's GetStats
        seq.tokens_computed += seq.num_tokens - cached
        return cached

    def fork(self, leader: Sequence, seq: Sequence) -> None:
        """seq (another sample of leader's request, same prompt and weights) holds leader's blocks too."""
        for block in leader.block_table:
            self._ref(seq.tenant, block)
        seq.block_table = list(leader.block_table)
        seq.block_keys = list(leader.block_keys)
        seq.num_cached = leader.num_cached
        seq.tokens_shared += len(seq.prompt)

    def take_copies(self) -> list[tuple[int, int, int]]:
        copies, self.copies = self.copies, []
        return copies

    def _match(self, seq: Sequence) -> int:
        """Takes the cached blocks of seq's leading full blocks, at most up to its last token: that one is
        always computed, for its logits."""
        if not (self.prefix_cache and seq.cache_key):
            return 0
        tokens, size, parent = seq.tokens, self.block_size, seq.cache_key.encode()
        for i in range((len(tokens) - 1) // size):
            key = block_key(parent, tokens[i * size : (i + 1) * size])
            block = self.cached.get(key)
            if block is None:
                break
            if self.refs[block] == 0:
                del self._idle[block]
            self._ref(seq.tenant, block)
            seq.block_table.append(block)
            seq.block_keys.append(key)
            parent = key
        seq.num_cached = len(seq.block_table) * size
        return seq.num_cached

    def register(self, seq: Sequence) -> None:
        """Caches seq's blocks that its last forward filled (their K/V are now in the cache)."""
        if not (self.prefix_cache and seq.cache_key):
            return
        size = self.block_size
        parent = seq.block_keys[-1] if seq.block_keys else seq.cache_key.encode()
        for i in range(len(seq.block_keys), seq.num_cached // size):  # most steps fill no block: no work
            key = block_key(parent, seq.token_slice(i * size, (i + 1) * size))
            block = seq.block_table[i]
            if key not in self.cached and self.keys[block] is None:  # a twin computed at the same time keeps its own
                self.cached[key] = block
                self.keys[block] = key
            seq.block_keys.append(key)
            parent = key

    def release(self, seq: Sequence) -> None:
        """seq lets go of every block it holds (finished, aborted or preempted); cached ones stay cached."""
        for block in seq.block_table:
            self._unref(seq.tenant, block)
            assert self.refs[block] >= 0, f"block {block} released more often than taken"
            if self.refs[block] == 0:
                if self.keys[block] is None:
                    self._free.append(block)
                else:
                    self._idle[block] = None  # most recently used last
        seq.block_table = []
        seq.block_keys = []
        seq.num_cached = 0

    def _ref(self, tenant: str, block: int) -> None:
        self.refs[block] += 1
        refs = self._tenant_refs.get(tenant)
        if refs is None:
            refs = self._tenant_refs[tenant] = collections.Counter()
        refs[block] += 1

    def _unref(self, tenant: str, block: int) -> None:
        self.refs[block] -= 1
        refs = self._tenant_refs[tenant]
        refs[block] -= 1
        if not refs[block]:
            del refs[block]
            if not refs:
                del self._tenant_refs[tenant]

    def _take(self) -> int:
        if self._free:
            return self._free.popleft()
        block, _ = self._idle.popitem(last=False)  # the least recently used cached block nobody holds
        key = self.keys[block]
        assert key is not None
        del self.cached[key]
        self.keys[block] = None
        self.evicted += 1
        return block

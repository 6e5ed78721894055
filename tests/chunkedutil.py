"""Helpers for the chunked-prefill and per-tenant KV bound tests: an engine over a block pool whose scheduler
records every step (each sequence's chunk) and every preemption."""

from __future__ import annotations

import torch
from pagedkvutil import CPU

from opentinker.sampler_server.engine import Engine
from opentinker.sampler_server.model.kv_cache import KVCache
from opentinker.sampler_server.model.llama import LlamaForCausalLM
from opentinker.sampler_server.scheduler import ScheduledBatch, Scheduler
from opentinker.sampler_server.sequence import Sequence
from opentinker.sampler_server.slot_pool import SlotPool


class RecordingScheduler(Scheduler):
    """Remembers every step's (request id, sample index, chunk, tokens it lacked) and every preemption."""

    def __init__(self, *, max_seqs: int, max_batch_tokens: int, chunk: int, tenant_blocks: int) -> None:
        super().__init__(
            max_seqs=max_seqs,
            max_batch_tokens=max_batch_tokens,
            prefill_chunk_tokens=chunk,
            max_blocks_per_tenant=tenant_blocks,
        )
        self.steps: list[list[tuple[str, int, int, int]]] = []
        self.preempted: list[tuple[str, int, bool]] = []  # (tenant, sample index, its prompt partly computed)

    def schedule(self) -> ScheduledBatch | None:
        batch = super().schedule()
        if batch is not None:
            self.steps.append(
                [
                    (seq.request_id, seq.sample_index, chunk, seq.num_tokens - seq.num_cached)
                    for seq, chunk in zip(batch.sequences, batch.chunks, strict=True)
                ]
            )
        return batch

    def preempt(self, seq: Sequence) -> None:
        self.preempted.append((seq.tenant, seq.sample_index, seq.num_tokens - seq.num_cached > 1))
        super().preempt(seq)

    def partial_chunks(self) -> int:
        """Chunks that computed part of what their sequence lacked (it sampled nothing that step)."""
        return sum(0 < chunk < lacked for step in self.steps for _, _, chunk, lacked in step)


def chunked_engine(
    runner: LlamaForCausalLM,
    pool: SlotPool,
    *,
    num_blocks: int,
    chunk: int,
    max_len: int,
    block_size: int = 16,
    max_seqs: int = 8,
    prefix_cache: bool = True,
    tenant_blocks: int = 0,
    max_batch_tokens: int = 4096,
) -> tuple[Engine, RecordingScheduler]:
    """An engine over num_blocks blocks (+ ComputeLogprobs' area) prefilling `chunk` prompt tokens per step
    (0: whole prompts), each tenant bound to `tenant_blocks` blocks (0: no bound)."""
    scheduler = RecordingScheduler(
        max_seqs=max_seqs, max_batch_tokens=max_batch_tokens, chunk=chunk, tenant_blocks=tenant_blocks
    )
    cache = KVCache(runner.config, num_blocks + -(-max_len // block_size), block_size, CPU, torch.float32)
    engine = Engine(
        runner,
        cache,
        pool.tensors,
        scheduler,
        release=lambda slot: None,
        max_len=max_len,
        eos_token_ids=(),
        burst_wait=0.05,
        prefix_cache=prefix_cache,
    )
    return engine, scheduler

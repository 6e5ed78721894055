"""ComputeLogprobs inputs are sequences of the batch (Engine.score): a long input goes through chunked prefill
with the same logprobs as in one piece, and one tenant's flood of scores takes its share of the batch, not the
engine thread: another tenant's Sample submitted with them gets its first token before most of them are done
(scored inline, every one of them ran before the next step)."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
from pagedkvutil import prompt
from samplerutil import max_diff

from opentinker.sampler_server.engine import Engine
from opentinker.sampler_server.model.kv_cache import KVCache
from opentinker.sampler_server.model.llama import LlamaForCausalLM
from opentinker.sampler_server.scheduler import Scheduler
from opentinker.sampler_server.sequence import SamplingParams, Sequence
from opentinker.sampler_server.slot_pool import SlotPool
from opentinker.sampler_server.updates import SequenceUpdate

CPU = torch.device("cpu")
MAX_LEN = 128


@pytest.fixture(scope="module")
def runner(tiny_model: Path) -> LlamaForCausalLM:
    return LlamaForCausalLM.from_pretrained(tiny_model, device=CPU, dtype=torch.float32)


def engine(runner: LlamaForCausalLM, *, chunk: int = 0, max_seqs: int = 4, per_tenant: int = 0) -> Engine:
    pool = SlotPool(runner.linear_shapes(), max_slots=1, max_rank=4, device=CPU)
    cache = KVCache(runner.config, 64, 16, CPU, torch.float32)
    scheduler = Scheduler(
        max_seqs=max_seqs, max_batch_tokens=512, max_seqs_per_tenant=per_tenant, prefill_chunk_tokens=chunk
    )
    return Engine(
        runner,
        cache,
        pool.tensors,
        scheduler,
        release=lambda slot: None,
        max_len=MAX_LEN,
        eos_token_ids=(),
        burst_wait=0.05,
    )


def test_a_long_score_is_chunked_like_a_prompt_with_the_same_logprobs(runner: LlamaForCausalLM) -> None:
    tokens = prompt(MAX_LEN - 1, 3)
    whole, chunked = engine(runner), engine(runner, chunk=32)
    for e in (whole, chunked):
        e.start()
    try:
        reference = whole.score(tokens, 0).result(60)
        logprobs = chunked.score(tokens, 0).result(60)
        assert len(logprobs) == len(tokens) - 1 and max_diff(logprobs, reference) < 1e-5
        assert whole.stats.steps == 1 and chunked.stats.steps == 4  # 127 tokens in chunks of 32
        assert chunked.stats.prompt_tokens_computed == len(tokens) and chunked.stats.tokens_generated == 0
        assert chunked.blocks.num_used == 0 and chunked.num_running == 0  # nothing held after it
    finally:
        whole.stop()
        chunked.stop()


def test_a_flood_of_scores_leaves_another_tenant_its_share_of_the_batch(runner: LlamaForCausalLM) -> None:
    e = engine(runner, max_seqs=4, per_tenant=2)
    flood = [e.score(prompt(MAX_LEN - 1, 10 + i), 0, tenant="team-a") for i in range(16)]
    first_token = threading.Event()
    done_at_first_token: list[int] = []
    finished = threading.Event()

    def on_update(update: SequenceUpdate) -> None:
        assert not update.error, update.error
        if update.tokens and not first_token.is_set():
            done_at_first_token.append(sum(f.done() for f in flood))
            first_token.set()
        if update.finished:
            finished.set()

    params = SamplingParams(temperature=0.0, max_tokens=4)
    e.submit(
        [
            Sequence(
                seq_id=1,
                request_id="b",
                sample_index=0,
                prompt=prompt(12, 7),
                params=params,
                lora_slot=0,
                tenant="team-b",
            )
        ],
        on_update,
    )
    e.start()  # everything is in the inbox already: one burst
    try:
        assert finished.wait(120)
        results = [f.result(120) for f in flood]
    finally:
        e.stop()
    assert all(len(r) == MAX_LEN - 2 for r in results)
    # team-a holds 2 of the 4 seats at a time: team-b's prompt is in the first step, with team-a's first two.
    assert done_at_first_token and done_at_first_token[0] <= 2, done_at_first_token


def test_a_cancelled_score_is_dropped_before_it_runs(runner: LlamaForCausalLM) -> None:
    e = engine(runner)
    cancelled = e.score(prompt(40, 1), 0)
    kept = e.score(prompt(40, 2), 0)
    assert cancelled.cancel()  # the client went away before the engine took it
    e.start()
    try:
        assert len(kept.result(60)) == 39
        assert e.stats.prompt_tokens_computed == 40  # the cancelled one never ran
    finally:
        e.stop()

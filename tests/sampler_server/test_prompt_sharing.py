"""The n samples of one request (an RL group) share their prompt: one prefill computes it and the others copy
its K/V, and every sample then goes on exactly as if it had been prefilled alone."""

from __future__ import annotations

import re
import threading
import urllib.request
from pathlib import Path

import pytest
import torch
from samplerutil import Sampler, max_diff, params, prompt, request, run
from serverproc import ServerProcess

from opentinker.sampler_server.engine import Engine
from opentinker.sampler_server.model.kv_cache import KVCache
from opentinker.sampler_server.model.llama import LlamaForCausalLM
from opentinker.sampler_server.scheduler import Scheduler
from opentinker.sampler_server.sequence import SamplingParams, Sequence
from opentinker.sampler_server.slot_pool import SlotPool
from opentinker.sampler_server.updates import SequenceUpdate

CPU = torch.device("cpu")
PROMPT = [(11 * i + 5) % 200 + 3 for i in range(20)]


@pytest.fixture(scope="module")
def runner(tiny_model: Path) -> LlamaForCausalLM:
    return LlamaForCausalLM.from_pretrained(tiny_model, device=CPU, dtype=torch.float32)


def sequence(request_id: str, index: int, seed: int, *, prompt: list[int] = PROMPT) -> Sequence:
    generator = torch.Generator().manual_seed(seed)
    params = SamplingParams(temperature=1.0, max_tokens=10, logprobs=True)
    return Sequence(
        seq_id=seed,
        request_id=request_id,
        sample_index=index,
        prompt=list(prompt),
        params=params,
        lora_slot=0,
        want_prompt_logprobs=True,
        generator=generator,
    )


def run_engine(runner: LlamaForCausalLM, requests: list[list[Sequence]]) -> Engine:
    """Submits the requests to a fresh engine and waits until every sequence finished."""
    cache = KVCache(runner.config, 17, 64, CPU, torch.float32)
    pool = SlotPool(runner.linear_shapes(), max_slots=1, max_rank=4, device=CPU)
    engine = Engine(
        runner,
        cache,
        pool.tensors,
        Scheduler(max_seqs=16, max_batch_tokens=4096),
        release=pool.release,
        max_len=64,
        eos_token_ids=(),
        burst_wait=0.05,
    )
    left = sum(map(len, requests))
    done, lock = threading.Event(), threading.Lock()

    def on_update(update: SequenceUpdate) -> None:
        nonlocal left
        with lock:
            left -= update.finished
            if left == 0:
                done.set()

    engine.start()
    try:
        for sequences in requests:
            engine.submit(sequences, on_update)
        assert done.wait(60), "the sequences did not finish"
    finally:
        engine.stop()
    return engine


def test_the_samples_of_one_request_compute_their_prompt_once(runner: LlamaForCausalLM) -> None:
    group = [sequence("group", i, seed=100 + i) for i in range(4)]
    shared = run_engine(runner, [group])
    assert (shared.stats.prompt_tokens_computed, shared.stats.prompt_tokens_shared) == (20, 60)

    # The contrast: the same samples as 4 requests of one sample each prefill the prompt 4 times...
    alone = [sequence(f"alone-{i}", 0, seed=100 + i) for i in range(4)]
    separate = run_engine(runner, [[seq] for seq in alone])
    assert (separate.stats.prompt_tokens_computed, separate.stats.prompt_tokens_shared) == (80, 0)

    # ...and every sample continues exactly as it does alone: the copied K/V is the computed one.
    assert len({tuple(seq.output) for seq in group}) == 4  # seeded samples that really differ
    for together, by_itself in zip(group, alone, strict=True):
        assert together.output == by_itself.output
        assert max_diff(together.output_logprobs, by_itself.output_logprobs) < 1e-5
        assert together.prompt_logprobs is not None and by_itself.prompt_logprobs is not None
        assert len(together.prompt_logprobs) == len(PROMPT) - 1
        assert max_diff(together.prompt_logprobs, by_itself.prompt_logprobs) < 1e-5


def test_a_request_with_a_different_prompt_is_not_shared_by_request_id_alone(runner: LlamaForCausalLM) -> None:
    # Sampler requests give all samples one prompt; should one ever differ, it is computed, never copied.
    other = [(7 * i + 1) % 200 + 3 for i in range(12)]
    mixed = [sequence("r", 0, seed=1), sequence("r", 1, seed=2, prompt=other), sequence("r", 2, seed=3)]
    engine = run_engine(runner, [mixed])
    assert (engine.stats.prompt_tokens_computed, engine.stats.prompt_tokens_shared) == (20 + 12, 20)
    alone = sequence("s", 0, seed=2, prompt=other)
    run_engine(runner, [[alone]])
    assert mixed[1].output == alone.output


def test_a_request_s_samples_are_admitted_together_within_the_token_budget() -> None:
    # Followers cost the prefill budget nothing: 4 samples of a 20-token prompt fit a 30-token budget together.
    scheduler = Scheduler(max_seqs=8, max_batch_tokens=30)
    for i in range(4):
        scheduler.add(sequence("r", i, seed=i))
    scheduler.add(sequence("s", 0, seed=9))
    first = scheduler.schedule()
    assert first is not None and first.is_prefill
    assert [seq.request_id for seq in first.sequences] == ["r"] * 4
    second = scheduler.schedule()  # r's samples decode once before the next prefill (no starving them)
    assert second is not None and not second.is_prefill and [seq.request_id for seq in second.sequences] == ["r"] * 4
    third = scheduler.schedule()
    assert third is not None and third.is_prefill and [seq.request_id for seq in third.sequences] == ["s"]


def test_a_sample_call_with_n_samples_prefills_its_prompt_once(sampler_server: ServerProcess, sampler: Sampler) -> None:
    def prompt_tokens() -> dict[str, float]:
        url = f"http://{sampler_server.metrics_address}/metrics"
        body = urllib.request.urlopen(url, timeout=10).read().decode()
        pattern = r'^opentinker_sampler_prompt_tokens_total\{source="(\w+)"\} (\S+)$'
        return {source: float(value) for source, value in re.findall(pattern, body, re.MULTILINE)}

    before = prompt_tokens()
    result = run(
        sampler, request("base", prompt(3, length=30), params(temperature=1.0, max_tokens=4, seed=1), num_samples=4)
    )
    after = prompt_tokens()
    assert sorted(result.samples) == [0, 1, 2, 3]
    assert (after["computed"] - before["computed"], after["shared"] - before["shared"]) == (30, 90)

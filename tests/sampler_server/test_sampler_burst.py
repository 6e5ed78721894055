"""Bursts of requests: an idle engine woken by a request waits for the rest of the burst before its first
prefill (one prefill for all of them, not one for the first and another for the rest), but never longer than
its cap; and the engine's updates reach the event loop with one wake-up per batch, in order."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import pytest
import torch

from opentinker.sampler_server.engine import Engine, SequenceUpdate
from opentinker.sampler_server.model.kv_cache import KVCache
from opentinker.sampler_server.model.llama import LlamaForCausalLM
from opentinker.sampler_server.scheduler import ScheduledBatch, Scheduler
from opentinker.sampler_server.sequence import SamplingParams, Sequence
from opentinker.sampler_server.service import Mailbox
from opentinker.sampler_server.slot_pool import SlotPool

CPU = torch.device("cpu")


class RecordingScheduler(Scheduler):
    """Remembers (monotonic time, prefill?, sequences) of every scheduled batch."""

    def __init__(self) -> None:
        super().__init__(max_seqs=64, max_batch_tokens=4096)
        self.batches: list[tuple[float, bool, int]] = []

    def schedule(self) -> ScheduledBatch | None:
        batch = super().schedule()
        if batch is not None:
            self.batches.append((time.monotonic(), batch.is_prefill, len(batch.sequences)))
        return batch


@pytest.fixture(scope="module")
def runner(tiny_model: Path) -> LlamaForCausalLM:
    return LlamaForCausalLM.from_pretrained(tiny_model, device=CPU, dtype=torch.float32)


def submit_spread(engine: Engine, count: int, gap: float) -> tuple[float, threading.Event]:
    """Submits `count` one-sequence requests `gap` seconds apart from another thread (as separate clients'
    requests arrive); returns the first submission's time and an event set when all of them finished."""
    done, finished = threading.Event(), [0]
    lock = threading.Lock()

    def on_update(update: SequenceUpdate) -> None:
        if update.finished:
            with lock:
                finished[0] += 1
                if finished[0] == count:
                    done.set()

    params = SamplingParams(temperature=0.0, max_tokens=2)
    first = time.monotonic()
    for i in range(count):
        engine.submit(
            [Sequence(seq_id=i, request_id=f"r{i}", sample_index=0, prompt=[1, 2, 3], params=params, lora_slot=0)],
            on_update,
        )
        time.sleep(gap)
    return first, done


def run_burst(
    runner: LlamaForCausalLM, *, burst_wait: float, count: int, gap: float
) -> tuple[RecordingScheduler, float]:
    scheduler = RecordingScheduler()
    cache = KVCache(runner.config, 65, 32, CPU, torch.float32)
    pool = SlotPool(runner.linear_shapes(), max_slots=1, max_rank=4, device=CPU)
    engine = Engine(
        runner,
        cache,
        pool.tensors,
        scheduler,
        release=pool.release,
        max_len=32,
        eos_token_ids=(),
        burst_wait=burst_wait,
    )
    engine.start()
    try:
        first, done = submit_spread(engine, count, gap)
        assert done.wait(30), "requests did not finish"
    finally:
        engine.stop()
    return scheduler, first


def prefills(scheduler: RecordingScheduler) -> list[int]:
    return [n for _, is_prefill, n in scheduler.batches if is_prefill]


def test_a_burst_spread_over_time_gets_one_prefill(runner: LlamaForCausalLM) -> None:
    # 6 requests 20 ms apart; a burst ends after 150 ms without a request.
    scheduler, _ = run_burst(runner, burst_wait=0.15, count=6, gap=0.02)
    assert prefills(scheduler) == [6]


def test_without_burst_wait_the_first_request_starts_alone(runner: LlamaForCausalLM) -> None:
    # The contrast that makes the test above mean something: the same arrivals, no wait -> split prefills.
    scheduler, _ = run_burst(runner, burst_wait=0.0, count=6, gap=0.02)
    assert len(prefills(scheduler)) > 1 and sum(prefills(scheduler)) == 6


def test_a_steady_stream_of_requests_does_not_hold_the_first_one_forever(runner: LlamaForCausalLM) -> None:
    # A request every 10 ms for 1.5 s never leaves a 50 ms gap: the wait is capped at 10 x 50 ms.
    scheduler, first = run_burst(runner, burst_wait=0.05, count=150, gap=0.01)
    started, _, size = scheduler.batches[0]
    assert started - first < 1.0, f"first prefill after {started - first:.2f} s"
    assert 1 < size < 150 and sum(prefills(scheduler)) == 150


def test_mailbox_delivers_a_batch_with_one_wakeup_in_order() -> None:
    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        mailbox = Mailbox(loop)
        wakeups = [0]
        schedule = loop.call_soon_threadsafe

        def counting(callback: object, *args: object) -> asyncio.Handle:
            wakeups[0] += 1
            return schedule(callback, *args)  # type: ignore[arg-type]

        loop.call_soon_threadsafe = counting  # type: ignore[method-assign,assignment]
        queues: list[asyncio.Queue[SequenceUpdate]] = [asyncio.Queue(), asyncio.Queue()]
        seqs = [
            Sequence(seq_id=i, request_id=f"r{i}", sample_index=0, prompt=[1], params=SamplingParams(), lora_slot=0)
            for i in range(2)
        ]

        def engine_step() -> None:  # while the loop is busy (blocked here), a step's updates pile up
            for token in range(50):
                for q, seq in zip(queues, seqs, strict=True):
                    mailbox.post(q, SequenceUpdate(seq.request_id, 0, [token], [0.0], finished=False))

        thread = threading.Thread(target=engine_step)
        thread.start()
        thread.join()
        await asyncio.sleep(0)  # the one scheduled delivery runs
        await asyncio.sleep(0)
        assert wakeups[0] == 1
        for q in queues:
            assert [q.get_nowait().tokens[0] for _ in range(q.qsize())] == list(range(50))
        mailbox.post(queues[0], SequenceUpdate("r0", 0, [99], [0.0], finished=True))  # the next batch wakes again
        await asyncio.sleep(0)
        assert wakeups[0] == 2 and (await queues[0].get()).tokens == [99]

    asyncio.run(scenario())

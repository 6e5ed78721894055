"""Bursts of requests: an idle engine woken by a request waits for the rest of the burst before its first
prefill (one prefill for all of them, not one for the first and another for the rest), but never longer than
its cap; and the engine's updates reach the event loop with one wake-up per batch, in order.

The burst rule is tested on a scripted clock (exact arrival times, the engine's own loop), so the outcome does
not depend on how loaded the machine is."""

from __future__ import annotations

import asyncio
import collections
import queue
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from opentinker.sampler_server import inbox as inbox_module
from opentinker.sampler_server.engine import Engine
from opentinker.sampler_server.model.kv_cache import KVCache
from opentinker.sampler_server.model.llama import LlamaForCausalLM
from opentinker.sampler_server.scheduler import ScheduledBatch, Scheduler
from opentinker.sampler_server.sequence import SamplingParams, Sequence
from opentinker.sampler_server.slot_pool import SlotPool
from opentinker.sampler_server.update_stream import Mailbox
from opentinker.sampler_server.updates import SequenceUpdate

CPU = torch.device("cpu")


class ScriptedArrivals:
    """The engine's inbox and clock, scripted: requests arrive at given times on a fake clock, so the burst
    rule is tested on exact arrival times, not on how fast this machine happens to be today.

    ``get(timeout)`` moves the clock to the next arrival when it comes within the timeout (and returns it), else
    by the whole timeout (and raises Empty), as a real blocking queue would; ``get_nowait`` returns only what has
    arrived."""

    def __init__(self) -> None:
        self.now = 0.0
        self.at = 0.0  # the arrival time of the next put (the test sets it before each submit)
        self.pending: collections.deque[tuple[float, object]] = collections.deque()

    def monotonic(self) -> float:
        return self.now

    def put(self, message: object) -> None:
        self.pending.append((self.at, message))

    def qsize(self) -> int:
        return sum(1 for at, _ in self.pending if at <= self.now)

    def get(self, timeout: float | None = None) -> object:
        assert timeout is not None, "the engine never blocks without a timeout"
        if self.pending and self.pending[0][0] <= self.now + timeout:
            at, message = self.pending[0]
            self.now = max(self.now, at)
            self.pending.popleft()
            return message
        self.now += timeout
        raise queue.Empty

    def get_nowait(self) -> object:
        if self.pending and self.pending[0][0] <= self.now:
            return self.pending.popleft()[1]
        raise queue.Empty


class RecordingScheduler(Scheduler):
    """Remembers (fake time, prefill?, sequences) of every scheduled batch."""

    def __init__(self, clock: ScriptedArrivals) -> None:
        super().__init__(max_seqs=256, max_batch_tokens=4096)
        self.clock = clock
        self.batches: list[tuple[float, bool, int]] = []

    def schedule(self) -> ScheduledBatch | None:
        batch = super().schedule()
        if batch is not None:
            self.batches.append((self.clock.now, batch.is_prefill, len(batch.sequences)))
        return batch


@pytest.fixture(scope="module")
def runner(tiny_model: Path) -> LlamaForCausalLM:
    return LlamaForCausalLM.from_pretrained(tiny_model, device=CPU, dtype=torch.float32)


def run_burst(
    runner: LlamaForCausalLM, monkeypatch: pytest.MonkeyPatch, *, burst_wait: float, count: int, gap: float
) -> RecordingScheduler:
    """One-sequence requests `gap` seconds apart (as separate clients' requests arrive), the first at time 0,
    through the engine's own loop (`Engine._run`, on this thread) until the first batch has run."""
    arrivals = ScriptedArrivals()
    monkeypatch.setattr(inbox_module, "time", SimpleNamespace(monotonic=arrivals.monotonic))
    scheduler = RecordingScheduler(arrivals)
    cache = KVCache(runner.config, 257, 32, CPU, torch.float32)
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
    engine._inbox = inbox_module.Inbox(arrivals)  # type: ignore[arg-type]
    params = SamplingParams(temperature=0.0, max_tokens=2)
    for i in range(count):
        arrivals.at = i * gap
        engine.submit(
            [Sequence(seq_id=i, request_id=f"r{i}", sample_index=0, prompt=[1, 2, 3], params=params, lora_slot=0)],
            lambda update: None,
        )
    engine.on_iteration = lambda: setattr(engine, "_stopping", True)  # one iteration: the first batch
    engine._run()
    return scheduler


def prefills(scheduler: RecordingScheduler) -> list[int]:
    return [n for _, is_prefill, n in scheduler.batches if is_prefill]


def test_a_burst_spread_over_time_gets_one_prefill(runner: LlamaForCausalLM, monkeypatch: pytest.MonkeyPatch) -> None:
    # 6 requests 20 ms apart; a burst ends after 150 ms without a request: all 6 in the first prefill, which
    # starts when the last has waited its 150 ms.
    scheduler = run_burst(runner, monkeypatch, burst_wait=0.15, count=6, gap=0.02)
    [(started, is_prefill, size)] = scheduler.batches
    assert is_prefill and size == 6 and started == pytest.approx(0.1 + 0.15)


def test_without_burst_wait_the_first_request_starts_alone(
    runner: LlamaForCausalLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The contrast that makes the test above mean something: the same arrivals, no wait -> the first alone.
    scheduler = run_burst(runner, monkeypatch, burst_wait=0.0, count=6, gap=0.02)
    assert scheduler.batches == [(0.0, True, 1)]


def test_a_gap_longer_than_the_wait_ends_the_burst(runner: LlamaForCausalLM, monkeypatch: pytest.MonkeyPatch) -> None:
    # 60 ms between requests, 50 ms of wait: the burst is the first request alone, started at 50 ms.
    scheduler = run_burst(runner, monkeypatch, burst_wait=0.05, count=3, gap=0.06)
    [(started, is_prefill, size)] = scheduler.batches
    assert is_prefill and size == 1 and started == pytest.approx(0.05)


def test_a_steady_stream_of_requests_does_not_hold_the_first_one_forever(
    runner: LlamaForCausalLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A request every 10 ms for 1.5 s never leaves a 50 ms gap: the wait is capped at 10 x 50 ms, so the first
    # prefill starts at 0.5 s with what arrived by then (requests 0 to 50), not after all 150.
    scheduler = run_burst(runner, monkeypatch, burst_wait=0.05, count=150, gap=0.01)
    [(started, is_prefill, size)] = scheduler.batches
    assert is_prefill and started == pytest.approx(0.5)
    assert size in (50, 51)  # 0.01 steps in floating point: request 50 lands on the deadline's either side


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
